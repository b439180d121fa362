"""Shape-invariant forward: a position's logits do not depend on how many positions, or rows of
a batch, one forward pass scores.

Why: greedy speculative decoding is exact only if the target's logits at a position are the
same whether the position is decoded alone (the target-alone path, K = 0), verified inside a
block of K + 1 positions, or computed in a prefill. Kernels pick their blocking and reduction
order from the shape of the call, so in reduced precision the same row can round differently
(bfloat16 flips near-ties within a few dozen tokens; float32 differs by about 1e-6). Batch
invariance (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025; SGLang's
deterministic mode, vLLM's batch-invariant mode) fixes the reduction order per row. Here, without
writing kernels, the engine only feeds kernels shapes that it has measured to give the same
rows:

1. **Linear layers** (every ``nn.Linear``, torchao-quantized ones and the output projection
   included): the rows of one call (``batch * positions``) are computed in chunks of
   ``min_rows..max_rows`` rows (zero rows pad a short chunk). The plan is measured per weight
   shape and format when the model is loaded (:func:`plan_linear`): the largest row count up to
   which every probed size gives the plain-decoding (one-row) result; failing that, the same with
   two-row calls as the reference (one-row calls padded to two); failing that, a fixed row count
   for every call. Measured on a Sapphire Rapids CPU: bfloat16 (oneDNN/AMX) 1..32 rows give the
   one-row result; float16 every count >= 2 agrees; float32 (MKL) differs between most counts and
   gets fixed 8-row calls; torch's int8 and int4 weight-only kernels agree for every count.
   A layer that declares ``ROW_EXACT = True`` (w8a8's :class:`specdec.models.formats.W8A8Linear`:
   per-row activation quantization and an exact int32 integer product) is probed the same way
   and, when every probed count agrees, called unchunked whatever the row count (its own
   ``forward``, no chunking wrapper).
2. **Attention**: :func:`rowwise_attention` runs one scaled-dot-product call per query row over
   exactly the keys that row may see (on a CPU, bfloat16/float16 rows in float32), so neither the number of
   query rows nor left padding of a batch changes a row's result. On an accelerator, where one call
   per row is bound by launching kernels (H200, bfloat16: 8 sessions x 5 positions 74 ms against
   34 ms plain; docs/bench/gpu-s22/NOTES.md), a model may instead get one masked call per sequence
   (:data:`SEQUENCE_ATTENTION`), only where a probe at load time (:func:`probe_sequence_attention`)
   found every row of such calls bitwise equal to that row's own one-row call.

Everything else in a decoder layer (embedding, RMSNorm, rotary embedding, activations, residual
adds) works row by row. Tests check the property end to end: logits of every position equal
bitwise across block sizes, and greedy speculative output equal to the target alone for every
weight format (tests/test_formats.py).
"""

from __future__ import annotations

import logging
import threading
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

