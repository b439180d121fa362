"""The target replica's batch fill (``AppConfig.batch_fill_wait_s``): while blocks wait, a
forward is held for the sessions the replica answered and expects back, so sessions whose
blocks arrive at different times (after the gathering window) still share one forward. Tiny
models, the TP ranks as in-process tables, no Ray."""

from __future__ import annotations

import asyncio
import random
import shutil
import threading
import time

import pytest
import torch

from deployments import convert
from deployments.config import AppConfig
from deployments.metrics import SpecDecMetrics
from deployments.target import BatchFill, Target
from deployments.target_sessions import TargetSessionTable
from deployments.tp_worker import TPWorker
from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.verifier import TargetVerifier
from specdec.request import SamplingParams
from specdec.testing.tiny import build_tiny_model
from specdec.types import DraftBlock
from tests.conftest import load_tiny
from tests.deployments.test_target_sweep import Clock, Rank


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("fill") / "t", seed=0, max_positions=1024)


@pytest.fixture(scope="module")
def target(folder):
    return load_tiny(folder)


def test_batch_fill_expects_answered_sessions_for_twice_their_own_gap():
    """The policy's bookkeeping on a fake clock: answered sessions are expected (for max_wait_s
    before their first gap is known), an arrival records the session's gap and ends its
    expectation; after that a session is expected for window + 2 x its gap estimate (the mean
    of its last gap and its previous estimate); a close ends the expectation and forgets it."""
    clock = Clock()
    clock.t = 0.0
    fill = BatchFill(max_wait_s=1.0, window_s=0.002, clock=clock)
    for sid in ("a", "b", "c"):
        fill.answered(sid)
    assert fill.missing() == ["a", "b", "c"] and fill.gap() is None
    clock.t = 0.1
    fill.arrived("a")  # gap 0.1
    clock.t = 0.3
    fill.arrived("b")  # gap 0.3
    assert fill.gaps == {"a": pytest.approx(0.1), "b": pytest.approx(0.3)} and fill.missing() == ["c"]
    assert fill.gap() == pytest.approx(0.2)  # the replica's median, for statistics
    clock.t = 0.999  # c has no gap yet: expected until 0 + 0.002 + max_wait_s
    assert fill.missing() == ["c"]
    clock.t = 1.003
    assert fill.missing() == []  # ran out: not waited for any more
    fill.answered("a")  # at 1.003: expected until 1.003 + 0.002 + 2 x 0.1
    fill.answered("b")
    clock.t = 1.204
    assert fill.missing() == ["a", "b"]
    clock.t = 1.206
    assert fill.missing() == ["b"]
    clock.t = 1.403  # a's next gap 0.4: its estimate (0.1 + 0.4) / 2
    fill.arrived("a")
    assert fill.gaps["a"] == pytest.approx(0.25)
    fill.closed("b")
    assert fill.missing() == [] and "b" not in fill.expected and "b" not in fill.gaps
    fill.arrived("new")  # a session never answered (its first block): no gap recorded
    assert "new" not in fill.gaps
    assert asyncio.run(BatchFill(0.0).wait()) == 0.0  # off: never holds


def _open(sid: str, prompt: list[int]) -> bytes:
    sp = SamplingParams()
    return convert.draft_block_to_proto(DraftBlock.empty(), sid, len(prompt),
                                        open=convert.session_open_to_proto(prompt, sp, 1, False)).SerializeToString()


