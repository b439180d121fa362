"""Handing back memory a loaded model no longer needs (served RSS).

A quantized model is read from memory-mapped files: the bfloat16 folder's safetensors (what
``from_pretrained`` maps) and the quantized cache entry's ``quantized.pt`` (``torch.load(...,
mmap=True)``, :mod:`specdec.models.quant_cache`). Every page of a mapping that was read counts in
the process's RSS for as long as the mapping lives, and a mapping lives while *any* tensor of the
file does (torch maps the whole file once; each tensor is a view of it). After loading, many read
pages are dead:

- the bfloat16 linear weights, read once to quantize them (:func:`release_source_file` copies the
  few small unquantized tensors, norms and biases, out of the mapping; the input embedding table
  stays mapped, see below);
- w8a8: the int8 rows of every layer oneDNN or fbgemm prepacked (the prepacked copy replaces them,
  :meth:`specdec.models.formats.W8A8Linear.prepack`), and the separate q/k/v and gate/up rows the
  fused layers copied (:mod:`specdec.models.fused`); :func:`release_after_load` prepacks every
  layer now and copies the layers' small remaining tensors (scales, biases, the narrow layers'
  int8 rows) out of the mapping, so it goes too;
- int4 (and what else stays file-backed): the separate q/k/v and gate/up weights read by the
  fusion. :func:`drop_unused_pages` tells the kernel (``madvise(MADV_DONTNEED)``) to drop the
  pages of a mapping that no live tensor of the model covers; the pages live tensors use stay.

The input embedding table (:data:`EMBEDDINGS_MAPPED`): a forward reads only the rows of the
tokens it is fed (one row per token: 1536 bfloat16 = 3 KiB for the demo target), so the table
stays a read-only view of the bfloat16 folder's safetensors file and :func:`drop_unused_pages`
drops its pages too: a row's page is read back from the page cache (or the disk) when a token
first needs it, and only the pages of the tokens a process has seen count in its RSS, file-backed
(``RssFile``, clean: the kernel may reclaim them under memory pressure) rather than anonymous. The
demo pair's tables are 445 MiB (target, 151936 x 1536) and 260 MiB (draft, 151936 x 896) in
bfloat16; copied, they were anonymous memory for the process's life. The values are the file's, as
the copy's were: outputs are bitwise the same. At worst (every token id seen) the resident pages
are the whole table, as before, but file-backed and reclaimable. llama.cpp maps its weights the
same way.

``MADV_DONTNEED`` on a private file mapping whose pages were never written only unmaps them from
the process; a later read faults the file's bytes back in (from the page cache), so a page
dropped by mistake costs a page fault, never a wrong value. A mapping with written pages (copied
on write: ``Anonymous`` in /proc/self/smaps) is left alone. Linux only (``/proc/self/maps``); elsewhere the functions do nothing.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import mmap

import torch
from torch import nn

from specdec.models import formats

log = logging.getLogger(__name__)

#: Files whose read-only mappings :func:`drop_unused_pages` may trim: the quantized cache's tensor
#: file and safetensors weights.
MAPPED_SUFFIXES: tuple[str, ...] = ("quantized.pt", ".safetensors")
_MADV_DONTNEED = 4
#: Keep the input embedding table a view of the file it was loaded from and drop its pages after
#: loading (module doc). False: copy it into anonymous memory, as the other unquantized tensors.
EMBEDDINGS_MAPPED = True


def release_freed_memory() -> None:
    """Collect garbage (objects in reference cycles, e.g. a dropped tokenizer's), then hand freed
    heap pages back to the OS (glibc ``malloc_trim``): quantizing frees the bfloat16 weights in
    many small pieces that would otherwise stay in the process's RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def input_embedding(model: nn.Module) -> torch.Tensor | None:
    """The plain CPU tensor of ``model``'s input embedding table (``[V, hidden]``), or None (no
    ``get_input_embeddings``, a tensor subclass such as a TP DTensor, not on the CPU)."""
    get = getattr(model, "get_input_embeddings", None)
    weight = getattr(get(), "weight", None) if callable(get) else None
    if weight is None:
        return None
    t = weight.data
    return t if type(t) is torch.Tensor and t.device.type == "cpu" else None


def _mapped_embedding(model: nn.Module) -> torch.Tensor | None:
    """:func:`input_embedding` when :data:`EMBEDDINGS_MAPPED` and it is a view of a mapped file
    (:data:`MAPPED_SUFFIXES`), else None."""
    t = input_embedding(model) if EMBEDDINGS_MAPPED else None
    return t if t is not None and _in_mapping(t, file_mappings()) else None


def release_source_file(model: nn.Module) -> int:
    """Copy the model's small unquantized tensors (norms, biases) into memory of their own.

    ``from_pretrained`` leaves bfloat16 tensors memory-mapped from the folder's safetensors file;
    while one of them lives, the whole mapping stays, and every page of it that was read
    (all the linear weights, read once to quantize them) counts in the process's RSS although
    the model no longer uses them. Copying the few unquantized tensors leaves the mapping to the
    input embedding table (:data:`EMBEDDINGS_MAPPED`, read row by row: :func:`drop_unused_pages`
    drops its pages and those no tensor covers), or lets it go. Quantized layers (plain int8 or
    torchao tensors) are left as they are; tied tensors stay tied.

    Returns:
        bytes copied.
    """
    copies: dict[int, torch.Tensor] = {}
    embedding = _mapped_embedding(model)
    if embedding is not None:  # stays a view of the file: never copied, also where it is tied
        copies[embedding.untyped_storage().data_ptr()] = embedding
    copied = 0
    for module in model.modules():
        if isinstance(module, (formats.Int8WeightOnlyLinear, formats.W8A8Linear)):
            continue
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None or type(t.data) is not torch.Tensor or t.device.type != "cpu":
                    continue
                if isinstance(module, nn.Linear) and name == "weight" and t.dtype == torch.int8:
                    continue
                key = t.data.untyped_storage().data_ptr()
                if key not in copies:
                    copies[key] = t.data.clone()
                    copied += t.data.nbytes
                new = copies[key]
                table[name] = nn.Parameter(new, requires_grad=False) if isinstance(t, nn.Parameter) else new
    return copied


def file_mappings(suffixes: tuple[str, ...] = MAPPED_SUFFIXES) -> list[tuple[int, int, str]]:
    """``(start, end, path)`` of this process's mappings of files ending in ``suffixes``
    (address ranges in bytes, end exclusive; empty off Linux)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].strip().endswith(suffixes):
                    lo, hi = (int(a, 16) for a in parts[0].split("-"))
                    out.append((lo, hi, parts[5].strip()))
    except OSError:
        pass
    return out


def _mapping_stats() -> dict[int, dict[str, int]]:
    """``{start: {"Rss": bytes, "Anonymous": bytes, ...}}`` per mapping, from /proc/self/smaps."""
    stats: dict[int, dict[str, int]] = {}
    cur = None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    cur = stats.setdefault(int(head.split("-")[0], 16), {})
                elif cur is not None and line.rstrip().endswith("kB"):
                    cur[head.rstrip(":")] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return stats


def mapped_rss(suffixes: tuple[str, ...] = MAPPED_SUFFIXES) -> int:
    """Bytes of this process's RSS in mappings of files ending in ``suffixes``."""
    stats = _mapping_stats()
    return sum(stats.get(lo, {}).get("Rss", 0) for lo, _, _ in file_mappings(suffixes))


def _tensors(model: nn.Module):
    """Every plain tensor the model's parameters and buffers hold (tensor subclasses such as
    torchao's unwrapped into their inner tensors)."""
    stack = [t for t in list(model.parameters()) + list(model.buffers()) if t is not None]
    while stack:
        t = stack.pop()
        t = t.data if isinstance(t, nn.Parameter) else t
        if type(t) is torch.Tensor:
            yield t
        elif hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            stack.extend(getattr(t, n) for n in names if getattr(t, n, None) is not None)


def _in_mapping(t: torch.Tensor, maps: list[tuple[int, int, str]]) -> bool:
    if t.device.type != "cpu" or t.numel() == 0:
        return False
    p = t.untyped_storage().data_ptr()
    return any(lo <= p < hi for lo, hi, _ in maps)


def own_w8a8_tensors(model: nn.Module) -> int:
    """Prepack every w8a8 layer that runs oneDNN's kernel (its int8 rows go) and copy the w8a8
    layers' remaining file-mapped tensors (scales, biases, narrow layers' int8 rows) into memory
    of their own, so the quantized cache file's mapping can go.

    Returns:
        bytes copied.
    """
    maps = file_mappings()
    copied = 0
    for m in model.modules():
        if not isinstance(m, formats.W8A8Linear):
            continue
        m.prepack()
        for table in (m._parameters, m._buffers):
            for name, t in list(table.items()):
                if t is not None and _in_mapping(t.data, maps):
                    new = t.data.clone()
                    copied += new.nbytes
                    table[name] = nn.Parameter(new, requires_grad=False) if isinstance(t, nn.Parameter) else new
    return copied


def drop_unused_pages(model: nn.Module, suffixes: tuple[str, ...] = MAPPED_SUFFIXES) -> int:
    """``madvise(MADV_DONTNEED)`` the whole pages of this process's mappings of ``suffixes`` files
    that no tensor of ``model`` covers, and those of the mapped input embedding table (read per
    token, :data:`EMBEDDINGS_MAPPED`), in the mappings that hold at least one of its tensors (see
    the module doc; mappings with written pages are skipped).

    Returns:
        bytes of RSS handed back (the mappings' RSS before minus after).
    """
    maps = file_mappings(suffixes)
    if not maps:
        return 0
    page = mmap.PAGESIZE
    spans = {(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
             for t in _tensors(model) if _in_mapping(t, maps)}
    holders = {a for a, _ in spans}  # the mappings to trim: those holding a tensor of the model
    embedding = _mapped_embedding(model)
    if embedding is not None:  # its pages go too: a lookup reads its rows back from the file
        e = embedding.untyped_storage().data_ptr()
        spans = {s for s in spans if s[0] != e}
    live = sorted(spans)
    stats = _mapping_stats()
    before = sum(stats.get(lo, {}).get("Rss", 0) for lo, _, _ in maps)  # (every mapping: RSS freed anywhere)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for lo, hi, path in maps:
        if not any(lo <= a < hi for a in holders):
            continue  # another model's mapping (or one about to go): not this model's to trim
        if stats.get(lo, {}).get("Anonymous", 0):  # copied-on-write pages: the file no longer has them
            log.info("not trimming %s: it has written pages", path)
            continue
        cursor = lo
        for a, b in [r for r in live if lo <= r[0] < hi] + [(hi, hi)]:
            gap_lo = -(-cursor // page) * page  # first whole page after the last live byte
            gap_hi = (a // page) * page  # last page boundary before the next live byte
            if gap_hi > gap_lo and libc.madvise(gap_lo, gap_hi - gap_lo, _MADV_DONTNEED) != 0:
                log.info("madvise on %s failed (errno %d)", path, ctypes.get_errno())
            cursor = max(cursor, b)
    return before - mapped_rss(suffixes)


def release_after_load(model: nn.Module) -> dict[str, int]:
    """What a finished load (quantized, fused, made invariant) no longer needs, handed back:
    :func:`own_w8a8_tensors`, :func:`drop_unused_pages`, :func:`release_freed_memory`.
    The model computes bitwise the same afterwards.

    Returns:
        ``{"copied": bytes copied, "dropped": bytes of mapped RSS dropped}``.
    """
    copied = own_w8a8_tensors(model)
    dropped = drop_unused_pages(model)
    release_freed_memory()
    return {"copied": copied, "dropped": dropped}