#: Attention implementation name registered with transformers.
ATTENTION_NAME = "specdec_rowwise"
#: Row counts probed by :func:`plan_linear`.
PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 24, 31, 32, 33, 40)
#: Row counts probed for a layer that is row-exact by construction (``ROW_EXACT``: w8a8's integer
#: sums): a one-row decode, two rows, a block, a verify block of K = 16, across a 32-row chunk.
#: The probe confirms the construction at fewer rows (102 rows computed instead of 272: on the AVX2
#: Zen 3 the demo pair's 151,936-wide output layers took ~3 s of a 26 s load with PROBE_ROWS).
ROW_EXACT_PROBE_ROWS = (1, 2, 3, 5, 8, 17, 33)
#: Rows of every call when no row count range gives invariant results (float32 on MKL).
FIXED_ROWS = 8
#: No chunk has more rows than this, whatever the probe found: on the demo target in bfloat16 a
#: 48-row prefill differed from 32 rows + 16 decode steps although the k/v projections (1536x256)
#: had probed equal up to 48 rows; with every chunk at most 32 rows all checks are exact.
MAX_CHUNK_ROWS = 32
#: ``max_rows`` of a layer that is row-exact by construction (``ROW_EXACT``): never chunked.
UNCHUNKED_ROWS = 1 << 62
#: A row-wise attention call whose row sees at most this many keys runs on one intra-op thread
#: (:data:`ROWS_ON_ONE_THREAD`), a row over more on all of them, whatever else its forward holds
#: (the thread count changes a call's bits) (CPU; measured on the 2-core VM: 16 rows of 96..3000 keys, 12/2 heads,
#: d = 128, were faster on one thread than on two, 1.3-5x, the machine shared with other jobs; one
#: decode row over 100 keys too).
SINGLE_THREAD_MAX_KEYS = 2048
#: Row-wise attention's per-row calls (up to :data:`SINGLE_THREAD_MAX_KEYS` keys) run on one
#: intra-op thread; False: a row's call splits its heads over the torch threads. Measured both ways
#: on session 13's 2-core AMD EPYC (Zen 4, AVX512-VNNI), w8a8 demo target, 2 threads, in process
#: (libgomp's default wait policy: idle threads spin after each linear layer): with the machine
#: nearly to itself, False made an 8-row x 1-position packed forward 132.8 ms at best against 143.7,
#: one row 89.2 against 96.0, the int4 draft's one row 29.7 against 32.0; but with one other
#: process busy on the other core, batching_goal's 8 clients at K = 1 ran 2.34 tok/s with False
#: (109 s for 256 tokens, where 14 s quiet): a parallel region per row and layer (224-448 per
#: forward, ~50 us of work each) waits for a descheduled thread every time, and sessions 10-12
#: measured the same 5-60x per call under load, or where idle threads sleep
#: (``OMP_WAIT_POLICY=PASSIVE``, the served model processes). So one thread per row stays the
#: default; docs/bench/batching/batch-s13/README.md. A row's thread count is its own (its key count,
#: :data:`SINGLE_THREAD_MAX_KEYS`), never its forward's: one and two threads give a call different last
#: bits (float32, torch 2.13; tests/test_invariant.py): a model without grouped-query attention
#: (H == Hkv; 16/16 and 12/12 heads measured) and torch's grouped-query call. The folded call of a
#: grouped-query model (:func:`row_call`, since session 23) gave the same bits on both (12/2, 14/2,
#: 28/4, 32/8, 8/1 heads), which the code does not rely on: the rule is needed.
ROWS_ON_ONE_THREAD = True
#: On a CPU, row-wise attention over bfloat16/float16 tensors computes every row in this dtype and
#: rounds the row's result back: torch's reduced-precision CPU attention kernel cost 5-6x the
#: float32 one per row on the AMD EPYC (Zen 5, no AMX) of session 10 (one query row, 12/2 heads,
#: d = 128, one thread: 145 / 345 / 1013 / 2498 us against 34 / 63 / 154 / 448 us over 60 / 150 /
#: 400 / 1000 keys; docs/bench/batching/inprocess-s10/README.md), and row-wise attention was 31 %
#: of an 8-client batch's CPU seconds. Still one call per row over exactly its keys, so a row's
#: bits depend on neither the batch nor the block (the property, not the kernel, is what matters).
#: None: rows in their own dtype (the reduced-precision kernel; sessions 6-9).
CPU_ROW_DTYPE: torch.dtype | None = torch.float32
#: A row-wise attention call with at least this many rows, each on one intra-op thread
#: (:data:`ROWS_ON_ONE_THREAD`, ``SINGLE_THREAD_MAX_KEYS``), runs its second half of rows on a helper thread, in parallel
#: with the first (torch releases the GIL inside each call; each row is still its own call on one
#: thread, so the bits do not change); 0: never (the default: on the 2-core EPYC, loaded by other
#: jobs, 8-row forwards of the demo target were no faster with it, 101 vs 100 ms at best;
#: docs/bench/batching/PROFILE-s11.md).
ROW_WORKER_MIN_ROWS = 0
#: How attention computes a forward's query rows, decided per model by :func:`make_invariant`:
#:
#: - ``"auto"``: one call per row (:func:`rowwise_attention`) on a CPU, unconditionally (the CPU
#:   path is tuned and measured, and the probe fails there: torch 2.13 on the 2-core session-22 VM,
#:   float32, bfloat16, float16 and float64, flash and math backends, 4/2 and 12/2 heads: row 1 of
#:   a 2- or 5-row call already differs from its one-row call); on any other device one call per sequence
#:   (:func:`_sequence_call`) when :func:`probe_sequence_attention` finds it exact on the model's
#:   device, dtype and head shape, else one call per row. Why: on the H200 one attention call per
#:   query row and layer made a packed forward of 8 sessions x 5 positions cost 74 ms against 34 ms
#:   plain, and 79 % of a batching run's busy samples (docs/bench/gpu-s22/NOTES.md, prof-top.txt).
#: - ``"probe"``: probe on every device, the CPU included (tests); ``"sequence"``: one call per
#:   sequence without probing (tests; exact only where the probe would pass); ``"row"``: never.
SEQUENCE_ATTENTION = "auto"
#: Device types whose one-call-per-sequence calls go straight to the memory-efficient kernel
#: (``aten._scaled_dot_product_efficient_attention``); elsewhere torch's own choice. CUDA: the one
#: kernel that takes an arbitrary mask whatever the number of query rows (flash takes no mask; left
#: to choose, a shape it refuses would fall back to the math kernel, whose matmuls pick their
#: blocking by shape). Called directly, not through ``torch.nn.attention.sdpa_kernel``, whose
#: backend flags are process-wide: a pin entered and left by two threads in turn leaves the other
#: thread's calls unpinned and the process pinned (session 22's review). The probe checks these
#: calls; a call the kernel refuses raises there, and the model keeps one call per row. Not yet
#: run on a GPU.
SEQUENCE_EFFICIENT_KERNEL: tuple[str, ...] = ("cuda",)
#: Query rows of one per-sequence call at most: a longer run of a sequence's rows (an unchunked
#: prompt prefilled alone) is split, so that its mask is at most this many rows by its keys (a
#: 32k-token prompt in one call would need a 12 GiB mask; session 22's review).
SEQUENCE_CALL_ROWS = 64
#: ``(cached keys L, new rows n)`` shapes :func:`probe_sequence_attention` checks, every row of
#: each: decode rows (n = 1), verify blocks (K + 1 <= 33), packed rows, prefill chunks (n = 65,
#: 257), key counts across tile boundaries of 16..512.
SEQUENCE_PROBE_SHAPES = (tuple((L, n) for L in (0, 1, 37, 200, 513) for n in (1, 2, 5, 9, 17, 32, 64, 65))
                         + ((0, 257), (2047, 17), (4095, 5), (8191, 2)))
