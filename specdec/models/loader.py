"""Load a model spec into a :class:`LoadedModel`, and a pair with its compatibility check.

Every kind ends in the same code path, ``from_pretrained(folder)`` on a Hugging Face folder:

- ``hf``: the folder itself;
- ``demo``: the folder :func:`specdec.models.demo.ensure_demo_folder` builds once per cache;
- ``gguf``: with ``cache_gguf=True`` (default) the folder converted once and cached under
  ``<cache>/gguf/<sha256>/`` (:func:`specdec.models.convert.cached_gguf_folder`); with
  ``cache_gguf=False`` transformers dequantizes the file on every load and nothing is written.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specdec.errors import ModelLoadError
from specdec.models import cache, convert, demo
from specdec.models.loaded import LoadedModel
from specdec.models.spec import (
    DemoModelSpec,
    GGUFModelSpec,
    HFModelSpec,
    ModelPairSpec,
    ModelSpec,
    parse_model_spec,
)
from specdec.models.vocab import check_pair_compatible

log = logging.getLogger(__name__)


def load_model(
    spec: ModelSpec,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_gguf: bool = True,
) -> LoadedModel:
    """Load the model and tokenizer a spec names, in eval mode, on ``device``.

    Args:
        spec: what to load.
        dtype: parameter dtype (default float32; GGUF weights are dequantized to it).
        device: torch device for the parameters.
        cache_gguf: for a GGUF spec, convert once and load the cached HF folder (see module doc).

    Returns:
        A :class:`LoadedModel`; ``name`` is e.g. ``"demo target (Qwen2.5-Coder-1.5B-Instruct)"``,
        ``"SmolLM2-135M-Instruct.Q4_1.gguf"`` or ``"<model name> (<folder>)"``.

    Raises:
        ModelLoadError: the path is missing or unreadable, a demo package is missing, a sha256 does
            not match, or transformers cannot load the model.
    """
    t0 = time.perf_counter()
    if isinstance(spec, DemoModelSpec):
        info = demo.demo_model(spec.role)
        loaded = _load_folder(demo.ensure_demo_folder(spec.role), f"demo {spec.role} ({info.model_name})",
                              dtype, device)
    elif isinstance(spec, GGUFModelSpec):
        path = Path(spec.path).expanduser()
        if cache_gguf:
            loaded = _load_folder(convert.cached_gguf_folder(path), path.name, dtype, device)
        else:
            if not path.is_file():
                raise ModelLoadError(f"GGUF file {path} does not exist")
            model, tokenizer = convert.load_gguf(path, dtype)
            loaded = _wrap(path.name, model.to(device), tokenizer)
    elif isinstance(spec, HFModelSpec):
        folder = Path(spec.path).expanduser()
        marker = cache.read_marker(folder)
        name = f"{marker['name']} ({folder})" if marker and marker.get("name") else str(folder)
        loaded = _load_folder(folder, name, dtype, device)
    else:
        raise TypeError(f"not a model spec: {spec!r}")
    log.info("loaded %s in %.1f s (%d positions, %d vocab rows)", loaded.name, time.perf_counter() - t0,
             loaded.max_positions, loaded.vocab_rows)
    return loaded


def load_pair(
    pair: ModelPairSpec,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[LoadedModel, LoadedModel | None]:
    """Load ``(target, draft)`` (draft None when the pair has none) and check they fit together.

    Raises:
        ModelLoadError: either model cannot be loaded.
        ModelCompatibilityError: the draft's vocabulary or special ids differ from the target's.
    """
    target = load_model(pair.target, dtype=dtype, device=device)
    if pair.draft is None:
        return target, None
    draft = load_model(pair.draft, dtype=dtype, device=device)
    check_pair_compatible(draft, target)
    return target, draft


def resolve_folder(spec_text: str) -> str:
    """The Hugging Face folder model spec ``spec_text`` loads from, without loading weights.

    A demo role is assembled into the cache once, a GGUF file converted once and cached (the
    folder :func:`load_model` would load); an HF folder is itself. Tensor-parallel loading and
    the serving layer's tokenizer/config reads need a folder.

    Raises:
        ModelLoadError: a demo package is missing, a sha256 does not match, or the GGUF file
            cannot be converted.
    """
    spec = parse_model_spec(spec_text)
    if isinstance(spec, DemoModelSpec):
        return str(demo.ensure_demo_folder(spec.role))
    if isinstance(spec, GGUFModelSpec):
        return str(convert.cached_gguf_folder(Path(spec.path).expanduser()))
    return str(Path(spec.path).expanduser())


def _load_folder(folder: Path, name: str, dtype: torch.dtype, device: str | torch.device) -> LoadedModel:
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"cannot load model {name}: {e}") from e
    return _wrap(name, model.to(device), tokenizer)


def _wrap(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> LoadedModel:
    model.eval()
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        max_positions=int(model.config.max_position_embeddings),
        vocab_rows=int(model.get_output_embeddings().weight.shape[0]),
    )
