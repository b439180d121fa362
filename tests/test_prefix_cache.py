"""Prefix caching: a sequence started from another's cached prefix computes exactly what it would
alone, feeds only its unshared tail, and batched/alone outputs stay identical."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.batch import BatchScheduler
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.kv_cache import CachedSequence, feed_many
from specdec.engine.prefix_cache import (MIN_SHARED, PrefixCache, disable_prefix_cache, enable_prefix_cache,
                                         prefix_cache_of, prefix_scope)
from specdec.request import GenerationRequest
from specdec.testing.tiny import build_tiny_model
from tests.conftest import load_tiny


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny shape-invariant (int8) target and a close draft of its own (not shared with other tests)."""
    from specdec.models.loader import load_model
    from specdec.models.spec import HFModelSpec

    d = tmp_path_factory.mktemp("prefixpair")
    t = build_tiny_model(d / "t", seed=0)
    target = load_model(HFModelSpec(kind="hf", path=t), weight_format="int8")
    dr = build_tiny_model(d / "d", seed=1, base=load_tiny(t).model, noise=0.03)
    draft = load_model(HFModelSpec(kind="hf", path=dr), weight_format="int8")
    assert target.invariant and draft.invariant
    return target, draft


PREFIX = [5, 17, 42, 9, 100, 33, 7, 250, 61, 12, 8, 90]


def test_a_sequence_started_from_a_shared_prefix_gives_the_same_logits_and_feeds_only_its_tail(pair):
    model = pair[0].model
    donor_ids = PREFIX + [3, 4, 5]
    ids = PREFIX + [77, 78, 79, 80]
    alone = CachedSequence(model, list(ids))
    ref = alone.feed(ids)  # [16, V]: computed alone, every position
    store = enable_prefix_cache(model, entries=2)
    try:
        donor = CachedSequence(model, list(donor_ids))
        donor.feed(donor_ids)
        seq = CachedSequence(model, list(ids))
        assert seq.sync(ids) == len(PREFIX)  # the shared prefix is copied, not fed
        assert store.hits == 1 and store.shared_positions == len(PREFIX)
        out = seq.feed(ids[len(PREFIX):])
        assert torch.equal(out, ref[len(PREFIX):])
        # its keys and values are the ones it would have computed: the next step agrees too
        nxt = [int(out[-1].argmax())]
        assert torch.equal(seq.feed(nxt), alone.feed(nxt))
        # a closed sequence is kept: a new one copies from it (the live donor holds only 12)
        seq.close()
        donor.close()
        again = CachedSequence(model, list(ids) + nxt + [1])
        assert again.sync(again.token_ids) == len(ids) + 1
        assert torch.equal(again.feed(again.token_ids[len(ids) + 1:]), alone.feed([1]))
        # too short a shared prefix is fed, not copied
        short = CachedSequence(model, PREFIX[:MIN_SHARED - 1] + [250])
        assert short.sync(short.token_ids) == 0 and store.hits == 2
        # cleared: the closed sequences are forgotten
        again.close()
        store.clear()
        fresh = CachedSequence(model, list(ids))
        assert fresh.sync(ids) == 0 and store.hits == 2
    finally:
        disable_prefix_cache(model)
    assert prefix_cache_of(model) is None


def test_enable_refuses_a_model_whose_forward_is_not_shape_invariant(tmp_path):
    plain = load_tiny(build_tiny_model(tmp_path / "f", seed=0))
    plain.model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="shape-invariant forward"):
        enable_prefix_cache(plain.model)
    with pytest.raises(ValueError, match="entries must be >= 0"):
        PrefixCache(-1)


def _requests(n: int, max_tokens: int = 10):
    # one shared system prompt, different questions: the chat template's prefix is shared
    sys_prompt = "You answer briefly."
    return [GenerationRequest(messages=[{"role": "system", "content": sys_prompt},
                                        {"role": "user", "content": f"question number {i} about {'ab' * (i + 1)}"}],
                              max_tokens=max_tokens, speculation={"proposer": "draft", "k": 3})
            for i in range(n)]