#: One-call-per-sequence attention masks kept for reuse (a forward's layers share them; each
#: decode step adds one), at most this many and bytes; the oldest are dropped first, the newest
#: always kept.
SEQUENCE_MASKS_KEPT = 64
SEQUENCE_MASK_BYTES = 1 << 28


@dataclass(frozen=True)
class RowPlan:
    """How one linear layer's rows are fed to its kernel.

    Attributes:
        min_rows: a chunk with fewer rows is padded with zero rows to this many (>= 1).
        max_rows: no chunk has more rows (>= min_rows).
    """

    min_rows: int
    max_rows: int


def plan_linear(linear_rows, in_features: int, dtype: torch.dtype, device, need_rows: int,
                seed: int = 0, probe_rows: tuple[int, ...] = PROBE_ROWS) -> RowPlan:
    """Measure a :class:`RowPlan` for one linear kernel.

    Args:
        linear_rows: ``f(x: [M, in] dtype) -> [M, out]``, the layer's kernel call.
        in_features: input width.
        dtype, device: of the activations.
        need_rows: the plan must accept at least this many rows per chunk without padding
            beyond ``min_rows`` (one verify block: K_max + 1).
        seed: seed of the random probe activations.
        probe_rows: row counts probed, ascending (:data:`PROBE_ROWS`; :data:`ROW_EXACT_PROBE_ROWS`
            for a layer that is row-exact by construction).

    Returns:
        ``RowPlan(1, T)`` when every probed size up to T >= need_rows gives the one-row result;
        else ``RowPlan(2, T)`` when every probed size from 2 up to T agrees with two-row calls;
        else ``RowPlan(FIXED_ROWS, FIXED_ROWS)`` after checking that a row's result does not
        depend on its slot in a fixed-size call.

    Raises:
        RuntimeError: no plan found (a row's result depends on its slot even at a fixed size).
    """
    g = torch.Generator().manual_seed(seed)
    n = max(probe_rows)
    x = torch.randn(n, in_features, generator=g).to(dtype=dtype, device=device)
    with torch.inference_mode():
        for lo in (1, 2):
            # every row computed alone (lo = 1) or next to one zero row (lo = 2)
            rows = []
            for r in range(n):
                row = x[r:r + 1]
                if lo == 2:
                    row = torch.cat([row, torch.zeros_like(row)])
                rows.append(linear_rows(row)[:1])
            ref = torch.cat(rows)
            top = 0
            for m in probe_rows:
                if m < lo:
                    continue
                if not torch.equal(linear_rows(x[:m]), ref[:m]):
                    break
                top = m
            if top >= need_rows:
                return RowPlan(lo, min(top, MAX_CHUNK_ROWS))
        r = FIXED_ROWS
        base = linear_rows(x[:r])
        for s in range(1, r):
            z = torch.randn(r, in_features, generator=g).to(dtype=dtype, device=device)
            z[s] = x[0]
            if not torch.equal(linear_rows(z)[s], base[0]):
                raise RuntimeError(
                    f"no shape-invariant plan for a {dtype} linear of width {in_features} on {device}: "
                    f"a row's result depends on its slot in a {r}-row call"
                )
    return RowPlan(r, r)


