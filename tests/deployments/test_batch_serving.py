"""Continuous batching on the serving side, without Ray: the target's session table and TP worker
verify many sessions' blocks in one forward; the draft replica's combiner batches drafting."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from deployments import convert
from deployments.target_sessions import TargetSessionTable
from deployments.tp_worker import TPWorker
from protos.specdec.v1 import exchange_pb2 as xpb
from specdec.engine.draft_combiner import DraftCombiner
from specdec.engine.engine import SpeculativeEngine
from specdec.errors import GenerationCancelledError, InvalidRequestError
from specdec.request import GenerationRequest, SamplingParams
from specdec.testing.tiny import build_tiny_model
from specdec.types import DraftBlock
from specdec.engine.verifier import TargetVerifier
from tests.conftest import load_tiny


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("batchserve") / "t", seed=0, max_positions=1024)


@pytest.fixture(scope="module")
def target(folder):
    return load_tiny(folder)


def _sessions(n: int):
    """(session id, prompt, sampling) of n sessions: prompt lengths 1..300, greedy and sampled."""
    rng = random.Random(5)
    lens = [1, 40, 300, 7, 120, 2][:n]
    return [
        (f"s{i}", [rng.randrange(3, 300) for _ in range(n_)],
         SamplingParams(temperature=[0.0, 0.9][i % 2], top_k=20, seed=i))
        for i, n_ in enumerate(lens)
    ]


def _block(rng: random.Random, k: int) -> DraftBlock:
    return DraftBlock(token_ids=torch.tensor([rng.randrange(3, 300) for _ in range(k)], dtype=torch.long))


def _run_batched(table: TargetSessionTable, msgs: list[xpb.CandidateBlock], budget: int | None):
    """Admit msgs as tickets 0.., step until every ticket is answered; replies by ticket, steps."""
    answers, steps = {}, 0
    for t, m in enumerate(msgs):
        reply = table.admit(t, m)
        if reply is not None:
            answers[t] = reply
    while len(answers) < len(msgs):
        for t, res in table.step(budget):
            answers[t] = res
        steps += 1
    return answers, steps


@pytest.mark.parametrize("budget", [None, 32])
def test_table_step_equals_handle_alone(target, budget):
    """Six sessions (prompts 1..300, K 0..8, greedy and sampled) over four rounds: each reply of
    the batched step equals the unbatched handle() of the same block."""
    sessions = _sessions(6)
    alone = TargetSessionTable(TargetVerifier(target))
    batched = TargetSessionTable(TargetVerifier(target))
    rng = random.Random(9)
    positions = {sid: len(p) for sid, p, _ in sessions}
    total_steps = 0
    for rnd in range(4):
        msgs = []
        for i, (sid, prompt, sampling) in enumerate(sessions):
            block = _block(rng, [0, 1, 4, 8, 2, 5][(i + rnd) % 6])
            if not sampling.greedy and block.k:  # a sampled block carries its q
                q = torch.full((block.k, 1), 1.0)
                block = DraftBlock(token_ids=block.token_ids, q_ids=block.token_ids[:, None], q_probs=q)
            open_ = convert.session_open_to_proto(prompt, sampling, 7, True) if rnd == 0 else None
            msgs.append(convert.draft_block_to_proto(block, sid, positions[sid], open=open_))
        expected = [alone.handle(m) for m in msgs]
        got, steps = _run_batched(batched, msgs, budget)
        total_steps += steps
        for t, exp in enumerate(expected):
            g = got[t]
            assert (g.status, g.accepted, list(g.token_ids), g.committed_len) == \
                   (exp.status, exp.accepted, list(exp.token_ids), exp.committed_len)
            assert list(g.logprobs) == pytest.approx(list(exp.logprobs), abs=1e-4)
            positions[msgs[t].session_id] = g.committed_len
    if budget is None:
        assert total_steps == 4  # one forward per round for all six sessions
    else:
        assert total_steps > 4  # the 300-token prompt was prefilled in chunks of <= 32 positions
    assert batched.pending == {}


def test_table_handle_reports_its_forward_as_step_does(target):
    """Before: an unbatched reply (handle) carried no BatchShape, so a draft replica served with
    target_batching off never measured a verify forward (K under load priced on priors). Now
    handle's reply carries its own forward's shape: one counter with step's forwards, rows 1,
    the positions it fed (a prompt's prefill with its block, then K + 1), the tokens cached
    before it, its wall seconds; the same (rows, positions, context) as a batched step that
    verifies the same block alone."""
    sessions = _sessions(4)
    alone = TargetSessionTable(TargetVerifier(target))
    single = TargetSessionTable(TargetVerifier(target))  # batched path, one block per forward
    rng = random.Random(3)
    positions = {sid: len(p) for sid, p, _ in sessions}
    forwards = 0
    for rnd in range(3):
        for i, (sid, prompt, sampling) in enumerate(sessions):
            block = _block(rng, [0, 1, 4, 3][(i + rnd) % 4])
            if not sampling.greedy and block.k:
                q = torch.full((block.k, 1), 1.0)
                block = DraftBlock(token_ids=block.token_ids, q_ids=block.token_ids[:, None], q_probs=q)
            open_ = convert.session_open_to_proto(prompt, sampling, 7, False) if rnd == 0 else None
            msg = convert.draft_block_to_proto(block, sid, positions[sid], open=open_)
            got = alone.handle(msg)
            forwards += 1
            res = convert.verify_result_from_proto(got, False)
            b = res.batch
            assert b is not None and (b.forward, b.rows) == (forwards, 1) and b.seconds > 0
            # open: the whole prompt (nothing cached) and the block; then the bonus token and the block
            fed, cached = (len(prompt) + block.k, 0.0) if rnd == 0 else (1 + block.k, positions[sid] - 1.0)
            assert (b.positions, b.context) == (fed, cached)
            assert got.target_time_s >= b.seconds
            (_, other), = _run_batched(single, [msg], None)[0].items()
            ob = convert.verify_result_from_proto(other, False).batch
            assert (ob.forward, ob.rows, ob.positions, ob.context) == (forwards, 1, b.positions, b.context)
            assert (other.accepted, list(other.token_ids)) == (got.accepted, list(got.token_ids))
            positions[sid] = got.committed_len
    # one counter for both paths: a batched step after unbatched forwards numbers on
    sid, prompt, sampling = sessions[0]
    msg = convert.draft_block_to_proto(_block(rng, 2), sid, positions[sid])
    (_, after), = _run_batched(alone, [msg], None)[0].items()
    assert after.batch_forward == forwards + 1


def test_table_statuses_close_and_superseded(target):
    table = TargetSessionTable(TargetVerifier(target))
    sp = SamplingParams()
    assert table.admit(0, convert.draft_block_to_proto(DraftBlock.empty(), "ghost", 4)).status == \
        xpb.VERIFY_STATUS_SESSION_MISSING
    open_ = convert.session_open_to_proto(list(range(3, 203)), sp, 1, False)
    assert table.admit(1, convert.draft_block_to_proto(DraftBlock.empty(), "a", 200, open=open_)) is None
    assert table.admit(2, convert.draft_block_to_proto(DraftBlock.empty(), "b", 3,
                                                       open=convert.session_open_to_proto([5, 6, 7], sp, 1, False))) is None
    out = dict(table.step(16))  # b answered; a's prompt partly prefilled
    assert set(out) == {2} and out[2].committed_len == 4
    assert 1 in table.pending and len(table.sessions["a"].seq.cached) == 13
    assert table.close("a") is True
    out = dict(table.step(16))
    assert isinstance(out[1], GenerationCancelledError) and str(out[1]) == "the session was closed"
    assert "a" not in table.sessions and table.pending == {}
    # a retried block supersedes the one still waiting; a malformed block is refused at once
    table.admit(3, convert.draft_block_to_proto(DraftBlock.empty(), "b", 4))
    table.admit(4, convert.draft_block_to_proto(DraftBlock.empty(), "b", 4))
    out = dict(table.step(None))
    assert isinstance(out[3], GenerationCancelledError) and out[4].committed_len == 5
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        table.admit(5, convert.draft_block_to_proto(DraftBlock(token_ids=torch.tensor([9999])), "b", 5))
    assert "b" not in table.sessions  # a refused block drops its session, as handle() does


def test_a_row_failing_after_the_forward_fails_only_its_session(target, monkeypatch):
    """One session whose decision raised after the batched forward (a sampled step whose
    processed distribution was nan: repetition_penalty 1e-300 did, served as HTTP 500) failed
    every session of the forward: verify_batch raised and the table closed them all. Now the
    failing row alone gets its exception, with its own type (not INVALID_ARGUMENT: the block
    was fine), and its session is closed; the other row's reply is the one it gets alone."""
    sp = SamplingParams()
    alone = TargetSessionTable(TargetVerifier(target))
    ref = alone.handle(convert.draft_block_to_proto(DraftBlock.empty(), "good", 3,
                                                    open=convert.session_open_to_proto([5, 6, 7], sp, 1, False)))
    table = TargetSessionTable(TargetVerifier(target))
    for t, sid in enumerate(["bad", "good"]):
        assert table.admit(t, convert.draft_block_to_proto(
            DraftBlock.empty(), sid, 3, open=convert.session_open_to_proto([5, 6, 7], sp, 1, False))) is None

    def boom(block, logits):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    monkeypatch.setattr(table.sessions["bad"], "decide", boom)
    out = dict(table.step(None))
    assert type(out[0]) is RuntimeError and "probability tensor" in str(out[0])
    assert out[1].committed_len == 4 and list(out[1].token_ids) == list(ref.token_ids)
    assert set(table.sessions) == {"good"} and table.pending == {}


def test_tp_worker_verify_batch_rank0_answers(folder, target):
    worker = TPWorker(0, 1)
    worker.setup(str(folder), "127.0.0.1", 0)
    alone = TargetSessionTable(TargetVerifier(target))
    sessions = _sessions(3)
    msgs = [convert.draft_block_to_proto(DraftBlock.empty(), sid, len(p),
                                         open=convert.session_open_to_proto(p, sp, 3, False))
            for sid, p, sp in sessions]
    bad = convert.draft_block_to_proto(DraftBlock(token_ids=torch.tensor([5000])), "s0", len(sessions[0][1]) + 1)
    res = worker.verify_batch([(10 + i, m.SerializeToString()) for i, m in enumerate(msgs)], None)
    out = res["answers"]
    assert sorted(t for t, *_ in out) == [10, 11, 12]
    assert res["rows"] == 3 and res["positions"] == sum(len(p) for _, p, _ in sessions)
    for (t, raw, kind, message), m in zip(sorted(out), msgs):
        assert kind is None and list(xpb.VerificationResult.FromString(raw).token_ids) == list(alone.handle(m).token_ids)
    out = worker.verify_batch([(13, bad.SerializeToString())], None)["answers"]
    assert out == [(13, None, "InvalidBlockError",
                    f"block token_ids[0] = 5000 is outside the vocabulary 0..{target.emittable_vocab - 1}")]
    assert worker.pending_count() == 0 and worker.num_sessions() == 2


def test_tp_worker_verify_passes_the_unbatched_forward_on(folder, target):
    """``target_batching`` off: TPWorker.verify answers (rank 0) with the shape of its forward as
    verify_batch's answers carry theirs (one forward counter for both)."""
    worker = TPWorker(0, 1)
    worker.setup(str(folder), "127.0.0.1", 0)
    sid, prompt, sp = _sessions(3)[2]  # greedy, a 300-token prompt
    first = convert.draft_block_to_proto(_block(random.Random(1), 3), sid, len(prompt),
                                         open=convert.session_open_to_proto(prompt, sp, 3, False))
    got = xpb.VerificationResult.FromString(worker.verify(first.SerializeToString()))
    assert (got.batch_forward, got.batch_rows, got.batch_positions) == (1, 1, len(prompt) + 3)
    assert got.HasField("batch_context") and got.batch_context == 0 and got.batch_forward_s > 0
    nxt = convert.draft_block_to_proto(DraftBlock.empty(), sid, got.committed_len)
    again = xpb.VerificationResult.FromString(worker.verify(nxt.SerializeToString()))
    assert (again.batch_forward, again.batch_rows, again.batch_positions, again.batch_context) == \
           (2, 1, 1, got.committed_len - 1)
    nxt = convert.draft_block_to_proto(DraftBlock.empty(), sid, again.committed_len)
    (_, raw, _, _), = worker.verify_batch([(0, nxt.SerializeToString())], None)["answers"]
    assert xpb.VerificationResult.FromString(raw).batch_forward == 3


def test_draft_combiner_batches_concurrent_steps(target, tmp_path):
    """Generations stepped by their own threads: drafting is batched, outputs equal alone."""
    draft = load_tiny(build_tiny_model(tmp_path / "d", seed=1, base=target.model, noise=0.03, max_positions=1024))
    engine = SpeculativeEngine(target, draft)
    rng = random.Random(2)
    reqs = [
        GenerationRequest(prompt_token_ids=[rng.randrange(3, 300) for _ in range(n)], max_tokens=16, ignore_eos=True,
                          sampling={"temperature": t, "seed": i, "top_k": 20}, speculation={"proposer": p, "k": k})
        for i, (n, k, t, p) in enumerate([(3, 4, 0.0, "draft"), (80, 2, 0.8, "draft"), (20, 6, 0.0, "draft"),
                                          (9, 3, 0.0, "ngram"), (150, 1, 1.0, "draft")])
    ]
    alone = [engine.generate(r).token_ids for r in reqs]
    combiner = DraftCombiner(window_s=0.02)
    gens = [engine.start(r) for r in reqs]
    _step_in_threads(combiner, gens, together=True)
    assert [g.result().token_ids for g in gens] == alone
    assert max(combiner.batch_sizes) >= 3  # draft-model sessions drafted together
    unbatched = DraftCombiner(batched=False)
    gen = engine.start(reqs[0])
    while not gen.finished:
        unbatched.step(gen)
    assert gen.result().token_ids == alone[0] and unbatched.batch_sizes == []


def test_table_orders_rows_fairly_by_tenant(target):
    """A burst of one tenant does not push another tenant's block out of the next forward."""
    table = TargetSessionTable(TargetVerifier(target))
    sp = SamplingParams()
    sids = ["a1", "a2", "a3", "a4", "b1"]
    pos = {}
    for t, sid in enumerate(sids):  # open every session (prefill) in one unbounded forward
        open_ = convert.session_open_to_proto([5, 6, 7 + t], sp, 1, False)
        open_.tenant, open_.tenant_weight = sid[0], 1.0
        table.admit(t, convert.draft_block_to_proto(DraftBlock.empty(), sid, 3, open=open_))
    for t, reply in table.step(None):
        pos[sids[t]] = reply.committed_len
    # decode steps: tenant a's four blocks arrive first, then b's; budget 4 positions
    for t, sid in enumerate(sids):
        table.admit(10 + t, convert.draft_block_to_proto(DraftBlock.empty(), sid, pos[sid]))
    answered = sorted(t for t, _ in table.step(4))
    assert 14 in answered and len(answered) == 4  # b1 made it; one of tenant a's blocks waits
    assert sorted(t for t, _ in table.step(4)) == sorted(set(range(10, 15)) - set(answered))
    # a heavier weight gives more turns per round
    assert table.tenants["b1"] == ("b", 1.0)


def test_target_replica_batches_concurrent_verifies(target):
    """The Target replica's batching loop (TP ranks as in-process tables): blocks of concurrent
    sessions share one forward, each reply equals the unbatched one, stats and metrics see it, and
    each reply carries its forward's shape and its rows' mean context (the prefill's, then a decode step's)."""
    import asyncio

    from deployments.config import AppConfig
    from deployments.metrics import SpecDecMetrics
    from deployments.target import Target
    from tests.deployments.test_target_sweep import Rank

    ranks = [Rank(target), Rank(target)]
    metrics = SpecDecMetrics(backend=None)
    replica = Target(AppConfig(target_model="unused", batch_window_s=0.01, max_batch_positions=1024),
                     workers=ranks, metrics=metrics)
    alone = TargetSessionTable(TargetVerifier(target))
    sessions = _sessions(4)
    msgs = [convert.draft_block_to_proto(DraftBlock.empty(), sid, len(p),
                                         open=convert.session_open_to_proto(p, sp, 3, False))
            for sid, p, sp in sessions]

    async def verify_all(blocks):
        return [xpb.VerificationResult.FromString(r)
                for r in await asyncio.gather(*[replica.Verify(m.SerializeToString()) for m in blocks])]

    async def main():
        first = await verify_all(msgs)
        stats = await replica.BatchStats()
        steps = [convert.draft_block_to_proto(DraftBlock.empty(), sid, r.committed_len)
                 for (sid, _, _), r in zip(sessions, first)]
        return first, stats, await verify_all(steps)

    replies, stats, decoded = asyncio.run(main())
    for got, m in zip(replies, msgs):
        exp = alone.handle(m)
        assert (got.accepted, list(got.token_ids), got.committed_len) == (exp.accepted, list(exp.token_ids), exp.committed_len)
    assert stats["forwards"] == 1 and stats["max_rows"] == 4  # all four in one batched forward
    assert stats["mean_positions"] == sum(len(p) for _, p, _ in sessions)
    assert metrics.count("specdec_batch_rows") == 2  # one per forward: the prefill's, then the decode step's
    assert [sorted(r.table.sessions) for r in ranks] == [["s0", "s1", "s2", "s3"]] * 2  # ranks in lockstep
    # each reply carries its forward's rows' mean context (the draft replica's cost model prices by it):
    # 0 cached before the prompts' prefill, then each prompt, its first token not yet fed
    assert {(r.batch_rows, r.batch_context) for r in replies} == {(4, 0.0)}
    mean_prompt = sum(len(p) for _, p, _ in sessions) / len(sessions)
    assert {(r.batch_rows, r.batch_positions, r.batch_context) for r in decoded} == {(4, 4, mean_prompt)}


def test_table_burst_of_one_tenant_does_not_stall_another_prefill(target):
    """Target replica under a burst: tenant a keeps 6 sessions stepping at K = 4 (30 positions
    per step, each answered block followed at once by the next), tenant b opens one session with
    a 60-token prompt; budget 12. b's fair share is 6 positions per forward, so its prompt is
    prefilled in 6-position chunks and answered in exactly the 10th forward, while a's rows
    keep being answered in every forward; b's reply equals the unbatched one."""
    table = TargetSessionTable(TargetVerifier(target))
    alone = TargetSessionTable(TargetVerifier(target))
    sp = SamplingParams()
    rng = random.Random(3)
    pos, ticket = {}, iter(range(10_000))
    for i in range(6):  # a's sessions, opened and prefilled first
        open_ = convert.session_open_to_proto([5, 6, 7 + i], sp, 1, False)
        open_.tenant = "a"
        table.admit(next(ticket), convert.draft_block_to_proto(DraftBlock.empty(), f"a{i}", 3, open=open_))
    for _t, reply in table.step(None):
        pos[f"a{len(pos)}"] = reply.committed_len
    sid_of = {}

    def admit_a(sid):
        t = next(ticket)
        sid_of[t] = sid
        table.admit(t, convert.draft_block_to_proto(_block(rng, 4), sid, pos[sid]))

    for sid in list(pos):
        admit_a(sid)
    prompt = [rng.randrange(3, 300) for _ in range(60)]
    open_b = convert.session_open_to_proto(prompt, sp, 2, False)
    open_b.tenant = "b"
    b_msg = convert.draft_block_to_proto(DraftBlock.empty(), "b", 60, open=open_b)
    table.admit(9999, b_msg)
    forwards, b_reply = 0, None
    while b_reply is None:
        out = table.step(12)
        forwards += 1
        a_answered = [(t, r) for t, r in out if t != 9999]
        assert a_answered  # a is never starved either
        for t, r in a_answered:
            pos[sid_of[t]] = r.committed_len
            admit_a(sid_of[t])
        b_reply = dict(out).get(9999)
        assert table.verifier.last_positions <= 12
    assert forwards == 10
    exp = alone.handle(b_msg)
    assert (list(b_reply.token_ids), b_reply.committed_len) == (list(exp.token_ids), exp.committed_len)


def test_draft_combiner_chunks_a_long_prompt_prefill(target, tmp_path):
    """The draft replica's combiner with a 16-position prefill budget: a 300-token prompt joins
    two running generations; no batched draft forward feeds more than 16 prefill positions (the prompt
    goes in chunks over many rounds), and all three outputs equal each request alone."""
    draft = load_tiny(build_tiny_model(tmp_path / "d", seed=1, base=target.model, noise=0.03, max_positions=1024))
    engine = SpeculativeEngine(target, draft)
    rng = random.Random(6)
    reqs = [GenerationRequest(prompt_token_ids=[rng.randrange(3, 300) for _ in range(n)], max_tokens=20,
                              ignore_eos=True, sampling={"temperature": t, "seed": 5, "top_k": 20},
                              speculation={"proposer": "draft", "k": 4})
            for n, t in [(4, 0.0), (9, 0.7), (300, 0.0)]]
    alone = [engine.generate(r).token_ids for r in reqs]
    combiner = DraftCombiner(window_s=0.005, max_prefill=16)
    gens = [engine.start(r) for r in reqs]
    _step_in_threads(combiner, gens)
    assert [g.result().token_ids for g in gens] == alone
    # prefill chunks of 16 beside the other sessions' decoding tails (at most 2 positions each)
    assert 16 <= max(p for _, p in combiner.trace) <= 16 + 2 * 2 and len(combiner.trace) >= 300 // 16
    assert sum(r for r, _ in combiner.take_timings()) >= len(combiner.trace)
    with pytest.raises(ValueError, match="max_prefill must be >= 1"):
        DraftCombiner(max_prefill=0)



def _step_in_threads(combiner, gens, together: bool = False) -> None:
    """Step every generation to its end through ``combiner``, each in its own thread (as a
    serving replica does); ``together``: the threads start their first step at once."""
    barrier = threading.Barrier(len(gens)) if together else None

    def run(gen):
        if barrier is not None:
            barrier.wait()
        while not gen.finished:
            combiner.step(gen)

    threads = [threading.Thread(target=run, args=(g,)) for g in gens]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)

