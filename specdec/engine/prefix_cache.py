"""Prefix caching: a new sequence's KV cache starts from the longest prefix it shares with another.

Requests to one assistant share their chat template's opening (the demo pair's Qwen template: 24
tokens of the 44-68 of the benchmark's prompts), and a conversation's next turn shares the whole
previous one. A :class:`PrefixCache` attached to a model (:func:`enable_prefix_cache`) lets a
:class:`specdec.engine.kv_cache.CachedSequence` whose cache is empty copy the keys and values of
the longest prefix its upcoming tokens share with a live sequence of the same model, or with one
of the last ``entries`` closed ones (kept, least recently used first out), instead of computing
them (vLLM's automatic prefix caching, SGLang's RadixAttention, here per sequence and without
paging).

Scopes: a sequence shares prefixes only with sequences of its own *scope* (a string; ``""`` is
the one scope of every sequence that names none). The serving layer puts each tenant's
sequences, and each request's ``cache_salt``, in a scope of their own (:func:`prefix_scope`),
so one tenant cannot learn from a request's speed whether another tenant recently sent the same
prompt prefix (the timing side channel vLLM closes with a per-request ``cache_salt``).

Exactness: only for a model whose forward is shape-invariant
(:func:`specdec.engine.invariant.make_invariant`): a position's keys and values then depend only
on the tokens up to it, not on how many positions or sequences the forward that computed them
fed, so copied keys and values are bitwise the ones the sequence would compute itself and every
output stays the same request's output alone. :func:`enable_prefix_cache` refuses other models.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from typing import Sequence

from transformers import DynamicCache

#: shorter shared prefixes are computed, not copied (a copy's bookkeeping outweighs a few positions)
MIN_SHARED = 4


def prefix_scope(tenant: str = "", salt: str | None = None) -> str:
    """The prefix cache scope of a request of ``tenant`` with cache salt ``salt``.

    Args:
        tenant: the tenant whose sequences may share prefixes (``""``: no tenant boundary, the
            serving layer's ``prefix_cache_scope: shared``).
        salt: the request's ``cache_salt`` (None or ``""``: none); only requests with the same
            salt (and tenant) share prefixes.

    Returns:
        ``""`` (the shared scope) without tenant and salt, else 32 hex digits of the sha256 of
        ``[tenant, salt]`` as JSON (unambiguous: no tenant/salt pair aliases another; the salt
        itself is not kept with the cached sequences).
    """
    if not tenant and not salt:
        return ""
    return hashlib.sha256(json.dumps([tenant, salt or ""]).encode("utf-8")).hexdigest()[:32]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """The sequences of one model whose cached prefixes a new sequence may start from.

    A sequence copies only from sequences of its own scope (``seq.prefix_scope``, a string;
    :func:`prefix_scope`): different scopes never share a position, whatever their tokens.

    Thread-safe (a lock around every method): sequences may open, start and close from several
    threads, as a served draft replica's do. The copy decisions depend only on the calls made and
    their order, so replicas of one model that see the same calls in the same order (the TP
    ranks of a target) copy the same positions.

    Memory: the ``entries`` closed sequences' caches, each what that sequence held (its
    positions × layers × 2 × KV heads × head dim in the cache's dtype, buffers with up to half
    again of spare room, :class:`specdec.engine.kv_store.GrowingLayer`); live sequences are
    only referenced weakly.

    Args:
        entries: closed sequences kept (their token ids and cache), least recently used first out.
        live: also copy from live sequences. False: only from closed ones, for a model whose
            sequences are fed from several threads at once (a live sequence's cache may then be
            cut and overwritten while it is copied).

    Attributes:
        hits: sequences started from a shared prefix; shared_positions: positions copied.
    """

    def __init__(self, entries: int = 4, live: bool = True):
        if entries < 0:
            raise ValueError(f"entries must be >= 0, got {entries}")
        self.entries = entries
        self.live = bool(live)
        self._lock = threading.Lock()
        self._live: "weakref.WeakSet" = weakref.WeakSet()
        #: key -> (scope, token ids, cache) of the closed sequences kept, least recently used first
        self._closed: "OrderedDict[int, tuple[str, list[int], DynamicCache]]" = OrderedDict()
        self._next = 0
        self.hits = 0
        self.shared_positions = 0

    def register(self, seq) -> None:
        """A live :class:`CachedSequence` others may copy from."""
        with self._lock:
            self._live.add(seq)

    def retire(self, seq) -> None:
        """Keep a closing sequence's cached tokens and cache (its cache object is no longer used by it)."""
        with self._lock:
            self._live.discard(seq)
            if self.entries == 0 or seq.cache is None or len(seq.cached) < MIN_SHARED:
                return
            self._closed[self._next] = (_scope_of(seq), list(seq.cached), seq.cache)
            self._next += 1
            while len(self._closed) > self.entries:
                self._closed.popitem(last=False)

    def clear(self) -> None:
        """Forget the closed sequences kept (live ones stay registered)."""
        with self._lock:
            self._closed.clear()

    def stats(self) -> dict:
        """``{"entries", "held", "hits", "shared_positions"}``: the closed sequences kept at most
        and now, sequences started from a shared prefix and positions copied (since it was made)."""
        with self._lock:
            return {"entries": self.entries, "held": len(self._closed), "hits": self.hits,
                    "shared_positions": self.shared_positions}

    def start(self, seq, upcoming: Sequence[int]) -> int:
        """Fill the empty cache of ``seq`` with the longest prefix of ``upcoming`` held by another
        sequence of the same scope (``seq.prefix_scope``), within its committed tokens and short
        of their last one: a verify forward scores the last committed token and every proposed
        one after it, whose keys another sequence may hold too (it drafted the same), and a
        drafting forward the last committed token.

        Returns:
            the positions copied (0 when no prefix of at least :data:`MIN_SHARED` is held).
        """
        with self._lock:
            return self._start(seq, upcoming)

    def _start(self, seq, upcoming: Sequence[int]) -> int:
        limit = min(len(upcoming), len(seq.token_ids)) - 1
        best, src, key = 0, None, None
        scope = _scope_of(seq)
        for other in (list(self._live) if self.live else ()):
            if other is seq or other.cache is None or _scope_of(other) != scope:
                continue
            n = min(_common_prefix(other.cached, upcoming), limit)
            if n > best:
                best, src, key = n, other.cache, None
        for k, (other_scope, tokens, cache) in self._closed.items():
            if other_scope != scope:
                continue
            n = min(_common_prefix(tokens, upcoming), limit)
            if n > best:
                best, src, key = n, cache, k
        if best < MIN_SHARED:
            return 0
        if key is not None:
            self._closed.move_to_end(key)
        from specdec.engine.kv_store import new_cache

        cache = new_cache(seq.model.config, getattr(seq, "kv_dtype", None))
        for i, layer in enumerate(src.layers):
            cache.update(layer.keys[:, :, :best], layer.values[:, :, :best], i)  # copies (concatenation)
        seq.cache = cache
        seq.cached = list(upcoming[:best])
        self.hits += 1
        self.shared_positions += best
        return best