def run_rows(linear_rows, x2: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """Apply ``linear_rows`` to ``x2 [N, in]`` in chunks that follow ``plan``; returns ``[N, out]``."""
    n = x2.shape[0]
    if plan.min_rows <= n <= plan.max_rows:
        return linear_rows(x2.contiguous())
    outs = []
    for s in range(0, n, plan.max_rows):
        c = x2[s:s + plan.max_rows]
        k = c.shape[0]
        if k < plan.min_rows:
            c = torch.cat([c, c.new_zeros(plan.min_rows - k, c.shape[1])])
        outs.append(linear_rows(c.contiguous())[:k])
    return torch.cat(outs)


def _linear_rows_of(module: nn.Module):
    if isinstance(module, nn.Linear):
        return lambda x: F.linear(x, module.weight, module.bias)
    return module.forward_rows  # quantized modules of specdec.models.formats


def _invariant_forward(self, x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    y = run_rows(self._specdec_rows, x.reshape(-1, shape[-1]), self._specdec_plan)
    return y.reshape(*shape[:-1], y.shape[-1])


def _row_ranges(attention_mask: torch.Tensor | None, b_size: int, q_len: int, kv_len: int) -> list[tuple[int, int]]:
    """Visible key range ``(lo, hi)`` of every query row, row-major over ``[B, q]``.

    Computed with a few tensor ops over the whole mask and one transfer to Python, and memoized
    on the mask tensor: a forward passes the same mask object to every layer, so the ranges are
    computed once per forward, not once per layer and row.

    Raises:
        ValueError: a row whose visible keys are not one contiguous range.
    """
    if attention_mask is None:  # causal: row i sees the first kv_len - q_len + i + 1 keys
        return [(0, kv_len - q_len + i + 1) for _ in range(b_size) for i in range(q_len)]
    memo = getattr(attention_mask, "_specdec_ranges", None)
    if memo is not None and memo[0] == (b_size, q_len, kv_len):
        return memo[1]
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    visible = visible[:, 0, :, :kv_len].expand(b_size, q_len, kv_len)  # [B, q, L] bool
    count = visible.sum(-1)  # [B, q]
    lo = visible.to(torch.uint8).argmax(-1)  # first visible key (0 when none)
    hi = kv_len - visible.flip(-1).to(torch.uint8).argmax(-1)  # last visible key + 1
    hi = torch.where(count > 0, hi, lo)  # a row that sees nothing: empty range
    if not bool(((hi - lo) == count).all()):
        raise ValueError("rowwise attention needs each row's visible keys to be contiguous")
    ranges = list(zip(lo.flatten().tolist(), hi.flatten().tolist()))
    try:
        attention_mask._specdec_ranges = ((b_size, q_len, kv_len), ranges)
    except (AttributeError, RuntimeError):  # pragma: no cover - a tensor subclass without __dict__
        pass
    return ranges


def row_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """One query row's attention call, as :func:`rowwise_attention` makes it for every row.

    With grouped-query attention the row's ``G = H / Hkv`` query heads that share a key head are
    folded into G query rows of that head (``[1, H, 1, d]`` -> ``[1, Hkv, G, d]``, a view): one
    plain call, no grouped-query expansion. Every row of every forward takes this same form, so a
    row's bits depend only on its query, its keys and the intra-op threads of the call
    (:data:`ROWS_ON_ONE_THREAD`). Why folded: half the time of the
    grouped-query call on a CPU (torch 2.13, one thread, 12/2 heads, d = 128: 150 keys 39 vs 75 us,
    300 keys 69 vs 150 us, 1200 keys 261 vs 548 us; session 23), and a decode step of the demo
    target makes 28 such calls per row.

    Args:
        q: ``[1, H, 1, d]``; k, v: ``[1, Hkv, L, d]`` / ``[1, Hkv, L, dv]`` (the row's visible
            keys), q's dtype; H a multiple of Hkv.
        scaling: the softmax scale (None: ``d ** -0.5``).

    Returns:
        ``[1, H, 1, dv]``.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads == kv_heads:
        return F.scaled_dot_product_attention(q, k, v, scale=scaling)
    out = F.scaled_dot_product_attention(q.view(1, kv_heads, heads // kv_heads, q.shape[-1]), k, v, scale=scaling)
    return out.reshape(1, heads, 1, v.shape[-1])  # a kernel may return its rows in another layout


def rowwise_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention computed one query row at a time (transformers ``AttentionInterface`` signature).

    Every query row gets its own scaled-dot-product call over exactly the keys it may see (the
    call plain decoding makes for that position), so a row's result depends neither on how many
    query rows the forward has nor on padding. On a CPU, bfloat16/float16 rows are computed in
    float32 (:data:`CPU_ROW_DTYPE`: inputs upcast, the row's result rounded back; 5-6x cheaper
    there than the reduced-precision kernel). One call per row is what keeps it exact: a shared
    call with a mask gives rows whose visible keys end before the call's last key different bits
    (measured: CPU bfloat16, 12/2 heads, d = 128: 2786 of 6412 such rows differ), because the
    kernel reduces a masked tail differently from a shorter key range. The rows' key ranges are
    computed once per forward (:func:`_row_ranges`).

    A model whose probe passed (``module._specdec_attention == "sequence"``, set by
    :func:`make_invariant`; :data:`SEQUENCE_ATTENTION`) gets one call per sequence instead
    (:func:`_sequence_rows`): the same rows and results, in the call form the probe checked.

    Args:
        module: the attention module (None: one call per row).
        query: ``[B, H, q, d]``; key, value: ``[B, Hkv, L, d]`` (cache included), or for a
            packed forward (B = 1) :func:`specdec.engine.kv_store.packed_parts` placeholders whose
            parts (each sequence's own cache, possibly stored in float32) hold the keys.
        attention_mask: None (causal: row i sees the first ``L - q + i + 1`` keys) or a boolean
            (True = visible) or additive float ``[B or 1, 1, q, >= L]`` mask whose visible keys
            per row are contiguous; a row that sees no key (a padding position) gets zeros.

    Returns:
        ``([B, q, H, d], None)`` in ``query``'s dtype.

    Raises:
        ValueError: a row whose visible keys are not one contiguous range, or (parts) not within
            one part, or parts with B > 1.
    """
    b_size, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    out_dtype = query.dtype
    # a packed forward's keys as the sequences' own caches (kv_cache.packed_parts), not one tensor
    parts_k, parts_v = getattr(key, "_specdec_parts", None), getattr(value, "_specdec_parts", None)
    row_dtype = out_dtype
    if CPU_ROW_DTYPE is not None and query.device.type == "cpu" and out_dtype in (torch.bfloat16, torch.float16):
        # every row in float32 (CPU_ROW_DTYPE), its result rounded back below: once per layer
        # call for the whole key range (or per part), not per row (a block's rows share their
        # keys); a cache stored in float32 (specdec.engine.kv_store.store_dtype) needs nothing
        row_dtype = CPU_ROW_DTYPE
        query = query.to(row_dtype)
    if parts_k is None:  # keys in another dtype than the rows' (a float32 cache, rows in their own dtype)
        key, value = key.to(row_dtype), value.to(row_dtype)
    if parts_k is not None and b_size != 1:
        raise ValueError("rowwise attention: packed key parts need a batch of one packed row")
    ranges = _row_ranges(attention_mask, b_size, q_len, kv_len)
    if getattr(module, "_specdec_attention", None) == "sequence":
        rows = _sequence_rows(query, key, value, parts_k, parts_v, ranges, q_len, scaling)
        return rows.to(out_dtype).view(b_size, q_len, heads, -1), None
    threads = torch.get_num_threads()
    # Short per-row calls, a decode step's single row included: one intra-op thread each
    # (ROWS_ON_ONE_THREAD; a parallel region per row costs more than the row's work on a loaded or
    # shared CPU: 24 one-row calls of the 0.5B draft over 100 keys took 0.33 ms on one thread and
    # 0.51 ms on two at best, 0.49 vs 48 ms median with the machine shared;
    # docs/bench/formats/PROFILE.md). The thread count is each row's own (its key count), never
    # the forward's: one and two threads give a float32 call different last bits (torch 2.13:
    # H == Hkv models, and torch's grouped-query call at 12/2 heads, 40 to 2100 keys; not the
    # folded row_call of a grouped-query model, which nothing relies on), so a short row beside a
    # long one (a batch, a block across the bound) gets its decode call's one thread
    # (tests/test_invariant.py).
    single = ROWS_ON_ONE_THREAD and query.device.type == "cpu" and threads > 1
    calls = []  # per row (q, k, v) or None (a padding row)
    keys = _KeyRanges(key, value, parts_k, parts_v, row_dtype)
    # every query row as a view, made in one call (b_size 1, as a packed forward: no batch slice)
    rows_q = query.split(1, dim=2) if b_size == 1 else None
    for r, (lo, hi) in enumerate(ranges):
        b, i = divmod(r, q_len)
        if hi == lo:  # a padding query row sees nothing: its output is unused
            calls.append(None)
            continue
        k, v = keys.take(b, lo, hi)
        calls.append((rows_q[i] if rows_q is not None else query[b:b + 1, :, i:i + 1], k, v))
    zeros = query.new_zeros(1, heads, 1, value.shape[-1]) if None in calls else None

    def run(some):
        return [zeros if c is None else row_call(c[0], c[1], c[2], scaling) for c in some]

    # rows over more than SINGLE_THREAD_MAX_KEYS keys: on all threads (and none of them one-threaded)
    long_rows = ([j for j, c in enumerate(calls) if c is not None and c[1].shape[2] > SINGLE_THREAD_MAX_KEYS]
                 if single else [])
    outs: list = [None] * len(calls)
    if long_rows:
        for j, o in zip(long_rows, run([calls[j] for j in long_rows])):
            outs[j] = o
    short_rows = [j for j in range(len(calls)) if outs[j] is None] if long_rows else list(range(len(calls)))
    some = [calls[j] for j in short_rows]
    if single and some:
        torch.set_num_threads(1)
    try:
        split = len(some) // 2 if single and ROW_WORKER_MIN_ROWS and len(some) >= ROW_WORKER_MIN_ROWS else 0
        if split:  # the second half on the helper thread (the other core), the first half here
            later = _row_worker().submit(_run_one_thread, run, some[split:])
            done = run(some[:split])
            done += later.result()
        else:
            done = run(some)
    finally:
        if single and some:
            torch.set_num_threads(threads)
    for j, o in zip(short_rows, done):
        outs[j] = o
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, H, B*q, d]
    return out.to(out_dtype).view(heads, b_size, q_len, -1).permute(1, 2, 0, 3), None


_worker = None


def _row_worker():
    """The one helper thread row-wise attention splits its rows with (created on first use)."""
    global _worker
    if _worker is None:
        from concurrent.futures import ThreadPoolExecutor

        _worker = ThreadPoolExecutor(1, thread_name_prefix="specdec-rows")
    return _worker


def _run_one_thread(run, calls):
    torch.set_num_threads(1)  # this thread's own intra-op setting (the caller's is 1 meanwhile too)
    return run(calls)


_masks: dict[tuple, torch.Tensor] = {}
_mask_bytes = 0
_masks_lock = threading.Lock()


def _sequence_mask(seen: tuple[int, ...], length: int, groups: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """Additive mask ``[1, 1, groups * n, length]`` of :func:`_sequence_call` (0 visible, -inf not):
    row ``g * n + j`` sees keys ``0 .. seen[j] - 1``. Its rows are 16-element aligned (a view of a
    wider tensor: the memory-efficient kernel would otherwise pad a copy per call). Kept for reuse
    (a forward's layers share their masks): at most :data:`SEQUENCE_MASKS_KEPT` masks and
    :data:`SEQUENCE_MASK_BYTES` bytes, the least recently used dropped first."""
    global _mask_bytes
    key = (seen, length, groups, dtype, device)
    with _masks_lock:
        mask = _masks.pop(key, None)
        if mask is not None:
            _masks[key] = mask  # most recently used last
    if mask is None:
        width, n = -(-length // 16) * 16, len(seen)
        if seen == tuple(range(seen[0], seen[0] + n)):  # causal rows (every forward's): no copy from the host
            ends = torch.arange(seen[0], seen[0] + n, device=device)
        else:
            ends = torch.tensor(seen).to(device)
        visible = torch.arange(width, device=device)[None, :] < ends[:, None]  # [n, width]
        full = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        mask = full.repeat(groups, 1)[None, None, :, :length]  # [1, 1, groups * n, length] of [.., width]
        size = mask.untyped_storage().nbytes()
        with _masks_lock:  # models may run in several threads
            while _masks and (len(_masks) >= SEQUENCE_MASKS_KEPT or _mask_bytes + size > SEQUENCE_MASK_BYTES):
                _mask_bytes -= _masks.pop(next(iter(_masks))).untyped_storage().nbytes()
            if key not in _masks:
                _masks[key] = mask
                _mask_bytes += size
    return mask


def _sequence_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: tuple[int, ...],
                   scaling: float | None) -> torch.Tensor:
    """One sequence's query rows in one masked scaled-dot-product call (the per-sequence call form).

    The ``G = H / Hkv`` query heads that share a key head are folded into the rows (``[1, Hkv,
    G * n, d]``: one copy of the queries, none of the keys), so the call needs no grouped-query
    support (the memory-efficient CUDA kernel has none) and a one-row decode call has the form of
    a block's. On :data:`SEQUENCE_EFFICIENT_KERNEL` devices the memory-efficient kernel is called
    directly.

    Args:
        q: ``[1, H, n, d]``; k, v: ``[1, Hkv, length, d]`` / ``[1, Hkv, length, dv]``, q's dtype,
            the sequence's keys from its first.
        seen: per row, how many keys (from key 0) it sees, each in ``1..length``.
        scaling: the softmax scale (None: ``d ** -0.5``).

    Returns:
        ``[n, Hkv, G, dv]`` (a view): row j, key head, query head within the group.
    """
    _, heads, n, d = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    mask = _sequence_mask(seen, length, groups, q.dtype, q.device)
    rows = q.reshape(1, kv_heads, groups * n, d)
    if q.device.type in SEQUENCE_EFFICIENT_KERNEL:
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            rows, k, v, mask.expand(1, kv_heads, groups * n, length), False, scale=scaling)[0]
    else:
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scaling)
    return out[0].view(kv_heads, groups, n, -1).permute(2, 0, 1, 3)


