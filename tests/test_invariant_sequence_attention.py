"""One attention call per sequence (specdec/engine/invariant.py: SEQUENCE_ATTENTION, the load-time
probe, the per-sequence call form) on the CPU, where the mode is only ever forced (on CUDA:
tests/test_gpu_batch.py::test_cuda_attention_mode_is_the_probes_decision).

The mode exists for accelerators (one call per query row is launch-bound there: H200, 8 sessions
x 5 positions 74 ms against 34 ms plain; docs/bench/gpu-s22/NOTES.md) and is used only where the
probe finds every row bitwise equal to that row's own one-row call. On the CPU it is forced
here to check that the mode computes what the probe measured, end to end.
"""

from __future__ import annotations

import random
import types

import pytest
import torch
import torch.nn.functional as F

from specdec.engine import invariant
from specdec.engine.batch import BatchScheduler
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.invariant import (
    _sequence_call,
    attention_mode,
    make_invariant,
    probe_sequence_attention,
    row_call,
    rowwise_attention,
)
from specdec.engine.kv_cache import CachedSequence, feed_many
from specdec.engine.kv_store import packed_parts
from specdec.testing.tiny import build_tiny_model
from specdec.engine.kv_cache import _packed_mask
from tests.conftest import load_tiny
from tests.test_batch import _requests
from tests.test_batch_forward import _Cfg

SEQ = types.SimpleNamespace(_specdec_attention="sequence")  # an attention module in the mode

#: requests of tests/test_batch.py's MIX that fit the tiny 256-position pair: greedy and seeded
#: sampled, K 0/1/4/8, draft/ngram/none
MIX = [(1, 0, "draft", 0.0, "code"), (5, 1, "draft", 0.0, "creative"), (37, 4, "ngram", 0.0, "code"),
       (120, 8, "draft", 0.9, "creative"), (60, 8, "draft", 0.0, "creative"), (12, 4, "none", 0.7, "code")]


def _qkv(b, q, length, heads=4, kv_heads=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(dtype)
                 for h, n in ((heads, q), (kv_heads, length), (kv_heads, length)))


