"""Continuous batching: batched forwards, batched verification and drafting, the step scheduler.

Every output of a batched run must equal the same request run alone (the unbatched engine),
whatever the batch composition, arrival order, positions budget or cancellations of others.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from scipy.stats import chisquare

from specdec.engine.batch import BatchScheduler
from specdec.engine.fairness import fair_order
from specdec.engine.engine import SpeculativeEngine
from specdec.errors import InvalidRequestError
from specdec.engine.kv_cache import CachedSequence, feed_many
from specdec.request import GenerationRequest, SamplingParams
from specdec.engine.sampling import warp_probs
from specdec.testing.tiny import build_tiny_model
from specdec.types import DraftBlock, FinishReason
from specdec.engine.verifier import InvalidBlockError
from tests.conftest import load_tiny


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    """Tiny target (1024 positions) and a close draft: prompts up to 500 tokens fit."""
    d = tmp_path_factory.mktemp("batchpair")
    target = load_tiny(build_tiny_model(d / "t", seed=0, max_positions=1024))
    draft = load_tiny(build_tiny_model(d / "d", seed=1, base=target.model, noise=0.03, max_positions=1024))
    return target, draft


def _prompt(rng: random.Random, n: int) -> list[int]:
    # repeated fragments so prompt lookup finds matches
    base = [rng.randrange(3, 300) for _ in range(max(1, n // 3))]
    return (base * 4)[:n]


#: (prompt length, K, proposer, temperature, tenant)
MIX = [
    (1, 0, "draft", 0.0, "code"),
    (5, 1, "draft", 0.0, "creative"),
    (37, 4, "ngram", 0.0, "code"),
    (120, 8, "draft", 0.9, "creative"),
    (500, 4, "draft", 0.0, "code"),
    (60, 8, "draft", 1.0, "creative"),
    (12, 4, "none", 0.7, "code"),
    (250, 1, "ngram", 0.8, "creative"),
]


def _requests(mix=MIX, max_tokens=20, seed=0):
    rng = random.Random(seed)
    out = []
    for i, (n, k, proposer, temp, tenant) in enumerate(mix):
        req = GenerationRequest(
            prompt_token_ids=_prompt(rng, n), max_tokens=max_tokens, ignore_eos=True,
            sampling={"temperature": temp, "top_k": 20, "seed": 100 + i},
            speculation={"proposer": proposer, "k": k},
        )
        out.append((req, tenant))
    return out


@pytest.fixture(scope="module")
def alone(long_pair):
    """Each request of MIX run alone through the unbatched engine."""
    engine = SpeculativeEngine(*long_pair)
    return [engine.generate(req).token_ids for req, _ in _requests()]


# --- the packed forward ----------------------------------------------------------------------



def _twin_sequences(target, lens, rng):
    """Two lists of cached sequences with the same random prefixes of ``lens`` tokens: one to
    feed alone, one to feed packed."""
    alone_seqs = [CachedSequence(target.model, []) for _ in lens]
    batch_seqs = [CachedSequence(target.model, []) for _ in lens]
    for a, b, n in zip(alone_seqs, batch_seqs, lens):
        if n:
            prefix = [rng.randrange(3, 300) for _ in range(n)]
            a.feed(prefix, keep=1)
            b.feed(prefix, keep=1)
    return alone_seqs, batch_seqs

def test_feed_many_equals_separate_forwards(long_pair):
    """Ragged caches (0..500 cached) and ragged new tokens (1..9): same logits, same caches."""
    target, _ = long_pair
    rng = random.Random(1)
    lens = [0, 1, 7, 120, 500]
    alone_seqs, batch_seqs = _twin_sequences(target, lens, rng)
    for step in range(3):
        news = [[rng.randrange(3, 300) for _ in range(rng.choice([1, 2, 5, 9]))] for _ in lens]
        keeps = [len(t) if i % 2 else 1 for i, t in enumerate(news)]
        ref = [s.feed(t, keep=k) for s, t, k in zip(alone_seqs, news, keeps)]
        got = feed_many([(s, t, k) for s, t, k in zip(batch_seqs, news, keeps)])
        for r, g, k in zip(ref, got, keeps):
            assert g.shape == (k, target.vocab_rows)
            assert torch.allclose(r, g, atol=1e-4, rtol=1e-4)
            assert torch.equal(r.argmax(-1), g.argmax(-1))
        for a, b in zip(alone_seqs, batch_seqs):
            assert a.cached == b.cached
            for la, lb in zip(a.cache.layers, b.cache.layers):
                assert la.keys.shape == lb.keys.shape
                assert torch.allclose(la.keys, lb.keys, atol=1e-4)
        # per-row cut-back, different per row
        for i, (a, b) in enumerate(zip(alone_seqs, batch_seqs)):
            cut = len(a.cached) - (i % 3)
            a._crop(cut)
            b._crop(cut)


def test_feed_many_keep_zero_and_errors(long_pair):
    target, draft = long_pair
    a, b = CachedSequence(target.model, []), CachedSequence(target.model, [])
    out = feed_many([(a, [5, 6, 7], 0), (b, [8], 1)])
    assert out[0].shape == (0, target.vocab_rows) and out[1].shape == (1, target.vocab_rows)
    assert a.cached == [5, 6, 7] and b.cached == [8]
    with pytest.raises(ValueError, match="at least one token"):
        feed_many([(a, [], 0), (b, [1], 1)])
    with pytest.raises(ValueError, match="keep=4 outside 0..3"):
        feed_many([(a, [1, 2, 3], 4), (b, [1], 1)])
    with pytest.raises(ValueError, match="same model"):
        feed_many([(a, [1], 1), (CachedSequence(draft.model, []), [1], 1)])


# --- batched verification --------------------------------------------------------------------


def test_verify_batch_rows_equal_verify_alone(long_pair):
    """Greedy and seeded sampled rows, ragged K (0..8) and caches: results equal verify()."""
    target, _ = long_pair
    engine = SpeculativeEngine(target)
    rng = random.Random(3)
    specs = [(1, 0, 0.0), (40, 3, 0.0), (300, 8, 1.0), (9, 1, 0.8), (120, 5, 0.0)]
    def sessions():
        return [
            engine.verifier.open_session(_prompt(random.Random(n), n), SamplingParams(temperature=t, seed=n), seed=n)
            for n, _, t in specs
        ]
    alone_s, batch_s = sessions(), sessions()
    for step in range(4):
        blocks = [DraftBlock(token_ids=torch.tensor([rng.randrange(3, 300) for _ in range(k)], dtype=torch.long))
                  for _, k, _ in specs]
        ref = [s.verify(b) for s, b in zip(alone_s, blocks)]
        got = engine.verifier.verify_batch(list(zip(batch_s, blocks)))
        assert [(r.accepted, r.token_ids, r.committed_len) for r in ref] == \
               [(g.accepted, g.token_ids, g.committed_len) for g in got]
        for a, b in zip(alone_s, batch_s):
            assert a.seq.cached == b.seq.cached  # each row cut back to its own accepted prefix


def test_verify_batch_budget_chunks_prefill_and_defers(long_pair):
    target, _ = long_pair
    engine = SpeculativeEngine(target)
    sp = SamplingParams()
    short = engine.verifier.open_session([5, 6, 7], sp, seed=1)
    long_ = engine.verifier.open_session(list(range(3, 103)), sp, seed=2)  # 100-token prompt
    late = engine.verifier.open_session([9, 10], sp, seed=3)
    block = DraftBlock.empty()
    res = engine.verifier.verify_batch([(short, block), (long_, block), (late, block)], max_positions=16)
    # short: 3 positions; long: a chunk of the remaining 13; late: deferred
    assert res[0] is not None and res[0].committed_len == 4
    assert res[1] is None and len(long_.seq.cached) == 13
    assert res[2] is None and late.seq.cached == []
    rounds = 0
    while True:
        res = engine.verifier.verify_batch([(long_, block), (late, block)], max_positions=16)
        rounds += 1
        if res[0] is not None:
            break
        assert res[1] is None  # the first row's chunk takes the whole budget
    # the 87 positions left after the first chunk of 13: 5 chunks of 16, then the last 7 with
    # the logits, and the 2-token prompt behind it in the same forward
    assert rounds == 6 and engine.verifier.last_positions == 9
    alone = engine.verifier.open_session(list(range(3, 103)), sp, seed=2).verify(block)
    assert res[0].token_ids == alone.token_ids and res[0].committed_len == 101
    assert res[1].committed_len == 3
    # a block that does not fit and cannot be chunked runs when it is first
    big = DraftBlock(token_ids=torch.tensor([7] * 8))
    out = engine.verifier.verify_batch([(short, big)], max_positions=4)
    assert out[0] is not None and out[0].committed_len >= 5


def test_verify_batch_bad_row_leaves_others(long_pair):
    target, _ = long_pair
    engine = SpeculativeEngine(target)
    sp = SamplingParams()
    good = engine.verifier.open_session([5, 6, 7], sp, seed=1)
    bad = engine.verifier.open_session([5, 6, 7], sp, seed=1)
    ref = engine.verifier.open_session([5, 6, 7], sp, seed=1).verify(DraftBlock.empty())
    res = engine.verifier.verify_batch(
        [(bad, DraftBlock(token_ids=torch.tensor([target.vocab_rows + 5]))), (good, DraftBlock.empty())]
    )
    assert isinstance(res[0], InvalidBlockError)
    assert str(res[0]) == f"block token_ids[0] = {target.vocab_rows + 5} is outside the vocabulary 0..{target.emittable_vocab - 1}"
    assert bad.committed_len == 3 and bad.seq.cached == []
    assert res[1].token_ids == ref.token_ids
    with pytest.raises(ValueError, match="appears twice"):
        engine.verifier.verify_batch([(good, DraftBlock.empty()), (good, DraftBlock.empty())])


def test_verify_batch_row_failing_after_the_forward_leaves_others(long_pair, monkeypatch):
    """A row whose decision raises after the forward is that row's result; the others stand."""
    target, _ = long_pair
    engine = SpeculativeEngine(target)
    sp = SamplingParams()
    good = engine.verifier.open_session([5, 6, 7], sp, seed=1)
    bad = engine.verifier.open_session([5, 6, 7], sp, seed=1)
    ref = engine.verifier.open_session([5, 6, 7], sp, seed=1).verify(DraftBlock.empty())
    monkeypatch.setattr(bad, "decide", lambda block, logits: (_ for _ in ()).throw(RuntimeError("nan row")))
    res = engine.verifier.verify_batch([(bad, DraftBlock.empty()), (good, DraftBlock.empty())])
    assert type(res[0]) is RuntimeError and str(res[0]) == "nan row"
    assert res[1].token_ids == ref.token_ids and good.committed_len == 4


