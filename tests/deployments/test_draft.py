"""The Draft replica's loop without Ray: RemoteTargetSession over serialized protos, rebuilds,
resume after a replica death, cancellation. The "wire" is a local TargetSessionTable."""

from __future__ import annotations

import asyncio
import time

import pytest

from deployments import convert
from deployments.config import AppConfig
from deployments.draft import Draft
from deployments.remote_target import RemoteTargetSession
from deployments.router import RelayProgress
from deployments.target_sessions import TargetSessionTable
from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.engine.engine import SpeculativeEngine
from specdec.request import SamplingParams, parse_request
from specdec.engine.sampling import derive_seeds
from specdec.testing.tiny import build_tiny_model
from specdec.types import DraftBlock
from specdec.engine.verifier import TargetVerifier
from tests.conftest import load_tiny, target_greedy


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("draftrep")
    t = build_tiny_model(root / "target", seed=0)
    target = load_tiny(t)
    d = build_tiny_model(root / "draft", seed=1, base=target.model, noise=0.03)
    return str(t), str(d), target, load_tiny(d)


class Wire:
    """A target replica in process: serialized protos in and out, like the Serve handle."""

    def __init__(self, target):
        self.table = TargetSessionTable(TargetVerifier(target))
        self.calls: list[str] = []

    close_delay_s = 0.0  # a slow CloseSession (a busy target replica)

    def send(self, method: str, payload: bytes) -> bytes:
        self.calls.append(method)
        if method == "CloseSession" and self.close_delay_s:
            time.sleep(self.close_delay_s)
        if method == "Verify":
            return self.table.handle(xpb.CandidateBlock.FromString(payload)).SerializeToString()
        sid = xpb.CloseSessionRequest.FromString(payload).session_id
        return xpb.CloseSessionResponse(existed=self.table.close(sid)).SerializeToString()


@pytest.fixture()
def draft_replica(pair):
    t, d, target, _ = pair
    wire = Wire(target)
    return Draft(AppConfig(target_model=t, draft_model=d, cpu_threads=1), send_factory=lambda key: wire.send), wire


def _job(prompt_ids, sid="s1", **kw) -> xpb.DraftJob:
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt_ids), **kw)
    if not req.sampling.HasField("seed"):
        req.sampling.seed = 5
    return xpb.DraftJob(session_id=sid, request=req)


async def _collect(agen, n: int | None = None):
    out = []
    async for raw in agen:
        out.append(pb.GenerateStreamChunk.FromString(raw))
        if n is not None and len(out) >= n:
            break
    return out


PROMPT = [1, 5, 9, 33, 70, 100, 7]


PENALISED = pb.SamplingParams(temperature=0.9, top_k=40, seed=78, min_p=0.05, repetition_penalty=1.4,
                              presence_penalty=0.5, frequency_penalty=0.3, logit_bias={7: 2.0, 9: -3.0})


@pytest.mark.parametrize("sampling, extra", [
    (None, {}),
    (pb.SamplingParams(temperature=0.9, top_k=40, seed=77), {}),
    (PENALISED, dict(min_tokens=10, stop_token_ids=[12], logprobs=True, top_logprobs=4)),
    (pb.SamplingParams(repetition_penalty=1.6, logit_bias={40: 3.0}), dict(min_tokens=5, logprobs=True, top_logprobs=2)),
], ids=["greedy", "sampled", "sampled-processed", "greedy-processed"])
def test_draft_replica_equals_in_process_engine(pair, draft_replica, sampling, extra):
    """Also with every processor and top-N logprobs: they travel to the target with `open`
    (the penalties, bias and min-p in SamplingParams, min_tokens and the masked ids beside)."""
    _, _, target, draft = pair
    rep, wire = draft_replica
    kw = dict(max_tokens=40, ignore_eos=True, speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4),
              **extra)
    if sampling is not None:
        kw["sampling"] = sampling
    job = _job(PROMPT, **kw)
    got = convert.join_chunks(asyncio.run(_collect(rep.Generate(job.SerializeToString()))))
    expected = SpeculativeEngine(target, draft).generate(convert.request_from_proto(job.request))
    assert list(got.token_ids) == expected.token_ids and got.text == expected.text
    assert got.stats.steps == expected.stats.steps and got.stats.accepted == expected.stats.accepted
    if extra.get("top_logprobs"):
        got_top = convert.top_logprobs_from_proto(got.top_logprobs)
        assert [[t for t, _ in row] for row in got_top] == [[t for t, _ in row] for row in expected.top_logprobs]
        assert len(got_top) == len(expected.token_ids) and all(len(r) == extra["top_logprobs"] for r in got_top)
    assert got.stats.wire_bytes_per_step > 0 and got.stats.round_trip_s > 0
    assert len(wire.table) == 0 and rep.Sessions() == []  # both caches freed at the end
    assert wire.calls.count("Verify") == got.stats.steps  # one round trip per step


