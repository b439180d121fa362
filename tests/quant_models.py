"""Helpers of the weight-cache tests (``test_quant_cache.py``, ``test_release.py``): a tiny model
folder marked as a cached conversion, loading it in a weight format, and its logits over one
fixed prompt. Not a test module."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.models import cache
from specdec.models.loader import load_model
from specdec.models.spec import HFModelSpec
from specdec.testing.tiny import build_tiny_model

#: The prompt whose logits the tests compare (token ids of the tiny vocabulary).
PROMPT = [1, 5, 9, 33, 70, 100, 7, 8, 250, 3, 44, 12]


def marked_tiny_model(tmp_path: Path, monkeypatch, source_sha256: str, **tiny) -> Path:
    """A tiny bfloat16 model folder (seed 3, ``tiny`` passed to :func:`build_tiny_model`) with the
    cache marker the demo/GGUF conversions write (``source_sha256``, name ``tiny``), with
    ``SPECDEC_CACHE`` under ``tmp_path`` and ``SPECDEC_QUANT_CACHE`` unset."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDEC_QUANT_CACHE", raising=False)
    folder = build_tiny_model(tmp_path / "tiny-bfloat16", seed=3, **tiny)
    cache.write_marker(folder, source_sha256=source_sha256, name="tiny", dtype="bfloat16")
    return folder


def load(folder: Path, fmt: str):
    """``folder`` loaded in weight format ``fmt`` (:func:`specdec.models.loader.load_model`)."""
    return load_model(HFModelSpec(path=folder), weight_format=fmt)


@torch.no_grad()
def logits(loaded) -> torch.Tensor:
    """``[len(PROMPT), vocab]`` logits of ``loaded``'s model over :data:`PROMPT`."""
    return loaded.model(torch.tensor([PROMPT])).logits[0]


def int4_narrow_qkv_fuses() -> bool:
    """Whether the tiny models' int4 q/k/v projections (k/v of 32 output rows at hidden 64) fuse
    on this CPU. The load fuses only what concatenates bitwise (specdec.models.fused): torch's CPU
    int4 packing works in blocks of 64 output rows with AVX-512 kernels, so a 32-row part does not
    concatenate and q/k/v stay separate; with AVX2 kernels (the AVX2-only AMD EPYC Zen 3 of 2 Dec
    2026) they concatenate and fuse. Gate/up (128 rows) fuse on both."""
    import torch

    return not torch.backends.cpu.get_cpu_capability().startswith("AVX512")