def test_propose_batch_equals_propose_alone(long_pair):
    target, draft = long_pair
    engine = SpeculativeEngine(target, draft)
    proposer = engine.draft_proposer
    specs = [(1, 4, 0.0, 0.0), (50, 8, 0.0, 0.4), (200, 3, 1.0, 0.0), (20, 0, 0.0, 0.0), (7, 6, 0.7, 0.3)]
    def sessions():
        return [proposer.open_session(_prompt(random.Random(n), n), SamplingParams(temperature=t, top_k=20),
                                      seed=n, min_confidence=c) for n, _, t, c in specs]
    a, b = sessions(), sessions()
    for step in range(3):
        ks = [k for _, k, _, _ in specs]
        ref = [s.propose(k) for s, k in zip(a, ks)]
        got = proposer.propose_batch(b, ks)
        for r, g in zip(ref, got):
            assert r.token_ids.tolist() == g.token_ids.tolist()
            if r.q_ids is not None:
                assert torch.equal(r.q_ids, g.q_ids)
                assert torch.allclose(r.q_probs, g.q_probs, atol=1e-5)
        for s1, s2, r in zip(a, b, ref):  # commit the first draft (or a fixed token) + a correction
            emitted = r.token_ids.tolist()[:1] + [11]
            s1.commit(emitted)
            s2.commit(emitted)