def test_final_stats_carry_the_per_step_costs(draft_replica):
    """The controller's step costs: every step but the first (prefill), by positions scored."""
    rep, _ = draft_replica
    job = _job(PROMPT, max_tokens=40, ignore_eos=True,
               speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=3))
    got = convert.join_chunks(asyncio.run(_collect(rep.Generate(job.SerializeToString()))))
    s = got.stats
    by_positions = {c.positions: c.steps for c in s.verify_costs}
    assert sum(by_positions.values()) == s.steps - 1
    expected = dict(s.k_counts)
    first_k = max(expected)  # the first step drafts the full K (nothing caps it yet)
    expected[first_k] -= 1
    assert by_positions == {k + 1: n for k, n in expected.items() if n}
    assert s.cost_drafted == s.proposed - first_k
    assert all(c.seconds > 0 for c in s.verify_costs) and s.cost_draft_s > 0
    costs = convert.step_costs_from_proto(s)
    assert costs["drafted"] == s.cost_drafted
    assert {p: n for p, (_, n) in costs["verify_s_by_positions"].items()} == by_positions


@pytest.mark.parametrize("sampling", [None, pb.SamplingParams(temperature=0.9, top_k=40, seed=77)],
                         ids=["greedy", "sampled"])
def test_unbatched_replica_teaches_k_under_load_every_forward(pair, sampling, monkeypatch):
    """Before: served with target_batching and draft_batching off, the draft replica's K under
    load never learned a cost (no BatchShape came back from the unbatched target, no draft
    forward was timed): every K was chosen on the cost model's priors. Now every step reports
    the target forward that verified it (rows 1, the positions and cached tokens of the forward
    actually run, the prompt's prefill first) and every draft forward run, once each, and the
    cost model observes them as in batched mode: one verify point per step, one draft point per
    draft forward but those of the first drafting step (its first forward fed the prompt).
    Output: the in-process engine's and the batched drafting's, token for token."""
    from specdec.engine.kv_cache import CachedSequence

    t, d, target, draft = pair
    kw = dict(max_tokens=40, ignore_eos=True, speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4))
    if sampling is not None:
        kw["sampling"] = sampling
    job = _job(PROMPT, **kw)
    expected = SpeculativeEngine(target, draft).generate(convert.request_from_proto(job.request))
    batched_wire = Wire(target)
    batched_rep = Draft(AppConfig(target_model=t, draft_model=d, cpu_threads=1), send_factory=lambda key: batched_wire.send)
    batched = convert.join_chunks(asyncio.run(_collect(batched_rep.Generate(job.SerializeToString()))))

    wire = Wire(target)
    rep = Draft(AppConfig(target_model=t, draft_model=d, cpu_threads=1, target_batching=False, draft_batching=False),
                send_factory=lambda key: wire.send)
    assert rep.combiner.batched is False and rep.batch_k is not None
    target_feeds: list[tuple[int, float]] = []  # (positions fed, tokens cached before)
    draft_feeds: list[int] = []  # positions fed per draft forward
    feed = CachedSequence.feed

    def spy_feed(seq, tokens, keep=None):
        if seq.model is target.model:
            target_feeds.append((len(tokens), float(len(seq.cached))))
        elif seq.model is rep.draft_proposer.draft.model:
            draft_feeds.append(len(tokens))
        return feed(seq, tokens, keep)

    monkeypatch.setattr(CachedSequence, "feed", spy_feed)
    steps, ticks = [], []
    observe_step, observe_tick = rep.batch_k.observe_step, rep.batch_k.controller.observe_tick

    def spy_step(key, k, accepted, batch=None, draft_forwards=(), **kw):
        steps.append((k, batch, list(draft_forwards)))
        return observe_step(key, k, accepted, batch, draft_forwards, **kw)

    def spy_tick(rows, positions, verify_s, draft_forwards=(), **kw):
        ticks.append((rows, positions, verify_s, list(draft_forwards), kw.get("context")))
        return observe_tick(rows, positions, verify_s, draft_forwards, **kw)

    monkeypatch.setattr(rep.batch_k, "observe_step", spy_step)
    monkeypatch.setattr(rep.batch_k.controller, "observe_tick", spy_tick)
    got = convert.join_chunks(asyncio.run(_collect(rep.Generate(job.SerializeToString()))))
    assert list(got.token_ids) == expected.token_ids == list(batched.token_ids) and got.text == expected.text
    assert got.stats.steps == expected.stats.steps and got.stats.accepted == expected.stats.accepted
    n = got.stats.steps
    # the target: one forward per step, each reported once with the shape it ran
    assert len(steps) == n == wire.calls.count("Verify") == len(target_feeds)
    shapes = [b for _, b, _ in steps]
    assert [(b.forward, b.rows, b.positions, b.context) for b in shapes] == \
           [(i + 1, 1, p, c) for i, (p, c) in enumerate(target_feeds)]
    assert target_feeds[0] == (len(PROMPT) + steps[0][0], 0.0)  # the prompt's prefill and the first block
    assert all(b.seconds > 0 for b in shapes)
    # the draft: every decode forward timed at one row, each handed to exactly one step; the
    # first forward fed the prompt (a prefill, not a draft position's cost: left out)
    reported = [f for _, _, fs in steps for f in fs]
    assert draft_feeds[0] == len(PROMPT) > 2
    assert len(reported) == sum(1 for p in draft_feeds if p <= 2) == len(draft_feeds) - 1
    assert all(r == 1 and s > 0 for r, s in reported)
    assert sum(k for k, _, _ in steps) == len(draft_feeds)  # K forwards per drafting step (no early stop here)
    # the cost model: each verify forward once (new forward ids), the draft forwards but the first step's
    assert [(r, p, s, c) for r, p, s, _, c in ticks] == [(1, b.positions, b.seconds, b.context) for b in shapes]
    # (a drafting step after one at K = 0 leaves its draft forwards out too: they also fed the missed token)
    kept = [f for i in range(1, n) if steps[i][0] > 0 and steps[i - 1][0] > 0 for f in steps[i][2]]
    assert [f for *_, fs, _ in ticks for f in fs] == kept and kept
    snap = rep.batch_k.controller.cost.snapshot()
    assert snap["prefill_forwards"] == 1 and snap["verify_s_by_positions"] and list(snap["draft_s_by_rows"]) == [1]
    assert len(wire.table) == 0 and rep.Sessions() == []


