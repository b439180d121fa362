"""Where a model spec's Hugging Face folder is once it is built, found without torch.

:func:`specdec.models.loader.resolve_folder` builds a missing folder (assembling and converting a
GGUF needs torch and transformers' model code). A process that holds no model (the serving
layer's router and target replicas: they read the target's tokenizer and config files, or hand
the folder to the TP ranks) asks :func:`built_folder` first, which only reads the cache's marker
files, and calls ``resolve_folder`` when it answers None (a cold cache).

The rules are those of the builders, restated without torch dtypes: the cached weights' dtype of
a format (:func:`storage_dtype_name`, as :func:`specdec.models.formats.storage_dtype`) and a
folder's dtype suffix (:func:`dtype_suffix`, as :func:`specdec.models.convert.folder_suffix`);
``tests/test_folders.py`` checks both against the torch versions for every format.
"""

from __future__ import annotations

from pathlib import Path

from specdec.models import cache
from specdec.models.demo_models import demo_model
from specdec.models.spec import DemoModelSpec, GGUFModelSpec, WeightFormat, parse_model_spec

#: Formats whose cache folder holds float32 weights (the others load from bfloat16).
FLOAT32_STORED = ("float32", "float16")


def storage_dtype_name(fmt: WeightFormat | str) -> str:
    """Name of the dtype a format's cached weights are stored in: ``"float32"`` for float32 and
    float16 (cast on load), ``"bfloat16"`` for bfloat16, int8, int4 and w8a8.

    Raises:
        ValueError: ``fmt`` is not a weight format.
    """
    from typing import get_args

    if fmt not in get_args(WeightFormat):
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {', '.join(get_args(WeightFormat))}")
    return "float32" if fmt in FLOAT32_STORED else "bfloat16"


def dtype_suffix(dtype_name: str) -> str:
    """Suffix of a cache folder holding weights of dtype ``dtype_name``: ``""`` for float32, else
    ``"-bfloat16"`` etc."""
    return "" if dtype_name == "float32" else "-" + dtype_name


def built_folder(spec_text: str, weight_format: str | None, root: Path | None = None) -> str | None:
    """The folder ``resolve_folder(spec_text, weight_format)`` returns, if it needs no building.

    - ``hf:`` / a folder path: the folder itself (as ``resolve_folder``; not checked here).
    - ``demo:<role>``: ``<root>/demo/<role><suffix>`` when its marker names the demo model's sha256.
    - a GGUF file: ``<root>/gguf/<sha256><suffix>`` when complete (the file is hashed, as
      ``resolve_folder`` does on every call: about 1 s per GB).

    Args:
        spec_text: a model spec (:func:`specdec.models.spec.parse_model_spec`).
        weight_format: the format it is served in; None (the machine's default format, which
            needs torch to decide) answers None.
        root: cache folder (default :func:`specdec.models.cache.cache_root`).

    Returns:
        the folder as a string, or None when it is not built yet (or the format is not given):
        call ``resolve_folder``, which builds it or raises ModelLoadError.

    Raises:
        ModelLoadError / InvalidRequestError: the spec text is not a model spec.
    """
    if weight_format is None:
        return None
    spec = parse_model_spec(spec_text)
    suffix = dtype_suffix(storage_dtype_name(weight_format))
    root = root or cache.cache_root()
    if isinstance(spec, DemoModelSpec):
        model = demo_model(spec.role)
        dest = root / "demo" / (model.role + suffix)
        return str(dest) if cache.is_complete(dest, model.sha256) else None
    if isinstance(spec, GGUFModelSpec):
        path = Path(spec.path).expanduser()
        if not path.is_file():
            return None
        sha = cache.sha256_file(path)
        dest = root / "gguf" / (sha + suffix)
        return str(dest) if cache.is_complete(dest, sha) else None
    return str(Path(spec.path).expanduser())