# --- the scheduler ---------------------------------------------------------------------------


def test_scheduler_outputs_equal_requests_alone(long_pair, alone):
    """Prompts 1..500, K 0/1/4/8, draft/ngram/none, greedy and seeded sampled, two tenants."""
    engine = SpeculativeEngine(*long_pair)
    sched = BatchScheduler(engine, max_batch_positions=64)
    handles = [sched.submit(req, tenant=tenant) for req, tenant in _requests()]
    sched.run_until_idle()
    assert [h.result().token_ids for h in handles] == alone
    assert all(h.result().finish_reason is FinishReason.MAX_TOKENS for h in handles)
    # rows really shared forwards, and no forward went over the budget but a lone first row
    assert max(len(t.answered) for t in sched.trace) >= 5
    assert all(not t.rows or t.positions_fed <= 64 for t in sched.trace)


@pytest.mark.parametrize("order_seed", [1, 2])
def test_scheduler_order_and_composition_do_not_change_outputs(long_pair, alone, order_seed):
    """Other arrival order, staggered arrivals, another budget, and the unbatched switch."""
    engine = SpeculativeEngine(*long_pair)
    reqs = list(enumerate(_requests()))
    random.Random(order_seed).shuffle(reqs)
    sched = BatchScheduler(engine, max_batch_positions=[16, 200][order_seed - 1])
    handles = {}
    for j, (i, (req, tenant)) in enumerate(reqs):
        handles[i] = sched.submit(req, tenant=tenant)
        if j % 3 == 2:  # later arrivals join a running batch
            sched.step()
            sched.step()
    sched.run_until_idle()
    assert [handles[i].result().token_ids for i in range(len(reqs))] == alone
    unbatched = BatchScheduler(engine, batched=False)
    hs = [unbatched.submit(req, tenant=t) for req, t in _requests()[:4]]
    unbatched.run_until_idle()
    assert [h.result().token_ids for h in hs] == alone[:4]
    # each row its own forward over all its positions: the trace counts them all
    assert max(len(t.answered) for t in unbatched.trace) >= 2
    assert all(t.positions_fed == t.positions for t in unbatched.trace if t.answered)


