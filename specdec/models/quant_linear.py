"""The int8 linear layers the weight formats run on CPU (:mod:`specdec.models.formats`).

- :class:`Int8WeightOnlyLinear` (format ``int8``): int8 weights, one scale per output row,
  bfloat16 activations, ``aten._weight_int8pack_mm``.
- :class:`W8A8Linear` (format ``w8a8``): int8 weights and int8 activations quantized per token at
  run time (LLM.int8()'s vector-wise activation quantization, Dettmers et al. 2022, without its
  outlier split; SmoothQuant's per-token dynamic quantization, Xiao et al. 2023, without its
  smoothing), oneDNN's int8 linear on a prepacked weight (VNNI, AMX-INT8), fbgemm's (AVX2 only) or
  ``aten._int_mm``; a row's result does not depend on the number of rows in a call (exact integer
  sums, per-row scales).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import warnings
from typing import Iterable

import torch
from torch import nn

from specdec.models.cpu_features import this_cpu_onednn_int8_exact

log = logging.getLogger(__name__)

_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def fbgemm_available() -> bool:
    """Whether this torch has PyTorch's ``fbgemm`` quantized engine and the int8 linear op
    :class:`W8A8Linear` runs on it (x86 builds; the engine's ops are deprecated upstream,
    pytorch/pytorch#184982, so a later torch may lack them: the layer then runs ``aten._int_mm``)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32")


_ENGINE_LOCK = threading.Lock()
_engine_users = 0
_engine_saved: str | None = None


@contextlib.contextmanager
def _fbgemm_engine():
    """PyTorch's quantized engine set to ``fbgemm`` while any thread is inside (``linear_prepack``
    packs for the engine in force, a process-wide setting), restored when the last one leaves, so
    layers may prepack in parallel (:func:`prepack_all`) and the engine is left as it was."""
    global _engine_users, _engine_saved
    with _ENGINE_LOCK:
        if _engine_users == 0:
            _engine_saved = torch.backends.quantized.engine
            torch.backends.quantized.engine = "fbgemm"
        _engine_users += 1
    try:
        yield
    finally:
        with _ENGINE_LOCK:
            _engine_users -= 1
            if _engine_users == 0:
                torch.backends.quantized.engine = _engine_saved


def cpu_int8_kernel() -> str:
    """The kernel a wide :class:`W8A8Linear` runs on this CPU: ``"qlinear"`` (oneDNN) where its
    int8 sums are exact (VNNI, AMX-INT8), else ``"fbgemm"`` where available, else ``"int_mm"``."""
    if this_cpu_onednn_int8_exact():
        return "qlinear"
    return "fbgemm" if fbgemm_available() else "int_mm"


def _collapse_packed(packed: torch.Tensor) -> int:
    """Put oneDNN's prepacked weight on huge pages; bytes moved (0 where not possible)."""
    from specdec.models.hugepages import collapse

    try:
        return collapse(torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed))
    except (AttributeError, RuntimeError):  # an older torch without these ops
        return 0


class _RowsLinear(nn.Module):
    """Base of the int8 linears: ``forward`` flattens ``[..., in]`` to ``[M, in]`` rows, calls the
    subclass's ``forward_rows`` (``[M, in]`` -> ``[M, out]``) and restores the leading dims."""

    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.forward_rows(x.reshape(-1, shape[-1]))
        return y.reshape(*shape[:-1], self.out_features)


class Int8WeightOnlyLinear(_RowsLinear):
    """A linear layer with int8 weights and one scale per output row, bf16 activations (CPU).

    ``y = (x @ qweight.T) * scale + bias`` computed by ``aten._weight_int8pack_mm``, which reduces
    every output element on its own: a row's result does not depend on how many rows a call has
    (see :mod:`specdec.engine.invariant`).

    Args:
        qweight: ``[out, in]`` int8.
        scale: ``[out]`` float (stored in the activation dtype).
        bias: ``[out]`` or None.
        act_dtype: activation dtype (bfloat16).
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 act_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.act_dtype = act_dtype
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.reshape(-1).to(act_dtype).contiguous())
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    @property
    def weight(self) -> torch.Tensor:
        return self.qweight

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, in]`` -> ``[M, out]`` in ``act_dtype``."""
        y = torch.ops.aten._weight_int8pack_mm(x.to(self.act_dtype), self.qweight, self.scale)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only"


