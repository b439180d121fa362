"""Fused projections: one int4 matmul for q/k/v and one for gate/up, bitwise as separate ones.

A decoder layer of Llama-style models (Qwen2, Llama, Mistral, ...) multiplies the same input by
three projections in attention (``q_proj``, ``k_proj``, ``v_proj``) and by two in the MLP
(``gate_proj``, ``up_proj``). In int4 on a CPU every projection is one call of torch's
``_weight_int4pack_mm_for_cpu`` (torchao's ``Int4OpaqueTensor``); for the 0.5B draft's one-token
decode step the call overhead and its parallel region are a large part of a small matmul.
Concatenating the packed weights along the output dimension gives one call per group instead
(vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``, here on torchao's packed tensors):
7 matmuls per layer become 4.

w8a8 (:class:`specdec.models.formats.W8A8Linear`) fuses the same groups: the int8 weight rows,
their scales and biases concatenated into one W8A8Linear, so the shared input is quantized per
token once per group instead of once per projection (the quantization's ~10 small ops per call
were ~10 % of a one-thread decode step of the demo target) and the narrow k/v projections ride
in the wide q call. Every output column is an exact int32 sum times its row's and the token's
scale, so the fused columns are the separate ones bitwise (checked like int4's).

Exactness: the kernel reduces every output column on its own, over the same groups of the
input, so a fused call's columns are bitwise the separate calls' outputs. :func:`fuse_projections`
does not assume it: each fused group is checked on random activations of 1, 5 and 33 rows
(:data:`CHECK_ROWS`, across the 32-row chunks of the shape-invariant forward) against its
separate projections with ``torch.equal``, and a group that differs is left unfused (one log
line); w8a8's integer columns do not depend on the weights' values, so there the first group of
each shape is checked and the others of that shape share its verdict (:func:`_signature`).
Measured on the demo pair's shapes (Sapphire Rapids, 2 threads, best of 200 calls, one row):
draft q/k/v 84 -> 47 µs, gate/up 308 -> 281 µs; target q/k/v 148 -> 126 µs, gate/up 950 -> 849 µs
(docs/bench/formats/PROFILE.md, "The draft's per-token cost").

How the layer still calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)``: each becomes a
:class:`FusedSlice` of one shared :class:`FusedLinear`. The first slice called with an input
computes the fused product; the group's other slices called with *the same tensor object* take
their columns from it (per thread: the draft replica steps sessions in several threads). A slice
called with another tensor computes the fused product for it; the answer is always that slice's
columns of the fused product of its own input, so a caller that does not follow the
q-then-k-then-v pattern is only slower, never wrong.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)

#: projection groups fused, by attribute name on the module that holds them
GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
#: row counts of the bitwise check of each fused group (one decode row, a block, more than one
#: 32-row chunk of the shape-invariant forward)
CHECK_ROWS: tuple[int, ...] = (1, 5, 33)


class FusedLinear(nn.Module):
    """Several int4 projections of one input as one linear layer.

    Args:
        linears: ``nn.Linear`` layers with torchao ``Int4OpaqueTensor`` weights ``[N_i, K]`` (same
            K, group size and dtype; no padding rows; all with a bias or none).

    Attributes:
        linear: the fused ``nn.Linear`` (weight ``[Σ N_i, K]`` int4, bias ``[Σ N_i]`` or None);
            the shape-invariant forward wraps it like any linear layer.
        bounds: ``(start, end)`` output columns of each part, in order.

    Raises:
        ValueError: the layers cannot be concatenated (:func:`fusable`).
    """

    def __init__(self, linears: Sequence[nn.Module]):
        super().__init__()
        why = fusable(linears)
        if why:
            raise ValueError(f"cannot fuse: {why}")
        if isinstance(linears[0], _w8a8_class()):
            self._init_w8a8(linears)
            return
        ws = [lin.weight for lin in linears]
        w0 = ws[0]
        n = sum(int(w.shape[0]) for w in ws)
        k = int(w0.shape[1])
        weight = type(w0)(
            torch.cat([w.qdata for w in ws], 0),
            torch.cat([w.scale_and_zero for w in ws], 1),
            list(w0.block_size),
            torch.Size([n, k]),
        )
        self.linear = nn.Linear(k, n, bias=False, device="meta")
        self.linear.weight = nn.Parameter(weight, requires_grad=False)
        if linears[0].bias is not None:
            self.linear.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False)
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for w in ws:
            self.bounds.append((start, start + int(w.shape[0])))
            start += int(w.shape[0])
        self._last = threading.local()

    def _init_w8a8(self, linears) -> None:
        """w8a8: one :class:`~specdec.models.formats.W8A8Linear` on the concatenated int8 weight
        rows, per-row scales and biases (its kernel choice, qlinear or int_mm, by the fused width)."""
        cls = _w8a8_class()
        bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
        self.linear = cls(torch.cat([lin.qweight for lin in linears], 0), torch.cat([lin.scale for lin in linears]),
                          bias, linears[0].act_dtype)
        self.bounds = []
        start = 0
        for lin in linears:
            self.bounds.append((start, start + lin.out_features))
            start += lin.out_features
        self._last = threading.local()

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Columns ``bounds[index]`` of the fused product of ``x`` (``[..., K]`` -> ``[..., N_index]``).

        The fused product of the last input is kept per thread until every part has taken its
        columns, so the group's calls on one input cost one matmul.
        """
        last = getattr(self._last, "value", None)
        if last is None or last[0] is not x or index in last[2]:
            last = (x, self.linear(x), set())
            self._last.value = last
        last[2].add(index)
        if len(last[2]) == len(self.bounds):
            self._last.value = None  # every part served: do not hold the activations
        lo, hi = self.bounds[index]
        # contiguous, as a separate projection's output: the ops after it see the same layout
        return last[1][..., lo:hi].contiguous()