def test_batched_outputs_with_prefix_caching_equal_the_requests_alone_and_feed_fewer_positions(pair):
    target, draft = pair
    engine = SpeculativeEngine(target, draft)
    alone = [engine.generate(r).token_ids for r in _requests(4)]

    def run() -> tuple[list[list[int]], int]:
        sched = BatchScheduler(engine, max_batch_positions=32)
        handles = [sched.submit(r) for r in _requests(4)]
        sched.run_until_idle()
        return [h.result().token_ids for h in handles], sum(t.positions_fed for t in sched.trace)

    plain_out, plain_fed = run()
    stores = [enable_prefix_cache(target.model), enable_prefix_cache(draft.model)]
    try:
        warm_out, _ = run()  # a running server: the shared template is held after the first requests
        cached_out, cached_fed = run()
    finally:
        disable_prefix_cache(target.model)
        disable_prefix_cache(draft.model)
    assert plain_out == warm_out == cached_out == alone
    assert all(s.hits > 0 for s in stores)
    shared = len(_common_template_prefix(engine))
    assert shared >= MIN_SHARED
    # every one of the 4 requests of the last run copied at least the shared template opening
    assert plain_fed - cached_fed >= 4 * (shared - 1)


def _common_template_prefix(engine) -> list[int]:
    import os

    ids = [engine.encode(r) for r in _requests(4)]
    return os.path.commonprefix(ids)


def test_packed_forward_from_copied_prefixes_matches_alone(pair):
    """Two sequences whose caches were copied from a donor, fed together in one packed forward."""
    model = pair[0].model
    a_ids, b_ids = PREFIX + [1, 2], PREFIX[:8] + [44, 45, 46]
    ref_a = CachedSequence(model, list(a_ids)).feed(a_ids, keep=2)
    ref_b = CachedSequence(model, list(b_ids)).feed(b_ids, keep=3)
    enable_prefix_cache(model)
    try:
        donor = CachedSequence(model, list(PREFIX))
        donor.feed(PREFIX)
        a, b = CachedSequence(model, list(a_ids)), CachedSequence(model, list(b_ids))
        ka, kb = a.sync(a_ids), b.sync(b_ids)
        assert (ka, kb) == (len(PREFIX), 8)
        out_a, out_b = feed_many([(a, a_ids[ka:], 2), (b, b_ids[kb:], 3)])
    finally:
        disable_prefix_cache(model)
    assert torch.equal(out_a, ref_a) and torch.equal(out_b, ref_b)


def test_prefix_scope_keys():
    """The shared scope is ""; a tenant and/or salt make a scope of their own (sha256 of the JSON pair,
    so no tenant/salt pair aliases another: ("a", "b") is not ("", "a\\", \\"b") or ("a", "") )."""
    assert prefix_scope() == prefix_scope("", None) == prefix_scope("", "") == ""
    assert prefix_scope("team-a") == "7ed4cc851bc1f3c8ace2487b56dfe52c"
    assert prefix_scope("team-b") == "7d57b769ce834e7e2c9e9018ce36f605"
    assert prefix_scope("team-a", "s1") == "d4de9b1f9e87f04430a1595f67ee6167"
    assert prefix_scope("", "s1") == "de11cb24984be62aaaf89772f796c03c"
    assert len({prefix_scope("a", "b"), prefix_scope("", 'a", "b'), prefix_scope("a"), prefix_scope("", "a")}) == 4


def test_sequences_share_prefixes_only_within_their_scope(pair):
    """A donor of scope A (live, then closed) gives nothing to a sequence of scope B with the same
    tokens, and exactly the shared prefix to one of scope A; logits equal the sequence alone's."""
    model = pair[0].model
    ids = PREFIX + [77, 78, 79]
    ref = CachedSequence(model, list(ids)).feed(ids)  # [15, V], alone
    a, b = prefix_scope("team-a"), prefix_scope("team-b")
    store = enable_prefix_cache(model, entries=4)
    try:
        donor = CachedSequence(model, list(ids), prefix_scope=a)
        donor.feed(ids)
        other = CachedSequence(model, list(ids), prefix_scope=b)  # the live donor is of another scope
        assert other.sync(ids) == 0 and (store.hits, store.shared_positions) == (0, 0)
        assert torch.equal(other.feed(ids), ref)
        unscoped = CachedSequence(model, list(ids))  # the shared scope "" is a scope of its own too
        assert unscoped.sync(ids) == 0
        same = CachedSequence(model, list(ids), prefix_scope=a)
        assert same.sync(ids) == len(ids) - 1 and (store.hits, store.shared_positions) == (1, len(ids) - 1)
        assert torch.equal(same.feed(ids[-1:]), ref[-1:])
        donor.close()
        other.close()
        same.close()  # closed: scope A twice, scope B once
        assert store.stats()["held"] == 3
        again_b = CachedSequence(model, list(ids), prefix_scope=b)
        assert again_b.sync(ids) == len(ids) - 1 and (store.hits, store.shared_positions) == (2, 2 * (len(ids) - 1))
        salted = CachedSequence(model, list(ids), prefix_scope=prefix_scope("team-b", "s1"))
        assert salted.sync(ids) == 0 and store.hits == 2
    finally:
        disable_prefix_cache(model)