def test_cancel_mid_batch_frees_caches_and_leaves_others(long_pair, alone):
    engine = SpeculativeEngine(*long_pair)
    victims = {}

    def during_forward(ids):  # cancel request 3 while a forward that holds it runs
        if 3 in ids and len(sched.trace) == 2:
            victims[3].cancel()

    sched = BatchScheduler(engine, max_batch_positions=64, on_forward=during_forward)
    handles = [sched.submit(req, tenant=t) for req, t in _requests()]
    victims[3] = handles[3]
    sched.run_until_idle()
    res = handles[3].result()
    assert res.finish_reason is FinishReason.CANCELLED
    gen = handles[3].generation
    assert gen.target.seq.cache is None and gen.target.seq.cached == []  # target cache freed
    assert gen.proposer.seq.cache is None  # draft cache freed
    assert 3 not in sched.trace[-1].rows and all(3 not in t.rows for t in sched.trace[3:])
    assert [h.result().token_ids for i, h in enumerate(handles) if i != 3] == alone[:3] + alone[4:]


def test_block_arriving_during_a_forward_joins_the_next(long_pair, alone):
    engine = SpeculativeEngine(*long_pair)
    reqs = _requests()
    late = {}

    def during_forward(ids):
        if len(sched.trace) == 1 and not late:
            late["h"] = sched.submit(reqs[1][0], tenant=reqs[1][1])

    sched = BatchScheduler(engine, on_forward=during_forward)
    first = sched.submit(reqs[0][0], tenant=reqs[0][1])
    sched.step()
    sched.step()  # its forward runs while the late request arrives
    assert late["h"].id not in sched.trace[1].rows
    sched.step()
    assert late["h"].id in sched.trace[2].rows and first.id in sched.trace[2].rows
    sched.run_until_idle()
    assert first.result().token_ids == alone[0] and late["h"].result().token_ids == alone[1]


def test_scheduler_thread_streams_chunks(long_pair, alone):
    engine = SpeculativeEngine(*long_pair)
    sched = BatchScheduler(engine)
    sched.start()
    try:
        handles = [sched.submit(req, tenant=t) for req, t in _requests()[:3]]
        streamed = [[tid for c in h.stream(timeout=120) for tid in c.token_ids] for h in handles]
    finally:
        sched.shutdown()
    assert streamed == alone[:3]


def test_scheduler_bad_block_fails_only_its_row(long_pair, alone):
    engine = SpeculativeEngine(*long_pair)
    sched = BatchScheduler(engine)
    reqs = _requests()
    ok = sched.submit(reqs[0][0])
    bad = sched.submit(reqs[2][0])
    bad.generation.proposer.propose = lambda k: DraftBlock(token_ids=torch.tensor([10_000]))
    sched.run_until_idle()
    with pytest.raises(InvalidRequestError, match=r"block token_ids\[0\] = 10000 is outside the vocabulary"):
        bad.result()
    assert bad.generation.target.seq.cache is None
    assert ok.result().token_ids == alone[0]


