"""Where a sequence's keys and values live: buffers that grow in place, stored in the dtype attention reads.

Part of :mod:`specdec.engine.kv_cache` (a :class:`specdec.engine.kv_cache.CachedSequence`'s
cache is made by :func:`new_cache`). Three costs of a forward that are not the weights, each
measured on the demo target (docs/bench/batching/PROFILE-s11.md):

- transformers' ``DynamicLayer`` appends by concatenation, a copy of the whole cache per layer
  and forward; :class:`GrowingLayer` writes the new positions into spare room;
- row-wise attention (:mod:`specdec.engine.invariant`) computes bfloat16 rows in float32 on a
  CPU and so converted every visible key and value of every layer on every forward; a cache
  stored in that dtype (:func:`store_dtype`; bfloat16 values are exact in float32) is read as it
  is;
- a packed forward over many sequences (:func:`specdec.engine.kv_cache.feed_many`) concatenated
  all their caches per layer; :func:`packed_parts` hands them to row-wise attention as they are.

None of it changes a bit of any logit or cached value (tests/test_batch_forward.py).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

#: Sequences keep their keys and values in buffers with room to grow (:class:`GrowingLayer`);
#: False: transformers' ``DynamicLayer`` (and :func:`store_dtype` None).
GROWING_CACHE = True
#: Room a :class:`GrowingLayer` buffer is (re)allocated with: the positions it must hold plus half
#: of them, at least this many more.
GROW_MIN = 64
#: A :class:`GrowingLayer` whose keys and values are still the views it handed out last (or their
#: crop) appends without re-checking that they are prefix views of its buffers (one row of a packed
#: 8-row forward appends 28 times per forward); False: every append checks (the same bits).
FAST_APPEND = True
#: On a CPU, a model whose attention computes rows in float32 (row-wise attention,
#: :data:`specdec.engine.invariant.CPU_ROW_DTYPE`) stores its bfloat16/float16 keys and values in
#: float32 (twice the bytes; exact); False: in the model's dtype.
STORE_ROW_DTYPE = True


class GrowingLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` whose keys and values live in buffers with spare room.

    ``keys`` / ``values`` are ``[B, H, n, D]`` prefix views of ``[B, H, capacity, D]`` buffers;
    :meth:`update` writes the new positions after them in place while they fit (reallocating
    with :data:`GROW_MIN` and half again of spare room when they do not), where ``DynamicLayer``
    concatenates, i.e. copies the whole cache, on every forward. ``crop`` (inherited) keeps a
    prefix view of the same buffer, so positions after a cut are overwritten by the next update:
    a caller that keeps a returned ``keys`` tensor past the next update of the layer must copy
    it (the prefix cache copies what it takes; attention uses it at once). Keys set from outside
    (not a prefix view of the buffer) are copied into a new buffer, never written over.

    Args:
        dtype: dtype of the buffers (None: that of the first keys); new positions are converted
            to it (exact from bfloat16/float16 to float32).
    """

    def __init__(self, dtype: torch.dtype | None = None):
        super().__init__()
        self.store_dtype = dtype
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        # the keys / values views :meth:`update` last handed out (prefix views of the buffers)
        self._kview: torch.Tensor | None = None
        self._vview: torch.Tensor | None = None

    @staticmethod
    def _fits(buf: torch.Tensor | None, view: torch.Tensor, n: int, m: int) -> bool:
        return (buf is not None and n + m <= buf.shape[-2] and view.dim() == 4 and view.dtype == buf.dtype
                and view.data_ptr() == buf.data_ptr() and view.stride() == buf.stride()
                and view.shape[:2] == buf.shape[:2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[B, H, m, D]`` keys and values; returns the whole ``[B, H, n + m, D]`` views."""
        m = key_states.shape[-2]
        keys = self.keys
        if FAST_APPEND and keys is not None and keys is self._kview and self.values is self._vview:
            # the views this layer handed out (or cropped): prefix views of the buffers; only the room is checked
            n = keys.shape[-2]
            if n + m <= self._kbuf.shape[-2]:
                kb, vb = self._kbuf, self._vbuf
                kb[:, :, n:n + m].copy_(key_states)
                vb[:, :, n:n + m].copy_(value_states)
                self.keys = self._kview = kb[:, :, :n + m]
                self.values = self._vview = vb[:, :, :n + m]
                return self.keys, self.values
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        if not (self._fits(self._kbuf, self.keys, n, m) and self._fits(self._vbuf, self.values, n, m)):
            cap = n + m + max(GROW_MIN, (n + m) // 2)
            dtype = self.store_dtype or key_states.dtype
            kb = key_states.new_empty(*key_states.shape[:2], cap, key_states.shape[-1], dtype=dtype)
            vb = value_states.new_empty(*value_states.shape[:2], cap, value_states.shape[-1], dtype=dtype)
            if n:
                kb[:, :, :n].copy_(self.keys)
                vb[:, :, :n].copy_(self.values)
            self._kbuf, self._vbuf = kb, vb
        self._kbuf[:, :, n:n + m].copy_(key_states)
        self._vbuf[:, :, n:n + m].copy_(value_states)
        self.keys = self._kview = self._kbuf[:, :, :n + m]
        self.values = self._vview = self._vbuf[:, :, :n + m]
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        """``DynamicLayer.crop`` (drop the last ``-tokens_to_remove`` positions): the shorter keys
        and values stay prefix views of the same buffers, so the next :meth:`update` appends in
        place without re-checking them."""
        handed_out = self.keys is self._kview and self.values is self._vview
        super().crop(tokens_to_remove)
        if handed_out:
            self._kview, self._vview = self.keys, self.values

    def reset(self) -> None:
        self._kbuf = self._vbuf = self._kview = self._vview = None
        super().reset()


def store_dtype(model, device: torch.device) -> torch.dtype | None:
    """The dtype a sequence of ``model`` on ``device`` stores its keys and values in: float32
    (:data:`specdec.engine.invariant.CPU_ROW_DTYPE`) for a bfloat16/float16 model with row-wise
    attention on a CPU (:data:`STORE_ROW_DTYPE`, :data:`GROWING_CACHE`); None (the model's own)
    otherwise."""
    from specdec.engine import invariant

    if not (STORE_ROW_DTYPE and GROWING_CACHE) or invariant.CPU_ROW_DTYPE is None or torch.device(device).type != "cpu":
        return None
    if getattr(model.config, "_attn_implementation", None) != invariant.ATTENTION_NAME:
        return None
    return invariant.CPU_ROW_DTYPE if getattr(model, "dtype", None) in (torch.bfloat16, torch.float16) else None


def new_cache(config, dtype: torch.dtype | None = None) -> DynamicCache:
    """An empty ``DynamicCache`` for a model of ``config`` whose full-attention layers are
    :class:`GrowingLayer` storing ``dtype`` (:data:`GROWING_CACHE`; sliding-window layers stay as
    transformers builds them)."""
    cache = DynamicCache(config=config)
    if GROWING_CACHE:
        cache.layers = [GrowingLayer(dtype) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def packed_parts(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The concatenation of ``parts`` (``[1, H, L_i, D]`` each) along dim -2, without copying.

    Returns a ``[1, H, Σ L_i, D]`` tensor whose every element is one zero-stride placeholder
    value, with the parts themselves in its ``_specdec_parts`` attribute (a list of ``(offset,
    part)``): :func:`specdec.engine.invariant.rowwise_attention` reads each row's keys from the
    part that holds them, so a packed forward does not copy every sequence's cache once more per
    layer. Only for an attention implementation that reads the parts.
    """
    first = parts[0]
    total = sum(int(p.shape[-2]) for p in parts)
    out = first.new_zeros(()).expand(first.shape[0], first.shape[1], total, first.shape[-1])
    offsets, off = [], 0
    for p in parts:
        offsets.append((off, p))
        off += int(p.shape[-2])
    out._specdec_parts = offsets
    return out