class _KeyRanges:
    """The keys and values a row (or a sequence's rows) sees, ``[1, Hkv, hi - lo, d]``, from one
    tensor (``key[b, :, lo:hi]``) or, in a packed forward, from the sequences' own cache parts
    (:func:`specdec.engine.kv_store.packed_parts`), converted to ``dtype`` once per part. Rows are
    asked for part after part (a packed forward's order); an earlier range restarts the search."""

    def __init__(self, key, value, parts_k, parts_v, dtype: torch.dtype):
        self.key, self.value, self.parts_k, self.parts_v, self.dtype = key, value, parts_k, parts_v, dtype
        self.part, self.off, self.end, self.pk, self.pv = -1, 0, 0, None, None  # the current part

    def take(self, b: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``lo:hi`` of batch row ``b``.

        Raises:
            ValueError: (parts) the range spans two packed sequences.
        """
        if self.parts_k is None:
            return self.key[b:b + 1, :, lo:hi], self.value[b:b + 1, :, lo:hi]
        if lo < self.off:  # not part after part (never in a packed forward): search from the first
            self.part, self.off, self.end = -1, 0, 0
        while not self.off <= lo < self.end:  # move to the part holding lo
            self.part += 1
            self.off, pk = self.parts_k[self.part]
            pv = self.parts_v[self.part][1]
            self.end = self.off + pk.shape[2]
            if pk.dtype != self.dtype or pv.dtype != self.dtype:
                pk, pv = pk.to(self.dtype), pv.to(self.dtype)
            self.pk, self.pv = pk, pv
        if hi > self.end:
            raise ValueError("rowwise attention: a row's keys span two packed sequences")
        # a range that is its whole part (a decode row, a block's last row) takes the part itself
        if lo == self.off and hi == self.end:
            return self.pk, self.pv
        return self.pk[:, :, lo - self.off:hi - self.off], self.pv[:, :, lo - self.off:hi - self.off]


def _sequence_rows(query, key, value, parts_k, parts_v, ranges, q_len, scaling) -> torch.Tensor:
    """:func:`rowwise_attention`'s rows with one :func:`_sequence_call` per sequence.

    Consecutive rows of one batch row that see keys from the same first key form one call over the
    keys from that one to the last any of them sees (a packed part: that sequence's own cache from
    its first key, the layout its decode calls see), at most :data:`SEQUENCE_CALL_ROWS` rows a call;
    consecutive rows that see nothing are zeros.

    Returns:
        ``[B * q, Hkv, G, dv]`` in ``query``'s dtype (contiguous).

    Raises:
        ValueError: (parts) a sequence's rows span two packed sequences.
    """
    heads, kv_heads, dv = query.shape[1], key.shape[1], value.shape[-1]
    groups = heads // kv_heads
    pieces = []
    keys = _KeyRanges(key, value, parts_k, parts_v, query.dtype)
    r, total = 0, len(ranges)
    while r < total:
        b, start, (lo, top) = r // q_len, r, ranges[r]
        empty = top == lo
        r += 1
        while r < total and r // q_len == b and ((ranges[r][1] == ranges[r][0]) if empty
                                                 else (ranges[r][0] == lo and ranges[r][1] > lo)):
            top = max(top, ranges[r][1])
            r += 1
        if empty:  # padding query rows see nothing: their output is unused
            pieces.append(query.new_zeros(r - start, kv_heads, groups, dv))
            continue
        k, v = keys.take(b, lo, top)
        for c0 in range(start, r, SEQUENCE_CALL_ROWS):  # the run of rows in calls of at most that many
            c1 = min(r, c0 + SEQUENCE_CALL_ROWS)
            seen = tuple(hi - lo for _, hi in ranges[c0:c1])
            i, last = c0 - b * q_len, max(seen)
            pieces.append(_sequence_call(query[b:b + 1, :, i:i + c1 - c0], k[:, :, :last], v[:, :, :last], seen,
                                         scaling))
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces)


def probe_sequence_attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                             scaling: float | None = None, shapes=SEQUENCE_PROBE_SHAPES, call=None,
                             seed: int = 0) -> bool:
    """Whether one call per sequence gives every row the bits of that row's own one-row call.

    For each ``(L, n)`` of ``shapes``: random ``q [1, heads, n, head_dim]`` and keys/values
    ``[1, kv_heads, L + n, head_dim]``; row j of the n-row call (seeing the first ``L + j + 1``
    keys, the rest masked) must equal bitwise the one-row call over exactly those ``L + j + 1``
    keys, the call a decode step of that position makes (as :func:`rowwise_attention` makes one
    call per row over exactly its keys), so that a position's result does not depend on how many
    rows (block, prefill chunk, packed sequences) its forward holds. Both calls take the
    per-sequence call form (``call``: on CUDA the memory-efficient kernel), the form every row of a model in
    that mode takes, decode rows included: comparing against today's unmasked per-row call would
    compare two kernels (on CUDA flash against memory-efficient), not the property.

    Args:
        heads, kv_heads, head_dim: the model's attention shape.
        dtype, device: of the rows as the model computes them.
        scaling: the model's softmax scale (None: ``head_dim ** -0.5``).
        shapes: ``(L, n)`` pairs (:data:`SEQUENCE_PROBE_SHAPES`).
        call: the per-sequence call (None: :func:`_sequence_call`; tests inject a perturbed one).
        seed: of the random probe tensors.

    Returns:
        True when every probed row is bitwise equal; False at the first that is not, or when a
        call raises (a backend that refuses the shape); a False is logged at INFO.
    """
    call = call or _sequence_call
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    n_max, l_max = max(n for _, n in shapes), max(L + n for L, n in shapes)
    q_all = torch.randn(1, heads, n_max, head_dim, generator=g).to(dtype=dtype, device=device)
    k_all = torch.randn(1, kv_heads, l_max, head_dim, generator=g).to(dtype=dtype, device=device)
    v_all = torch.randn(1, kv_heads, l_max, head_dim, generator=g).to(dtype=dtype, device=device)
    try:
        with torch.inference_mode():
            for L, n in shapes:
                q, k, v = q_all[:, :, :n], k_all[:, :, :L + n], v_all[:, :, :L + n]
                rows = call(q, k, v, tuple(range(L + 1, L + n + 1)), scaling)
                for j in range(n):
                    one = call(q[:, :, j:j + 1], k[:, :, :L + j + 1], v[:, :, :L + j + 1], (L + j + 1,), scaling)
                    if not torch.equal(rows[j], one[0]):
                        log.info("per-sequence attention probe: row %d of L=%d, n=%d differs (%s, %s)",
                                 j, L, n, dtype, device)
                        return False
    except Exception as e:  # noqa: BLE001 - a kernel that refuses the call, or an op this torch lacks
        log.info("per-sequence attention probe: the call failed (%s, %s): %s", dtype, device, e)
        return False
    return True


def _attention_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model's attention rows are computed in: its embedding's (on a CPU,
    bfloat16/float16 as :data:`CPU_ROW_DTYPE`)."""
    emb = model.get_input_embeddings().weight
    if CPU_ROW_DTYPE is not None and emb.device.type == "cpu" and emb.dtype in (torch.bfloat16, torch.float16):
        return CPU_ROW_DTYPE
    return emb.dtype


def choose_attention(model: nn.Module, how: str | None = None) -> str:
    """``"sequence"`` or ``"row"``: how ``model``'s attention computes rows (:data:`SEQUENCE_ATTENTION`).

    Args:
        model: a transformers causal LM (its config's ``num_attention_heads``,
            ``num_key_value_heads``, ``head_dim`` or ``hidden_size``).
        how: ``"auto"``, ``"probe"``, ``"sequence"`` or ``"row"`` (None: :data:`SEQUENCE_ATTENTION`).

    Raises:
        ValueError: an unknown ``how``.
    """
    how = how or SEQUENCE_ATTENTION
    if how not in ("auto", "probe", "sequence", "row"):
        raise ValueError(f"attention mode {how!r}: expected auto, probe, sequence or row")
    device = model.get_input_embeddings().weight.device
    if how == "row" or (how == "auto" and device.type == "cpu"):
        return "row"
    if how == "sequence":
        return "sequence"
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    scaling = next((m.scaling for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "head_dim")), None)
    ok = probe_sequence_attention(heads, kv_heads, head_dim, _attention_dtype(model), device, scaling=scaling)
    return "sequence" if ok else "row"