def test_rebuild_on_missing_and_mismatched_session(pair):
    _, _, target, _ = pair
    wire = Wire(target)
    seed = derive_seeds(3)[1]
    s = RemoteTargetSession("r1", PROMPT, SamplingParams(), seed, False, wire.send)
    s.verify(DraftBlock.empty())
    wire.table.close("r1")  # the target replica restarted
    s.verify(DraftBlock.empty())
    assert s.wire.rebuilds == 1
    # the target session ran ahead (a step whose reply was lost): POSITION_MISMATCH, rebuilt
    wire.table.handle(convert.draft_block_to_proto(DraftBlock.empty(), "r1", s.committed_len))
    s.verify(DraftBlock.empty())
    assert s.wire.rebuilds == 2
    ref = TargetVerifier(target).open_session(PROMPT, SamplingParams(), seed, False)
    for _ in range(3):
        ref.verify(DraftBlock.empty())
    assert s.token_ids == ref.token_ids
    s.close()
    assert len(wire.table) == 0


def test_a_failing_first_verify_leaves_no_session_behind(pair):
    """The target raises on a session's first block: neither the target's table nor the draft
    side keeps it (the table drops a session whose verify raised; close() still sends
    CloseSession once a Verify went out)."""
    import torch

    from specdec.errors import InvalidRequestError

    _, _, target, _ = pair
    wire = Wire(target)
    s = RemoteTargetSession("f1", PROMPT, SamplingParams(), derive_seeds(3)[1], False, wire.send)
    bad = DraftBlock(token_ids=torch.tensor([target.emittable_vocab + 5]))  # outside the vocabulary
    with pytest.raises(InvalidRequestError):
        s.verify(bad)
    assert len(wire.table) == 0
    s.close()
    assert wire.calls == ["Verify", "CloseSession"]
    # a session that verified before and then fails is dropped too (a retry would rebuild it)
    s2 = RemoteTargetSession("f2", PROMPT, SamplingParams(), derive_seeds(3)[1], False, wire.send)
    s2.verify(DraftBlock.empty())
    with pytest.raises(InvalidRequestError):
        s2.verify(bad)
    assert len(wire.table) == 0