class BatchingWire:
    """A batching target replica in process for Draft replicas: Verify calls from concurrent
    step threads wait for one batched TargetSessionTable.step (window, positions budget), like
    the Target replica's loop; the replies carry the forward's shape."""

    def __init__(self, target, budget: int, window_s: float = 0.01):
        self.table = TargetSessionTable(TargetVerifier(target))
        self.budget, self.window_s = budget, window_s
        self.cv = threading.Condition()
        self.replies: dict[int, object] = {}
        self.tickets = iter(range(1 << 30))
        self.forwards = 0
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        import time

        while True:
            with self.cv:
                while not self.table.pending:
                    self.cv.wait()
            time.sleep(self.window_s)
            with self.cv:
                out = self.table.step(self.budget)
                self.forwards += 1
                for t, r in out:
                    self.replies[t] = r
                self.cv.notify_all()

    def send(self, method: str, payload: bytes) -> bytes:
        with self.cv:
            if method == "CloseSession":
                sid = xpb.CloseSessionRequest.FromString(payload).session_id
                return xpb.CloseSessionResponse(existed=self.table.close(sid)).SerializeToString()
            t = next(self.tickets)
            reply = self.table.admit(t, xpb.CandidateBlock.FromString(payload))
            if reply is not None:
                return reply.SerializeToString()
            self.cv.notify_all()
            while t not in self.replies:
                self.cv.wait()
            r = self.replies.pop(t)
        if isinstance(r, Exception):
            raise r
        return r.SerializeToString()