@pytest.mark.parametrize("fill_s", [5.0, 0.0])
def test_blocks_arriving_apart_share_one_forward_with_the_fill(target, fill_s):
    """Four sessions opened in one forward send their next blocks (K = 3) 0.5 s apart, 250x the
    2 ms gathering window. With the fill the four are verified in one forward (2 forwards in
    all); without it (batch_fill_wait_s = 0) each block gets its own (5). Both ways every reply
    equals the block verified alone. Then a session that closes instead of sending a block ends
    the hold: the other three are verified at once (well before its expectation, 2 x its 1.5 s
    gap, runs out)."""
    replica = Target(AppConfig(target_model="unused", batch_window_s=0.002, batch_fill_wait_s=fill_s),
                     workers=[Rank(target)], metrics=SpecDecMetrics(backend=None))
    alone = TargetSessionTable(TargetVerifier(target))
    rng = random.Random(4)
    prompts = {f"s{i}": [rng.randrange(3, 300) for _ in range(3 + 5 * i)] for i in range(4)}
    for sid, p in prompts.items():
        alone.handle(xpb.CandidateBlock.FromString(_open(sid, p)))

    async def send_after(delay: float, raw: bytes):
        await asyncio.sleep(delay)
        return xpb.VerificationResult.FromString(await replica.Verify(raw))

    async def main():
        opened = await asyncio.gather(*[replica.Verify(_open(sid, p)) for sid, p in prompts.items()])
        pos = {sid: xpb.VerificationResult.FromString(r).committed_len for sid, r in zip(prompts, opened)}
        msgs = [convert.draft_block_to_proto(
            DraftBlock(token_ids=torch.tensor([rng.randrange(3, 300) for _ in range(3)])), sid, pos[sid])
            for sid in prompts]
        got = await asyncio.gather(*[send_after(0.5 * i, m.SerializeToString()) for i, m in enumerate(msgs)])
        after_round = (await replica.BatchStats())["forwards"]
        # round 3: s3 closes (its generation ended) 100 ms in; s0..s2 send at once
        t0 = time.monotonic()
        last = [convert.draft_block_to_proto(DraftBlock.empty(), sid, r.committed_len)
                for sid, r in zip(prompts, got)][:3]
        close = replica.CloseSession(xpb.CloseSessionRequest(session_id="s3").SerializeToString())
        await asyncio.gather(*[send_after(0, m.SerializeToString()) for m in last], _after(0.1, close))
        return msgs, got, after_round, time.monotonic() - t0, await replica.BatchStats()

    msgs, got, after_round, held, stats = asyncio.run(main())
    for m, g in zip(msgs, got):
        exp = alone.handle(m)
        assert (g.status, g.accepted, list(g.token_ids), g.committed_len) == \
               (exp.status, exp.accepted, list(exp.token_ids), exp.committed_len)
    if fill_s:
        assert after_round == 2 and stats["max_rows"] == 4
        assert stats["forwards"] == 3 and held < 1.5  # released by the close (expected until ~3 s)
    else:
        assert after_round == 5 and stats["max_rows"] == 4  # (the opens)
        assert stats["forwards"] == 6 and stats["mean_held_s"] == 0.0


async def _stop_loop_task(replica) -> None:
    """Cancel the replica's batching loop and let it end (its loop is about to stop)."""
    task = replica._loop_task
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


async def _after(delay: float, coro):
    await asyncio.sleep(delay)
    return await coro


