"""Weights on 2 MiB pages: fewer TLB misses while a decode step streams them (Linux).

A one-position decode step of a quantized model reads every weight once, ~1.5 GB for the w8a8
demo target, from memory on 4 KiB pages: one TLB entry per 4 KiB, and in a virtual machine each
miss walks two page tables (guest and host). Transparent huge pages back the same memory with
2 MiB pages. The kernel does this only for memory advised ``MADV_HUGEPAGE`` where THP is in
``madvise`` mode (the default of many distributions, this VM's included), and PyTorch advises only
with ``THP_MEM_ALLOC_ENABLE=1`` set before it starts, for every allocation of 2 MiB or more
(activations too, whose fresh huge pages then cost page clearing in every prefill: measured slower).

:func:`collapse` advises one weight buffer's range and asks the kernel to move it onto huge pages
now (``MADV_COLLAPSE``, Linux 6.1+: synchronous, independent of the THP sysfs mode unless THP is
``never``). It is used on oneDNN's prepacked w8a8 weights
(:meth:`specdec.models.quant_linear.W8A8Linear.prepack`): anonymous memory of ours. Memory mapped
from a file (the float32 and bfloat16 formats' safetensors) cannot be collapsed (EINVAL; no
read-only file THP for these filesystems) and is left alone. The contents never change (the
kernel copies the 4 KiB pages into the huge page), so results are bitwise the same.

Measured (demo target w8a8, one thread, the int8 matmuls of even layers collapsed against odd
layers not, alternating in one process, 2-core Sapphire Rapids VM, load ~17): 4-10 % less CPU time
(docs/bench/formats/PROFILE.md section 10).
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

#: Huge page size on x86-64 (PMD size), bytes.
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL("libc.so.6", use_errno=True)
            lib.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            _libc = lib
        except (OSError, AttributeError):  # not glibc
            _libc = False
    return _libc


def thp_mode(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str | None:
    """The kernel's THP mode (``"always"``, ``"madvise"`` or ``"never"``; the bracketed word of
    ``path``), or None when the file is missing (not Linux, no THP)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def collapse(ptr: int, nbytes: int) -> int:
    """Advise ``[ptr, ptr + nbytes)`` ``MADV_HUGEPAGE`` and collapse it onto 2 MiB pages.

    The range is widened to whole huge pages (the neighbouring bytes of the same mapping move
    with it, unchanged); where the widened range leaves the mapping (the kernel answers ENOMEM
    or EINVAL), the huge pages lying wholly inside the buffer are tried instead. Failures (no
    huge page free, THP ``never``, file-backed memory, not Linux) leave the memory as it was.

    Args:
        ptr: address of the first byte (an int, e.g. ``torch.ops.mkldnn.data_ptr(t)``).
        nbytes: length in bytes.

    Returns:
        bytes of the buffer now on huge pages as far as the kernel reported success (0 when
        nothing was collapsed).
    """
    libc = _madvise()
    if not libc or not sys.platform.startswith("linux") or nbytes <= 0:
        return 0
    outer = (ptr // HUGE_PAGE * HUGE_PAGE, -(-(ptr + nbytes) // HUGE_PAGE) * HUGE_PAGE)
    inner = (-(-ptr // HUGE_PAGE) * HUGE_PAGE, (ptr + nbytes) // HUGE_PAGE * HUGE_PAGE)
    for lo, hi in (outer, inner):
        if hi <= lo:
            continue
        if libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0 and libc.madvise(lo, hi - lo, _MADV_COLLAPSE) == 0:
            return min(hi, ptr + nbytes) - max(lo, ptr)
    return 0


def anon_huge_bytes(ptr: int, nbytes: int) -> int:
    """Bytes of ``AnonHugePages`` in the mappings of this process that overlap the range (from
    ``/proc/self/smaps``; 0 off Linux). A check of :func:`collapse`, per mapping, not per byte."""
    total = 0
    hit = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(a, 16) for a in head.split("-"))
                    hit = lo < ptr + nbytes and ptr < hi
                elif hit and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total
