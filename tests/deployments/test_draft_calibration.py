"""The draft replica's start-up calibration (deployments.draft_calibration): before a fresh replica
reports ready, its cost model holds measured verify forwards of 1 .. K + 1 positions and its
draft forwards, and nothing else learned anything from the calibration's dummy prompt. The
"wire" is a local TargetSessionTable whose forwards take fake seconds (0.01 per position)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from deployments.config import AppConfig
from deployments.draft import Draft
from deployments.draft_calibration import StartupCalibration, calibration_schedule
from deployments.target_sessions import TargetSessionTable
from protos.specdec.v1 import exchange_pb2 as xpb
from specdec.engine.verifier import TargetSession, TargetVerifier
from specdec.testing.tiny import build_tiny_model
from tests.conftest import load_tiny

SECONDS_PER_POSITION = 0.01


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib")
    t = build_tiny_model(root / "target", seed=0)
    target = load_tiny(t)
    d = build_tiny_model(root / "draft", seed=1, base=target.model, noise=0.03)
    return str(t), str(d), target


class _FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _TimedVerifier(TargetVerifier):
    """A target verifier whose batched forward advances a fake clock by 0.01 s per position fed."""

    def __init__(self, model, clock: _FakeClock):
        super().__init__(model)
        self.fake_clock = clock

    def verify_batch(self, items, max_positions=None, caps=None):
        out = super().verify_batch(items, max_positions, caps)
        self.fake_clock.t += SECONDS_PER_POSITION * self.last_positions
        return out


class StepWire:
    """The Target replica's batched verify in process, one block per forward (the replies carry
    the forward's shape: rows, positions, fake seconds)."""

    def __init__(self, target):
        clock = _FakeClock()
        self.table = TargetSessionTable(_TimedVerifier(target, clock), clock=clock)
        self.tickets = itertools.count()
        self.opened: list[str] = []

    def send(self, method: str, payload: bytes) -> bytes:
        if method == "CloseSession":
            sid = xpb.CloseSessionRequest.FromString(payload).session_id
            return xpb.CloseSessionResponse(existed=self.table.close(sid)).SerializeToString()
        msg = xpb.CandidateBlock.FromString(payload)
        if msg.HasField("open"):
            self.opened.append(msg.session_id)
        t = next(self.tickets)
        reply = self.table.admit(t, msg)
        if reply is not None:
            return reply.SerializeToString()
        return dict(self.table.step(None))[t].SerializeToString()


class _TimedSession(TargetSession):
    """A target session whose unbatched verify advances the fake clock by 0.01 s per position fed."""

    def verify(self, block):
        out = super().verify(block)
        self._verifier.fake_clock.t += SECONDS_PER_POSITION * self._verifier.last_positions
        return out


class _TimedAloneVerifier(TargetVerifier):
    def __init__(self, model, clock: _FakeClock):
        super().__init__(model)
        self.fake_clock = clock

    def open_session(self, *args, **kwargs):
        session = super().open_session(*args, **kwargs)
        session.__class__ = _TimedSession
        return session


class HandleWire(StepWire):
    """The Target replica's unbatched verify (``target_batching`` off) in process: each block
    alone (:meth:`TargetSessionTable.handle`), its forward's fake seconds in the reply."""

    def __init__(self, target):
        clock = _FakeClock()
        self.table = TargetSessionTable(_TimedAloneVerifier(target, clock), clock=clock)
        self.opened = []

    def send(self, method: str, payload: bytes) -> bytes:
        if method == "CloseSession":
            return super().send(method, payload)
        msg = xpb.CandidateBlock.FromString(payload)
        if msg.HasField("open"):
            self.opened.append(msg.session_id)
        return self.table.handle(msg).SerializeToString()


def _replica(pair, batching: bool = True, **cfg):
    cfg.setdefault("startup_calibration_repeats", 3)  # the presets' (AppConfig's default: off)
    t, d, target = pair
    wire = StepWire(target) if batching else HandleWire(target)
    if not batching:
        cfg.update(target_batching=False, draft_batching=False)
    return Draft(AppConfig(target_model=t, draft_model=d, cpu_threads=1, **cfg), send_factory=lambda key: wire.send), wire


