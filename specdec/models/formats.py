"""Weight formats: how a model's weights are stored and multiplied.

=========== ============================================ ============ ==================================
format      weights                                      activations  kernel on CPU
=========== ============================================ ============ ==================================
float32     float32                                      float32      ``nn.Linear`` (MKL)
bfloat16    bfloat16                                     bfloat16     ``nn.Linear`` (oneDNN; AMX where present)
float16     float16                                      float16      ``nn.Linear`` (oneDNN)
int8        int8, symmetric, one scale per output row    bfloat16     ``aten._weight_int8pack_mm``
int4        int4, asymmetric, groups of 128 (or 64, 32)  bfloat16     ``aten._weight_int4pack_mm_for_cpu``
w8a8        int8, symmetric, one scale per output row    int8 per     ``onednn.qlinear_pointwise`` (AMX-INT8
                                                         token        or VNNI); fbgemm (AVX2); ``aten._int_mm``
w7a8        as w8a8 in 7 bits (-64..63: torchao's        int8 per     as w8a8; on AVX2 fbgemm in one pass
            ``reduce_range``)                            token        (w8a8 needs two: :class:`W8A8Linear`)
=========== ============================================ ============ ==================================

int8 and int4 are weight-only and quantized with torchao (``Int8WeightOnlyConfig``;
``PrototypeInt4WeightOnlyConfig``, the CPU packing of ``Int4WeightOnlyConfig``) from the bfloat16
weights, every ``nn.Linear`` including the output projection (embeddings and norms stay
bfloat16, the input embedding table read from the bfloat16 folder's file per token, its pages
not kept: :mod:`specdec.models.release`; an int4 layer whose input width no group size divides, or on CPU whose output width
is not a multiple of 16 (the kernel packs 16 rows), stays bfloat16 too). On CPU, torchao 0.18's int8 tensor multiplies by converting the whole weight to
bfloat16 on every call; the int8 layers therefore run torch's own int8 weight-only kernel
(``aten._weight_int8pack_mm``, the one gpt-fast uses) on torchao's quantized data and scales.
On a GPU the int8/int4 layers stay torchao tensors (untested here: no GPU on this machine).

w8a8 quantizes the weights as int8 does (torchao ``Int8DynamicActivationInt8WeightConfig``:
symmetric int8, one scale per output row) and also the activations, dynamically per token: each
row of a linear layer's input is scaled by its own absolute maximum to int8 (the vector-wise
activation quantization of LLM.int8(), Dettmers et al. 2022, without its outlier decomposition;
SmoothQuant's per-token dynamic quantization, Xiao et al. 2023, without its smoothing). The
product is an integer matrix multiply (oneDNN's int8 linear on a prepacked weight, or
``aten._int_mm``; int32 accumulation, AMX-INT8 on Sapphire Rapids) rescaled by the row's and the
output channel's scales (:class:`W8A8Linear`). Its cost
hardly grows with the number of rows (one linear 1536->8960 on the 2-core VM: about the same time
for 1 and 32 rows, where int4's grows about linearly), so verifying K + 1 positions or a batch of
sessions costs about one decode step; and since integer sums are exact, a row's result does not
depend on how many rows a call has, by construction. On CPU the layers are :class:`W8A8Linear`
on torchao's quantized data; on a GPU they stay torchao tensors (untested).

w7a8 is w8a8 with the weights quantized to 7 bits (codes -64..63, torchao's ``reduce_range``; one
scale per output row) and the activations still to int8 per token. It exists for CPUs whose int8
dot product is AVX2's ``vpmaddubsw`` (fbgemm): that instruction adds pairs of u8 x s8 products in a
saturating int16, so w8a8's 8-bit codes must be fed as two 7-bit halves (twice the rows), while
7-bit weights keep every pair within int16 (2 * 255 * 64 = 32,640): one pass, the exact integer
sums, about half the compute of a forward of several positions (on session 18's Zen 3 the demo
target's 5 / 8-row / 64-position forwards 1.31x / 1.48x / 1.72x faster, one position about the
same). Its cost in quality, measured on the demo target against float32 over 1,200 positions of
prose and code (docs/bench/formats/w7a8-s18/quality.txt): top-1 agreement 0.918 (w8a8 0.919, int4
0.812), mean KL 0.039 nats (w8a8 0.036, int4 0.087), NLL per token 3.603 (w8a8 3.597, float32 3.592);
7-bit activations instead of weights cost twice w8a8's KL in a fake-quantized probe (0.060 against
0.030, bfloat16 reference). Exactness is per format, as for every format: speculation equals the w7a8
target alone.

:func:`default_format` picks the format when a spec names none: ``$SPECDEC_WEIGHT_FORMAT``, else
bfloat16 on a GPU, else by the CPU (:func:`choose_cpu_format`): **w8a8** on a CPU with AMX-INT8
(``amx_int8`` in /proc/cpuinfo: Sapphire Rapids and later) or with AVX512-VNNI and native bfloat16
(``avx512_vnni`` and ``avx512_bf16``: AMD EPYC Zen 4/5, this project's machine since 2 Dec 2026),
**int4** on other CPUs with native bfloat16 instructions (``avx512_bf16`` or ``amx_bf16``);
**w7a8** on fbgemm where torch runs its AVX2 kernels (no AVX-512: :data:`CPU_AVX2_DEFAULT`, measured
on sessions 16 and 18's AVX2-only AMD EPYC Zen 3; int4 where torch lacks fbgemm); float32 on older CPUs. w8a8 is
the default there because its verify cost
hardly grows with the rows a forward scores (speculation's K + 1 positions and the batch of
sessions), where int4's grows about linearly: on the 2-core Sapphire Rapids VM the served w8a8 pair
gives 2.66x one client's tokens/s at 8 clients (int4 1.40x) and the same main-job speed
(docs/history/weight-formats.md, "Default format"); on the AMD EPYC (VNNI) the demo target's forward of
1 / 5 / 17 positions costs 0.071 / 0.098 / 0.199 CPU-s in w8a8, 0.065 / 0.175 / 0.478 in int4
(one thread). int4 stays the default without either, where oneDNN's int8 matmul is not measured
here. Exactness is per format: speculation equals the
target alone *in the same format*; int4 and w8a8 requantize the demo GGUF's Q4_K/Q6_K weights
and their text differs from float32's after a few tokens.

int8/int4/w8a8 weights are cached on disk next to the bfloat16 folder they come from
(:mod:`specdec.models.quant_cache`), so only the first load quantizes. At tensor parallelism
(deployments/tp_worker.py) each rank quantizes its own shard (int4 groups divide the local input
width), so TP=2 is not bitwise TP=1 in these formats.
"""