def test_served_k_under_load_on_the_draft_replica(target, tmp_path):
    """Two tenants' adaptive jobs run concurrently on one draft replica against a batching
    target: every step's K comes from the replica's batch controller (at most the job's ceiling),
    which learns the batched verify by rows and positions from the target's replies; every
    output equals the same request alone; the tenant stats and gauges show K under load, rows
    and positions per step; a non-adaptive job keeps its K on every step."""
    import asyncio

    from deployments.config import AppConfig
    from deployments.draft import Draft
    from deployments.metrics import SpecDecMetrics
    from protos.specdec.v1 import specdec_pb2 as pb
    from specdec.testing.tiny import build_tiny_model as build

    t_folder = tmp_path / "t"
    import shutil

    shutil.copytree(build(tmp_path / "t0", seed=0, max_positions=1024), t_folder)
    d_folder = build(tmp_path / "d", seed=1, base=target.model, noise=0.03, max_positions=1024)
    wire = BatchingWire(target, budget=64)
    metrics = SpecDecMetrics(backend=None)
    rep = Draft(AppConfig(target_model=str(t_folder), draft_model=str(d_folder), cpu_threads=1,
                          batch_window_s=0.01, max_batch_positions=64),
                send_factory=lambda key: wire.send, metrics=metrics)
    rng = random.Random(11)

    def job(i, tenant, adaptive=True, k=6):
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[rng.randrange(3, 300) for _ in range(5 + i)]),
                                 max_tokens=24, ignore_eos=True,
                                 speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=k))
        req.sampling.seed = 3
        return xpb.DraftJob(session_id=f"j{i}", request=req, tenant=tenant, batch_adaptive=adaptive)

    jobs = [job(i, ["code", "creative"][i % 2]) for i in range(6)] + [job(6, "creative", adaptive=False, k=3)]

    async def run_one(j):
        chunks = [pb.GenerateStreamChunk.FromString(raw) async for raw in rep.Generate(j.SerializeToString())]
        return convert.join_chunks(chunks)

    async def main():
        return await asyncio.gather(*[run_one(j) for j in jobs])

    got = asyncio.run(main())
    engine = SpeculativeEngine(target, load_tiny(d_folder))
    for j, g in zip(jobs, got):
        assert list(g.token_ids) == engine.generate(convert.request_from_proto(j.request)).token_ids
    # not adaptive: K = 3 every step but where max_tokens cuts the last blocks short
    kc = dict(got[6].stats.k_counts)
    assert max(kc) == 3 and kc[3] >= got[6].stats.steps - 2
    for g in got[:6]:
        assert max(dict(g.stats.k_counts)) <= 6
    live = rep.batch_k
    assert live.decisions >= 1 and live.controller.batches  # decided from measured batched forwards
    # (a fixed-K job still running at the last decision is in it under its own key)
    adaptive_ks = {t for t in live.controller.last.ks if "\x00" not in t}
    assert adaptive_ks and adaptive_ks <= {"code", "creative"}
    steps = {t: sum(g.stats.steps for j, g in zip(jobs, got) if j.tenant == t) for t in ("code", "creative")}
    for tenant in ("code", "creative"):
        st = asyncio.run(rep.BatchKStats(tenant))
        assert st["steps"] == steps[tenant] and st["sessions"] == 0
        assert st["k_under_load"] in range(0, 7)
        assert 1.0 <= st["rows_per_step"] <= 7 and st["positions_per_step"] >= st["rows_per_step"]
        assert metrics.value("specdec_batch_rows_seen", tenant=tenant) > 0
        # the acceptance gauge of a batch-adaptive tenant comes from the draft replica's estimate
        assert 0 < metrics.value("specdec_acceptance_rate", tenant=tenant, proposer="draft") <= 1
    assert max(r for r, _ in live.controller.batches) >= 3  # sessions really shared forwards
    # K per step of the adaptive jobs is what the controller chose: every recorded step K is one
    # of the K the controller held for that tenant or the job's own ceiling at a probe
    assert sum(len(v) for v in live.k_steps.values()) == sum(g.stats.steps for g in got)