class _Remote:
    """A TP rank method as a Ray handle method: ``.remote()`` runs it in a worker thread, so the
    replica's event loop keeps taking blocks while a forward runs (as with real actors)."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return asyncio.get_running_loop().run_in_executor(None, self.fn, *args)


class _ThreadedRank:
    def __init__(self, target):
        self.table = TargetSessionTable(TargetVerifier(target))
        worker = TPWorker(0, 1)
        worker.table = self.table
        self.verify_batch = _Remote(worker.verify_batch)
        self.close_session = _Remote(self.table.close)
        self.num_sessions = _Remote(lambda: len(self.table))
        self.session_ids = _Remote(lambda: sorted(self.table.sessions))


def test_draft_replica_sessions_share_the_target_forwards(target, tmp_path):
    """A draft replica (its sessions stepped in their own threads, drafting batched by its
    DraftCombiner) against a target replica (its batching loop in its own event loop, the
    forward in a worker thread), as served but without Ray; every Verify reaches the target
    0-20 ms late and its reply reaches the step thread 0-20 ms late (seeded), 10x the 2 ms
    window. Eight greedy sessions of 24..38 tokens: every output equals the request alone, and
    with the batch fill on both sides the target's forwards and the drafting batches hold about
    all running sessions: about one of each per step of the longest session (measured 30-31 for
    29 steps; without the target's fill 93 forwards of 1.8 rows; without the draft side's,
    60-70 drafting batches of 3-3.5 sessions)."""
    from deployments.draft import Draft
    from specdec.request import GenerationRequest

    t_folder = tmp_path / "t"
    shutil.copytree(build_tiny_model(tmp_path / "t0", seed=0, max_positions=1024), t_folder)
    d_folder = build_tiny_model(tmp_path / "d", seed=1, base=target.model, noise=0.03, max_positions=1024)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    replica = Target(AppConfig(target_model="unused", batch_fill_wait_s=1.0), workers=[_ThreadedRank(target)],
                     metrics=SpecDecMetrics(backend=None))
    delays = random.Random(0)
    lock = threading.Lock()

    def send(method: str, payload: bytes) -> bytes:
        with lock:
            there, back = delays.random() * 0.02, delays.random() * 0.02
        time.sleep(there)
        reply = asyncio.run_coroutine_threadsafe(getattr(replica, method)(payload), loop).result(timeout=120)
        time.sleep(back)
        return reply

    draft = Draft(AppConfig(target_model=str(t_folder), draft_model=str(d_folder), cpu_threads=1, served_batch_k=False),
                  send_factory=lambda key: send, metrics=SpecDecMetrics(backend=None))
    rng = random.Random(1)
    jobs = []
    for i in range(8):
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[rng.randrange(3, 300) for _ in range(4 + 3 * i)]),
                                 max_tokens=24 + 2 * i, ignore_eos=True,
                                 speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4))
        jobs.append(xpb.DraftJob(session_id=f"f{i}", request=req))

    async def one(job):
        return convert.join_chunks([pb.GenerateStreamChunk.FromString(raw)
                                    async for raw in draft.Generate(job.SerializeToString())])

    async def run_all():
        return await asyncio.gather(*[one(j) for j in jobs])

    try:
        got = asyncio.run(run_all())
        stats = asyncio.run_coroutine_threadsafe(replica.BatchStats(), loop).result(timeout=30)
        held = asyncio.run_coroutine_threadsafe(replica.Sessions(), loop).result(timeout=30)
    finally:
        asyncio.run_coroutine_threadsafe(_stop_loop_task(replica), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    engine = SpeculativeEngine(target, load_tiny(d_folder))
    for j, g in zip(jobs, got):
        assert list(g.token_ids) == engine.generate(convert.request_from_proto(j.request)).token_ids
    steps = sum(g.stats.steps for g in got)
    assert held == []  # every session closed on the target
    assert stats["max_rows"] == 8
    # one forward per step of the longest session (29 steps), about: every forward held every
    # session still running (without the fill, measured: 93 forwards of 1.8 rows)
    longest = max(g.stats.steps for g in got)
    assert stats["forwards"] <= longest + 8, (stats, steps, longest)
    assert len(draft.combiner.batch_sizes) <= longest + 8, (draft.combiner.batch_sizes, longest)


@pytest.mark.parametrize("linger_s", [0.5, 0.0])
def test_draft_combiner_waits_for_sessions_coming_back(target, tmp_path, linger_s):
    """The draft side's fill: three sessions drafted together; their next drafts are asked 60 ms
    apart (30x the 2 ms window). With ``linger_s`` 0.5 the three draft in one batch; without
    (0), asked one after another, each drafts alone at once (timed gaps would let a loaded
    machine's slow forward gather the late two into one batch). A session that left (its generation ended) is not waited for: the
    other two draft at once. The blocks equal each session's drafts alone."""
    from specdec.engine.draft_combiner import DraftCombiner
    from specdec.request import GenerationRequest

    draft = load_tiny(build_tiny_model(tmp_path / "d", seed=1, base=target.model, noise=0.03, max_positions=1024))
    engine = SpeculativeEngine(target, draft)
    rng = random.Random(3)
    reqs = [GenerationRequest(prompt_token_ids=[rng.randrange(3, 300) for _ in range(5 + 4 * i)], max_tokens=16,
                              speculation={"proposer": "draft", "k": 3}) for i in range(3)]
    combiner = DraftCombiner(window_s=0.002, linger_s=linger_s, max_linger_s=5.0)
    sessions = [engine.start(r).proposer for r in reqs]
    alone = [engine.start(r).proposer for r in reqs]

    def propose_all(delays: list[float], who: list[int]) -> list:
        out: list = [None] * len(who)

        def run(j: int) -> None:
            time.sleep(delays[j])
            out[j] = combiner.propose(sessions[who[j]], 3)

        threads = [threading.Thread(target=run, args=(j,)) for j in range(len(who))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        return out

    combiner.window_s = 0.3  # the threads start together: one batch (a 2 ms window may split them)
    first = propose_all([0.0, 0.0, 0.0], [0, 1, 2])
    combiner.window_s = 0.002
    assert combiner.batch_sizes == [3]
    for s, a, b in zip(sessions, alone, first):  # commit the same tokens on both sides
        exp = a.propose(3)
        assert b.token_ids.tolist() == exp.token_ids.tolist()
        s.commit(b.token_ids[:1])
        a.commit(b.token_ids[:1])
    if linger_s:
        second = propose_all([0.0, 0.06, 0.12], [0, 1, 2])
    else:  # one after another: each must draft alone at once, not wait for the others to come back
        t0 = time.monotonic()
        second = [propose_all([0.0], [j])[0] for j in range(3)]
        assert time.monotonic() - t0 < 2.0  # not the 5 s bound
    assert combiner.batch_sizes[1:] == ([3] if linger_s else [1, 1, 1])
    for a, b in zip(alone, second):
        assert b.token_ids.tolist() == a.propose(3).token_ids.tolist()
    combiner.leave(sessions[2])
    combiner.window_s = 0.3
    t0 = time.monotonic()
    propose_all([0.0, 0.0], [0, 1])
    assert combiner.batch_sizes[-1] == 2 and time.monotonic() - t0 < 2.0  # not the 5 s bound


def test_a_lone_session_does_not_wait_for_the_gathering_window(target, monkeypatch):
    """The gathering window (``batch_window_s``) waits for blocks of other sessions. One client
    alone waited it on every step for nobody (2 ms of a ~0.11 s plain step served). Now it is
    skipped when every session the replica holds already has its block waiting: one session's
    three blocks, no window; with a second session held whose block is not in, the window is
    waited as before. Replies equal the blocks verified alone."""
    import deployments.target as target_mod

    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay, *a, **k):
        waits.append(delay)
        return await real_sleep(0, *a, **k)

    monkeypatch.setattr(target_mod.asyncio, "sleep", sleep)
    replica = Target(AppConfig(target_model="unused", batch_window_s=0.25, batch_fill_wait_s=0.0),
                     workers=[Rank(target)], metrics=SpecDecMetrics(backend=None))
    alone = TargetSessionTable(TargetVerifier(target))
    prompt = [5, 17, 42, 9, 100, 23]
    alone.handle(xpb.CandidateBlock.FromString(_open("a", prompt)))

    async def main():
        r = xpb.VerificationResult.FromString(await replica.Verify(_open("a", prompt)))
        got = []
        for _ in range(3):
            m = convert.draft_block_to_proto(DraftBlock(token_ids=torch.tensor([7, 8])), "a", r.committed_len)
            r = xpb.VerificationResult.FromString(await replica.Verify(m.SerializeToString()))
            got.append((m, r))
        lone = list(waits)
        await replica.Verify(_open("b", prompt[:4]))  # a second session held, its next block not in
        m = convert.draft_block_to_proto(DraftBlock.empty(), "a", r.committed_len)
        await replica.Verify(m.SerializeToString())
        await _stop_loop_task(replica)
        return got, lone, list(waits)

    got, lone, later = asyncio.run(main())
    for m, g in got:
        exp = alone.handle(m)
        assert (g.accepted, list(g.token_ids), g.committed_len) == (exp.accepted, list(exp.token_ids), exp.committed_len)
    assert 0.25 not in lone
    assert later.count(0.25) == 2  # b's open (a held, no block) and a's block (b held, no block)