class W8A8Linear(_RowsLinear):
    """A linear layer with int8 weights and int8 activations quantized per token at run time (CPU).

    For an input row ``x`` (bfloat16): ``s_x = max(|x|) / 127`` (float32; at least
    :attr:`EPS`, so an all-zero row gives zeros), ``q_x = round(x / s_x)`` in int8 [-127, 127];
    then ``y = float32(q_x @ qweight.T) * scale * s_x + bias``: the integer product accumulated
    exactly in int32, converted to float32, times the weight row's scale, times the token's scale,
    rounded to ``act_dtype``, plus the bias. This is per-token symmetric dynamic activation
    quantization with per-channel symmetric int8 weights (LLM.int8()'s vector-wise scheme without
    its outlier decomposition, Dettmers et al. 2022; SmoothQuant's W8A8 per-token dynamic setting
    without its smoothing, Xiao et al. 2023); the weights are torchao's
    (``Int8DynamicActivationInt8WeightConfig``).

    Kernel (:attr:`KERNEL`, :func:`cpu_int8_kernel`): ``"qlinear"``, oneDNN's int8 linear on a
    weight prepacked once (``torch.ops.onednn.qlinear_prepack`` / ``qlinear_pointwise``, the ops
    PyTorch's x86 int8 inference uses; AMX-INT8 or VNNI where present), with activation scale 1
    and the weight's per-row scales, float32 out; on a CPU with neither (AVX2 only), whose oneDNN
    kernel saturates pairs of products in int16 (:mod:`specdec.models.cpu_features`), **fbgemm**'s
    int8 GEMM (PyTorch's ``fbgemm`` quantized engine: ``quantized.linear_prepack`` and
    ``linear_with_input_q_dq_qweight_dq_output_fp32``) fed each row's codes as two 7-bit halves,
    which cannot saturate (:meth:`_fbgemm_sums`), or in one pass where the weights are 7-bit
    (format w7a8, :attr:`FBGEMM_ONE_PASS_MAX_WEIGHT`); or ``"int_mm"``, ``aten._int_mm`` (int32 out)
    and the scales in torch ops. All give bitwise the same result (oneDNN's float32 output is
    exactly ``float32(acc) * scale``, fbgemm's halves are exact below 2**24; tests/test_formats.py),
    so the kernel is chosen for speed alone: qlinear (about 1.6x faster than int_mm at one row on
    the 2-core Sapphire Rapids VM: 1536->8960, 0.37 vs 0.62 ms; the draft's 896-output layers
    1.3-1.7x) for layers with at least :attr:`QLINEAR_MIN_OUT` outputs, int_mm for narrower ones
    (qlinear's one-row call on 256 or 128 outputs is pathological, 3-70 ms) and wherever the
    prepack op is missing or fails (logged once); fbgemm for every layer where it runs (an AVX2-only
    AMD EPYC Zen 3, one thread: 1536->8960 0.45 ms at one row against int_mm's 29 and int4's 2.5;
    the demo target's forward of 1 / 5 / 17 positions 0.16-0.23 / 0.29 / 0.98 s against int4's
    0.29 / 0.62 / 1.38, docs/bench/formats/avx2-s16/).

    Every step works on one row at a time or sums integers exactly, so a row's result does not
    depend on how many rows a call has (:attr:`ROW_EXACT`; checked by
    :func:`specdec.engine.invariant.plan_linear` at load and by tests/test_formats.py).

    Args:
        qweight: ``[out, in]`` int8.
        scale: ``[out]`` (or ``[out, 1]``) float, the weight's per-row scale (stored float32).
        bias: ``[out]`` or None (kept in its dtype, added to the ``act_dtype`` output).
        act_dtype: dtype of the layer's input and output (bfloat16).

    Raises:
        ValueError: ``qweight`` is not a 2-D int8 tensor, or ``scale`` does not have ``out`` values.
    """

    #: A row's result is bitwise the same whatever the number of rows of the call: the invariant
    #: forward (:mod:`specdec.engine.invariant`) calls the layer unchunked.
    ROW_EXACT = True
    #: Smallest activation scale (float32 machine epsilon, as torchao's int8 quantization).
    EPS = float(torch.finfo(torch.float32).eps)
    #: ``"qlinear"`` (the CPU's prepacked kernel: oneDNN's, or fbgemm's where oneDNN's int8 sums are
    #: not exact; falls back to int_mm) or ``"int_mm"``.
    KERNEL = "qlinear"
    #: Layers with fewer output features run ``int_mm`` even when KERNEL is qlinear: oneDNN's
    #: qlinear took 3-70 ms for one row of 128 or 256 outputs (896, 1536 and 4864 inputs; the demo
    #: target's unfused 1536 -> 256 k/v projections ~14 ms; int_mm 0.07-0.7 ms), while from 384
    #: outputs up it was 1.0-1.7x faster than int_mm at one row (the draft's 896 -> 896 o and
    #: 4864 -> 896 down projections: 90 vs 129 us, 279 vs 456 us; 2-core Sapphire Rapids VM, one
    #: thread, minimum of 15 calls; docs/bench/formats/PROFILE.md section 9).
    QLINEAR_MIN_OUT = 384
    #: Zero point of the activation codes fed to oneDNN's qlinear: the int8 codes plus 128 as uint8
    #: (``quantize_rows(x, 128)``), so oneDNN sums ``(q + 128) * w`` and subtracts ``128 * sum(w)``
    #: per output, both exact in int32 (at most 255 * 127 * 8960 < 2**31): the same integer sums
    #: as int8 codes, bitwise the same output. oneDNN's VNNI and AMX kernels multiply u8 x s8 (the
    #: x86 int8 recipe of PyTorch quantizes activations to uint8); an int8 source on a CPU without
    #: AMX-INT8 (AVX512-VNNI, e.g. the AMD EPYC of this project's machine since 2 Dec 2026) takes
    #: oneDNN's reference ``ref_int8`` matmul: 0.46 s for one row of 1536 -> 2048, against 0.17 ms
    #: for the uint8 source on ``brg_matmul:avx512_core_vnni`` (docs/bench/formats/PROFILE.md section 11).
    U8_ZERO_POINT = 128
    #: Keep the plain int8 weight after prepacking (for comparing kernels). False: the prepacked
    #: copy is the only one (no second copy of the weights in memory); ``qweight`` is then empty.
    KEEP_INT8 = False
    #: fbgemm takes a row's 8-bit codes in one pass (as uint8 ``q + 128``, 0..255) when no weight is
    #: larger than this in magnitude: a pair of u8 x s8 products then stays within AVX2's int16
    #: (2 * 255 * 64 = 32,640 <= 32,767), so the sums are exact without the two halves. The 7-bit
    #: weights of format w7a8 (torchao's ``reduce_range``, -64..63) always are; a w8a8 layer whose
    #: weights happen to be is too (bitwise the same either way).
    FBGEMM_ONE_PASS_MAX_WEIGHT = 64
    #: Move each prepacked weight onto 2 MiB pages (:func:`specdec.models.hugepages.collapse`):
    #: a decode step streams every weight, and on 4 KiB pages a VM pays a two-level page walk per
    #: TLB miss (4-10 % of the demo target's int8 matmul time at one thread; bitwise the same).
    HUGEPAGES = True

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 act_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if qweight.dim() != 2 or qweight.dtype != torch.int8:
            raise ValueError(f"W8A8Linear needs a 2-D int8 weight, got {tuple(qweight.shape)} {qweight.dtype}")
        if scale.numel() != qweight.shape[0]:
            raise ValueError(f"W8A8Linear: {scale.numel()} weight scales for {qweight.shape[0]} output rows")
        self.out_features, self.in_features = qweight.shape
        self.act_dtype = act_dtype
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.reshape(-1).to(torch.float32).contiguous())
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None
        #: whether every weight is within :attr:`FBGEMM_ONE_PASS_MAX_WEIGHT` (fbgemm: one pass per row)
        self.one_pass = qweight.numel() > 0 and max(int(qweight.max()), -int(qweight.min())) \
            <= self.FBGEMM_ONE_PASS_MAX_WEIGHT
        self._packed = None  # oneDNN's or fbgemm's prepacked weight (built at the first call); False: unavailable
        self._kind = "int_mm"  # the kernel of the prepacked weight: "qlinear" (oneDNN) or "fbgemm"
        self._huge_bytes = 0  # bytes of the prepacked weight moved onto huge pages (HUGEPAGES)

    @property
    def weight(self) -> torch.Tensor:
        """``qweight``; once prepacked (``qweight`` empty) a meta tensor of its shape and dtype."""
        if self.qweight.numel() == 0 and self.out_features * self.in_features:
            return torch.empty((self.out_features, self.in_features), dtype=torch.int8, device="meta")
        return self.qweight

    @staticmethod
    def quantize_rows(x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token symmetric int8 quantization: ``[M, in]`` float -> (``[M, in]`` codes,
        ``[M, 1]`` float32 scales) with ``x ≈ q * s``; the codes are int8 in [-127, 127], or with
        ``offset`` 128 the same codes plus 128 as uint8 in [1, 255] (:attr:`U8_ZERO_POINT`)."""
        xf = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # divided in place
        s = xf.abs().amax(dim=-1, keepdim=True).div_(127.0).clamp_min_(W8A8Linear.EPS)
        # |x| / s <= 127 * (1 + 2**-23) rounds to at most 127: no clamp needed (in [-127, 127])
        if offset:
            return xf.div_(s).round_().add_(offset).to(torch.uint8), s
        return xf.div_(s).round_().to(torch.int8), s

    def _prepacked(self):
        if self._packed is None:
            self._packed = False
            if self.qweight.device.type == "cpu" and not this_cpu_onednn_int8_exact():
                self._packed = self._fbgemm_prepack()
                if self._packed is False:
                    _warn_once("w8a8: this CPU has no VNNI or AMX-INT8 int8 dot products, so oneDNN's int8 matmul "
                               "would add u8 x s8 products in saturating int16 pairs (not the exact sums), and "
                               "PyTorch's fbgemm engine is not available; using aten._int_mm")
                elif not self.KEEP_INT8:
                    self.qweight = self.qweight.new_empty((0, self.in_features))
            elif self.qweight.device.type == "cpu":
                try:
                    self._zero_points = torch.zeros(self.out_features, dtype=torch.int64)
                    self._packed = torch.ops.onednn.qlinear_prepack(self.qweight, None)
                except (RuntimeError, AttributeError, NotImplementedError) as e:
                    _warn_once(f"w8a8: oneDNN's qlinear_prepack is not available ({type(e).__name__}: {e}); "
                               "using aten._int_mm")
                else:
                    self._kind = "qlinear"
                    if self.HUGEPAGES:
                        self._huge_bytes = _collapse_packed(self._packed)
                    if not self.KEEP_INT8:  # drop the plain copy (e.g. the cache file's mapping)
                        self.qweight = self.qweight.new_empty((0, self.in_features))
        return self._packed

    def _fbgemm_prepack(self):
        """fbgemm's packed int8 weight (PyTorch's ``quantized.linear_prepack`` on the ``fbgemm``
        engine) of ``qweight`` with scale 1 and zero point 0, so the kernel's float32 output is the
        integer sum itself; False where the engine or its ops are missing or fail (logged once)."""
        if not fbgemm_available():
            return False
        try:
            with _fbgemm_engine():
                with warnings.catch_warnings():  # the quantized tensor API's deprecation notice, once per layer
                    warnings.simplefilter("ignore", UserWarning)
                    qw = torch._make_per_tensor_quantized_tensor(self.qweight, 1.0, 0)
                packed = torch.ops.quantized.linear_prepack(qw, None)
        except (RuntimeError, AttributeError, NotImplementedError) as e:
            _warn_once(f"w8a8: fbgemm's linear_prepack failed ({type(e).__name__}: {e})")
            return False
        self._kind = "fbgemm"
        return packed

    def prepack(self) -> bool:
        """Build oneDNN's prepacked weight now if the layer runs the qlinear kernel (:attr:`KERNEL`
        and :attr:`QLINEAR_MIN_OUT`), as its first forward would, dropping the plain int8 rows
        unless :attr:`KEEP_INT8` (done at load, :mod:`specdec.models.release`, so their memory goes
        before serving). Returns :attr:`prepacked`."""
        if self._uses_prepacked():
            self._prepacked()
        return self.prepacked

    def _uses_prepacked(self) -> bool:
        """Whether this layer runs a prepacked kernel: :attr:`KERNEL` is qlinear, and the layer is
        at least :attr:`QLINEAR_MIN_OUT` wide or this CPU runs fbgemm (no narrow-layer pathology)."""
        return self.KERNEL == "qlinear" and (self.out_features >= self.QLINEAR_MIN_OUT
                                             or not this_cpu_onednn_int8_exact())

    @property
    def prepacked(self) -> bool:
        """Whether the weight lives only in its kernel's prepacked form, oneDNN's or fbgemm's
        (``qweight`` is then empty)."""
        return self._packed is not None and self._packed is not False and self.qweight.numel() == 0

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, in]`` -> ``[M, out]`` in ``act_dtype`` (any M >= 1)."""
        packed = self._prepacked() if self._uses_prepacked() or self.prepacked else False
        if packed is not False and self._kind == "fbgemm":
            y, s = self._fbgemm_sums(x, packed)
            y = y.mul_(self.scale)
        elif packed is not False:
            zp = self.U8_ZERO_POINT
            q, s = self.quantize_rows(x, zp)
            y = torch.ops.onednn.qlinear_pointwise(q, 1.0, zp, packed, self.scale, self._zero_points, None,
                                                   1.0, 0, torch.float32, "none", [], "")
        else:
            q, s = self.quantize_rows(x)
            y = torch._int_mm(q, self.qweight.t()).to(torch.float32).mul_(self.scale)  # int32 sums: exact
        y = y.mul_(s).to(self.act_dtype)
        if self.bias is None:
            return y
        return y.add_(self.bias) if self.bias.dtype == y.dtype else y + self.bias

    #: Zero point of the 7-bit activation codes fed to fbgemm (values -64..63 as uint8 0..127).
    FBGEMM_ZERO_POINT = 64

    def _fbgemm_sums(self, x: torch.Tensor, packed) -> tuple[torch.Tensor, torch.Tensor]:
        """The integer sums ``q_x @ qweight.T`` (``[M, out]`` float32) by fbgemm on a CPU without
        exact int8 dot products (AVX2): fbgemm multiplies u8 x s8 with ``vpmaddubsw``, which adds
        pairs of products into a saturating int16, so 8-bit codes (-127..127) times 8-bit weights
        could be clipped.

        With 7-bit weights (:attr:`one_pass`, format w7a8) the codes go in one pass, as uint8
        ``q + 128`` with zero point 128 (a pair is at most 2 * 255 * 64 = 32,640 in magnitude): the
        int32 sum converted once to float32, bitwise ``float32(aten._int_mm(q, W.T))`` for any width.

        Otherwise each row's codes are split as ``q = h + (q - h)`` with ``h = floor(q / 2)`` and
        ``h - q = -ceil(q / 2)``, both in [-64, 63], fed as 2M rows of uint8 codes ``v + 64`` in
        [0, 127] (a pair of products then stays within int16: at most 2 * 127 * 128 = 32,512 in
        magnitude); the kernel sums each in int32 exactly and returns it as
        float32 (scale 1, zero point 64 subtracted exactly), and ``sum(h) - sum(h - q)`` is the
        sum of ``q``. Bitwise ``float32(aten._int_mm(q, W.T))`` whenever each half's sum is below
        2**24 in magnitude (always for inputs up to 1,024 wide: 1024 * 64 * 128 = 2**23; for wider
        ones a half's float32 could round where int_mm's int32 does not); every step is exact or
        per element, so a row's result never depends on the number of rows. Returns the sums and
        the rows' activation scales (``[M, 1]`` float32, as :meth:`quantize_rows`)."""
        xf = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        s = xf.abs().amax(dim=-1, keepdim=True).div_(127.0).clamp_min_(W8A8Linear.EPS)
        q = xf.div_(s).round_()  # float codes in [-127, 127], as quantize_rows
        if self.one_pass:
            return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                q, 1.0, self.U8_ZERO_POINT, packed), s
        m = q.shape[0]
        halves = torch.empty((2 * m, q.shape[1]), dtype=torch.float32)
        torch.floor(q * 0.5, out=halves[:m])
        torch.sub(halves[:m], q, out=halves[m:])
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            halves, 1.0, self.FBGEMM_ZERO_POINT, packed)
        return y[:m].sub_(y[m:]), s

    def extra_repr(self) -> str:
        bits = "7-bit" if self.one_pass else "int8"
        return f"in_features={self.in_features}, out_features={self.out_features}, {bits} weights, int8 per-token activations"