class FusedSlice(nn.Module):
    """Stands in for one projection of a :class:`FusedLinear` (``[..., K]`` -> ``[..., N]``, the
    activation dtype).

    Attributes:
        in_features, out_features: those of the projection it replaces.
    """

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        self.fused = fused
        self.index = index
        lo, hi = fused.bounds[index]
        self.in_features = fused.linear.in_features
        self.out_features = hi - lo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.index)

    def extra_repr(self) -> str:
        lo, hi = self.fused.bounds[self.index]
        return f"columns {lo}:{hi} of a fused linear"


def _w8a8_class():
    from specdec.models.formats import W8A8Linear

    return W8A8Linear


def _w8a8_fusable(linears: Sequence[nn.Module]) -> str | None:
    cls = _w8a8_class()
    if any(type(lin) is not cls for lin in linears):
        return "not all w8a8 layers"
    if any(lin.qweight.numel() == 0 for lin in linears):
        return "w8a8 weight already prepacked (its int8 rows are gone)"
    l0 = linears[0]
    if any(lin.in_features != l0.in_features or lin.act_dtype != l0.act_dtype or lin.qweight.device != l0.qweight.device
           for lin in linears[1:]):
        return "input width, dtype or device differ"
    if len({lin.bias is None for lin in linears}) > 1:
        return "some have a bias and some do not"
    return None


def fusable(linears: Sequence[nn.Module]) -> str | None:
    """Why ``linears`` cannot be fused into one :class:`FusedLinear` (None: they can).

    Needs plain ``nn.Linear`` layers with CPU ``Int4OpaqueTensor`` weight-only (A16W4) weights of
    the same input width, group size and dtype, no output padding, and a bias on all or none; or
    :class:`~specdec.models.formats.W8A8Linear` layers (w8a8) of the same input width and
    activation dtype whose int8 rows are still there (not yet prepacked), a bias on all or none.
    """
    if len(linears) >= 2 and type(linears[0]).__name__ == "W8A8Linear":
        return _w8a8_fusable(linears)
    try:
        from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor
    except ImportError:  # pragma: no cover - torchao is a dependency
        return "torchao's Int4OpaqueTensor is not available"
    if len(linears) < 2:
        return "fewer than two layers"
    ws = []
    for lin in linears:
        if type(lin) is not nn.Linear:
            return f"{type(lin).__name__} is not a plain nn.Linear"
        w = lin.weight
        if not isinstance(w, Int4OpaqueTensor):
            return f"weight is {type(w).__name__}, not Int4OpaqueTensor"
        if w.act_mapping_type is not None or w.act_pre_scale is not None:
            return "not a weight-only int4 weight"
        if w.qdata.shape[0] != w.shape[0] or w.scale_and_zero.shape[1] != w.shape[0]:
            return "padded output rows"
        ws.append(w)
    w0 = ws[0]
    for w in ws[1:]:
        if w.shape[1] != w0.shape[1] or list(w.block_size) != list(w0.block_size) or w.dtype != w0.dtype \
                or w.qdata.shape[1:] != w0.qdata.shape[1:] or w.scale_and_zero.shape[0] != w0.scale_and_zero.shape[0] \
                or w.device != w0.device:
            return "input width, group size, dtype or device differ"
    if len({lin.bias is None for lin in linears}) > 1:
        return "some have a bias and some do not"
    return None