def test_fair_order_round_robin_by_weight():
    class R:
        def __init__(self, i, t):
            self.id, self.tenant = i, t
    rows = [R(0, "a"), R(1, "a"), R(2, "a"), R(3, "b"), R(4, "b")]
    def order(w, tick):
        return [r.id for r in fair_order(rows, lambda r: r.tenant, w, tick)]
    assert order({}, 0) == [0, 3, 1, 4, 2]
    assert order({}, 1) == [3, 0, 4, 1, 2]
    assert order({"a": 2}, 0) == [0, 1, 3, 2, 4]


def test_batched_sampling_follows_target_distribution(long_pair):
    """Chi-square of the first two sampled tokens with rows batched (K=1, draft proposer)."""
    target, draft = long_pair
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = [60, 61, 62]
    with torch.inference_mode():
        p0 = warp_probs(target.model(torch.tensor([prompt])).logits[0, -1:].float(), params)[0]
        cells, probs = [], []
        for a in p0.nonzero().flatten().tolist():
            p1 = warp_probs(target.model(torch.tensor([prompt + [a]])).logits[0, -1:].float(), params)[0]
            for b in p1.nonzero().flatten().tolist():
                cells.append((a, b))
                probs.append(float(p0[a]) * float(p1[b]))
    engine = SpeculativeEngine(target, draft)
    n, per_batch = 1200, 24
    counts = {c: 0 for c in cells}
    proposed = accepted = 0
    for start in range(0, n, per_batch):
        sched = BatchScheduler(engine, max_batch_positions=256)
        hs = [
            sched.submit(GenerationRequest(
                prompt_token_ids=prompt, max_tokens=2, ignore_eos=True,
                sampling={"temperature": 1.0, "top_k": 3, "seed": seed}, speculation={"proposer": "draft", "k": 1},
            ))
            for seed in range(start, start + per_batch)
        ]
        sched.run_until_idle()
        assert max(len(t.answered) for t in sched.trace) == per_batch  # all rows in one forward
        for h in hs:
            res = h.result()
            proposed += res.stats.proposed
            accepted += res.stats.accepted
            counts[tuple(res.token_ids)] += 1
    assert proposed >= n and 0 < accepted < proposed
    expected = [p * n for p in probs]
    scale = n / sum(expected)
    assert chisquare([counts[c] for c in cells], [e * scale for e in expected]).pvalue > 1e-3


def test_batched_path_on_the_accelerator_equals_alone(tiny_target, tiny_draft_close):
    """The batched forwards pass the device audit (CUDA rules on the virtual accelerator)."""
    from specdec.testing.devices import DeviceAudit

    reqs = [
        GenerationRequest(prompt_token_ids=[5, 17, 42, 9][: 1 + i], max_tokens=12, ignore_eos=True,
                          sampling={"temperature": [0.0, 0.9][i % 2], "seed": i},
                          speculation={"proposer": ["draft", "ngram"][i % 2 if i < 3 else 0], "k": [3, 1, 4, 0][i]})
        for i in range(4)
    ]
    on_cpu = [SpeculativeEngine(tiny_target, tiny_draft_close).generate(r).token_ids for r in reqs]
    with DeviceAudit() as audit:
        audit.track(tiny_target.model)
        audit.track(tiny_draft_close.model)
        sched = BatchScheduler(SpeculativeEngine(tiny_target, tiny_draft_close))
        hs = [sched.submit(r) for r in reqs]
        sched.run_until_idle()
    assert audit.violations == []
    assert max(len(t.answered) for t in sched.trace) == 4
    assert [h.result().token_ids for h in hs] == on_cpu


@pytest.mark.parametrize("impl,sliding,needle", [
    ("flash_attention_2", False, "attention implementation 'flash_attention_2' does not take"),
    ("flex_attention", False, "attention implementation 'flex_attention' does not take"),
    ("sdpa", True, "sliding-window attention layers"),
])
def test_packed_forward_refuses_unsupported_attention_with_a_clear_error(impl, sliding, needle):
    """A model the packed mask cannot serve is refused with ModelLoadError (a SpecDecError the
    serving layer maps to a status), naming the cause and the way out, not a bare crash."""
    from types import SimpleNamespace

    from specdec.engine.kv_cache import _packed_mask
    from specdec.errors import ModelLoadError

    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation=impl),
                            model=SimpleNamespace(has_sliding_layers=sliding))
    with pytest.raises(ModelLoadError, match=needle) as e:
        _packed_mask([3, 0], [1, 2], model, torch.device("cpu"))
    assert "batching" in str(e.value)


