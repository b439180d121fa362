"""A token sequence with the KV cache of the model that reads it.

Both the draft and the target keep, per sequence, the committed tokens and a KV cache of some
prefix of them (plus, transiently, of proposed tokens). Before each forward pass the cache is cut
back to the longest prefix it shares with what is about to be fed, so a cache that went past an
accepted prefix, or a cache that is empty because the session was rebuilt from its token
history, is handled by the same rule.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.engine.invariant import ATTENTION_NAME
from specdec.engine.kv_store import new_cache, packed_parts, store_dtype
from specdec.engine.prefix_cache import _common_prefix, prefix_cache_of
from specdec.errors import ModelLoadError


class CachedSequence:
    """Committed token ids plus a KV cache of a prefix of them (batch size 1).

    Args:
        model: the causal LM.
        token_ids: the committed sequence so far.
        device: where the model's inputs are put (the device of its embedding; default: the
            device of its first parameter). Logits come back on the model's device.
        prefix_scope: the scope of the model's prefix cache this sequence shares prefixes within
            (:func:`specdec.engine.prefix_cache.prefix_scope`; ``""``: the shared scope).

    Attributes:
        token_ids: the committed sequence, in tokens.
        cached: the tokens whose keys and values are in the cache (a list, ``len == cache
            length``); may run past ``token_ids`` into uncommitted proposals.
    """

    def __init__(self, model: PreTrainedModel, token_ids: list[int], device: torch.device | str | None = None,
                 prefix_scope: str = ""):
        self.model = model
        #: only sequences of the same scope share cached prefixes (:mod:`specdec.engine.prefix_cache`)
        self.prefix_scope = str(prefix_scope)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.token_ids = token_ids
        self.cached: list[int] = []
        #: dtype the cache stores keys and values in (:func:`specdec.engine.kv_store.store_dtype`)
        self.kv_dtype = store_dtype(model, self.device)
        self.cache: DynamicCache | None = new_cache(model.config, self.kv_dtype)
        #: the model's prefix cache (:mod:`specdec.engine.prefix_cache`), or None
        self._prefix = prefix_cache_of(model)
        if self._prefix is not None:
            self._prefix.register(self)

    def _crop(self, length: int) -> None:
        if length >= len(self.cached):
            return
        if length == 0:
            self.cache = new_cache(self.model.config, self.kv_dtype)
        else:
            self.cache.crop(length - len(self.cached))
        del self.cached[length:]

    def sync(self, upcoming: Sequence[int]) -> int:
        """Cut the cache back to its longest common prefix with ``upcoming``, minus one token.

        At least the last token of ``upcoming`` is left uncached, so the next forward pass yields
        logits for the position after it. An empty cache first copies the longest prefix of
        ``upcoming`` another sequence holds when the model has a prefix cache
        (:class:`specdec.engine.prefix_cache.PrefixCache`).

        Returns:
            the number of cached positions kept.
        """
        if self.cache is None:
            raise RuntimeError("sequence is closed")
        if not self.cached and self._prefix is not None:
            self._prefix.start(self, upcoming)
        keep = min(_common_prefix(self.cached, upcoming), len(upcoming) - 1)
        self._crop(keep)
        return keep

    @torch.inference_mode()
    def feed(self, tokens: Sequence[int], keep: int | None = None) -> torch.Tensor:
        """Run the model over ``tokens`` after the cached prefix and cache them.

        Args:
            tokens: ids to append after ``self.cached`` (at least one).
            keep: compute logits for the last ``keep`` positions only (None: all). Skipping the
                output projection over a long prefill saves about a sixth of its cost.

        Returns:
            ``[n, V]`` float32 logits on the model's device for the last ``n = keep or
            len(tokens)`` positions, row i predicting the token after the corresponding input token.
        """
        if not tokens:
            raise ValueError("feed needs at least one token")
        input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=keep or 0)
        self.cache = out.cache
        self.cached.extend(int(t) for t in tokens)
        return out.logits[0].float()

    def forward_with(self, extra: Sequence[int], last: int) -> torch.Tensor:
        """Feed the uncached committed tail plus ``extra`` tokens; return the last ``last`` logits.

        Args:
            extra: uncommitted tokens (a candidate block) to score after the committed sequence.
            last: number of final positions whose logits are returned (K + 1 for a block of K).

        Returns:
            ``[last, V]`` float32 logits.
        """
        upcoming = self.token_ids + [int(t) for t in extra]
        kept = self.sync(upcoming)
        if len(upcoming) - kept < last:
            raise ValueError(f"asked for {last} logits but only {len(upcoming) - kept} positions are fed")
        return self.feed(upcoming[kept:], keep=last)

    def commit(self, tokens: Sequence[int], cached_upto: int | None = None) -> None:
        """Append ``tokens`` to the committed sequence; optionally cut the cache to ``cached_upto``.

        Args:
            tokens: emitted ids.
            cached_upto: keep at most this many cached positions (the accepted prefix).
        """
        self.token_ids.extend(int(t) for t in tokens)
        if cached_upto is not None:
            self._crop(min(cached_upto, _common_prefix(self.cached, self.token_ids)))

    def realign(self) -> None:
        """Drop the keys and values past ``cached`` from every layer (a no-op on a closed or
        consistent cache).

        A forward that raised part-way (a packed forward of :func:`feed_many` whose later layer
        failed) has appended its new positions to the first layers only; afterwards every layer
        holds exactly the ``len(cached)`` positions of ``cached`` again, so the sequence can be
        fed alone as if the failed forward had not run.
        """
        if self.cache is None:
            return
        n = len(self.cached)
        for layer in getattr(self.cache, "layers", ()):
            extra = layer.get_seq_length() - n if getattr(layer, "is_initialized", False) else 0
            if extra > 0:
                layer.crop(-extra)

    def close(self) -> None:
        """Drop the cache (to the model's prefix cache, if any). Idempotent."""
        if self._prefix is not None and self.cache is not None:
            self._prefix.retire(self)
        self.cache = None
        self.cached = []


# --- batched (packed) forward over several sequences ----------------------------------------


#: A packed forward of a model with row-wise attention (:mod:`specdec.engine.invariant`) hands
#: the attention each sequence's own cache (:func:`packed_parts`) instead of concatenating all of
#: them per layer; False: the concatenation (the same bits, one more copy of every cache per layer).
PACKED_PARTS = True


class _PackedCacheView:
    """The KV cache seen by one packed forward over several sequences' own caches.

    The new tokens of all sequences are packed into one row (``[1, M]``, M = Σ new tokens). Per
    layer, :meth:`update` receives their keys/values ``[1, H_kv, M, D]``, appends each
    sequence's slice to that sequence's own :class:`DynamicCache` (exactly as a forward of that
    sequence alone would), and returns the sequences' whole caches one after the other,
    ``[1, H_kv, Σ (L_i + n_i), D]``: each sequence's keys are contiguous, its cached keys then its
    new ones, and the attention mask of :func:`feed_many` lets each token see only its own
    sequence's range (so attention that runs row by row over a contiguous key range, as a
    shape-invariant forward does, gets exactly the keys plain decoding would give it). Only
    ``update`` is called by the model because position ids and a ready 4-D mask are passed in.
    """

    def __init__(self, caches: Sequence[DynamicCache], new_lens: Sequence[int], parts: bool = False):
        self.caches = list(caches)
        self.new_lens = list(new_lens)
        #: hand the sequences' caches to row-wise attention as they are (no concatenation)
        self.parts = parts

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        parts_k: list[torch.Tensor] = []
        parts_v: list[torch.Tensor] = []
        # each sequence's new keys and values as views, made in one call each
        for cache, k_new, v_new in zip(self.caches, key_states.split(self.new_lens, dim=-2),
                                       value_states.split(self.new_lens, dim=-2)):
            k, v = cache.update(k_new, v_new, layer_idx)
            parts_k.append(k)
            parts_v.append(v)
        if self.parts:
            return packed_parts(parts_k), packed_parts(parts_v)
        return torch.cat(parts_k, dim=-2), torch.cat(parts_v, dim=-2)


def _packed_mask(past_lens: list[int], new_lens: list[int], model: PreTrainedModel, device: torch.device) -> torch.Tensor:
    """``[1, 1, M, Σ (L_i + n_i)]`` attention mask of a packed forward (see :func:`feed_many`).

    Keys are laid out sequence after sequence (each one's L_i cached keys, then its n_i new
    ones); query j of sequence i sees its own sequence's first L_i + j + 1 keys, one contiguous
    range. The form follows the model's attention implementation: additive float (0 / dtype
    min) for ``eager``, boolean (True = attend) otherwise (``sdpa`` and implementations that take
    sdpa's masks).

    Raises:
        specdec.errors.ModelLoadError: flash or flex attention (they take no 4-D mask), or a model
            with sliding-window layers (the mask would ignore the window); the message says how to
            load the model instead (``sdpa``/``eager``) or to turn batching off.
    """
    impl = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    if "flash" in impl or "flex" in impl:
        raise ModelLoadError(
            f"batched forward needs a 4-D attention mask, which attention implementation {impl!r} does not "
            "take: load the model with attn_implementation='sdpa' or 'eager', or turn batching off "
            "(target_batching / draft_batching: false)")
    if getattr(getattr(model, "model", model), "has_sliding_layers", False):
        raise ModelLoadError(
            "batched forward does not support models with sliding-window attention layers (the packed "
            "mask would ignore the window): turn batching off (target_batching / draft_batching: false)")
    rows = torch.arange(len(new_lens))
    totals = torch.tensor([lp + n for lp, n in zip(past_lens, new_lens)])
    q_row = torch.repeat_interleave(rows, torch.tensor(new_lens))  # [M]
    q_pos = torch.cat([torch.arange(n) + lp for n, lp in zip(new_lens, past_lens)])  # [M]
    k_row = torch.repeat_interleave(rows, totals)  # [Σ (L + n)]
    k_pos = torch.cat([torch.arange(int(t)) for t in totals])  # [Σ (L + n)]
    allowed = (q_row[:, None] == k_row[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    allowed = allowed[None, None].to(device)
    if impl != "eager":
        return allowed
    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


@torch.inference_mode()
def feed_many(items: Sequence[tuple["CachedSequence", Sequence[int], int]]) -> list[torch.Tensor]:
    """Run one model over new tokens of several sequences in one forward pass, caching them.

    The sequences' caches stay separate (ragged lengths, batch size 1 each); the new tokens are
    packed into one row of ``M = Σ len(tokens_i)`` positions with per-token position ids and a
    block mask (each token sees only its own sequence's past and earlier new tokens), so no
    position is padded and a forward costs what its M positions cost (keys: each sequence's
    cache then its new keys, sequence after sequence). Logits are computed only
    for the positions asked for. One item is exactly :meth:`CachedSequence.feed` (the unbatched
    path). All sequences must belong to the same model.

    Args:
        items: ``(sequence, tokens, keep)``: ids to append after ``sequence.cached`` (at least
            one) and how many final positions' logits to return (0: none, e.g. a prefill chunk).

    Returns:
        per item, ``[keep, V]`` float32 logits (``[0, V]`` for keep 0), row r predicting the token
        after the corresponding input token.

    Raises:
        ValueError: an item without tokens, keep outside 0..len(tokens), a closed sequence, or
            sequences of different models.
        specdec.errors.ModelLoadError: see :func:`_packed_mask`.
    """
    if not items:
        return []
    for seq, tokens, keep in items:
        if not tokens:
            raise ValueError("feed_many needs at least one token per sequence")
        if not 0 <= keep <= len(tokens):
            raise ValueError(f"keep={keep} outside 0..{len(tokens)}")
        if seq.cache is None:
            raise RuntimeError("sequence is closed")
    model = items[0][0].model
    if any(seq.model is not model for seq, _, _ in items):
        raise ValueError("feed_many: all sequences must belong to the same model")
    if len(items) == 1:
        seq, tokens, keep = items[0]
        logits = seq.feed(tokens, keep=max(keep, 1))
        return [logits[logits.shape[0] - keep :]]
    past = [len(seq.cached) for seq, _, _ in items]
    new = [len(tokens) for _, tokens, _ in items]
    device = items[0][0].device
    ids = torch.tensor([[int(t) for _, tokens, _ in items for t in tokens]], dtype=torch.long, device=device)
    pos = torch.tensor([[p + j for p, n in zip(past, new) for j in range(n)]], dtype=torch.long, device=device)
    keep_idx: list[int] = []
    off = 0
    for n, (_, _, keep) in zip(new, items):
        keep_idx.extend(range(off + n - keep, off + n))
        off += n
    # at least one position reaches the output layer (an empty index list would mean "all")
    idx = torch.tensor(keep_idx or [off - 1], dtype=torch.long, device=device)
    view = _PackedCacheView([seq.cache for seq, _, _ in items], new,
                            parts=PACKED_PARTS and getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME)
    out = model(
        input_ids=ids,
        position_ids=pos,
        # a 4-D mask is taken as given by every model's mask builder (a {"full_attention": mask}
        # mapping only by models with layer types, such as Qwen2; Llama's forward needs the tensor)
        attention_mask=_packed_mask(past, new, model, device),
        cache=view,
        use_cache=True,
        logits_to_keep=idx,
    )
    logits = out.logits[0].float()  # [Σ keep, V]
    results: list[torch.Tensor] = []
    off = 0
    for seq, tokens, keep in items:
        seq.cached.extend(int(t) for t in tokens)
        results.append(logits[off : off + keep])
        off += keep
    return results
