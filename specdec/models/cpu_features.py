"""What this CPU offers the weight formats: its ``/proc/cpuinfo`` flags, and whether oneDNN's
int8 matmul sums u8 x s8 products exactly on it.

Kept apart from :mod:`specdec.models.formats` (which chooses defaults from these) so that the
quantized layers (:mod:`specdec.models.quant_linear`) can ask without an import cycle.
"""

from __future__ import annotations

import functools

#: /proc/cpuinfo flags of int8 dot-product instructions that add u8 x s8 products straight into
#: int32 lanes: AVX512-VNNI (``vpdpbusd``; AMD EPYC Zen 4/5, Intel since Cascade Lake), AVX-VNNI
#: (the same on 256-bit registers; Intel Alder Lake and later) and AMX-INT8 (tile multiply, Intel
#: Sapphire Rapids and later). Without one of them oneDNN's x86 int8 kernels (``avx2`` or
#: ``avx512_core`` without VNNI) multiply with ``vpmaddubsw``, which adds each pair of adjacent
#: u8 x s8 products into an int16 with saturation: a pair of large codes (255 * 127 * 2 = 64,770 >
#: 32,767) is clipped, so the sums are not the exact int32 ones (measured on an AVX2-only AMD EPYC
#: Zen 3, 2 Dec 2026: outputs up to 15 % of the largest output away from ``aten._int_mm``'s;
#: docs/bench/batching/PROFILE-s12.md section 1; Intel's note on the int16 saturation of
#: ``vpmaddubsw`` is the reason oneDNN documents 7-bit activations for such CPUs).
EXACT_INT8_CPU_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (the first ``flags`` line); empty when the
    file is missing or has none (not Linux, some containers)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def onednn_int8_exact(flags: frozenset[str] | set[str]) -> bool:
    """Whether oneDNN's u8 x s8 int8 matmul sums products exactly (in int32) on a CPU with these
    flags: it has one of :data:`EXACT_INT8_CPU_FLAGS`. Unknown flags (empty) count as not exact."""
    return bool(set(flags) & EXACT_INT8_CPU_FLAGS)


@functools.cache
def this_cpu_onednn_int8_exact() -> bool:
    """:func:`onednn_int8_exact` of this machine's :func:`cpu_flags` (read once per process)."""
    return onednn_int8_exact(cpu_flags())