from __future__ import annotations

import os
from typing import Callable, get_args

import torch
from torch import nn

from specdec.models.cpu_features import cpu_flags  # noqa: F401 (re-exported)
from specdec.models.quant_linear import Int8WeightOnlyLinear, W8A8Linear  # noqa: F401 (re-exported)
from specdec.models.spec import WeightFormat

#: Every weight format, in README order.
WEIGHT_FORMATS: tuple[str, ...] = get_args(WeightFormat)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int8": torch.bfloat16, "int4": torch.bfloat16, "w8a8": torch.bfloat16, "w7a8": torch.bfloat16}

#: The formats whose linear layers are quantized (and cached: :mod:`specdec.models.quant_cache`).
QUANTIZED_FORMATS: tuple[str, ...] = ("int8", "int4", "w8a8", "w7a8")
#: The formats whose CPU linear layers are :class:`W8A8Linear` (int8 activations per token).
W8A8_FORMATS: tuple[str, ...] = ("w8a8", "w7a8")
#: The formats whose q/k/v and gate/up projections are fused (:mod:`specdec.models.fused`).
FUSED_FORMATS: tuple[str, ...] = ("int4",) + W8A8_FORMATS


def check_format(fmt: str) -> str:
    """Return ``fmt`` if it is a weight format, else raise ValueError naming the choices."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {', '.join(WEIGHT_FORMATS)}")
    return fmt


#: The environment variable that sets the format of every model that names none (:func:`env_format`).
FORMAT_ENV = "SPECDEC_WEIGHT_FORMAT"


def env_format(error: Callable[[str], Exception] = ValueError) -> str | None:
    """``$SPECDEC_WEIGHT_FORMAT`` as a weight format, or None when unset or blank: the one place
    that reads and checks the variable.

    Read case-insensitively, surrounding spaces dropped (``W7A8`` and `` w7a8 `` are ``w7a8``): the
    variable is typed by hand in shells and manifests. Every other place that takes a format name
    (``--target-format``, a spec's ``format``, ``AppConfig.target_dtype``, ``weight_format=``) takes
    the lower-case name exactly, and refuses another with the list of known formats.

    Every entry point (``specdec generate`` and ``prefetch``, ``specdec serve``'s checks,
    :func:`specdec.models.loader.load_model` / ``load_pair``) calls this first, whether or not a
    format is named for each model, so a set-but-invalid variable is refused the same way
    everywhere, not only where a default happens to be needed.

    Args:
        error: the exception type (or factory) raised with the message: each entry point's own
            error type, e.g. :class:`specdec.errors.SpecDecError` or ``ModelLoadError``.

    Raises:
        ValueError: (or ``error``) the variable names no weight format; the message names the
            variable, its value and the known formats.
    """
    raw = os.environ.get(FORMAT_ENV)
    if raw is None or not raw.strip():
        return None
    fmt = raw.strip().lower()
    if fmt not in WEIGHT_FORMATS:
        raise error(f"{FORMAT_ENV}={raw!r} is not a weight format; known formats: {', '.join(WEIGHT_FORMATS)}")
    return fmt


def compute_dtype(fmt: str) -> torch.dtype:
    """Activation (and unquantized parameter) dtype of a format: bfloat16 for int8/int4/w8a8/w7a8
    (w8a8 and w7a8 quantize activations to int8 inside their linear layers only)."""
    return _DTYPES[check_format(fmt)]


def storage_dtype(fmt: str) -> torch.dtype:
    """Dtype of the cached weights a format loads from: float32 for float32/float16 (float16 is
    cast on load), bfloat16 for bfloat16/int8/int4/w8a8/w7a8 (half the bytes; no float32 copy is built)."""
    return torch.float32 if check_format(fmt) in ("float32", "float16") else torch.bfloat16


#: The default format on a CPU with AMX-INT8 (``amx_int8``), or with AVX512-VNNI and native bfloat16
#: (the AMD EPYC of sessions 9-10, :func:`choose_cpu_format`): int8 weights and per-token int8
#: activations, whose cost hardly grows with the positions and rows of a forward (module docstring).
#: The name is historical (AMX was the first such CPU measured).
CPU_AMX_INT8_DEFAULT = "w8a8"
#: The default format on a CPU with native bfloat16 instructions (AVX512-BF16 or AMX-BF16) but no
#: AMX-INT8: the format measured fastest for one session's speculation on such instructions
#: (docs/history/weight-formats.md: int4 ahead of int8 and bfloat16).
CPU_BF16_DEFAULT = "int4"
#: /proc/cpuinfo flags that mean native bfloat16 matrix instructions.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
#: /proc/cpuinfo flag of Intel AMX's int8 tile multiply (oneDNN's int8 matmul runs on it).
AMX_INT8_CPU_FLAG = "amx_int8"
#: /proc/cpuinfo flag of AVX512-VNNI's u8 x s8 dot products (oneDNN's ``brg_matmul:avx512_core_vnni``
#: int8 matmul without AMX, e.g. AMD EPYC Zen 4/5). With native bfloat16 too, w8a8 is the default:
#: on the AMD EPYC of this project's machine since 2 Dec 2026 (AVX512-VNNI + AVX512-BF16, no AMX),
#: one thread, the demo target's forward of 1 / 5 / 17 positions took 0.071 / 0.098 / 0.199 CPU-s
#: in w8a8 against int4's 0.065 / 0.175 / 0.478 and float32's 0.344 / 0.706 / 1.107
#: (docs/bench/formats/PROFILE.md section 11).
VNNI_CPU_FLAG = "avx512_vnni"


def cpu_supports_bf16() -> bool:
    """Whether this CPU has native bfloat16 matrix instructions (AVX512-BF16 or AMX) for oneDNN:
    from ``/proc/cpuinfo``'s flags, else oneDNN's own check."""
    flags = cpu_flags()
    if flags:
        return bool(flags & BF16_CPU_FLAGS)
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


#: The default format where torch runs its AVX2 kernels (``get_cpu_capability() == "AVX2"``: no
#: AVX-512, so no VNNI and no native bfloat16; e.g. the AMD EPYC Zen 3 of sessions 12 and 16) and its
#: ``fbgemm`` quantized engine is present (x86 builds: :func:`~specdec.models.quant_linear.fbgemm_available`):
#: **w8a8** on fbgemm's int8 GEMM (:class:`W8A8Linear`, two 7-bit halves per row so that AVX2's
#: ``vpmaddubsw`` cannot saturate). Measured on session 16's Zen 3, the demo target loaded by the
#: engine (shape-invariant forward), one thread, 64-token context, seconds per forward of
#: 1 / 2 / 3 / 5 / 9 / 17 new positions (docs/bench/formats/avx2-s16/README.md):
#:
#: - w8a8 (fbgemm) 0.230 / 0.203 / 0.272 / 0.294 / 0.643 / 0.980 (profiled: ~0.16 s at one position,
#:   84 % in the int8 GEMM, which streams the 1.5 GB of int8 weights at ~11 GB/s)
#: - int4          0.287 / 0.297 / 0.304 / 0.623 / 1.006 / 1.384 (torch's AVX2 int4 kernel is compute-bound)
#:
#: and in ``specdec bench`` (32 tokens, code-prime, one thread, same run): target alone 3.87 tok/s in
#: w8a8, 2.19 in int4, 1.34 in float32. Session 12's measurements (int4 against int8, float32,
#: bfloat16, float16 and w8a8 on ``aten._int_mm``, 8-30x int4's cost per layer there):
#: docs/bench/formats/avx2-s12/README.md. Without fbgemm: :data:`CPU_AVX2_FALLBACK_DEFAULT`.
#:
#: Since session 18 **w7a8**: the same kernel in one pass per row (7-bit weights, module doc), the
#: demo target's forwards of 5 / 8 rows / 64 positions 1.31x / 1.48x / 1.72x faster than w8a8's, one
#: position about the same (Zen 3, 2 threads, docs/bench/formats/w7a8-s18/), at a small cost in
#: quality (module doc).
CPU_AVX2_DEFAULT = "w7a8"
#: The AVX2 default where torch has no fbgemm engine (w8a8 would run ``aten._int_mm``): int4, the
#: cheapest of the other formats there (session 12: one position 0.258 s, three 0.285 s, float32
#: 0.446 / 1.321; least memory; shape-invariant).
CPU_AVX2_FALLBACK_DEFAULT = "int4"
#: The draft's default where torch runs its AVX2 kernels: w7a8 as the target (since session 18; w8a8
#: before: the batched draft forwards of several sessions gain as the target's do), else int4. The 0.5B
#: demo draft's one-position step on session 16's Zen 3 (one / two threads): w8a8 0.0887 / 0.0807 s,
#: int4 0.1127 / 0.0882 (session 12: int4 0.0925 / 0.0568, int8 0.0980 / 0.0591, float32 0.135 /
#: 0.145). A draft only proposes (the target verifies), so its format changes acceptance, never the output.
CPU_AVX2_DRAFT_DEFAULT = "w7a8"


def _avx2_default(fmt: str, fbgemm: bool | None) -> str:
    from specdec.models.quant_linear import fbgemm_available

    if fbgemm is None:
        fbgemm = fbgemm_available()
    return fmt if fbgemm else CPU_AVX2_FALLBACK_DEFAULT


def choose_cpu_format(flags: frozenset[str] | set[str], capability: str, fbgemm: bool | None = None) -> str:
    """The CPU default for a CPU with these ``/proc/cpuinfo`` flags and this
    ``torch.backends.cpu.get_cpu_capability()`` (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``...):
    :data:`CPU_AMX_INT8_DEFAULT` (w8a8) when the CPU has AMX-INT8 (:data:`AMX_INT8_CPU_FLAG`), or
    AVX512-VNNI (:data:`VNNI_CPU_FLAG`) and native bfloat16, else :data:`CPU_BF16_DEFAULT` (int4) when it has native bfloat16 (a flag of
    :data:`BF16_CPU_FLAGS`), in both cases only where torch uses its AVX512 kernels; where torch uses
    its AVX2 kernels :data:`CPU_AVX2_DEFAULT` (w7a8 on fbgemm, measured on an AVX2-only AMD EPYC Zen 3)
    where ``fbgemm`` (default: whether this torch has the engine) else :data:`CPU_AVX2_FALLBACK_DEFAULT`
    (int4); else float32 (an AVX-512 CPU without bfloat16 or VNNI, or no AVX2: not measured here)."""
    cap = capability.upper()
    if cap.startswith("AVX2"):
        return _avx2_default(CPU_AVX2_DEFAULT, fbgemm)
    if not cap.startswith("AVX512"):
        return "float32"
    if AMX_INT8_CPU_FLAG in flags or (VNNI_CPU_FLAG in flags and set(flags) & BF16_CPU_FLAGS):
        return CPU_AMX_INT8_DEFAULT
    if set(flags) & BF16_CPU_FLAGS:
        return CPU_BF16_DEFAULT
    return "float32"


def default_format(device: str | torch.device = "cpu") -> str:
    """The format used when none is named: ``$SPECDEC_WEIGHT_FORMAT`` if set, else bfloat16 on
    CUDA, else :func:`choose_cpu_format` of this CPU (w8a8 on a CPU with AMX-INT8 such as
    Sapphire Rapids or with AVX512-VNNI and bfloat16 such as AMD EPYC Zen 4/5 and, on fbgemm, where torch runs
    its AVX2 kernels; int4 on other CPUs with native bfloat16; float32 on others).

    Raises:
        ValueError: ``$SPECDEC_WEIGHT_FORMAT`` is not a weight format (:func:`env_format`).
    """
    env = env_format()
    if env:
        return env
    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16"
    flags = cpu_flags() or (BF16_CPU_FLAGS if cpu_supports_bf16() else frozenset())
    return choose_cpu_format(flags, torch.backends.cpu.get_cpu_capability())


#: The draft's CPU default where the target's is w8a8 without AMX-INT8 (AVX512-VNNI + bfloat16, e.g.
#: the AMD EPYC of this project's machine): the 0.5B demo draft's one-position step is as cheap in int4
#: as in w8a8 on one thread and cheaper on two (0.0416 vs 0.0537 CPU-s, 0.0206 vs 0.0274 s wall per
#: drafted token, quiet; docs/bench/formats/PROFILE.md section 12): oneDNN's int8 matmul splits the
#: draft's 896-wide layers poorly over two threads. A draft only proposes (the target verifies), so
#: its format changes acceptance, never the output.
CPU_VNNI_DRAFT_DEFAULT = "int4"


def choose_draft_cpu_format(flags: frozenset[str] | set[str], capability: str, fbgemm: bool | None = None) -> str:
    """The draft's CPU default: :func:`choose_cpu_format`, except :data:`CPU_VNNI_DRAFT_DEFAULT`
    (int4) where that is w8a8 on a CPU without AMX-INT8 (on AMX, w8a8 as the target), and
    :data:`CPU_AVX2_DRAFT_DEFAULT` (w7a8; int4 without ``fbgemm``) where torch runs its AVX2 kernels."""
    if capability.upper().startswith("AVX2"):
        return _avx2_default(CPU_AVX2_DRAFT_DEFAULT, fbgemm)
    fmt = choose_cpu_format(flags, capability)
    if fmt == CPU_AMX_INT8_DEFAULT and AMX_INT8_CPU_FLAG not in flags:
        return CPU_VNNI_DRAFT_DEFAULT
    return fmt


def default_draft_format(device: str | torch.device = "cpu") -> str:
    """The format a draft gets when none is named (neither for it nor for its target):
    ``$SPECDEC_WEIGHT_FORMAT`` if set, else bfloat16 on CUDA, else :func:`choose_draft_cpu_format`
    of this CPU.

    Raises:
        ValueError: ``$SPECDEC_WEIGHT_FORMAT`` is not a weight format (:func:`env_format`).
    """
    env = env_format()
    if env:
        return env
    if torch.device(device).type == "cuda":
        return "bfloat16"
    flags = cpu_flags() or (BF16_CPU_FLAGS if cpu_supports_bf16() else frozenset())
    return choose_draft_cpu_format(flags, torch.backends.cpu.get_cpu_capability())


def _swap_int8_for_cpu(model: nn.Module, cls: type = Int8WeightOnlyLinear) -> int:
    """Replace every ``nn.Linear`` holding a torchao ``Int8Tensor`` by ``cls`` on its data and scales."""
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and isinstance(child.weight, Int8Tensor):
                w = child.weight
                setattr(parent, name, cls(w.qdata, w.scale, child.bias, compute_dtype("int8")))
                swapped += 1
    return swapped


#: int4 group sizes, in order of preference: a layer gets the first that divides its in_features
#: (a layer none divides stays bfloat16).
INT4_GROUP_SIZES: tuple[int, ...] = (128, 64, 32)


def _int4_group_size(in_features: int) -> int | None:
    for g in INT4_GROUP_SIZES:
        if in_features % g == 0:
            return g
    return None


def quantize(model: nn.Module, fmt: str) -> nn.Module:
    """Quantize ``model``'s linear layers in place to ``fmt`` (no-op for float formats).

    The model must already hold bfloat16 weights (load it with :func:`compute_dtype`).

    Returns:
        the same model.

    Raises:
        ValueError: unknown format.
        ModelLoadError: torchao is missing.
    """
    check_format(fmt)
    if fmt not in QUANTIZED_FORMATS:
        return model
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    except ImportError as e:  # pragma: no cover - torchao is a dependency
        from specdec.errors import ModelLoadError

        raise ModelLoadError(f"weight format {fmt} needs torchao: {e}") from e
    device = next(model.parameters()).device
    if fmt == "int8":
        quantize_(model, Int8WeightOnlyConfig())
        if device.type == "cpu":
            _swap_int8_for_cpu(model)
        return model
    if fmt in W8A8_FORMATS:
        # w7a8: torchao's reduce_range quantizes the weights to -64..63 (its activation range is not
        # used on CPU: W8A8Linear quantizes the activations to int8 itself)
        quantize_(model, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False,
                                                                reduce_range=fmt == "w7a8"))
        if device.type == "cpu":
            _swap_int8_for_cpu(model, W8A8Linear)
        return model
    if device.type == "cpu":
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig as Int4Config

        make = lambda g: Int4Config(group_size=g)  # noqa: E731
    else:
        from torchao.quantization import Int4WeightOnlyConfig as Int4Config

        make = lambda g: Int4Config(group_size=g)  # noqa: E731
    by_group: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            g = _int4_group_size(module.in_features)
            if device.type == "cpu" and module.out_features % 16:
                g = None  # the CPU int4 packing needs the output rows in multiples of 16: stays bfloat16
            if g is not None:
                by_group.setdefault(g, []).append(name)
    for g, names in by_group.items():
        wanted = set(names)
        quantize_(model, make(g), filter_fn=lambda m, fqn, w=wanted: fqn in w)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (quantized data included; a tied tensor once)."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        inner = [getattr(t, n) for n in getattr(t, "tensor_data_names", [])]
        for x in inner or [t]:
            if x is None:
                continue
            key = x.untyped_storage().data_ptr() if x.device.type != "meta" else id(x)
            if key in seen:
                continue
            seen.add(key)
            total += x.untyped_storage().nbytes()

    for p in model.parameters():
        add(p)
    for b in model.buffers():
        add(b)
    for m in model.modules():
        if isinstance(m, W8A8Linear) and m.prepacked:  # oneDNN's copy: one byte per weight
            total += m.in_features * m.out_features
    return total