def _scope_of(seq) -> str:
    return getattr(seq, "prefix_scope", "")


def prefix_cache_of(model) -> PrefixCache | None:
    """The :class:`PrefixCache` attached to ``model``, or None."""
    return getattr(model, "_specdec_prefix_cache", None)


def enable_prefix_cache(model, entries: int = 4, live: bool = True) -> PrefixCache:
    """Attach a :class:`PrefixCache` to ``model`` (a shape-invariant transformers causal LM); returns it.

    Sequences opened on the model afterwards register with it. ``entries`` and ``live``: see
    :class:`PrefixCache`.

    Raises:
        ValueError: the model's forward is not shape-invariant (copied keys and values could
            differ in the last bits from computed ones), or ``entries < 0``.
    """
    from specdec.engine.invariant import ATTENTION_NAME

    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        raise ValueError("prefix caching needs a shape-invariant forward (specdec.engine.invariant.make_invariant): "
                         "without it copied keys and values may differ from computed ones")
    store = PrefixCache(entries, live=live)
    model._specdec_prefix_cache = store
    return store


def disable_prefix_cache(model) -> None:
    """Detach the model's :class:`PrefixCache` (sequences already open keep working)."""
    if hasattr(model, "_specdec_prefix_cache"):
        del model._specdec_prefix_cache
