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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class CachedSequence:
    """Committed token ids plus a KV cache of a prefix of them (batch size 1).

    Args:
        model: the causal LM.
        token_ids: the committed sequence so far.
        device: where the model's inputs are put (the device of its embedding; default: the
            device of its first parameter). Logits come back on the model's device.

    Attributes:
        token_ids: the committed sequence, in tokens.
        cached: the tokens whose keys and values are in the cache (a list, ``len == cache
            length``); may run past ``token_ids`` into uncommitted proposals.
    """

    def __init__(self, model: PreTrainedModel, token_ids: list[int], device: torch.device | str | None = None):
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.token_ids = token_ids
        self.cached: list[int] = []
        self.cache: DynamicCache | None = DynamicCache(config=model.config)

    def _crop(self, length: int) -> None:
        if length >= len(self.cached):
            return
        if length == 0:
            self.cache = DynamicCache(config=self.model.config)
        else:
            self.cache.crop(length - len(self.cached))
        del self.cached[length:]

    def sync(self, upcoming: Sequence[int]) -> int:
        """Cut the cache back to its longest common prefix with ``upcoming``, minus one token.

        At least the last token of ``upcoming`` is left uncached, so the next forward pass yields
        logits for the position after it.

        Returns:
            the number of cached positions kept.
        """
        if self.cache is None:
            raise RuntimeError("sequence is closed")
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

    def close(self) -> None:
        """Drop the cache. Idempotent."""
        self.cache = None
        self.cached = []
