"""A fresh server's first and second requests (one client on code, the w8a8 demo pair's served
costs) with the draft replica's start-up calibration and the goodput guard's plain bound: no
step at K = 0 in either. Fake costs, a fake clock, exact K per step."""

from __future__ import annotations

import pytest

from specdec.control.batch_k import BatchKController, BatchKSessions, GoodputGuard
from specdec.testing.sim import BeattyDrafts
from specdec.types import BatchShape

#: the w8a8 demo pair served on the 2-core EPYC (trace-s9-default.jsonl.gz): a verify forward of
#: p decode positions (1..5), a draft forward at one row, the draft's catch-up per token, and
#: the step's wall time outside both forwards (the round trip and scheduling)
VERIFY = {1: 0.095, 2: 0.11, 3: 0.12, 4: 0.13, 5: 0.14}
DRAFT, CATCHUP, OVERHEAD = 0.044, 0.007, 0.014
PROMPT = 40


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _calibrate(live: BatchKSessions, repeats: int = 3, k_max: int = 4, dear: float = 1.0) -> None:
    """The start-up calibration's steps (deployments.draft_calibration.calibration_schedule): the
    warm-up pass at 3x the forwards' seconds (kernels created), then ``repeats`` rounds of each K,
    its verify forwards of 2 or more positions at ``dear`` times what they cost in service."""
    from deployments.draft_calibration import calibration_schedule

    live.join("cal", "", "draft", adaptive=False, k_range=(0, k_max), prompt_tokens=30, calibration="warmup")
    sched = calibration_schedule(k_max, repeats)
    for i, (mode, k) in enumerate(sched):
        live.set_calibration("cal", mode)
        verify = VERIFY[k + 1] * (3 if mode == "warmup" else dear if k > 0 else 1)
        live.observe_step("cal", k, k, BatchShape(1000 + i, 1, k + 1 + (30 if i == 0 else 0), verify),
                          [(1, DRAFT * (3 if mode == "warmup" else 1))] * k, draft_s=k * DRAFT,
                          verify_s=verify + OVERHEAD)
    live.leave("cal")


def _request(live: BatchKSessions, clock: _Clock, key: str, step0: int, max_tokens: int = 128) -> tuple[str, float, int]:
    """One adaptive 128-token request (K up to 4, drafts accepted at 0.9): (K per step, tokens/s, steps so far)."""
    live.join(key, "default", "draft", k_range=(0, 4), prompt_tokens=PROMPT, max_tokens=max_tokens)
    sched = live.schedule("default", 4)
    drafts = BeattyDrafts(0.9)
    left, behind, step, ks, t0 = max_tokens, PROMPT, step0, [], clock.t
    while left > 0:
        k = sched()
        accepted = drafts.accepted(k)
        first = step == step0
        verify = 0.4 if first else VERIFY[k + 1]
        draft_s = k * DRAFT + (behind * CATCHUP if k > 0 else 0.0)
        step += 1
        live.observe_step(key, k, accepted, BatchShape(step, 1, k + 1 + (PROMPT if first else 0), verify),
                          [(1, DRAFT)] * k, draft_s=draft_s, verify_s=verify + OVERHEAD)
        clock.t += draft_s + verify + OVERHEAD
        behind = 0 if k > 0 else behind + accepted + 1
        left -= min(accepted + 1, left)
        ks.append(k)
    live.leave(key)
    return "".join(map(str, ks)), max_tokens / (clock.t - t0), step


def _fresh_server(calibrated: bool, dear: float = 1.0, max_tokens: int = 128,
                  draft: float | None = None) -> tuple[list[str], list[float], BatchKSessions]:
    clock = _Clock()
    live = BatchKSessions(BatchKController(budget=64, clock=clock), guard=GoodputGuard())
    if calibrated:
        _calibrate(live, dear=dear)
    out, tps, step = [], [], 0
    for key in ("first", "second"):
        ks, rate, step = _request(live, clock, key, step, max_tokens)
        out.append(ks)
        tps.append(rate)
    return out, tps, live