@pytest.mark.parametrize("sampling", [None, pb.SamplingParams(temperature=0.9, top_k=40, seed=77)])
def test_resume_on_a_new_replica_gives_the_same_output(pair, sampling):
    t, d, target, _ = pair
    wire = Wire(target)
    cfg = AppConfig(target_model=t, draft_model=d, cpu_threads=1)
    kw = dict(max_tokens=40, ignore_eos=True, stop=["zz"])
    if sampling is not None:
        kw["sampling"] = sampling
    job = _job(PROMPT, **kw)
    full = convert.join_chunks(asyncio.run(_collect(Draft(cfg, send_factory=lambda k: wire.send).Generate(job.SerializeToString()))))
    # first replica: stream a few chunks, then "die" (the generator is dropped, no cleanup); the
    # router's bookkeeping builds the resume job (sent ids and characters, held-back tokens)
    first = Draft(cfg, send_factory=lambda k: wire.send)
    progress = RelayProgress()

    async def head_of(agen, n):
        return [progress.see(raw) for raw in [await agen.__anext__() for _ in range(n)]]

    head = asyncio.run(head_of(first.Generate(job.SerializeToString()), 3))
    progress.fill(job)
    assert list(job.resume_token_ids) == [i for c in head for i in c.token_ids]
    tail = asyncio.run(_collect(Draft(cfg, send_factory=lambda k: wire.send).Generate(job.SerializeToString())))
    got = convert.join_chunks(head + tail)
    assert (got.text, list(got.token_ids)) == (full.text, list(full.token_ids))
    assert got.usage.completion_tokens == full.usage.completion_tokens


def test_cancel_mid_stream_frees_both_caches(draft_replica):
    rep, wire = draft_replica
    job = _job(PROMPT, max_tokens=100, ignore_eos=True)

    held = []

    async def run():
        agen = rep.Generate(job.SerializeToString())
        await agen.__anext__()
        assert rep.Sessions() == ["s1"] and len(wire.table) == 1
        held.append(rep.sessions["s1"].proposer)  # alive, so only an explicit leave removes it
        assert held[0] in rep.combiner._out  # drafted, its block at the target
        await agen.aclose()  # what Serve does when the caller cancels

    asyncio.run(run())
    assert rep.Sessions() == [] and len(wire.table) == 0
    assert wire.calls[-1] == "CloseSession"
    # the other sessions' drafting batches no longer wait (linger) for the cancelled one
    assert held[0] not in rep.combiner._out and len(rep.combiner._out) == 0


def test_cancelled_twice_still_frees_both_caches(draft_replica):
    """Serve may cancel a replica's task again while its cleanup awaits (the proxy's cancel and
    the router's ``stream.cancel()`` race): the cleanup must still run to its end."""
    rep, wire = draft_replica
    wire.close_delay_s = 0.5
    job = _job(PROMPT, max_tokens=100, ignore_eos=True)

    async def run():
        agen = rep.Generate(job.SerializeToString())
        await agen.__anext__()

        async def consume():
            async for _ in agen:
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()  # first cancellation: mid-generation
        while "CloseSession" not in wire.calls:  # the cleanup is now waiting on CloseSession
            await asyncio.sleep(0.01)
        task.cancel()  # second cancellation: during the cleanup
        with pytest.raises(asyncio.CancelledError):
            await task
        return rep.Sessions(), len(wire.table)

    assert asyncio.run(run()) == ([], 0)
    # one cleanup: its CloseSession, preceded by cancel()'s own when the first cancellation came
    # mid-step (RemoteTargetSession.cancel: the target hears at once); nothing after it
    assert wire.calls.count("CloseSession") in (1, 2) and wire.calls[-1] == "CloseSession"