# --- fairness where requests wait --------------------------------------------------------------


def test_weighted_shares_water_filling():
    from specdec.engine.fairness import weighted_shares

    assert weighted_shares({"a": 40, "b": 60}, {}, 16) == {"a": 8, "b": 8}
    assert weighted_shares({"a": 40, "b": 3}, {}, 16) == {"a": 13, "b": 3}  # b's unused share goes to a
    assert weighted_shares({"a": 40, "b": 60}, {"a": 3.0}, 16) == {"a": 12, "b": 4}
    assert weighted_shares({"a": 5, "b": 6}, {}, 64) == {"a": 5, "b": 6}
    assert weighted_shares({"a": 10, "b": 10, "c": 10}, {}, 16) == {"a": 6, "b": 5, "c": 5}
    assert weighted_shares({"a": 10, "b": 0}, {}, 4) == {"a": 4, "b": 0}


def test_burst_of_one_tenant_does_not_starve_another(long_pair):
    """Tenant A bursts 8 requests at K = 4 (40 positions per tick) into a 16-position budget;
    tenant B's single request with a 96-token prompt arrives after them. After its draft
    prefill (two chunks of 32 before it drafts), B's target prefill gets its half of every forward (8 positions per
    tick, 12 ticks), its decode rows fit its share, so B completes within 3 + 12 + its steps
    ticks of arriving, long before A's burst is through; every output equals the request
    alone. Before fair shares, B's prefill went after all of A's decode rows and waited for A's
    burst to end (68 ticks with A's requests at 40 tokens, before draft prefill chunking)."""
    target, draft = long_pair
    engine = SpeculativeEngine(target, draft)
    rng = random.Random(4)
    a_reqs = [GenerationRequest(prompt_token_ids=_prompt(rng, 6), max_tokens=80, ignore_eos=True,
                                speculation={"proposer": "draft", "k": 4}) for _ in range(8)]
    b_req = GenerationRequest(prompt_token_ids=_prompt(rng, 96), max_tokens=10, ignore_eos=True,
                              speculation={"proposer": "draft", "k": 4})
    # A alone, its first 30 tokens (a prefix of its output: K never changes a greedy output)
    alone = [engine.generate(r.model_copy(update={"max_tokens": 30})).token_ids for r in a_reqs]
    alone.append(engine.generate(b_req).token_ids)
    sched = BatchScheduler(engine, max_batch_positions=16, draft_prefill_chunk=32)
    a = [sched.submit(r, tenant="A") for r in a_reqs]
    for _ in range(3):  # A's burst is prefilled and decoding
        sched.step()
    b = sched.submit(b_req, tenant="B")
    arrived = len(sched.trace)
    while not b.done:
        sched.step()
    b_ticks = len(sched.trace) - arrived
    b_steps = b.result().stats.steps
    # 2 ticks of draft prefill (chunks of 32; the last 32 go with its first draft), 12 of target
    # prefill (8 per tick), then its steps
    assert b_ticks <= 2 + 12 + b_steps and b_steps <= 10
    # once drafted, B was offered in every forward until done
    first = next(i for i, t in enumerate(sched.trace) if b.id in t.rows)
    assert first - arrived == 2 and all(b.id in t.rows for t in sched.trace[first:])
    assert not any(h.done for h in a)  # A's burst is still running
    assert all(t.positions_fed <= 16 for t in sched.trace)
    assert b.result().token_ids == alone[-1]
    for h, ref in zip(a, alone):  # A's outputs so far are their outputs alone, cut short
        so_far = h.generation.assembler.token_ids
        assert 0 < len(so_far) < 80 and so_far[:30] == ref[: len(so_far)]
        h.cancel()
    sched.run_until_idle()