def test_two_draft_replicas_pool_acceptance_through_the_shared_state(target, tmp_path):
    """Two draft replicas (each its own batch controller) against one batching target, sharing
    the controller state (a local SharedTenantState for the actor): replica A runs the code
    tenant's jobs, B the creative tenant's, concurrently; each exchanges its steps after its
    steps (batch_k_sync_s tiny). After a last exchange of each, both replicas hold the pooled
    counts of both tenants exactly, the pool holds every speculation step of every job once,
    and every output equals the request alone. K under load stays per replica."""
    import asyncio
    import shutil

    from deployments.config import AppConfig
    from deployments.controller_client import ControllerClient
    from deployments.draft import Draft
    from deployments.metrics import SpecDecMetrics
    from protos.specdec.v1 import specdec_pb2 as pb
    from specdec.testing.tiny import build_tiny_model as build

    t_folder = tmp_path / "t"
    shutil.copytree(build(tmp_path / "t0", seed=0, max_positions=1024), t_folder)
    d_folder = build(tmp_path / "d", seed=1, base=target.model, noise=0.03, max_positions=1024)
    wire = BatchingWire(target, budget=64)
    shared = ControllerClient.local()
    cfg = AppConfig(target_model=str(t_folder), draft_model=str(d_folder), cpu_threads=1, batch_window_s=0.01,
                    max_batch_positions=64, batch_k_sync_s=1e-9)
    reps = [Draft(cfg, send_factory=lambda key: wire.send, metrics=SpecDecMetrics(backend=None), controller=shared)
            for _ in range(2)]
    for r in reps:  # the first steps speculate on the priors (measured, the tiny pair may not pay)
        r.batch_k.controller.measure_first = False
    rng = random.Random(12)

    def job(i, tenant):
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[rng.randrange(3, 300) for _ in range(4 + i)]),
                                 max_tokens=20, ignore_eos=True,
                                 speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=5))
        return xpb.DraftJob(session_id=f"p{i}", request=req, tenant=tenant, batch_adaptive=True)

    jobs = [(reps[i % 2], job(i, ["code", "creative"][i % 2])) for i in range(6)]

    async def run_one(rep, j):
        chunks = [pb.GenerateStreamChunk.FromString(raw) async for raw in rep.Generate(j.SerializeToString())]
        return convert.join_chunks(chunks)

    async def main():
        got = await asyncio.gather(*[run_one(r, j) for r, j in jobs])
        for r in reps:  # the exchanges started after steps, then one more each, A last
            if r._sync_task is not None:
                await r._sync_task
        last = [await reps[0].SyncBatchK(), await reps[1].SyncBatchK(), await reps[0].SyncBatchK()]
        return got, last

    got, last = asyncio.run(main())
    engine = SpeculativeEngine(target, load_tiny(d_folder))
    for (_, j), g in zip(jobs, got):
        assert list(g.token_ids) == engine.generate(convert.request_from_proto(j.request)).token_ids
    state = shared.state
    assert set(state.batch_replicas) == {r.replica_id for r in reps}
    assert all("error" not in x for x in last) and last[2]["sent"] == 0
    for tenant in ("code", "creative"):
        key = (tenant, "draft")
        spec_steps = sum(sum(n for k, n in dict(g.stats.k_counts).items() if k > 0)
                         for (_, j), g in zip(jobs, got) if j.tenant == tenant)
        assert spec_steps > 0 and state.batch_acceptance.raw_steps(key) == spec_steps
        pooled = state.batch_acceptance.snapshot(key)
        for r in reps:
            assert r.batch_k.controller.estimator.snapshot(key) == pooled
    # K under load is each replica's own decision over its own sessions
    assert set(reps[0].batch_k.controller.k_by_tenant) == {"code"}
    assert set(reps[1].batch_k.controller.k_by_tenant) == {"creative"}


