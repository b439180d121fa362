"""Prepacked w8a8 weights on 2 MiB pages (specdec/models/hugepages.py): moved where the kernel
can, results bitwise the same as on 4 KiB pages."""

from __future__ import annotations

import mmap
import platform

import torch

from specdec.models.hugepages import HUGE_PAGE, anon_huge_bytes, collapse, thp_mode
from specdec.models.quant_linear import W8A8Linear


def _collapse_works() -> bool:
    """THP on (``always`` or ``madvise``) and MADV_COLLAPSE in the kernel (Linux 6.1+)."""
    major, minor = (int(p) for p in platform.release().split(".")[:2])
    return thp_mode() in ("always", "madvise") and (major, minor) >= (6, 1)


def _layer(out: int, inp: int, seed: int) -> W8A8Linear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (out, inp), generator=g, dtype=torch.int8)
    return W8A8Linear(w, torch.rand(out, generator=g) / 100 + 1e-3, torch.randn(out, generator=g))


def test_prepacked_weight_moves_onto_huge_pages_and_computes_the_same(monkeypatch, onednn_int8_prepack):
    """A 6 MiB prepacked weight is collapsed where THP and MADV_COLLAPSE exist (whole, its range
    widened to huge pages, or where that leaves its mapping the huge pages wholly inside it), and the layer's rows equal bitwise those of the same layer left on 4 KiB pages."""
    x = torch.randn(5, 1536, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    monkeypatch.setattr(W8A8Linear, "HUGEPAGES", False)
    plain = _layer(4096, 1536, seed=1)
    assert plain.prepack() and plain._huge_bytes == 0
    monkeypatch.setattr(W8A8Linear, "HUGEPAGES", True)
    huge = _layer(4096, 1536, seed=1)
    assert huge.prepack()
    ptr, n = torch.ops.mkldnn.data_ptr(huge._packed), torch.ops.mkldnn._nbytes(huge._packed)
    assert n >= 4096 * 1536  # the weight in oneDNN's blocked layout (plus its compensation terms)
    if _collapse_works():
        # all of it (widened to huge pages inside its mapping), else the huge pages wholly inside it
        assert huge._huge_bytes == n or huge._huge_bytes == (ptr + n) // HUGE_PAGE * HUGE_PAGE - -(-ptr // HUGE_PAGE) * HUGE_PAGE
        assert huge._huge_bytes >= 2 * HUGE_PAGE
        assert anon_huge_bytes(ptr, n) >= huge._huge_bytes // HUGE_PAGE * HUGE_PAGE
    else:
        assert huge._huge_bytes == 0
    with torch.inference_mode():
        assert torch.equal(huge(x), plain(x))


def test_collapse_of_nothing_or_of_a_file_mapping_moves_nothing(tmp_path):
    """Zero bytes move nothing; a read-only file mapping (as safetensors weights) is not anonymous
    memory and stays on its pages."""
    assert collapse(0, 0) == 0
    f = tmp_path / "w.bin"
    f.write_bytes(b"\1" * (3 * HUGE_PAGE))
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        t = torch.frombuffer(mm, dtype=torch.uint8)
        assert collapse(t.data_ptr(), t.numel()) == 0
        assert anon_huge_bytes(t.data_ptr(), t.numel()) == 0
        del t