def test_calibration_schedule_warms_up_every_k_then_measures_repeats_interleaved_rounds():
    # interleaved (a burst of load hits every K alike, not only the K measured first)
    assert calibration_schedule(2, 3) == [("warmup", 2), ("warmup", 2), ("warmup", 1), ("warmup", 0),
                                          ("measure", 2), ("measure", 1), ("measure", 0),
                                          ("measure", 2), ("measure", 1), ("measure", 0),
                                          ("measure", 2), ("measure", 1), ("measure", 0)]
    with pytest.raises(ValueError, match="repeats >= 1"):
        calibration_schedule(4, 0)
    with pytest.raises(ValueError, match="k_max >= 0"):
        calibration_schedule(-1, 3)


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
def test_a_fresh_replica_prices_its_first_request_from_calibrated_forwards(pair, batching):
    """Served batched, or unbatched (``target_batching`` and ``draft_batching`` off; before,
    such a replica's calibration measured nothing: no verify shape came back and no draft
    forward was timed, so its K stayed on the priors). Before: a fresh replica's cost model held
    only its priors (a verify forward 0.05 s at any positions count, a draft forward a fifth of
    it), and its first request's first decisions
    were priced on them and one or two thin measurements (served w8a8 pair: K = 0 on the third
    step, 40 of 49 steps at K 0-3). After calibrate(): every positions count 1 .. default_max_k
    + 1 measured 3 times at its exact fake seconds, the warm-up pass and the prompt's prefill
    kept off the curve, the draft's forwards measured at one row; no acceptance evidence, no
    goodput guard, no tenant and no decode forward "under load" (measure_first) came of it,
    and its target session is closed."""
    rep, wire = _replica(pair, batching)
    assert rep.combiner.batched is batching
    cost = rep.batch_k.controller.cost
    assert cost.snapshot()["verify_s_by_positions"] == {} and cost.snapshot()["draft_s_by_rows"] == {}
    out = asyncio.run(rep.calibrate())
    assert out["steps"] == len(calibration_schedule(4, 3)) == 21
    snap = cost.snapshot()
    assert snap["verify_s_by_positions"] == pytest.approx({p: SECONDS_PER_POSITION * p for p in range(1, 6)})
    assert {p: e.n for p, e in cost.verify._verify.items()} == {1: 3, 2: 3, 3: 3, 4: 3, 5: 3}
    assert snap["prefill_forwards"] == 0
    # the measured pass's draft forwards at one row: K per drafting step, less every K = 4
    # step's (each follows a K = 0 step: its first forward also fed the token the draft missed)
    assert list(snap["draft_s_by_rows"]) == [1]
    assert cost.draft._verify[1].n == 3 * 3 + 2 * 3 + 1 * 3
    assert cost.min_positions_per_row == float("inf")
    assert list(rep.batch_k.controller.estimator.keys()) == []
    assert rep.batch_k.guards == {} and rep.batch_k.tenant_views() == {} and rep.batch_k.decisions == 0
    assert len(wire.opened) == 1 and wire.opened[0].startswith("calibration-") and len(wire.table) == 0
    assert rep.Sessions() == []
    # once: a second call (Ready after the start-up run) returns the same result, nothing re-run
    assert asyncio.run(rep.calibrate()) is out and len(wire.opened) == 1


def test_settled_waits_for_the_start_up_calibration(pair):
    """Served, calibration starts with the replica; Settled (what the router's GET /health waits
    for) answers only once it has ended; Ready (requests) does not wait for it."""
    rep, wire = _replica(pair)

    async def main():
        rep.startup = StartupCalibration(rep, start=True)  # as served: runs once the target answers
        assert await rep.Ready() is True and rep.startup.result is None
        assert await rep.Settled() is True
        return rep.startup.result

    out = asyncio.run(main())
    assert out is not None and out["steps"] == 21 and len(wire.opened) == 1 and len(wire.table) == 0


def test_calibration_off_leaves_the_priors(pair):
    rep, wire = _replica(pair, startup_calibration_repeats=0)
    assert asyncio.run(rep.calibrate()) is None and asyncio.run(rep.Ready()) is True
    assert rep.batch_k.controller.cost.snapshot()["verify_s_by_positions"] == {} and wire.opened == []


def test_requests_after_calibration_decide_on_the_measured_curve(pair):
    """A request after calibration: its first decision is taken on the measured curve (the
    decision's predicted step is the calibrated forwards' seconds, not the priors')."""
    import json

    from protos.specdec.v1 import specdec_pb2 as pb

    rep, wire = _replica(pair)
    asyncio.run(rep.calibrate())
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=list(range(5, 25))), max_tokens=12, ignore_eos=True,
                             speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4))
    req.sampling.seed = 3
    job = xpb.DraftJob(session_id="r1", request=req, tenant="default", batch_adaptive=True)

    async def run():
        return [pb.GenerateStreamChunk.FromString(raw) async for raw in rep.Generate(job.SerializeToString())]

    chunks = asyncio.run(run())
    assert sum(len(c.token_ids) for c in chunks) == 12
    d = rep.batch_k.controller.last
    k = d.ks["default"]
    # the decision's step: k draft forwards (measured) + the (k + 1)-position verify (0.01 s per position)
    assert d.step_s == pytest.approx(k * rep.batch_k.controller.cost.draft_s(1) + SECONDS_PER_POSITION * (k + 1))
    assert json.dumps(rep.batch_k.tenant_views()["default"]["k_model"]) == str(k)
