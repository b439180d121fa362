"""The shape-invariant forward's pieces (specdec/engine/invariant.py) on synthetic tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.engine.invariant import _row_ranges, rowwise_attention


def _qkv(b, q, length, heads=4, kv_heads=2, d=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, q, d, generator=g).to(dtype), torch.randn(b, kv_heads, length, d, generator=g).to(dtype),
            torch.randn(b, kv_heads, length, d, generator=g).to(dtype))


def _folded(q, k, v, scale=None):
    """One row's call with its query heads folded into the rows of their key head: ``[1, H, 1, d]``
    as ``[1, Hkv, H / Hkv, d]`` (row-wise attention's call form, specdec.engine.invariant.row_call)."""
    h, hkv = q.shape[1], k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(1, hkv, h // hkv, q.shape[-1]), k, v, scale=scale)
    return out.reshape(1, h, 1, v.shape[-1])


def _row_ref(q, k, v, scale=None):
    """The call row-wise attention makes for one row on a CPU: bfloat16/float16 in float32, rounded back."""
    dt = q.dtype
    if dt in (torch.bfloat16, torch.float16):
        q, k, v = q.float(), k.float(), v.float()
    return _folded(q, k, v, scale=scale).to(dt)


def test_a_rows_folded_call_is_its_grouped_query_attention():
    """The folded call (query head h attends with key head h // G) computes the row's grouped-query
    attention: equal to torch's grouped-query call up to float32 rounding, for 12/2 and 4/2 heads
    and one key head per query head; a wrong head mapping would differ by O(1)."""
    from specdec.engine.invariant import row_call

    for heads, kv_heads in ((12, 2), (4, 2), (4, 4)):
        q, k, v = _qkv(1, 1, 77, heads=heads, kv_heads=kv_heads, d=32, dtype=torch.float32, seed=heads)
        out = row_call(q, k, v, 0.2)
        ref = F.scaled_dot_product_attention(q, k, v, scale=0.2, enable_gqa=True)
        assert out.shape == (1, heads, 1, 32)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        assert torch.equal(out, _folded(q, k, v, scale=0.2))


def test_rowwise_attention_rows_equal_one_call_per_row_over_visible_keys():
    """Row (b, i) is bitwise the call plain decoding makes: its query alone over keys lo..hi-1;
    a row that sees nothing is zeros; left padding and causal offsets follow the mask."""
    q, k, v = _qkv(2, 5, 12)
    mask = torch.zeros(2, 1, 5, 12, dtype=torch.bool)
    for i in range(5):
        mask[0, 0, i, 3:8 + i] = True  # row 0: 3 padding keys, causal over the rest
        mask[1, 0, i, : 8 + i] = True
    mask[0, 0, 0] = False  # a padding query row
    out, weights = rowwise_attention(None, q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (2, 5, 4, 16)
    for b in range(2):
        for i in range(5):
            vis = mask[b, 0, i].nonzero().flatten()
            if vis.numel() == 0:
                assert torch.equal(out[b, i], torch.zeros(4, 16, dtype=torch.bfloat16))
                continue
            lo, hi = int(vis[0]), int(vis[-1]) + 1
            ref = _row_ref(q[b:b + 1, :, i:i + 1], k[b:b + 1, :, lo:hi], v[b:b + 1, :, lo:hi], scale=0.25)
            assert torch.equal(out[b, i], ref[0, :, 0]), (b, i)
    # no mask: causal, row i sees the first L - q + i + 1 keys
    out, _ = rowwise_attention(None, q[:1], k[:1], v[:1], None, scaling=0.25)
    ref = _row_ref(q[:1, :, 2:3], k[:1, :, :10], v[:1, :, :10], scale=0.25)
    assert torch.equal(out[0, 2], ref[0, :, 0])


def test_rowwise_attention_computes_bfloat16_rows_in_float32_on_cpu():
    """On a CPU a bfloat16 row is its query alone over its keys in float32, rounded back to
    bfloat16 (CPU_ROW_DTYPE: the bfloat16 kernel cost 5-6x per row on the AMD EPYC), not the
    bfloat16 kernel's result, which differs in about a third of the values here; float32 rows
    are computed as they are."""
    from specdec.engine.invariant import CPU_ROW_DTYPE

    assert CPU_ROW_DTYPE == torch.float32
    q, k, v = _qkv(2, 3, 150, heads=12, kv_heads=2, d=128)
    out, _ = rowwise_attention(None, q, k, v, None, scaling=0.088)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 12, 128)
    differ = 0
    for b in range(2):
        for i in range(3):
            hi = 150 - 3 + i + 1
            args = (q[b:b + 1, :, i:i + 1], k[b:b + 1, :, :hi], v[b:b + 1, :, :hi])
            in_f32 = _folded(*(t.float() for t in args), scale=0.088).to(torch.bfloat16)
            assert torch.equal(out[b, i], in_f32[0, :, 0]), (b, i)
            in_bf16 = F.scaled_dot_product_attention(*args, scale=0.088, enable_gqa=True)
            differ += int((in_bf16[0, :, 0] != out[b, i]).sum())
    assert differ > 0.1 * out.numel()  # the test tells the two kernels apart
    qf, kf, vf = (t.float() for t in (q, k, v))
    out32, _ = rowwise_attention(None, qf, kf, vf, None, scaling=0.088)
    assert out32.dtype == torch.float32
    assert torch.equal(out32[1, 2], _folded(qf[1:, :, 2:3], kf[1:], vf[1:], scale=0.088)[0, :, 0])


def test_row_ranges_are_computed_once_per_mask_and_checked():
    mask = torch.ones(1, 1, 3, 6, dtype=torch.bool).tril(3)
    assert _row_ranges(mask, 1, 3, 6) == [(0, 4), (0, 5), (0, 6)]
    assert mask._specdec_ranges[1] == [(0, 4), (0, 5), (0, 6)]  # memoized for the next layer
    additive = torch.zeros(1, 1, 2, 4).masked_fill(torch.tensor([[True, False, False, True]] * 2), float("-inf"))
    assert _row_ranges(additive, 1, 2, 4) == [(1, 3), (1, 3)]
    holes = torch.tensor([[[[True, False, True]]]])
    with pytest.raises(ValueError, match="contiguous"):
        _row_ranges(holes, 1, 1, 3)


def test_rowwise_attention_does_not_depend_on_intra_op_threads():
    """Rows computed on one thread (short key ranges) equal rows computed on two (long ones)."""
    q, k, v = _qkv(1, 3, 2100, heads=12, kv_heads=2, d=128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        many, _ = rowwise_attention(None, q, k[:, :, :700], v[:, :, :700], None)  # one thread
        assert torch.get_num_threads() == 2  # restored
        long, _ = rowwise_attention(None, q, k, v, None)  # over the threshold: two threads
        for i in range(3):
            for keys, got in ((700, many), (2100, long)):
                hi = keys - 3 + i + 1
                ref = _row_ref(q[:, :, i:i + 1], k[:, :, :hi], v[:, :, :hi])
                assert torch.equal(got[0, i], ref[0, :, 0]), (keys, i)
        torch.set_num_threads(1)
        assert torch.equal(rowwise_attention(None, q, k, v, None)[0], long)
        # one decode row (runs on one thread under the key bound): the two-thread call's bits
        for keys in (1, 100, 2048):
            torch.set_num_threads(2)
            one, _ = rowwise_attention(None, q[:, :, :1], k[:, :, :keys], v[:, :, :keys], None)
            assert torch.get_num_threads() == 2
            ref = _row_ref(q[:, :, :1], k[:, :, :keys], v[:, :, :keys])
            assert torch.equal(one[0, 0], ref[0, :, 0]), keys
    finally:
        torch.set_num_threads(before)


def _threads_of_row_calls(monkeypatch, rows_on_one_thread: bool) -> list[int]:
    """Intra-op threads of each SDPA call of one decode row over 100 keys and over more than
    SINGLE_THREAD_MAX_KEYS, with torch at 2 threads (restored after each call)."""
    import specdec.engine.invariant as inv

    seen: list[int] = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(inv.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(inv, "ROWS_ON_ONE_THREAD", rows_on_one_thread)
    q, k, v = _qkv(1, 1, inv.SINGLE_THREAD_MAX_KEYS + 1, heads=4, kv_heads=2, d=16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        rowwise_attention(None, q, k[:, :, :100], v[:, :, :100], None)
        assert torch.get_num_threads() == 2
        rowwise_attention(None, q, k, v, None)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    return seen


def test_decode_row_attention_runs_on_one_thread_under_the_key_bound():
    """The default (ROWS_ON_ONE_THREAD): a plain decoding step's one row runs its SDPA call on one
    intra-op thread (no parallel region for a row's tiny work), over the bound on all threads; the
    thread count is restored."""
    import specdec.engine.invariant as inv

    assert inv.ROWS_ON_ONE_THREAD is True
    with pytest.MonkeyPatch.context() as mp:
        assert _threads_of_row_calls(mp, True) == [1, 2]


def test_row_attention_on_all_threads_when_switched(monkeypatch):
    """ROWS_ON_ONE_THREAD = False: every row's call splits its heads over the torch threads; the
    thread count is restored (the rows' bits: test_rowwise_attention_does_not_depend_on_intra_op_threads)."""
    assert _threads_of_row_calls(monkeypatch, False) == [2, 2]


@pytest.mark.parametrize("heads, kv_heads", [(12, 12), (12, 2)])
def test_a_short_row_keeps_its_one_thread_bits_beside_a_long_row(monkeypatch, heads, kv_heads):
    """A row's intra-op threads follow its own key count, not the forward's longest row: a
    100-key row batched with a 2100-key row gets the bits of its own decode call (one thread).
    float32, where one and two threads give the same call different bits (torch 2.13, this 2-core
    CPU): a model without grouped-query attention (12/12 heads), and for 12/2 heads torch's
    grouped-query call, put in row_call's place here (the folded call of a grouped-query model
    happened to give the same bits on both, so with it the test could not tell)."""
    import specdec.engine.invariant as inv

    if heads != kv_heads:
        monkeypatch.setattr(inv, "row_call", lambda q, k, v, s: F.scaled_dot_product_attention(
            q, k, v, scale=s, enable_gqa=True))
    q, k, v = _qkv(2, 1, 2100, heads=heads, kv_heads=kv_heads, d=128, dtype=torch.float32, seed=3)
    mask = torch.ones(2, 1, 1, 2100, dtype=torch.bool)
    mask[0, :, :, 100:] = False  # batch row 0 sees 100 keys, row 1 all 2100
    row = (q[:1], k[:1, :, :100], v[:1, :, :100])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        both, _ = rowwise_attention(None, q, k, v, mask)
        alone, _ = rowwise_attention(None, *row, None)  # a decode row: one thread
        torch.set_num_threads(1)
        one_thread = inv.row_call(*row, None)
        torch.set_num_threads(2)
        two_threads = inv.row_call(*row, None)
    finally:
        torch.set_num_threads(before)
    assert inv.SINGLE_THREAD_MAX_KEYS < 2100
    assert not torch.equal(one_thread, two_threads)  # the property is not vacuous here
    assert torch.equal(alone[0, 0], one_thread[0, :, 0])
    assert torch.equal(both[0, 0], alone[0, 0])


def test_row_call_takes_the_models_layouts():
    """row_call on a query row of transformers' layout (a strided view of ``[B, q, H, d]``), a
    value head width other than the key's, and a kernel that returns its rows in another layout
    (as CUDA kernels may): the grouped-query attention of that row each time."""
    import specdec.engine.invariant as inv

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 7, 12, 32, generator=g).transpose(1, 2)  # [B, H, q, d], not contiguous
    k, v = torch.randn(1, 2, 40, 32, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    row = q[1:2, :, 3:4]
    ref = F.scaled_dot_product_attention(row, k, v, scale=0.3, enable_gqa=True)
    out = inv.row_call(row, k, v, 0.3)
    assert out.shape == (1, 12, 1, 16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    sdpa = F.scaled_dot_product_attention

    def transposed(*a, **kw):  # the same values, laid out as [1, rows, heads, dv] transposed
        return sdpa(*a, **kw).transpose(1, 2).contiguous().transpose(1, 2)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inv.F, "scaled_dot_product_attention", transposed)
        assert torch.equal(inv.row_call(row, k, v, 0.3), out)