def test_tenant_stats_show_the_k_under_load_of_every_draft_replica(target, tmp_path):
    """One tenant's adaptive jobs on two draft replicas (each its own batch controller) sharing
    the controller state (a local SharedTenantState for the actor); a router whose draft handle
    always reaches replica A. GetTenantStats lists both replicas, each with the K under load and
    steps its own controller has (B's as of its last exchange), names the replica whose decision
    is the most recent as the source of k_under_load, and sums the steps over both."""
    import asyncio
    import shutil

    from deployments.config import AppConfig
    from deployments.controller_client import ControllerClient
    from deployments.draft import Draft
    from deployments.metrics import SpecDecMetrics
    from deployments.router import Router
    from deployments.tenancy import TenancyGate
    from protos.specdec.v1 import specdec_pb2 as pb
    from specdec.testing.tiny import build_tiny_model as build
    from tests.deployments.grpc_context import RecordingContext
    from tests.deployments.test_openai_api import LocalDraftHandle

    t_folder = tmp_path / "t"
    shutil.copytree(build(tmp_path / "t0", seed=0, max_positions=1024), t_folder)
    d_folder = build(tmp_path / "d", seed=1, base=target.model, noise=0.03, max_positions=1024)
    wire = BatchingWire(target, budget=64)
    shared = ControllerClient.local()
    cfg = AppConfig(target_model=str(t_folder), draft_model=str(d_folder), cpu_threads=1, batch_window_s=0.01,
                    max_batch_positions=64, batch_k_sync_s=1e-9)
    reps = [Draft(cfg, send_factory=lambda key: wire.send, metrics=SpecDecMetrics(backend=None), controller=shared)
            for _ in range(2)]
    rng = random.Random(13)

    def job(i):
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[rng.randrange(3, 300) for _ in range(4 + i)]),
                                 max_tokens=16, ignore_eos=True,
                                 speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4))
        return xpb.DraftJob(session_id=f"s{i}", request=req, tenant="default", batch_adaptive=True)

    jobs = [(reps[i % 2], job(i)) for i in range(4)]

    async def run_one(rep, j):
        chunks = [pb.GenerateStreamChunk.FromString(raw) async for raw in rep.Generate(j.SerializeToString())]
        return convert.join_chunks(chunks)

    class Handle(LocalDraftHandle):
        @property
        def BatchKStats(self):
            return self._Method(self.draft.BatchKStats)

    router = Router(cfg, draft=Handle(reps[0]), gate=TenancyGate(None, shared, SpecDecMetrics(backend=None)))

    async def main():
        got = await asyncio.gather(*[run_one(r, j) for r, j in jobs])
        for r in reps:
            if r._sync_task is not None:
                await r._sync_task
            await r.SyncBatchK()
        return got, await router.GetTenantStats(pb.GetTenantStatsRequest(), RecordingContext())

    got, stats = asyncio.run(main())
    views = {r.replica_id: r.batch_k.tenant_view("default") for r in reps}
    assert all(v["decided_at"] is not None for v in views.values())
    by_id = {m.replica: m for m in stats.batch.replicas}
    assert set(by_id) == set(views) and stats.batch.replicas[0].replica == reps[0].replica_id
    for rid, v in views.items():
        m = by_id[rid]
        assert (m.k_under_load, m.k_model, m.tenant_steps, m.guard_forced) == (
            v["k_under_load"], v["k_model"], v["steps"], v["guard_forced"])
    assert by_id[reps[0].replica_id].reported_s_ago == 0.0
    latest = max(views, key=lambda rid: views[rid]["decided_at"])
    assert stats.batch.k_under_load_replica == latest
    assert stats.batch.k_under_load == views[latest]["k_under_load"]
    assert stats.batch.tenant_steps == sum(g.stats.steps for g in got) == sum(v["steps"] for v in views.values())