def test_deadline_stops_the_generation(draft_replica):
    from specdec.errors import DeadlineExceededError

    rep, wire = draft_replica
    job = _job(PROMPT, max_tokens=100, ignore_eos=True)
    job.deadline_unix_s = 1.0  # long past
    with pytest.raises(DeadlineExceededError):
        asyncio.run(_collect(rep.Generate(job.SerializeToString())))
    assert rep.Sessions() == [] and len(wire.table) == 0


def test_the_draft_replica_holds_one_tokenizer_when_the_pair_shares_its_files(pair, tmp_path):
    """The tiny pair's folders hold the same tokenizer files: the draft model's tokenizer is the
    target's (the replica's TargetInfo), not a second copy; a draft whose tokenizer files differ
    (same vocabulary, another chat template in its config) keeps only its tokenizer's facts."""
    from specdec.models.loaded import TokenizerFacts
    from specdec.models.vocab import same_tokenizer_files

    t, d, target, _ = pair
    assert same_tokenizer_files(t, d)
    wire = Wire(target)
    rep = Draft(AppConfig(target_model=t, draft_model=d, cpu_threads=1), send_factory=lambda key: wire.send)
    assert rep.draft_proposer.draft.tokenizer is rep.info.tokenizer
    import json
    import shutil

    other = tmp_path / "draft-other"
    shutil.copytree(d, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 12345
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert not same_tokenizer_files(t, other)
    rep = Draft(AppConfig(target_model=t, draft_model=str(other), cpu_threads=1), send_factory=lambda key: wire.send)
    assert rep.draft_proposer.draft.tokenizer == TokenizerFacts(len(rep.info.tokenizer), 2, 0)
    # it drafts and the output is the target alone's (greedy)
    job = _job(PROMPT, max_tokens=12, speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4))
    out = convert.join_chunks(asyncio.run(_collect(rep.Generate(job.SerializeToString()))))
    assert list(out.token_ids) == target_greedy(target, PROMPT, 12) and out.stats.accepted > 0


class SlowPrefillWire(Wire):
    """A target whose first block (the prompt's prefill) takes ``prefill_s``, as a long prompt's
    chunked prefill does on a busy replica; a CloseSession meanwhile drops it (answered
    cancelled), as the target's session table drops a block still waiting for its forwards."""

    prefill_s = 5.0

    def __init__(self, target):
        super().__init__(target)
        import threading

        self.closed_event = threading.Event()

    def send(self, method: str, payload: bytes) -> bytes:
        from specdec.errors import GenerationCancelledError

        if method == "Verify" and xpb.CandidateBlock.FromString(payload).HasField("open"):
            self.calls.append(method)
            if self.closed_event.wait(self.prefill_s):
                raise GenerationCancelledError("the session was closed")
            return self.table.handle(xpb.CandidateBlock.FromString(payload)).SerializeToString()
        if method == "CloseSession":
            self.closed_event.set()
        return super().send(method, payload)


def test_cancel_during_a_long_prefill_tells_the_target_at_once(pair):
    """A request cancelled (or past its deadline) while its prompt is being prefilled: the draft
    replica sends CloseSession at once, so the target drops the rest of the prefill, instead of
    waiting for the whole prefill to end first (served: a 504 at the deadline, then minutes of a
    long prompt's prefill computed for nobody). Both caches are freed, no session is rebuilt."""
    t, d, target, _ = pair
    wire = SlowPrefillWire(target)
    rep = Draft(AppConfig(target_model=t, draft_model=d, cpu_threads=1), send_factory=lambda key: wire.send)
    job = _job(PROMPT, max_tokens=100, ignore_eos=True)

    async def run():
        task = asyncio.create_task(_collect(rep.Generate(job.SerializeToString())))
        while "Verify" not in wire.calls:  # the prefill is in flight
            await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.perf_counter() - t0

    elapsed = asyncio.run(run())
    assert elapsed < 2.0, f"the cancellation waited {elapsed:.1f} s for the prefill"
    assert wire.calls.count("Verify") == 1  # not rebuilt after the CloseSession
    assert "CloseSession" in wire.calls and rep.Sessions() == [] and len(wire.table) == 0