PLAIN_TOKENS_PER_S = 1 / (VERIFY[1] + OVERHEAD)


def test_a_calibrated_fresh_server_never_runs_k0_in_its_first_two_requests():
    """Before (the cost priors, served since session 7): the first request's third step ran at
    K = 0 (a 3-position verify measured, the 1-position one priced on the line through the
    origin below it), and the guard's first exploration, due after 64 spec steps, ran 12 steps
    at K = 0 in the second request (1.17x plain decoding there against 1.20x). With the
    start-up calibration the first decisions are priced from measured forwards: no K = 0 step
    in the first request (1.28x plain, 1.23x before), and in the second the exploration is
    skipped, speculation measuring 12.1 tokens/s above the 10.5 (1 / 0.095 s) plain decoding
    could reach by its measured forward."""
    (first, second), tps, live = _fresh_server(calibrated=False)
    assert first == "32012232333333333333333333333333333333333"
    assert second == "3" * 26 + "0" * 12 + "3" * 10
    assert live.guards["default"].explorations == 1
    assert [round(t / PLAIN_TOKENS_PER_S, 2) for t in tps] == [1.23, 1.17]
    (first, second), tps, live = _fresh_server(calibrated=True)
    assert first == "13343443443443443443343343334333433"
    assert second == "3" * 40
    guard = live.guards["default"]
    assert guard.explorations == 0 and guard.skipped == 1 and guard.vetoes == 0
    assert guard.goodput("spec") == pytest.approx(12.13, abs=0.01)
    assert [round(t / PLAIN_TOKENS_PER_S, 2) for t in tps] == [1.28, 1.2]
    # the calibration taught the model costs only: no acceptance evidence of its dummy prompt
    assert [k for k in live.controller.estimator.keys()] == [("default", "draft")]


def test_a_calibration_dearer_than_service_holds_no_client_at_k0_past_one_probe(monkeypatch):
    """Session 19 (served, w7a8 pair, ``clients-s19-guard``): the start-up calibration priced the
    verify forwards of 2-5 positions ~1.4x what they cost in service, the lone client of a
    32-token request ran K = 0 on every step (0.80x the unbatched path speculating), and its held
    steps never reached ``probe_every``, so nothing re-measured those shapes. Here the
    calibration measures 2-5 positions at 1.45x the service's costs. Before (the optimistic
    probe switched off): K = 0 on all 32 steps of both requests, 0.92x plain decoding. Now: the
    first held step after a one-position forward was measured in service probes at the K the
    service's own curve gives (K = 3), the probe's forwards replace the calibration's samples
    of their count, and the client speculates from then on: 1.06x the before. The same with the
    tenant's acceptance already measured (40 steps at 0.75, as pooled from another replica), so
    that its first held step is no acceptance probe: the shape probe runs instead (no evidence cap)."""
    from specdec.control.batch_cost import BatchCostModel

    real = BatchCostModel.calibration_unserved
    monkeypatch.setattr(BatchCostModel, "calibration_unserved", lambda self: False)
    (first, second), before, live = _fresh_server(calibrated=True, dear=1.45, max_tokens=32)
    assert first == second == "0" * 32 and live.controller.probes == 0
    assert [round(t / PLAIN_TOKENS_PER_S, 2) for t in before] == [0.92, 0.92]
    monkeypatch.setattr(BatchCostModel, "calibration_unserved", real)
    (first, second), after, live = _fresh_server(calibrated=True, dear=1.45, max_tokens=32)
    assert first == "00" + "3" * 10 and second == "3" * 11
    # two probe steps: after the second, the decision (on the measured 4-position forwards) gives K = 3;
    # the first held step's probe (its acceptance unmeasured) at the K the service's curve gives
    assert live.controller.probes == 1 and live.controller.shape_probes == 0 and live.controller.probe_step_count == 2
    assert [round(t / PLAIN_TOKENS_PER_S, 2) for t in after] == [0.98, 0.97]
    assert round(sum(after) / sum(before), 2) == 1.06
    cost = live.controller.cost
    # the 4-position count: service's forwards alone (the calibration's 0.13 · 1.45 dropped)
    assert cost.served(4) and cost.verify_s(1, 4) == pytest.approx(VERIFY[4])
    # 5 positions: calibrated, never served, nothing served above it: the calibration's price
    # (0.14 · 1.45), optimistically the service's curve alone (from its 4 positions on its slope)
    assert not cost.served(5) and cost.verify_s(1, 5) == pytest.approx(VERIFY[5] * 1.45)
    assert cost.verify_s(1, 5, optimistic=True) == pytest.approx(cost._served_curve.verify_s(5))
    assert VERIFY[4] < cost.verify_s(1, 5, optimistic=True) < VERIFY[5] * 1.2
    # 2 and 3 positions: calibrated, never served, at most the 4 served positions' price
    assert [cost.verify_s(1, p) for p in (2, 3)] == pytest.approx([VERIFY[4]] * 2)
    assert cost.calibration_unserved()

    for shape_probes, ks in ((False, ("0" * 32, "0" * 32)), (True, ("00" + "3" * 10, "3" * 11))):
        if not shape_probes:
            monkeypatch.setattr(BatchCostModel, "calibration_unserved", lambda self: False)
        else:
            monkeypatch.setattr(BatchCostModel, "calibration_unserved", real)
        clock = _Clock()
        live = BatchKSessions(BatchKController(budget=64, clock=clock), guard=GoodputGuard())
        _calibrate(live, dear=1.45)
        for i in range(40):
            live.controller.estimator.record(("default", "draft"), 4, (4, 2)[i % 2])
        out, step = [], 0
        for key in ("first", "second"):
            got, _, step = _request(live, clock, key, step, 32)
            out.append(got)
        assert tuple(out) == ks
        assert (live.controller.probes, live.controller.shape_probes, live.controller.caps) == (
            (1, 1, []) if shape_probes else (0, 0, []))