def prepack_all(layers: Iterable[nn.Module], workers: int | None = None) -> int:
    """Prepack every :class:`W8A8Linear` of ``layers`` that runs a prepacked kernel (oneDNN's or
    fbgemm's; :meth:`W8A8Linear.prepack`), ``workers`` layers at a time in threads, as their first
    forwards would one by one. The prepack ops (``quantized.linear_prepack``,
    ``onednn.qlinear_prepack``) release the GIL and pack on one core, so on two cores two threads
    halve the load's packing time (the demo pair's 2 GB of int8 weights: ~14 s of a 34 s load on
    one thread on the AVX2 Zen 3, fbgemm packing ~150 MB/s per thread). Each layer is packed by one
    thread; the result is the same packed weight as a lazy prepack's.

    Args:
        layers: modules; those that are not W8A8Linear are skipped.
        workers: threads (default: ``torch.get_num_threads()``, the process's share of cores).

    Returns:
        the number of layers whose weight is prepacked afterwards.
    """
    todo = [m for m in layers if isinstance(m, W8A8Linear) and not m.prepacked and m._uses_prepacked()]
    workers = max(1, min(workers or torch.get_num_threads(), len(todo) or 1))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="specdec-prepack") as pool:
        return sum(pool.map(lambda m: m.prepack(), todo))  # fbgemm's engine switch is ref-counted