def attention_mode(model: nn.Module) -> str:
    """How :func:`make_invariant` made ``model``'s attention compute rows: ``"sequence"`` or
    ``"row"`` (also for a model it did not make invariant)."""
    return getattr(model, "_specdec_attention", "row")


_registered = False


def register_attention() -> str:
    """Register :func:`rowwise_attention` (and sdpa's boolean masks) with transformers; returns its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTENTION_NAME, rowwise_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _registered = True
    return ATTENTION_NAME


def make_invariant(model: nn.Module, need_rows: int = 17, attention: str | None = None) -> dict[tuple, RowPlan]:
    """Make ``model``'s forward shape-invariant in place (see module docstring).

    Args:
        model: a transformers causal LM (any weight format of :mod:`specdec.models.formats`).
        need_rows: rows one chunk must take unpadded (K_max + 1).
        attention: how attention computes rows (:func:`choose_attention`; None:
            :data:`SEQUENCE_ATTENTION`); the choice is recorded (:func:`attention_mode`) and
            logged at INFO.

    Returns:
        The row plan per ``(kind, in_features, out_features, dtype)`` of the linear layers.
    """
    plans: dict[tuple, RowPlan] = {}
    device = next(model.parameters()).device
    for module in model.modules():
        if getattr(module, "_specdec_plan", None) is not None:
            continue
        if isinstance(module, nn.Linear) or hasattr(module, "forward_rows"):
            rows = _linear_rows_of(module)
            w = module.weight
            act_dtype = getattr(module, "act_dtype", w.dtype)
            key = (type(w).__name__, module.in_features, module.out_features, act_dtype, module.bias is not None,
                   type(module).__name__)
            if key not in plans:
                exact = getattr(module, "ROW_EXACT", False)
                plan = plan_linear(rows, module.in_features, act_dtype, device, need_rows,
                                   probe_rows=ROW_EXACT_PROBE_ROWS if exact else PROBE_ROWS)
                if exact and plan == RowPlan(1, MAX_CHUNK_ROWS):
                    plan = RowPlan(1, UNCHUNKED_ROWS)  # exact by construction, and probed: no chunking
                plans[key] = plan
            module._specdec_rows = rows
            module._specdec_plan = plans[key]
            if plans[key].max_rows < UNCHUNKED_ROWS:  # an unchunked row-exact layer keeps its own forward
                module.forward = types.MethodType(_invariant_forward, module)
    model.set_attn_implementation(register_attention())
    mode = choose_attention(model, attention)
    model._specdec_attention = mode
    for module in model.modules():
        if hasattr(module, "scaling") and hasattr(module, "head_dim"):  # the attention modules
            module._specdec_attention = mode
    log.info("shape-invariant forward: %s; attention: one call per %s",
             {k[1:3]: (p.min_rows, p.max_rows) for k, p in plans.items()}, mode)
    return plans