def _router_over_spied_draft(cfg, target, controller):
    """A Router (no Serve) over a Draft replica whose Generate records every DraftJob it gets, the
    Draft's blocks verified by a :class:`BatchingWire` on ``target``. Returns (router, draft, jobs)."""
    from deployments.draft import Draft
    from deployments.metrics import SpecDecMetrics
    from deployments.router import Router
    from deployments.tenancy import TenancyGate
    from tests.deployments.test_openai_api import LocalDraftHandle

    wire = BatchingWire(target, budget=64)
    draft = Draft(cfg, send_factory=lambda key: wire.send, metrics=SpecDecMetrics(backend=None), controller=controller)
    jobs: list = []
    generate = draft.Generate

    def spy(payload):
        jobs.append(xpb.DraftJob.FromString(payload))
        return generate(payload)

    draft.Generate = spy

    class Handle(LocalDraftHandle):
        @property
        def BatchKStats(self):
            return self._Method(self.draft.BatchKStats)

    router = Router(cfg, draft=Handle(draft), gate=TenancyGate(None, controller, SpecDecMetrics(backend=None)))
    return router, draft, jobs


def test_router_sends_adaptive_jobs_and_reports_k_under_load(target, tmp_path):
    """Through the router (gRPC methods, open mode): an adaptive greedy request becomes a
    batch-adaptive DraftJob with the request's K as ceiling; a seeded sampled one keeps a fixed K;
    GetTenantStats carries the tenant's K under load and the rows and positions its steps saw;
    outputs equal the engine alone."""
    import asyncio

    from deployments.config import AppConfig
    from deployments.controller_client import ControllerClient
    from deployments.ingress.relay import drained
    from protos.specdec.v1 import specdec_pb2 as pb
    from tests.deployments.grpc_context import RecordingContext

    t_folder = build_tiny_model(tmp_path / "t", seed=0, max_positions=1024)
    d_folder = build_tiny_model(tmp_path / "d", seed=1, base=target.model, noise=0.03, max_positions=1024)
    cfg = AppConfig(target_model=str(t_folder), draft_model=str(d_folder), cpu_threads=1, default_max_k=5)
    router, draft, jobs = _router_over_spied_draft(cfg, target, ControllerClient.local({}))
    greedy = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 17, 42, 9, 100]), max_tokens=20,
                                ignore_eos=True, speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=8))
    seeded = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 17, 42]), max_tokens=12, ignore_eos=True,
                                sampling=pb.SamplingParams(temperature=0.8, seed=4),
                                speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=3))

    async def main():
        out = await asyncio.gather(router.Generate(greedy, RecordingContext()), router.Generate(seeded, RecordingContext()))
        await drained()  # the draft replica's cleanup of each (the relay ends at the final chunk)
        return out, await router.GetTenantStats(pb.GetTenantStatsRequest(), RecordingContext())

    (g, s), stats = asyncio.run(main())
    by_len = {len(j.request.prompt_token_ids.ids): j for j in jobs}
    assert by_len[5].batch_adaptive and by_len[5].request.speculation.max_k == 5  # capped by default_max_k
    assert by_len[5].probe_steps == 0  # the draft replica's controller probes, not the per-request one
    assert not by_len[3].batch_adaptive and by_len[3].request.speculation.max_k == 3
    engine = SpeculativeEngine(target, load_tiny(d_folder))
    assert list(g.token_ids) == engine.generate(GenerationRequest(
        prompt_token_ids=[5, 17, 42, 9, 100], max_tokens=20, ignore_eos=True, speculation={"k": 5})).token_ids
    assert max(dict(g.stats.k_counts)) <= 5
    assert stats.tenant_id == "default" and stats.batch.HasField("k_under_load")
    assert stats.batch.k_under_load == draft.batch_k.tenant_view("default")["k_under_load"]
    assert stats.batch.k_under_load_replica == draft.replica_id and len(stats.batch.replicas) == 1
    assert stats.batch.tenant_steps == g.stats.steps + s.stats.steps
    assert stats.batch.tenant_rows_per_step >= 1 and stats.batch.tenant_positions_per_step >= stats.batch.tenant_rows_per_step