def _one_row(q, k, v, scale):
    """Row-wise attention's own call for one row (CPU, float32): its query over exactly its keys,
    on one intra-op thread (ROWS_ON_ONE_THREAD: a float32 call's bits can depend on the threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return row_call(q, k, v, scale)
    finally:
        torch.set_num_threads(threads)


def _exact_call(q, k, v, seen, scaling):
    """A per-sequence call form exact on the CPU by construction: row j is the one-row call over its
    ``seen[j]`` keys, returned as :func:`_sequence_call` returns rows (``[n, Hkv, G, dv]``). No CPU
    kernel makes a masked several-row call exact (float32, bfloat16, float16, float64; flash and
    math; measured with torch 2.13), so the CPU tests run the mode's plumbing (rows grouped per
    sequence, packed parts, padding rows, the probe, the model's choice) with this call."""
    rows = torch.cat([_one_row(q[:, :, j:j + 1], k[:, :, :s], v[:, :, :s], scaling) for j, s in enumerate(seen)], 2)
    return rows[0].view(k.shape[1], q.shape[1] // k.shape[1], len(seen), -1).permute(2, 0, 1, 3)


@pytest.fixture
def exact(monkeypatch):
    monkeypatch.setattr(invariant, "_sequence_call", _exact_call)


def _left_padded(b, q, length, pads, empty_rows=()):
    """Boolean ``[b, 1, q, length]`` mask: row (i, j) sees keys ``pads[i] .. length - q + j``."""
    mask = torch.zeros(b, 1, q, length, dtype=torch.bool)
    for i, pad in enumerate(pads):
        for j in range(q):
            mask[i, 0, j, pad:length - q + j + 1] = True
    for i, j in empty_rows:
        mask[i, 0, j] = False
    return mask


def _packed(heads, kv_heads, d):
    """A packed forward's query, per-sequence caches and mask: 5 sequences, 1..9 new rows each."""
    lens, new = [5, 90, 33, 1, 64], [1, 3, 9, 1, 5]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, heads, sum(new), d, generator=g)
    ks = [torch.randn(1, kv_heads, n, d, generator=g) for n in lens]
    vs = [torch.randn(1, kv_heads, n, d, generator=g) for n in lens]
    mask = _packed_mask([n - m for n, m in zip(lens, new)], new, _Cfg(), torch.device("cpu"))
    return q, ks, vs, mask


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (12, 2, 128)])
def test_sequence_mode_gives_the_per_row_bits_with_an_exact_call(exact, heads, kv_heads, d):
    """Forced, with a call form exact per row, the mode returns bitwise what one call per row
    returns: causal rows, left-padded batch rows (a padding row: zeros), packed parts."""
    q, k, v = _qkv(2, 6, 40, heads, kv_heads, d)
    for mask in (None, _left_padded(2, 6, 40, pads=(3, 0), empty_rows=((0, 0),))):
        seq, _ = rowwise_attention(SEQ, q, k, v, mask, scaling=0.2)
        row, _ = rowwise_attention(None, q, k, v, mask, scaling=0.2)
        assert seq.shape == (2, 6, heads, d) and seq.is_contiguous()
        assert torch.equal(seq, row)
    assert torch.equal(seq[0, 0], torch.zeros(heads, d))  # the padding row
    assert not torch.equal(seq[0, 1], torch.zeros(heads, d))
    q, ks, vs, mask = _packed(heads, kv_heads, d)
    seq, _ = rowwise_attention(SEQ, q, packed_parts(ks), packed_parts(vs), mask, scaling=0.2)
    row, _ = rowwise_attention(None, q, torch.cat(ks, 2), torch.cat(vs, 2), mask, scaling=0.2)
    assert torch.equal(seq, row)
    r = 1 + 3 + 4  # row 4 of the third sequence: its query over exactly its first 33 - 9 + 4 + 1 keys
    assert torch.equal(seq[0, r], _one_row(q[:, :, r:r + 1], ks[2][:, :, :29], vs[2][:, :, :29], 0.2)[0, :, 0])


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (12, 2, 128)])
def test_sequence_call_form_computes_the_rows_attention(heads, kv_heads, d):
    """The real masked call form (query heads folded per key head, additive mask): every row
    within float32 rounding of one call per row (its bits are what the probe checks)."""
    q, k, v = _qkv(2, 6, 40, heads, kv_heads, d)
    for mask in (None, _left_padded(2, 6, 40, pads=(3, 0), empty_rows=((0, 0),))):
        seq, _ = rowwise_attention(SEQ, q, k, v, mask, scaling=0.2)
        row, _ = rowwise_attention(None, q, k, v, mask, scaling=0.2)
        assert torch.allclose(seq, row, atol=1e-5, rtol=1e-5)
    q, ks, vs, mask = _packed(heads, kv_heads, d)
    seq, _ = rowwise_attention(SEQ, q, packed_parts(ks), packed_parts(vs), mask, scaling=0.2)
    row, _ = rowwise_attention(None, q, torch.cat(ks, 2), torch.cat(vs, 2), mask, scaling=0.2)
    assert torch.allclose(seq, row, atol=1e-5, rtol=1e-5)


def test_sequence_mode_rejects_a_sequence_spanning_two_parts():
    q, k, v = _qkv(1, 2, 8)
    mask = torch.ones(1, 1, 2, 8, dtype=torch.bool)  # both rows see keys of both parts
    with pytest.raises(ValueError, match="span two packed sequences"):
        rowwise_attention(SEQ, q, packed_parts([k[:, :, :4], k[:, :, 4:]]), packed_parts([v[:, :, :4], v[:, :, 4:]]),
                          mask)


def _perturbed(row):
    """The exact call with one value of ``row`` of every call of more rows one float step off."""

    def call(q, k, v, seen, scaling):
        out = _exact_call(q, k, v, seen, scaling)
        if out.shape[0] > row:
            out = out.clone()
            out[row, 0, 0, 0] = torch.nextafter(out[row, 0, 0, 0], torch.tensor(float("inf")))
        return out

    return call


