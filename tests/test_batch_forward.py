"""The cost of a batched forward without changing a bit: growing KV caches, packed forwards that
hand row-wise attention each sequence's own cache, and row-wise attention split over two threads
(specdec/engine/kv_cache.py, specdec/engine/invariant.py).

Each is checked two ways: it does what it is for (no concatenation, no reallocation, the helper
thread runs rows), and every logit and cached key/value is bitwise what the old path gives.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from specdec.engine import invariant, kv_cache, kv_store
from specdec.engine.invariant import rowwise_attention
from specdec.engine.kv_cache import CachedSequence, feed_many
from specdec.engine.kv_store import GrowingLayer, new_cache, packed_parts
from specdec.testing.tiny import build_tiny_model
from tests.conftest import load_tiny


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """Tiny invariant target, hidden 512 (bfloat16 activations), 1024 positions."""
    from specdec.models.loader import load_model
    from specdec.models.spec import HFModelSpec

    folder = build_tiny_model(tmp_path_factory.mktemp("fwd") / "t", seed=0, hidden_size=512, max_positions=1024)
    return load_model(HFModelSpec(path=folder), weight_format="w8a8")


@pytest.fixture
def switches():
    """Restore the module switches a test flips."""
    saved = (kv_store.GROWING_CACHE, kv_store.STORE_ROW_DTYPE, kv_cache.PACKED_PARTS, invariant.ROW_WORKER_MIN_ROWS,
             invariant.ROWS_ON_ONE_THREAD)
    yield
    (kv_store.GROWING_CACHE, kv_store.STORE_ROW_DTYPE, kv_cache.PACKED_PARTS, invariant.ROW_WORKER_MIN_ROWS,
     invariant.ROWS_ON_ONE_THREAD) = saved


def _seqs(model, lens, seed):
    rng = random.Random(seed)
    out = []
    for n in lens:
        s = CachedSequence(model, [])
        if n:
            s.feed([rng.randrange(3, 300) for _ in range(n)], keep=1)
        out.append(s)
    return out


def _assert_same_caches(a_seqs, b_seqs):
    for a, b in zip(a_seqs, b_seqs):
        assert a.cached == b.cached
        for la, lb in zip(a.cache.layers, b.cache.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def test_growing_layer_appends_in_place_and_keeps_dynamic_layers_values():
    """Appends write into the same buffer until it is full; a crop then an append overwrites the
    cut positions; keys and values equal DynamicLayer's after every step."""
    g = torch.Generator().manual_seed(0)
    grow, dyn = GrowingLayer(), DynamicLayer()
    steps = [(70, 0), (1, 0), (5, 0), (0, 3), (2, 0), (1, 0), (70, 0), (0, 50), (9, 0)]  # (append n, crop n)
    ptrs = []
    for add, cut in steps:
        if add:
            k = torch.randn(1, 2, add, 8, generator=g).to(torch.bfloat16)
            v = torch.randn(1, 2, add, 8, generator=g).to(torch.bfloat16)
            kg, vg = grow.update(k, v)
            kd, vd = dyn.update(k, v)
            assert torch.equal(kg, kd) and torch.equal(vg, vd)
            ptrs.append(grow._kbuf.data_ptr())
        else:
            grow.crop(-cut)
            dyn.crop(-cut)
        assert grow.get_seq_length() == dyn.get_seq_length()
        assert torch.equal(grow.keys, dyn.keys) and torch.equal(grow.values, dyn.values)
    # 70 positions get a buffer of 70 + 64: the next appends (up to 76, after a cut of 3) write in
    # place; 76 + 70 = 146 > 134 reallocates (146 + 73 = 219 positions), the last append fits again
    assert grow._kbuf.shape[-2] == 219
    assert ptrs[0] == ptrs[1] == ptrs[2] == ptrs[3] == ptrs[4] != ptrs[5] == ptrs[6]