def test_in_process_requests_share_prefixes_only_with_the_same_cache_salt(pair):
    """``GenerationRequest.cache_salt`` in process: a request salted differently from the one
    before starts from nothing on both models, the same salt from its whole prompt but the last
    token; the outputs are the same either way."""
    target, draft = pair
    engine = SpeculativeEngine(target, draft)

    def req(salt):
        return GenerationRequest(prompt_token_ids=PREFIX + [3, 4], max_tokens=8, cache_salt=salt,
                                 speculation={"proposer": "draft", "k": 3})

    alone = engine.generate(req(None)).token_ids
    stores = [enable_prefix_cache(target.model), enable_prefix_cache(draft.model)]
    try:
        outs, shared = [], []
        for salt in ("salt-one", "salt-two", "salt-one", None):
            outs.append(engine.generate(req(salt)).token_ids)
            shared.append([s.shared_positions for s in stores])
    finally:
        disable_prefix_cache(target.model)
        disable_prefix_cache(draft.model)
    assert outs == [alone] * 4
    n = len(PREFIX) + 1  # the prompt but its last token
    assert shared == [[0, 0], [0, 0], [n, n], [n, n]]


#: (tenant, prompt tail after PREFIX, cache_salt) of the scheduler scope test's requests, in order
SCOPE_JOBS = [("team-a", [3, 4], None), ("team-b", [5, 6], None), ("team-a", [7, 8], None),
              ("team-a", [9, 10], "s1"), ("team-b", [11, 12], "s1"), ("team-a", [13, 14], "s1")]


@pytest.mark.parametrize("scope, expected", [
    # per request: (hits, positions copied) on the target and on the draft model; a copy is the
    # 12 positions of PREFIX (the tails differ): team-b never starts from team-a's under "tenant",
    # and a salted request only from one of the same salt (and, under "tenant", the same tenant)
    ("tenant", [(0, 0), (0, 0), (1, 12), (0, 0), (0, 0), (1, 12)]),
    ("shared", [(0, 0), (1, 12), (1, 12), (0, 0), (1, 12), (1, 12)]),
])
def test_batch_scheduler_scopes_the_prefix_cache_per_tenant_like_the_served_default(pair, scope, expected):
    """``BatchScheduler(prefix_cache_scope=...)``, the in-process counterpart of
    ``AppConfig.prefix_cache_scope``: requests sharing the 12-token PREFIX, submitted one after
    another (each run to the end) by team-a, team-b, team-a, then salted ("s1") by team-a,
    team-b, team-a. Under "tenant" (the default) a request starts only from its own tenant's
    cached prefixes, under "shared" from any tenant's; a salted one only from the same salt's.
    Every output is the request's alone, without any prefix cache."""
    target, draft = pair
    engine = SpeculativeEngine(target, draft)

    def req(tail, salt):
        return GenerationRequest(prompt_token_ids=PREFIX + tail, max_tokens=8, cache_salt=salt,
                                 speculation={"proposer": "draft", "k": 3})

    alone = [engine.generate(req(tail, salt)).token_ids for _, tail, salt in SCOPE_JOBS]
    assert BatchScheduler(engine).prefix_cache_scope == "tenant"
    stores = [enable_prefix_cache(target.model, entries=8), enable_prefix_cache(draft.model, entries=8)]
    try:
        sched = BatchScheduler(engine, max_batch_positions=32, prefix_cache_scope=scope)
        outs, deltas = [], []
        for tenant, tail, salt in SCOPE_JOBS:
            before = [(s.hits, s.shared_positions) for s in stores]
            h = sched.submit(req(tail, salt), tenant=tenant)
            sched.run_until_idle()
            outs.append(h.result().token_ids)
            deltas.append([(s.hits - bh, s.shared_positions - bp) for s, (bh, bp) in zip(stores, before)])
    finally:
        disable_prefix_cache(target.model)
        disable_prefix_cache(draft.model)
    assert outs == alone and all(len(o) == 8 for o in outs)
    assert deltas == [[e, e] for e in expected]  # target, draft


def test_batch_scheduler_refuses_an_unknown_prefix_cache_scope(pair):
    engine = SpeculativeEngine(*pair)
    with pytest.raises(ValueError) as e:
        BatchScheduler(engine, prefix_cache_scope="global")
    assert str(e.value) == "prefix_cache_scope must be 'tenant' or 'shared', got 'global'"