def test_a_held_tenant_asks_for_a_shape_probe_once_per_new_shape_not_every_tick(monkeypatch):
    """A tenant held at K = 0 by its acceptance (drafts never agree) while calibrated counts stay
    unserved: the shape-probe check prices its batch optima (measured and optimistic) once per
    session count and new shape, not on every tick (a reviewer counted 97 extra optima in 100
    ticks before); its acceptance probes run as before and the shape check never caps evidence."""
    from specdec.control import batch_controller

    calls = []
    choose = batch_controller.choose_batch_ks
    monkeypatch.setattr(batch_controller, "choose_batch_ks", lambda *a, **k: calls.append(1) or choose(*a, **k))
    ctl = BatchKController(budget=64)
    for _ in range(3):
        for k in range(4, -1, -1):
            ctl.cost.observe_verify(1, k + 1, VERIFY[k + 1] * (1.45 if k else 1), calibration=True)
        ctl.cost.observe_draft(1, DRAFT)
    for _ in range(40):
        ctl.observe_row("default", "draft", 4, 0)
    per_tick = []
    for tick in range(100):
        before = len(calls)
        ctl.decide({("default", "draft"): 4})
        after_decide = len(calls)
        for _ in range(4):
            ctl.step_k("default", 4)
        per_tick.append(len(calls) - after_decide)
        assert after_decide - before == 1
        ctl.observe_tick(4, 4, VERIFY[4] + 0.01)
    assert ctl.cost.calibration_unserved() and ctl.shape_probes == 0 and ctl.probes == 4
    # the shape check at the first two ticks (before and after 4 positions were first served),
    # then only the acceptance probes' asks (measured optimum K = 0, then the optimistic one),
    # after 32, 64, 128, 128 held steps
    assert [(i, n) for i, n in enumerate(per_tick) if n] == [(0, 2), (1, 1), (8, 2), (25, 2), (58, 2), (91, 2)]
    # the acceptance probes still cap the evidence, once each
    assert len(ctl.caps) == 4