def test_probe_fails_on_one_differing_row_and_the_model_keeps_row_calls(exact, tmp_path, monkeypatch):
    """The probe passes the exact call and fails it with one value of one row one step off (a row
    of the verify-sized calls, a row only the 65-row prefill calls have); a model probed with the
    perturbed call keeps one call per row (on the CPU only when told to probe)."""
    args = (4, 2, 16, torch.float32, "cpu")
    assert probe_sequence_attention(*args)
    assert not probe_sequence_attention(*args, call=_perturbed(3))
    assert not probe_sequence_attention(*args, call=_perturbed(40))
    model = load_tiny(build_tiny_model(tmp_path / "t", seed=0), invariant=True).model
    assert attention_mode(model) == "row"  # the CPU default
    make_invariant(model, attention="probe")
    assert attention_mode(model) == "sequence"
    assert model.model.layers[0].self_attn._specdec_attention == "sequence"
    monkeypatch.setattr(invariant, "_sequence_call", _perturbed(3))
    make_invariant(model, attention="probe")
    assert attention_mode(model) == "row"
    assert model.model.layers[0].self_attn._specdec_attention == "row"


def test_cpu_default_is_one_call_per_row_without_probing(tmp_path, monkeypatch):
    """On the CPU the default ("auto") never probes and keeps one call per row, bfloat16 included;
    the real call form does not pass the probe there (float32 and bfloat16 rows, which the CPU
    computes in float32)."""
    assert invariant.SEQUENCE_ATTENTION == "auto"
    # measured with torch 2.13: row 1 of a 2-row masked call already differs from its one-row call
    assert not probe_sequence_attention(4, 2, 16, torch.float32, "cpu")

    def no_probe(*a, **k):
        raise AssertionError("probed on the CPU")

    monkeypatch.setattr(invariant, "probe_sequence_attention", no_probe)
    loaded = load_tiny(build_tiny_model(tmp_path / "t", seed=0), device="cpu", weight_format="bfloat16")
    assert loaded.invariant and attention_mode(loaded.model) == "row"
    assert loaded.model.model.layers[1].self_attn._specdec_attention == "row"
    with pytest.raises(ValueError, match="attention mode 'rows'"):
        make_invariant(loaded.model, attention="rows")