def test_router_leaves_batch_adaptive_jobs_to_the_draft_replica_controller(target, tmp_path):
    """served_batch_k: the router's per-request controller neither decides nor learns from an
    adaptive request (the draft replica's batch controller chooses its K per step and pools its
    acceptance); a seeded sampled request (fixed K) still goes through it. GetTenantStats then
    takes acceptance, counters and K from the draft replicas' side: the pooled α̂ and steps,
    current_k = k_under_load, no per-request predicted speedup or costs."""
    import asyncio

    from deployments.config import AppConfig
    from deployments.controller_client import ControllerClient
    from deployments.ingress.relay import drained
    from protos.specdec.v1 import specdec_pb2 as pb
    from tests.deployments.grpc_context import RecordingContext

    t_folder = build_tiny_model(tmp_path / "t", seed=0, max_positions=1024)
    d_folder = build_tiny_model(tmp_path / "d", seed=1, base=target.model, noise=0.03, max_positions=1024)
    cfg = AppConfig(target_model=str(t_folder), draft_model=str(d_folder), cpu_threads=1, default_max_k=4,
                    batch_k_sync_s=1e-9)
    shared = ControllerClient.local({})
    router, draft, jobs = _router_over_spied_draft(cfg, target, shared)
    greedy = [pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5 + i, 17, 42, 9, 100]), max_tokens=16,
                                 ignore_eos=True, speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT))
              for i in range(2)]
    seeded = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 17, 42]), max_tokens=10, ignore_eos=True,
                                sampling=pb.SamplingParams(temperature=0.8, seed=4),
                                speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=3))

    async def main():
        out = await asyncio.gather(*[router.Generate(r, RecordingContext()) for r in greedy + [seeded]])
        await drained()  # the draft replica's cleanup of each (the relay ends at the final chunk)
        if draft._sync_task is not None:
            await draft._sync_task
        await draft.SyncBatchK()
        return out, await router.GetTenantStats(pb.GetTenantStatsRequest(), RecordingContext())

    (g0, g1, s), stats = asyncio.run(main())
    assert [j.batch_adaptive for j in jobs] == [True, True, False]
    assert [(j.request.speculation.max_k, j.probe_steps) for j in jobs[:2]] == [(4, 0), (4, 0)]
    state = shared.state
    per_request = state.controller.tenant_stats("default")["draft"]
    assert per_request["decisions"] == 1  # the seeded request's only
    assert state.controller.estimator.snapshot(("default", "draft")).raw_steps == sum(
        n for k, n in dict(s.stats.k_counts).items() if k > 0)
    assert state.usage["default"]["requests"] == 3
    assert state.usage["default"]["completion_tokens"] == 16 + 16 + 10
    pooled = state.batch_acceptance.snapshot(("default", "draft"))
    spec_steps = sum(sum(n for k, n in dict(g.stats.k_counts).items() if k > 0) for g in (g0, g1, s))
    assert spec_steps > 0 and pooled.raw_steps == spec_steps  # every drafted step, once
    assert stats.acceptance_rate == pytest.approx(pooled.alpha)
    assert stats.stats.proposed == round(pooled.proposed) and stats.stats.accepted == round(pooled.accepted)
    assert stats.batch.HasField("k_under_load") and stats.current_k == stats.batch.k_under_load
    assert stats.current_k == draft.batch_k.tenant_view("default")["k_under_load"]
    assert not stats.HasField("predicted_speedup") and not stats.cost.verify_s_by_positions


def test_router_admission_is_sized_to_what_the_draft_replica_steps(tmp_path):
    """The router's fair-admission slots default to the draft replica's max_ongoing_requests (what
    one draft replica steps in its batch), so with the router holding more requests than that,
    requests wait in its per-tenant fair queue (weighted by batch_weight) rather than in Serve's
    first-come queue: a burst of 6 from tenant a into 2 slots, then tenant b's single request:
    b gets the first slot that frees (a weight-3 tenant's weight reaches the queue)."""
    import asyncio

    from deployments.config import AppConfig, Scaling
    from deployments.controller_client import ControllerClient
    from deployments.metrics import SpecDecMetrics
    from deployments.tenancy import TenancyGate
    from specdec.control.tenants import hash_api_key

    cfg = AppConfig(target_model="unused", router=Scaling(max_ongoing_requests=32),
                    draft=Scaling(max_ongoing_requests=2))
    assert cfg.router_admission_slots() == 2
    assert AppConfig(target_model="unused", admission_slots=5).router_admission_slots() == 5
    assert AppConfig(target_model="unused", router=Scaling(max_ongoing_requests=4),
                     draft=Scaling(max_ongoing_requests=16)).router_admission_slots() == 4
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n" + "".join(
        f"  - id: {t}\n    api_key_hashes: [{hash_api_key('sk-' + t * 20)}]\n"
        f"    limits: {{max_concurrent_requests: 16}}\n"
        f"    speculation: {{batch_weight: {w}}}\n" for t, w in [("a", 1), ("b", 1), ("heavy", 3)]))
    cfg = cfg.model_copy(update={"tenants_file": str(tenants)})
    gate = TenancyGate.from_config(cfg, ControllerClient.local({}), metrics=SpecDecMetrics(backend=None))
    assert gate.admission.capacity == 2 and gate.admission.weights["heavy"] == 3.0

    def md(t):
        return {"authorization": f"Bearer sk-{t * 20}"}

    def req():
        return GenerationRequest(prompt_token_ids=[5, 6, 7], max_tokens=4)

    async def main():
        held, order = [], []

        async def one(t, hold=False):
            adm = await gate.admit(md(t), req())
            order.append(t)
            if hold:
                held.append(adm)
            else:
                await asyncio.sleep(0)
                await gate.complete(adm, None)

        first = [asyncio.create_task(one("a", hold=True)) for _ in range(2)]
        await asyncio.sleep(0.01)
        burst = [asyncio.create_task(one("a")) for _ in range(4)]
        await asyncio.sleep(0.01)
        b = asyncio.create_task(one("b"))
        await asyncio.sleep(0.01)
        assert gate.admission.queued("a") == 4 and gate.admission.queued("b") == 1
        await gate.complete(held.pop(), None)  # one slot frees: b's request gets it, not a's 5th
        await asyncio.gather(b, *burst, *first)
        assert order[2] == "b"
        await gate.complete(held.pop(), None)
        assert gate.admission.running == 0

    asyncio.run(main())