def test_growing_layer_fast_append_checks_only_when_its_views_were_replaced_and_keeps_the_bits(monkeypatch):
    """kv_store.FAST_APPEND: while keys/values are the views the layer handed out (or their crop),
    an append that fits skips the prefix-view check; the bits equal the checked path's after every
    step, and keys set from outside still take the checked path (copied, never written over)."""
    checks = []
    fits = GrowingLayer._fits
    monkeypatch.setattr(GrowingLayer, "_fits", staticmethod(lambda *a: checks.append(1) or fits(*a)))
    g = torch.Generator().manual_seed(1)
    steps = [(70, 0), (1, 0), (5, 0), (0, 3), (2, 0), (1, 0), (70, 0), (0, 50), (9, 0)]
    layers = {}
    for fast in (False, True):
        monkeypatch.setattr(kv_store, "FAST_APPEND", fast)
        layer, seen, n_checks = GrowingLayer(torch.float32), [], len(checks)
        g.manual_seed(1)
        for add, cut in steps:
            if add:
                k = torch.randn(1, 2, add, 8, generator=g).to(torch.bfloat16)
                layer.update(k, -k)
            else:
                layer.crop(-cut)
            seen.append((layer.keys.clone(), layer.values.clone()))
        layers[fast] = (layer, seen, len(checks) - n_checks)
    for (ka, va), (kb, vb) in zip(layers[False][1], layers[True][1]):
        assert ka.dtype == kb.dtype == torch.float32 and torch.equal(ka, kb) and torch.equal(va, vb)
    # checked: 7 appends; the first (no buffer yet) and the one that reallocates (146 > 134
    # positions) stop at the keys' check, the 5 others check keys and values; fast: only those two
    assert layers[False][2] == 1 + 1 + 2 * 5
    assert layers[True][2] == 1 + 1
    layer = layers[True][0]
    outside = torch.full((1, 2, 2, 8), 7.0)
    layer.keys, layer.values = outside, outside.clone()
    k, _ = layer.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    assert k[0, 0, :, 0].tolist() == [7.0, 7.0, 0.0] and outside[0, 0, :, 0].tolist() == [7.0, 7.0]


def test_growing_layer_reallocates_when_its_keys_were_replaced():
    """keys set from outside (not a prefix view of the buffer) are copied into a new buffer,
    never written over."""
    layer = GrowingLayer()
    layer.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    outside = torch.full((1, 1, 2, 2), 7.0)
    layer.keys, layer.values = outside, outside.clone()
    k, _ = layer.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    assert k[0, 0, :, 0].tolist() == [7.0, 7.0, 0.0]
    assert outside[0, 0, :, 0].tolist() == [7.0, 7.0]  # untouched


def test_sequences_use_growing_float32_caches_bitwise_equal_dynamic_ones(target, switches):
    """CachedSequence (and the prefix cache's copies) build GrowingLayer caches that store the
    bfloat16 model's keys and values in float32 (what row-wise attention reads on a CPU); feeds,
    crops and packed forwards give the same logits, and the same cached values, as transformers'
    DynamicLayer in bfloat16; without STORE_ROW_DTYPE they are stored in bfloat16."""
    assert target.model.dtype == torch.bfloat16
    lens = [0, 3, 40, 150]
    kv_store.GROWING_CACHE, kv_store.STORE_ROW_DTYPE = True, True
    grow = _seqs(target.model, lens, seed=1)
    assert all(type(layer) is GrowingLayer for s in grow for layer in s.cache.layers)
    assert all(s.cache.layers[0].keys.dtype == torch.float32 for s in grow[1:])
    kv_store.STORE_ROW_DTYPE = False
    grow16 = _seqs(target.model, lens, seed=1)
    assert all(s.cache.layers[0].keys.dtype == torch.bfloat16 for s in grow16[1:])
    kv_store.GROWING_CACHE = False
    dyn = _seqs(target.model, lens, seed=1)
    assert all(type(layer) is DynamicLayer for s in dyn for layer in s.cache.layers)
    rng = random.Random(2)
    for sizes in ([1, 1, 1, 1], [5, 1, 9, 1], [1, 33, 1, 2]):
        news = [[rng.randrange(3, 300) for _ in range(n)] for n in sizes]
        ref = feed_many([(s, t, len(t)) for s, t in zip(dyn, news)])
        for seqs in (grow, grow16):
            got = feed_many([(s, t, len(t)) for s, t in zip(seqs, news)])
            assert all(torch.equal(r, x) for r, x in zip(ref, got))
            _assert_same_caches(dyn, seqs)
        for i, seqs in enumerate((dyn, grow, grow16)):  # per-row cut-back, then the next step overwrites
            for j, s in enumerate(seqs):
                s._crop(len(s.cached) - j)


def test_prefix_cache_copies_into_a_growing_cache_of_the_sequences_dtype(target, switches):
    """A sequence that starts from another's prefix gets its own float32 buffers (a copy): the
    source cutting back and writing over its positions does not change the copy."""
    from specdec.engine.prefix_cache import disable_prefix_cache, enable_prefix_cache

    kv_store.GROWING_CACHE, kv_store.STORE_ROW_DTYPE = True, True
    enable_prefix_cache(target.model, entries=2)
    try:
        rng = random.Random(5)
        prompt = [rng.randrange(3, 300) for _ in range(40)]
        src = CachedSequence(target.model, list(prompt))
        src.feed(prompt, keep=1)
        dst = CachedSequence(target.model, list(prompt) + [7])
        assert dst.sync(dst.token_ids) == 40
        layer = dst.cache.layers[0]
        assert type(layer) is GrowingLayer and layer.keys.dtype == torch.float32
        assert layer._kbuf.data_ptr() != src.cache.layers[0]._kbuf.data_ptr()
        before = layer.keys.clone()
        src._crop(10)
        src.feed([rng.randrange(3, 300) for _ in range(30)], keep=1)
        assert torch.equal(layer.keys, before)
    finally:
        disable_prefix_cache(target.model)