# --- chunked draft prefill -----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_prefill_is_chunked_while_others_keep_stepping(long_pair, temperature):
    """A 200-token prompt arrives while A steps at K = 4; draft prefill budget 16 positions per
    tick. The draft model prefills it in chunks (every batched draft forward feeds at most 16
    prefill positions, beside A's decoding tail) over 12 ticks, during which A is
    verified in every tick; then B drafts and decodes; both outputs equal each request alone."""
    target, draft = long_pair
    engine = SpeculativeEngine(target, draft)
    rng = random.Random(8)
    a_req = GenerationRequest(prompt_token_ids=_prompt(rng, 6), max_tokens=40, ignore_eos=True,
                              speculation={"proposer": "draft", "k": 4})
    b_req = GenerationRequest(prompt_token_ids=_prompt(rng, 200), max_tokens=12, ignore_eos=True,
                              sampling={"temperature": temperature, "top_k": 20, "seed": 3},
                              speculation={"proposer": "draft", "k": 4})
    alone = [engine.generate(r).token_ids for r in (a_req, b_req)]
    sched = BatchScheduler(engine, max_batch_positions=256, draft_prefill_chunk=16)
    a = sched.submit(a_req, tenant="t")
    sched.step()
    b = sched.submit(b_req, tenant="t")
    start = len(sched.trace)
    while b.id not in sched.trace[-1].rows:
        sched.step()
    waiting = sched.trace[start:-1]  # ticks in which B's draft prefill ran in chunks
    # 12 chunks of 16 in 12 ticks; the last 8 positions go with B's first draft forward
    assert len(waiting) == math.ceil(200 / 16) - 1 == 12
    assert all(a.id in t.answered for t in waiting)  # A kept stepping
    # no draft forward over the budget (plus A's decoding tail of at most 2 positions)
    assert all(p <= 16 + 2 for _, p in sched.draft_trace)
    assert max(p for _, p in sched.draft_trace) >= 16
    sched.run_until_idle()
    assert [h.result().token_ids for h in (a, b)] == alone
    # without the bound the whole prompt goes into one draft forward
    whole = BatchScheduler(engine, max_batch_positions=256, draft_prefill_chunk=10_000)
    whole.submit(b_req)
    whole.step()
    assert whole.draft_trace[0] == (1, 200)
    with pytest.raises(ValueError, match="draft_prefill_chunk must be >= 1"):
        BatchScheduler(engine, draft_prefill_chunk=0)
@pytest.fixture(scope="module")
def reduced_targets(tmp_path_factory):
    """The tiny long-context target in each reduced-precision format, invariant forward on."""
    from specdec.models.loader import load_model
    from specdec.models.spec import HFModelSpec

    # hidden 512: the down projection reduces over 1024 inputs, where bfloat16 rows of a 33-row
    # call differ from one-row calls (narrower tiny layers stay invariant at any row count)
    folder = build_tiny_model(tmp_path_factory.mktemp("reduced") / "t", seed=0, hidden_size=512, max_positions=1024)
    return {fmt: load_model(HFModelSpec(path=folder), weight_format=fmt) for fmt in ("bfloat16", "int8", "int4", "w8a8", "w7a8")}


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4", "w8a8", "w7a8"])
def test_feed_many_packed_rows_bitwise_equal_alone_in_reduced_precision(reduced_targets, fmt):
    """More than 32 packed rows (bfloat16 kernels keep rows invariant only up to 32) and ragged
    caches: every row's logits and every cached key/value bitwise equal the sequence fed alone."""
    target = reduced_targets[fmt]
    assert target.invariant
    rng = random.Random(3)
    lens = [0, 3, 40, 150]
    alone_seqs, batch_seqs = _twin_sequences(target, lens, rng)
    # packed rows per forward: 45 (> 32: chunk boundaries fall inside sequences), 36 with a
    # 33-token prefill in one row, then 4 single tokens
    for sizes in ([9, 9, 9, 18], [33, 1, 1, 1], [1, 1, 1, 1]):
        news = [[rng.randrange(3, 300) for _ in range(n)] for n in sizes]
        keeps = [len(t) for t in news]
        ref = [s.feed(t, keep=k) for s, t, k in zip(alone_seqs, news, keeps)]
        got = feed_many([(s, t, k) for s, t, k in zip(batch_seqs, news, keeps)])
        for i, (r, g) in enumerate(zip(ref, got)):
            assert torch.equal(r, g), (fmt, sizes, i, (r - g).abs().max().item())
        for a, b in zip(alone_seqs, batch_seqs):
            assert a.cached == b.cached
            for la, lb in zip(a.cache.layers, b.cache.layers):
                assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