@pytest.mark.parametrize("sampling, extra", [
    ({"repetition_penalty": 1.6, "logit_bias": {40: 3.0}}, dict(min_tokens=5, logprobs=True, top_logprobs=2)),
    ({"temperature": 0.9, "top_k": 40, "seed": 78, "min_p": 0.05, "repetition_penalty": 1.4, "presence_penalty": 0.5,
      "frequency_penalty": 0.3, "logit_bias": {7: 2.0, 9: -3.0}},
     dict(min_tokens=10, stop_token_ids=[12], logprobs=True, top_logprobs=4)),
], ids=["greedy-processed", "sampled-processed"])
def test_batched_target_applies_each_sessions_processors_and_top_logprobs(folder, target, tmp_path, sampling, extra):
    """The batched target opens a session with the request's logit processing (penalties, bias,
    min_tokens) and top-N logprobs, as the one-at-a-time path does: concurrent processed requests
    through a batching target give the in-process engine's token ids, text and top logprobs."""
    import asyncio

    from deployments.config import AppConfig
    from deployments.draft import Draft
    from protos.specdec.v1 import specdec_pb2 as pb

    d_folder = build_tiny_model(tmp_path / "d", seed=1, base=target.model, noise=0.03)
    wire = BatchingWire(target, budget=64)
    rep = Draft(AppConfig(target_model=str(folder), draft_model=str(d_folder), cpu_threads=1,
                          batch_window_s=0.01, max_batch_positions=64),
                send_factory=lambda key: wire.send)

    def job(i):
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 5, 9, 33, 70, 100, 7 + i]), max_tokens=30,
                                 ignore_eos=True, sampling=pb.SamplingParams(**sampling),
                                 speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4), **extra)
        return xpb.DraftJob(session_id=f"p{i}", request=req, tenant="t")

    jobs = [job(i) for i in range(3)]

    async def run_one(j):
        return convert.join_chunks([pb.GenerateStreamChunk.FromString(raw)
                                    async for raw in rep.Generate(j.SerializeToString())])

    async def main():
        return await asyncio.gather(*[run_one(j) for j in jobs])

    got = asyncio.run(main())
    engine = SpeculativeEngine(target, load_tiny(d_folder))
    for j, g in zip(jobs, got):
        expected = engine.generate(convert.request_from_proto(j.request))
        assert list(g.token_ids) == expected.token_ids and g.text == expected.text
        got_top = convert.top_logprobs_from_proto(g.top_logprobs)
        assert [[t for t, _ in row] for row in got_top] == [[t for t, _ in row] for row in expected.top_logprobs]
        assert all(len(row) == extra["top_logprobs"] for row in got_top)
    assert wire.forwards >= 1 and len(wire.table) == 0


def test_a_block_dropped_by_closing_its_session_is_answered_cancelled_not_raised(target):
    """A draft replica cancelled mid-step (its client went away) closes the session while its
    block waits (here: a prompt prefilled in chunks over several forwards). The Target replica
    raised GenerationCancelledError from Verify, which Serve logs as ``Request failed`` at
    ERROR (``CALL Verify ERROR``) for a normal cancellation; it answers VERIFY_STATUS_CANCELLED,
    and the draft side's session raises GenerationCancelledError itself."""
    import asyncio

    from deployments.config import AppConfig
    from deployments.remote_target import RemoteTargetSession
    from deployments.target import Target
    from tests.deployments.test_target_sweep import Rank

    ranks = [Rank(target)]
    replica = Target(AppConfig(target_model="unused", max_batch_positions=8), workers=ranks)
    prompt = list(range(5, 45))  # 40 positions: 5 forwards of 8
    block = convert.draft_block_to_proto(DraftBlock.empty(), "a", len(prompt),
                                         open=convert.session_open_to_proto(prompt, SamplingParams(), 3, False))

    async def main():
        verify = asyncio.ensure_future(replica.Verify(block.SerializeToString()))
        while not ranks[0].table.pending:  # the prefill's first chunk ran
            await asyncio.sleep(0)
        await replica.CloseSession(xpb.CloseSessionRequest(session_id="a").SerializeToString())
        return xpb.VerificationResult.FromString(await verify), await replica.BatchStats()

    reply, stats = asyncio.run(main())
    assert stats["forwards"] == 1  # dropped after the prefill's first chunk of 8 positions, none computed after
    assert reply == xpb.VerificationResult(status=xpb.VERIFY_STATUS_CANCELLED)
    assert ranks[0].table.sessions == {} and ranks[0].table.pending == {}

    session = RemoteTargetSession("b", prompt, SamplingParams(), 3, False, lambda method, payload: reply.SerializeToString())
    with pytest.raises(GenerationCancelledError, match="^the target dropped the block unverified: its session was closed$"):
        session.verify(DraftBlock.empty())


def test_the_batch_loop_runs_outside_the_request_that_started_it(target):
    """The target replica's batched-forward loop verifies every session's blocks, so it must not
    belong to the request whose Verify happened to start it: Serve cancels a request's Ray calls
    recursively (Ray keeps the current task in a context variable), so the loop's calls to the
    TP ranks, started in that request's context, could be cancelled with it, failing the other
    sessions' steps (a new user saw TaskCancelledError in the worker logs; that source is not
    confirmed). The loop now starts in an empty context, as deployments.aio.outside_request
    says a replica-wide job must: the ranks' calls see none of the starting request's context
    variables."""
    import asyncio
    import contextvars

    from deployments.config import AppConfig
    from deployments.target import Target
    from tests.deployments.test_target_sweep import Rank, _Method

    request = contextvars.ContextVar("request", default=None)
    seen = []
    rank = Rank(target)
    verify_batch = rank.verify_batch.fn
    rank.verify_batch = _Method(lambda *a: (seen.append(request.get()), verify_batch(*a))[1])
    replica = Target(AppConfig(target_model="unused"), workers=[rank])
    prompt = list(range(5, 12))
    block = convert.draft_block_to_proto(DraftBlock.empty(), "a", len(prompt),
                                         open=convert.session_open_to_proto(prompt, SamplingParams(), 3, False))

    async def verify_as(name):
        request.set(name)  # what Ray's context holds for the Serve request being handled
        return xpb.VerificationResult.FromString(await replica.Verify(block.SerializeToString()))

    reply = asyncio.run(verify_as("request-1"))
    assert reply.status == xpb.VERIFY_STATUS_OK and len(reply.token_ids) == 1
    assert seen and seen == [None] * len(seen)