def test_packed_forward_hands_attention_each_sequences_cache(target, switches, monkeypatch):
    """A packed forward's attention gets the sequences' caches as parts (no concatenation per
    layer) and its logits and caches are bitwise those of the concatenated path."""
    seen = []
    orig = invariant.rowwise_attention

    def spy(module, query, key, value, *args, **kwargs):
        seen.append(getattr(key, "_specdec_parts", None))
        return orig(module, query, key, value, *args, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(invariant.ATTENTION_NAME, spy)
    try:
        rng = random.Random(4)
        old = _seqs(target.model, [2, 60, 7], seed=3)
        new = _seqs(target.model, [2, 60, 7], seed=3)
        for sizes in ([1, 1, 1], [4, 1, 6]):
            news = [[rng.randrange(3, 300) for _ in range(n)] for n in sizes]
            kv_cache.PACKED_PARTS = False
            seen.clear()
            ref = feed_many([(s, t, len(t)) for s, t in zip(old, news)])
            assert seen and all(p is None for p in seen)
            kv_cache.PACKED_PARTS = True
            seen.clear()
            got = feed_many([(s, t, len(t)) for s, t in zip(new, news)])
            assert seen and all(p is not None and len(p) == 3 for p in seen)
            assert [off for off, _ in seen[0]] == [0, len(new[0].cached), len(new[0].cached) + len(new[1].cached)]
            assert all(torch.equal(r, x) for r, x in zip(ref, got))
            _assert_same_caches(old, new)
    finally:
        AttentionInterface.register(invariant.ATTENTION_NAME, orig)


def test_packed_parts_is_a_placeholder_of_the_concatenated_shape():
    a, b = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)
    t = packed_parts([a, b])
    assert t.shape == (1, 2, 8, 4) and t.stride() == (0, 0, 0, 0)
    assert [off for off, _ in t._specdec_parts] == [0, 3] and t._specdec_parts[1][1] is b


def _parts_inputs(lens, new, heads=12, kv_heads=2, d=128, seed=0):
    """query [1, H, Σ new, d] and per-sequence caches, the mask of a packed forward."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, sum(new), d, generator=g).to(torch.bfloat16)
    ks = [torch.randn(1, kv_heads, n, d, generator=g).to(torch.bfloat16) for n in lens]
    vs = [torch.randn(1, kv_heads, n, d, generator=g).to(torch.bfloat16) for n in lens]
    mask = kv_cache._packed_mask([n - m for n, m in zip(lens, new)], new, _Cfg(), torch.device("cpu"))
    return q, ks, vs, mask


class _Cfg:
    """Just enough of a model for _packed_mask (boolean masks)."""

    class config:
        _attn_implementation = invariant.ATTENTION_NAME


def test_rowwise_attention_over_parts_and_split_rows_equals_concatenated_keys(switches):
    """Parts instead of the concatenation, rows split over the helper thread or not: every row
    bitwise the same; the split runs its second half on the helper thread."""
    lens, new = [5, 90, 33, 1, 150, 64, 2, 40], [1, 1, 3, 1, 1, 5, 1, 1]
    q, ks, vs, mask = _parts_inputs(lens, new)
    invariant.ROW_WORKER_MIN_ROWS = 0
    ref, _ = rowwise_attention(None, q, torch.cat(ks, 2), torch.cat(vs, 2), mask, scaling=0.1)
    got, _ = rowwise_attention(None, q, packed_parts(ks), packed_parts(vs), mask, scaling=0.1)
    assert torch.equal(ref, got)
    threads_seen = set()
    orig = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        threads_seen.add(threading.get_ident())
        return orig(*args, **kwargs)

    invariant.ROW_WORKER_MIN_ROWS = 6
    invariant.ROWS_ON_ONE_THREAD = True  # the split needs rows on one thread each (the default)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        invariant.F.scaled_dot_product_attention = spy
        split, _ = rowwise_attention(None, q, packed_parts(ks), packed_parts(vs), mask, scaling=0.1)
    finally:
        invariant.F.scaled_dot_product_attention = orig
        torch.set_num_threads(before)
    assert torch.equal(ref, split)
    assert len(threads_seen) == 2 and threading.get_ident() in threads_seen
    assert torch.get_num_threads() == before


def test_rowwise_attention_rejects_parts_with_batched_rows():
    q, ks, vs, mask = _parts_inputs([4, 4], [1, 1])
    with pytest.raises(ValueError, match="packed key parts need a batch of one"):
        rowwise_attention(None, q.expand(2, -1, -1, -1), packed_parts(ks), packed_parts(vs), mask)
