"""Convert a GGUF file once into a fast-loading Hugging Face folder, and cache the result.

transformers reads GGUF by dequantizing every tensor (about 30 s for a 1.5B model on 2 cores),
and a model loaded that way refuses ``save_pretrained``. :func:`convert_gguf` therefore writes
the pieces itself:

- ``model.safetensors``: the fp32 weights via ``safetensors.torch.save_model`` (which drops the
  duplicate name of tied embeddings that ``save_file`` would refuse);
- ``config.json``: the config without the GGUF ``quantization_config`` (the weights are plain
  fp32 now), so ``from_pretrained(folder)`` loads them as they are;
- ``generation_config.json``: BOS/EOS/pad ids only; the EOS list is the GGUF's EOS plus its
  end-of-turn/end-of-message ids (llama.cpp stops on all of them), or ``eos_token_ids`` given
  by the caller;
- the tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``);
- ``specdec.json``: the marker naming the source sha256, written last (see
  :mod:`specdec.models.cache`).

:func:`cached_gguf_folder` keys such folders by the GGUF's sha256 under ``<cache>/gguf/``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Sequence

import torch

from specdec.errors import ModelLoadError
from specdec.models import cache

log = logging.getLogger(__name__)

#: GGUF metadata keys of extra end-of-generation tokens besides ``tokenizer.ggml.eos_token_id``.
_EXTRA_EOS_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def gguf_extra_eos_ids(gguf_path: Path) -> list[int]:
    """End-of-turn / end-of-message token ids recorded in a GGUF's metadata (often none)."""
    from gguf import GGUFReader  # local: reading metadata maps the file

    reader = GGUFReader(str(gguf_path))
    ids = []
    for key in _EXTRA_EOS_KEYS:
        field = reader.get_field(key)
        if field is not None:
            ids.append(int(field.contents()))
    return ids


def load_gguf(gguf_path: Path, dtype: torch.dtype = torch.float32):
    """Load ``(model, tokenizer)`` from a GGUF file through transformers (slow: dequantizes).

    Raises:
        ModelLoadError: transformers cannot read the file (unsupported architecture, truncated...).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"cannot load GGUF file {gguf_path}: {e}") from e
    return model.eval(), tokenizer


def convert_gguf(
    gguf_path: Path,
    dest: Path,
    *,
    sha256: str,
    name: str,
    eos_token_ids: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write the HF folder ``dest`` from ``gguf_path``; call it while holding dest's lock.

    Builds in a temporary sibling and publishes it with one rename (see
    :func:`specdec.models.cache.publish`). transformers dequantizes one tensor at a time and
    casts it to ``dtype`` at once, so peak memory is the model in ``dtype`` plus one float32
    tensor (1.5B demo target: about 6.2 GB in float32, 3.1 GB in bfloat16).

    Args:
        gguf_path: the source GGUF file.
        dest: the folder to create (an old one there is replaced).
        sha256: hex sha256 of ``gguf_path``, recorded in the marker (not recomputed).
        name: human-readable model name, recorded in the marker.
        eos_token_ids: ids that end a generation; default: the GGUF's EOS plus end-of-turn ids.
        dtype: dtype of the written weights (float32 or bfloat16).

    Raises:
        ModelLoadError: transformers cannot read the GGUF file.
    """
    from safetensors.torch import save_model

    t0 = time.perf_counter()
    model, tokenizer = load_gguf(gguf_path, dtype)
    t_load = time.perf_counter() - t0
    tmp = cache.temp_sibling(dest)
    tmp.mkdir(parents=True)
    try:
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", 0o644)  # safetensors creates it owner-only
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        gen = model.generation_config
        if eos_token_ids is None:
            eos_token_ids = [config.eos_token_id] if config.eos_token_id is not None else []
            eos_token_ids += [i for i in gguf_extra_eos_ids(gguf_path) if i not in eos_token_ids]
        gen.eos_token_id = list(eos_token_ids) if len(eos_token_ids) != 1 else int(eos_token_ids[0])
        gen._from_model_config = False  # else generate() may rebuild it from config (one EOS)
        gen.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        cache.write_marker(tmp, source_sha256=sha256, source=gguf_path.name, name=name, dtype=str(dtype).removeprefix("torch."))
        cache.publish(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    del model
    log.info("converted %s to %s (GGUF load %.1f s, total %.1f s)", gguf_path, dest, t_load,
             time.perf_counter() - t0)


def folder_suffix(dtype: torch.dtype) -> str:
    """Suffix of a cache folder holding weights in ``dtype``: ``""`` for float32, else ``"-bfloat16"`` etc."""
    return "" if dtype == torch.float32 else "-" + str(dtype).removeprefix("torch.")


def cached_gguf_folder(gguf_path: Path, *, root: Path | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """The HF folder converted from ``gguf_path``, converting it on first use.

    The entry is ``<root>/gguf/<sha256><suffix>/`` where sha256 is the file's digest (computed on
    every call: about 1 s per GB), so a changed file never reuses a stale conversion, and the
    suffix names the dtype of its weights (:func:`folder_suffix`).

    Raises:
        ModelLoadError: the file is missing or transformers cannot read it.
    """
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {gguf_path} does not exist")
    root = root or cache.cache_root()
    sha = cache.sha256_file(gguf_path)
    dest = root / "gguf" / (sha + folder_suffix(dtype))
    if cache.is_complete(dest, sha):
        return dest
    with cache.file_lock(root / "locks" / f"gguf-{sha[:16]}{folder_suffix(dtype)}.lock"):
        if not cache.is_complete(dest, sha):
            cache.remove_stale_temps(dest)
            convert_gguf(gguf_path, dest, sha256=sha, name=gguf_path.name, dtype=dtype)
    return dest