@contextlib.contextmanager
def _unpacked(linears: Sequence[nn.Module]):
    """w8a8 layers compute the check on their int8 rows and leave it unprepacked.

    The separate layers of a group are discarded once fused: prepacking them for the check would
    build oneDNN copies of their weights (the demo target's q and gate/up: ~0.8 GB in all) only
    to free them, so on a CPU running oneDNN they compute with ``aten._int_mm``, which gives
    bitwise what oneDNN's qlinear gives (the definition of
    :class:`~specdec.models.formats.W8A8Linear`; tests/test_formats.py). On a CPU running fbgemm
    (AVX2 only, :func:`~specdec.models.quant_linear.cpu_int8_kernel`) ``aten._int_mm`` is 30-60x
    slower than fbgemm (it made the demo target's load take ~35 s), so there each layer packs a
    temporary fbgemm copy for the check (its int8 rows kept) and drops it after: the same result,
    bitwise. Other layers run as they are."""
    from specdec.models.quant_linear import cpu_int8_kernel

    cls = _w8a8_class()
    w8a8 = [lin for lin in linears if type(lin) is cls and not lin.prepacked]
    temporary_fbgemm = cpu_int8_kernel() == "fbgemm"
    for lin in w8a8:  # instance attributes shadow the class's for this instance only
        if temporary_fbgemm:
            lin.KEEP_INT8 = True
        else:
            lin.KERNEL = "int_mm"
    try:
        yield
    finally:
        for lin in w8a8:
            if temporary_fbgemm:
                del lin.KEEP_INT8
                lin._packed, lin._kind = None, "int_mm"  # the temporary copy goes; packed again at first use
            else:
                del lin.KERNEL


def _check_bitwise(linears: Sequence[nn.Linear], fused: FusedLinear, seed: int = 0) -> str | None:
    """None when the fused columns equal the separate projections bitwise for :data:`CHECK_ROWS`
    (w8a8: the separate layers' reference computed without prepacking them, :func:`_unpacked`)."""
    g = torch.Generator().manual_seed(seed)
    k = fused.linear.in_features
    dtype = getattr(linears[0], "act_dtype", None) or linears[0].weight.dtype
    with torch.inference_mode(), _unpacked(linears):
        for rows in CHECK_ROWS:
            x = torch.randn(rows, k, generator=g).to(dtype)
            want = torch.cat([lin(x) for lin in linears], dim=-1)
            got = fused.linear(x)
            if not torch.equal(want, got):
                return f"{rows} rows differ (max |diff| {(want.float() - got.float()).abs().max().item():.3g})"
    return None


def _signature(parts: Sequence[nn.Module]) -> tuple | None:
    """What decides a w8a8 group's check: the layers' widths, bias, activation dtype and kernel
    settings (the kernel is chosen by these and the CPU); None unless every layer is w8a8 (then
    each group is checked).

    A w8a8 output column is an exact int32 sum over the row's int8 codes times its own scales
    (:class:`~specdec.models.formats.W8A8Linear`), whatever the weights' values, so a group whose
    signature passed the check passes it for any weights: one group per signature is checked (a
    guard against a kernel that computes columns differently), not every layer's (the demo pair's
    56 + 48 checks packed ~1 GB of temporary fbgemm copies on AVX2: ~11 s of its load)."""
    cls = _w8a8_class()
    if not all(type(p) is cls for p in parts):
        return None
    return tuple((p.in_features, p.out_features, p.bias is not None, p.act_dtype, p.KERNEL, p.QLINEAR_MIN_OUT,
                  p.one_pass) for p in parts)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every q/k/v and gate/up group of int4, w8a8 or w7a8 projections in ``model``, in place.

    Call after quantizing and before :func:`specdec.engine.invariant.make_invariant` (which then
    plans the fused linears like any other). Groups that are not int4, w8a8 or w7a8 (:func:`fusable`) or whose
    fused columns are not bitwise equal to the separate projections on a probe are left as
    they are (w8a8: the first group of each :func:`_signature` is probed, the others share its
    verdict). Idempotent.

    Returns:
        the number of groups fused.
    """
    fused_count = 0
    skipped: dict[str, int] = {}
    checked: dict[tuple, str | None] = {}  # w8a8: the check's verdict per signature (_signature)
    for module in list(model.modules()):
        for names in GROUPS:
            parts = [getattr(module, n, None) for n in names]
            if any(p is None for p in parts) or any(isinstance(p, FusedSlice) for p in parts):
                continue
            why = fusable(parts)
            if why is None:
                fused = FusedLinear(parts)
                sig = _signature(parts)
                if sig is None or sig not in checked:
                    why = _check_bitwise(parts, fused)
                    if sig is not None:
                        checked[sig] = why
                else:
                    why = checked[sig]
            if why is not None:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            for i, name in enumerate(names):
                setattr(module, name, FusedSlice(fused, i))
            fused_count += 1
    if skipped:
        log.info("projections left unfused: %s", skipped)
    return fused_count