def test_load_model_takes_the_attention_mode(tmp_path):
    """load_model(attention=...) is the mode make_invariant gets (benchmarks.forward_costs times
    both modes with it): "sequence" one call per sequence; "probe" probes, and the CPU's real call
    form fails it (test_cpu_default_is_one_call_per_row_without_probing): one call per row; "row"
    and the CPU default one call per row; an unknown mode make_invariant's ValueError naming it."""
    folder = build_tiny_model(tmp_path / "t", seed=0)
    for how, mode in (("sequence", "sequence"), ("probe", "row"), ("row", "row"), (None, "row")):
        loaded = load_tiny(folder, device="cpu", invariant=True, attention=how)
        assert attention_mode(loaded.model) == mode, how
        assert loaded.model.model.layers[0].self_attn._specdec_attention == mode
    with pytest.raises(ValueError, match="attention mode 'rows': expected auto, probe, sequence or row"):
        load_tiny(folder, device="cpu", invariant=True, attention="rows")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The tiny pair (float32, CPU, shape-invariant) twice: attention per row, and per sequence as
    the probe chose with the exact call form."""
    d = tmp_path_factory.mktemp("seqpair")
    t_dir, d_dir = d / "t", d / "d"
    build_tiny_model(t_dir, seed=0)
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(invariant, "_sequence_call", _exact_call)
        for how in ("row", "probe"):
            target = load_tiny(t_dir, invariant=True, device="cpu")
            if how == "row":
                build_tiny_model(d_dir, seed=1, base=target.model, noise=0.03)
            draft = load_tiny(d_dir, invariant=True, device="cpu")
            for m in (target.model, draft.model):
                make_invariant(m, attention=how)
            out[how] = (target, draft)
        yield out


def test_sequence_mode_engine_outputs_equal_row_mode(pairs):
    """With the exact call form, a model in the mode: packed forwards give every logit and cached
    key bitwise as each sequence alone and as the per-row model; speculative and batched outputs
    (greedy and seeded sampled, K 0..8) equal the per-row model's alone."""
    assert attention_mode(pairs["probe"][0].model) == "sequence" == attention_mode(pairs["probe"][1].model)
    assert attention_mode(pairs["row"][0].model) == "row"
    rng = random.Random(2)
    lens = [0, 3, 40, 150]
    seqs = {how: [CachedSequence(pairs[how][0].model, []) for _ in lens] for how in ("row", "probe")}
    alone = [CachedSequence(pairs["probe"][0].model, []) for _ in lens]
    for n, *group in zip(lens, seqs["row"], seqs["probe"], alone):
        if n:
            prefix = [rng.randrange(3, 300) for _ in range(n)]
            for s in group:
                s.feed(prefix, keep=1)
    for sizes in ([9, 9, 9, 18], [33, 1, 1, 1], [1, 1, 1, 1]):
        news = [[rng.randrange(3, 300) for _ in range(n)] for n in sizes]
        ref = [s.feed(t, keep=len(t)) for s, t in zip(alone, news)]
        rows = feed_many([(s, t, len(t)) for s, t in zip(seqs["row"], news)])
        got = feed_many([(s, t, len(t)) for s, t in zip(seqs["probe"], news)])
        for i, (r, w, g) in enumerate(zip(ref, rows, got)):
            assert torch.equal(g, r) and torch.equal(g, w), (sizes, i)
    for a, b in zip(alone, seqs["probe"]):
        for la, lb in zip(a.cache.layers, b.cache.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    reqs = _requests(MIX, max_tokens=12)
    row_engine, seq_engine = SpeculativeEngine(*pairs["row"]), SpeculativeEngine(*pairs["probe"])
    expected = [row_engine.generate(req).token_ids for req, _ in reqs]
    assert [seq_engine.generate(req).token_ids for req, _ in reqs] == expected
    sched = BatchScheduler(seq_engine, max_batch_positions=64)
    handles = [sched.submit(req, tenant=tenant) for req, tenant in reqs]
    sched.run_until_idle()
    assert [h.result().token_ids for h in handles] == expected
    assert max(len(t.answered) for t in sched.trace) >= 4  # rows really shared forwards


def test_a_long_run_of_rows_is_split_into_calls_of_at_most_sequence_call_rows(exact, monkeypatch):
    """An unchunked prefill's rows go in calls of at most SEQUENCE_CALL_ROWS rows, each over its
    sequence's keys from the first (its mask at most that many rows by its keys), with the per-row
    bits; the calls' row counts and key counts are the split's."""
    calls = []

    def counting(q, k, v, seen, scaling):
        calls.append((q.shape[2], k.shape[2], seen))
        return _exact_call(q, k, v, seen, scaling)

    monkeypatch.setattr(invariant, "_sequence_call", counting)
    monkeypatch.setattr(invariant, "SEQUENCE_CALL_ROWS", 4)
    q, k, v = _qkv(1, 10, 13)  # 3 cached keys, 10 new rows
    seq, _ = rowwise_attention(SEQ, q, k, v, None, scaling=0.2)
    row, _ = rowwise_attention(None, q, k, v, None, scaling=0.2)
    assert torch.equal(seq, row)
    assert calls == [(4, 7, (4, 5, 6, 7)), (4, 11, (8, 9, 10, 11)), (2, 13, (12, 13))]


def test_sequence_masks_are_kept_least_recently_used_first_out(monkeypatch):
    """A mask used again is kept over one used less recently (a forward's layers reuse all of its
    masks: first-in-first-out rebuilt every mask on every layer once a forward held more sessions
    than the cache keeps)."""
    monkeypatch.setattr(invariant, "_masks", {})
    monkeypatch.setattr(invariant, "_mask_bytes", 0)
    monkeypatch.setattr(invariant, "SEQUENCE_MASKS_KEPT", 2)
    cpu = torch.device("cpu")
    a = invariant._sequence_mask((1,), 1, 2, torch.float32, cpu)
    b = invariant._sequence_mask((2,), 2, 2, torch.float32, cpu)
    assert invariant._sequence_mask((1,), 1, 2, torch.float32, cpu) is a  # a hit: a is now the newest
    invariant._sequence_mask((3,), 3, 2, torch.float32, cpu)  # evicts the least recently used: b
    assert invariant._sequence_mask((1,), 1, 2, torch.float32, cpu) is a
    assert invariant._sequence_mask((2,), 2, 2, torch.float32, cpu) is not b
    assert len(invariant._masks) == 2
