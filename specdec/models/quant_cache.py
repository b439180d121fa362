"""A disk cache of int8/int4/w8a8 weights, so a warm start does not quantize again.

Quantizing the demo target at load takes 12-23 s on the 2-core CPU (torchao, every linear
layer); reading the quantized tensors back takes about a second. :func:`quantize_cached` does
what :func:`specdec.models.formats.quantize` does, but for a model loaded from a *cached* folder
(one whose cache marker names the digest of its source: the demo folders, converted GGUF files)
it stores the quantized linear layers next to that folder and loads them on the next start:

    <folder without "-bfloat16">-<format>[-tp<n>-rank<r>]/
        quantized.pt      torch.save of {fqn: {"kind": ..., tensors}} (see below)
        specdec.json      the cache marker, written last; its ``key`` names what the tensors
                          were made from and with what

The key is the format, the int4 group sizes, the torch and torchao versions, the device type,
the TP rank and degree, the variant (a draft's vocabulary subset slices the output layer before
quantizing: its own entry), and the source folder's marker digest and dtype
(:func:`cache_key`). A cache entry whose key differs (torchao upgraded, a new GGUF) or whose
file does not load or does not fit the model (corrupt, truncated, another architecture) is
rebuilt, with one log line saying why. Folders without a marker (a user's own HF folder, a tiny
test model) are quantized at every load and nothing is written, unless the caller asks for a
cache anyway (``use_cache=True``).

What is stored per quantized layer (``fqn`` = the module's dotted name):

- ``{"kind": "int8pack", "qweight": [out, in] int8, "scale": [out] bfloat16, "bias": [out] or None}``:
  a :class:`specdec.models.formats.Int8WeightOnlyLinear` (int8 on CPU);
- ``{"kind": "w8a8", "qweight": [out, in] int8, "scale": [out] float32, "bias": [out] or None}``:
  a :class:`specdec.models.formats.W8A8Linear` (w8a8 on CPU);
- ``{"kind": "weight", "weight": tensor}``: an ``nn.Linear`` whose weight is a torchao tensor
  subclass (int4's ``Int4OpaqueTensor`` on CPU; int8/int4 torchao tensors on a GPU); the
  subclass is saved whole and loaded with ``torch.load(weights_only=True)``, which torchao's
  tensors support.

Unquantized parameters (embeddings, norms, biases, layers whose width no int4 group divides)
come from the bfloat16 folder as before. The restored model is bitwise the model a fresh
quantization gives (tests/test_quant_cache.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from specdec.models import cache, formats
from specdec.models.release import release_freed_memory as _release_freed_memory
from specdec.models.release import release_source_file  # noqa: F401 - the load paths' step, kept importable here

log = logging.getLogger(__name__)

#: Name of the tensor file inside a quantized cache entry.
TENSORS = "quantized.pt"
#: Version of the stored layout; entries of another layout are rebuilt.
LAYOUT = 1


def _torchao_version() -> str:
    try:
        import torchao

        return str(torchao.__version__)
    except ImportError:  # pragma: no cover - torchao is a dependency
        return "none"


def cache_key(folder: Path, fmt: str, device: torch.device, rank: int = 0, tp_size: int = 1,
              variant: str | None = None) -> dict | None:
    """What a quantized cache entry of ``folder`` in ``fmt`` must have been made from and with.

    Returns:
        a JSON-able dict, or None when ``folder`` has no cache marker (nothing to key on).
    """
    marker = cache.read_marker(folder)
    if marker is None or not marker.get("source_sha256"):
        return None
    return {
        "layout": LAYOUT,
        "format": fmt,
        "int4_group_sizes": list(formats.INT4_GROUP_SIZES) if fmt == "int4" else None,
        "torch": torch.__version__,
        "torchao": _torchao_version(),
        "device": torch.device(device).type,
        "tp": [rank, tp_size],
        "source_sha256": marker["source_sha256"],
        "source_dtype": marker.get("dtype", "float32"),
        "variant": variant,
    }


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def cache_folder(folder: Path, fmt: str, rank: int = 0, tp_size: int = 1, variant: str | None = None) -> Path:
    """Where the quantized entry of ``folder`` lives: a sibling named after it, the format, the TP
    placement and the variant (e.g. a draft's vocabulary subset, whose output layer is sliced)."""
    stem = folder.name.removesuffix("-bfloat16")
    tp = f"-tp{tp_size}-rank{rank}" if tp_size > 1 else ""
    var = f"-{variant}" if variant else ""
    return folder.with_name(f"{stem}-{fmt}{tp}{var}")


def quantized_state(model: nn.Module) -> dict[str, dict]:
    """The quantized linear layers of ``model`` as ``{fqn: {"kind": ..., tensors}}`` (see module doc)."""
    out: dict[str, dict] = {}
    for name, module in model.named_modules():
        if isinstance(module, (formats.Int8WeightOnlyLinear, formats.W8A8Linear)):
            if isinstance(module, formats.W8A8Linear) and module.prepacked:
                raise RuntimeError(f"{name}: the w8a8 weight is only in its kernel's prepacked form (the layer "
                                   "has run); store a model before its first forward")
            kind = "w8a8" if isinstance(module, formats.W8A8Linear) else "int8pack"
            out[name] = {"kind": kind, "qweight": module.qweight, "scale": module.scale,
                         "bias": None if module.bias is None else module.bias.data}
        elif isinstance(module, nn.Linear) and type(module.weight.data) is not torch.Tensor:
            out[name] = {"kind": "weight", "weight": module.weight.data}
    return out


def _check_fits(model: nn.Module, state: dict[str, dict]) -> None:
    """Raise ValueError unless every stored layer names a linear layer of ``model`` of its shape."""
    modules = dict(model.named_modules())
    if not state:
        raise ValueError("no quantized layers stored")
    for name, entry in state.items():
        m = modules.get(name)
        if not isinstance(m, nn.Linear):
            raise ValueError(f"{name} is not a linear layer of this model")
        if entry.get("kind") in ("int8pack", "w8a8"):
            shape = tuple(entry["qweight"].shape)
            if entry["qweight"].dtype != torch.int8:
                raise ValueError(f"{name}: qweight is {entry['qweight'].dtype}, not int8")
        elif entry.get("kind") == "weight":
            shape = tuple(entry["weight"].shape)
        else:
            raise ValueError(f"{name}: unknown kind {entry.get('kind')!r}")
        if shape != (m.out_features, m.in_features):
            raise ValueError(f"{name}: stored shape {shape}, model has {(m.out_features, m.in_features)}")


def apply_state(model: nn.Module, state: dict[str, dict], act_dtype: torch.dtype = torch.bfloat16) -> None:
    """Put stored quantized layers into ``model`` (bfloat16 linears replaced in place).

    Raises:
        ValueError: ``state`` does not fit ``model`` (checked before anything is changed).
    """
    _check_fits(model, state)
    modules = dict(model.named_modules())
    for name, entry in state.items():
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        old = modules[name]
        if entry["kind"] in ("int8pack", "w8a8"):
            cls = formats.W8A8Linear if entry["kind"] == "w8a8" else formats.Int8WeightOnlyLinear
            setattr(parent, child, cls(entry["qweight"], entry["scale"], entry["bias"], act_dtype))
        else:
            old.weight = nn.Parameter(entry["weight"], requires_grad=False)


def quantize_cached(model: nn.Module, fmt: str, folder: Path | None, *, rank: int = 0, tp_size: int = 1,
                    use_cache: bool | None = None, variant: str | None = None) -> str:
    """Quantize ``model`` (bfloat16, loaded from ``folder``) to ``fmt``, through the disk cache.

    Args:
        model: the model, weights in bfloat16 (:func:`formats.compute_dtype`), on its device; for
            TP this rank's shard.
        fmt: weight format; float formats return ``"none"`` at once.
        folder: the HF folder the weights came from (None: no cache).
        rank, tp_size: TP placement; each rank caches its own shard.
        variant: what else changed the weights before quantizing (a vocabulary subset's id
            digest): part of the key and of the entry's folder name.
        use_cache: None: cache when ``folder`` has a cache marker and ``$SPECDEC_QUANT_CACHE`` is not
            ``0``; False: never; True: also for a folder without a marker (keyed on the folder's
            path and its files' sizes and mtimes).

    Returns:
        ``"hit"`` (loaded from the cache), ``"built"`` (quantized and stored), ``"off"``
        (quantized, not cached) or ``"none"`` (float format).

    Raises:
        ModelLoadError: torchao is missing (from :func:`formats.quantize`).
    """
    formats.check_format(fmt)
    if fmt not in formats.QUANTIZED_FORMATS:
        return "none"
    if use_cache is None:
        use_cache = os.environ.get("SPECDEC_QUANT_CACHE", "1") != "0"
        forced = False
    else:
        forced = use_cache
    device = next(model.parameters()).device
    key = cache_key(folder, fmt, device, rank, tp_size, variant) if (use_cache and folder is not None) else None
    if key is None and forced and folder is not None:
        key = _unmarked_key(folder, fmt, device, rank, tp_size) | {"variant": variant}
    if key is None:
        formats.quantize(model, fmt)
        release_source_file(model)
        _release_freed_memory()
        return "off"
    dest = cache_folder(folder, fmt, rank, tp_size, variant)
    digest = _digest(key)
    if _try_load(model, dest, digest, key, device):
        release_source_file(model)
        _release_freed_memory()
        return "hit"
    with cache.file_lock(cache.cache_root() / "locks" / f"quant-{hashlib.sha256(str(dest).encode()).hexdigest()[:16]}.lock"):
        if _try_load(model, dest, digest, key, device, quiet=True):  # built by another process meanwhile
            release_source_file(model)
            return "hit"
        log.info("quantizing %s to %s and caching it in %s", folder, fmt, dest)
        formats.quantize(model, fmt)
        _store(model, dest, digest, key)
        # read the layers back from the stored file: the same tensors, now file-backed (mmap)
        _try_load(model, dest, digest, key, device, quiet=True)
        release_source_file(model)
        _release_freed_memory()
    return "built"


def _unmarked_key(folder: Path, fmt: str, device: torch.device, rank: int, tp_size: int) -> dict:
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    h = hashlib.sha256(str(folder.resolve()).encode())
    for p in files:
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return {"layout": LAYOUT, "format": fmt,
            "int4_group_sizes": list(formats.INT4_GROUP_SIZES) if fmt == "int4" else None,
            "torch": torch.__version__, "torchao": _torchao_version(), "device": torch.device(device).type,
            "tp": [rank, tp_size], "source_sha256": "files:" + h.hexdigest(), "source_dtype": "unknown"}


def _tensor_classes() -> list[type]:
    """The torchao tensor subclasses a stored entry may hold, allowed for ``weights_only`` loads
    (importing torchao registers most of them; the CPU int4 class lives in a prototype module)."""
    import torchao  # noqa: F401 - registers torchao's own safe globals

    classes: list[type] = []
    try:
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor

        classes.append(Int4OpaqueTensor)
    except ImportError:  # pragma: no cover - older/newer torchao
        pass
    return classes


def _try_load(model: nn.Module, dest: Path, digest: str, key: dict, device: torch.device, quiet: bool = False) -> bool:
    marker = cache.read_marker(dest)
    if marker is None:
        if dest.exists() and not quiet:
            log.warning("quantized cache %s is incomplete: rebuilding", dest)
        return False
    if marker.get("key_sha256") != digest:
        if not quiet:
            old = marker.get("key") or {}
            changed = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
            log.warning("quantized cache %s is stale (%s changed): rebuilding", dest,
                        ", ".join(f"{k} {old.get(k)!r} -> {key.get(k)!r}" for k in changed) or "key")
        return False
    try:
        with torch.serialization.safe_globals(_tensor_classes()):
            state = torch.load(dest / TENSORS, map_location=device, weights_only=True, mmap=device.type == "cpu")
        apply_state(model, state)
    except Exception as e:  # noqa: BLE001 - any unreadable or unfitting entry is rebuilt
        if not quiet:
            log.warning("quantized cache %s is unusable (%s: %s): rebuilding", dest, type(e).__name__, e)
        return False
    return True


def _store(model: nn.Module, dest: Path, digest: str, key: dict) -> None:
    cache.remove_stale_temps(dest)
    tmp = cache.temp_sibling(dest)
    tmp.mkdir(parents=True)
    try:
        torch.save(quantized_state(model), tmp / TENSORS)
        cache.write_marker(tmp, source_sha256=key["source_sha256"], key_sha256=digest, key=key)
        cache.publish(tmp, dest)
    except OSError as e:  # a full disk must not fail the load: the model is quantized already
        log.warning("could not store the quantized cache %s: %s", dest, e)
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def cached_entry(folder: Path, fmt: str, device: str | torch.device = "cpu", rank: int = 0, tp_size: int = 1,
                 variant: str | None = None) -> Path | None:
    """The quantized entry of ``folder`` in ``fmt`` if a load now would be a cache hit by its key,
    without loading the model or the tensors (what ``specdec prefetch`` checks on a warm cache).

    Returns:
        the entry's folder, or None when ``folder`` has no cache marker, or the entry is missing,
        incomplete or stale (its tensors are then rebuilt by the next load). A tensor file that is
        present but corrupt is only found by loading it.
    """
    key = cache_key(folder, fmt, device, rank, tp_size, variant)
    if key is None:
        return None
    dest = cache_folder(folder, fmt, rank, tp_size, variant)
    marker = cache.read_marker(dest)
    if marker is None or marker.get("key_sha256") != _digest(key) or not (dest / TENSORS).is_file():
        return None
    return dest
