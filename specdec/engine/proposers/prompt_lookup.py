"""Prompt lookup decoding: draft by n-gram match against the prompt and the text so far.

Saxena 2023, "Prompt Lookup Decoding" (the method behind transformers'
``prompt_lookup_num_tokens``): take the last n tokens of the sequence, find an earlier
occurrence of the same n-gram, and propose the tokens that followed it. Longer n-grams are tried
first (``ngram_max`` down to ``ngram_min``); among matches of one length the most recent wins.
The proposal is deterministic (q is one-hot), so it is exact under sampling too. No match means
an empty block (plain decoding for that step), never an error.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.request import SamplingParams
from specdec.types import DraftBlock


def find_continuation(
    token_ids: Sequence[int], k: int, ngram_min: int, ngram_max: int, eos_ids: set[int] | frozenset[int] = frozenset()
) -> list[int]:
    """Return up to ``k`` tokens that followed the latest earlier match of the sequence's tail.

    Args:
        token_ids: the sequence so far (prompt + generated).
        k: most tokens to propose.
        ngram_min, ngram_max: n-gram lengths tried, longest first.
        eos_ids: a proposal ends at (and includes) the first of these ids.

    Returns:
        The proposed ids (possibly empty).
    """
    seq = list(token_ids)
    length = len(seq)
    if k <= 0:
        return []
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        tail = seq[length - n :]
        # latest start s < length - n whose n-gram equals the tail and has a continuation
        for s in range(length - n - 1, -1, -1):
            if seq[s : s + n] == tail:
                cont = seq[s + n : s + n + k]
                out: list[int] = []
                for t in cont:
                    out.append(t)
                    if t in eos_ids:
                        break
                if out:
                    return out
    return []


class PromptLookupSession:
    """One sequence drafted by n-gram lookup. See :class:`specdec.engine.proposers.base.ProposerSession`."""

    def __init__(self, proposer: "PromptLookupProposer", token_ids: Sequence[int]):
        self._proposer = proposer
        self._ids = [int(t) for t in token_ids]

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def propose(self, k: int) -> DraftBlock:
        p = self._proposer
        tokens = find_continuation(self._ids, k, p.ngram_min, p.ngram_max, p.eos_ids)
        if not tokens:
            return DraftBlock.empty()
        return DraftBlock(token_ids=torch.tensor(tokens, dtype=torch.long, device="cpu"))

    def commit(self, token_ids: Sequence[int]) -> None:
        self._ids.extend(int(t) for t in token_ids)

    def close(self) -> None:
        self._ids = []


class PromptLookupProposer:
    """Prompt lookup proposer (no draft model).

    Args:
        ngram_min, ngram_max: n-gram lengths matched, 1 <= ngram_min <= ngram_max.
        eos_ids: ids after which nothing is proposed.

    Raises:
        ValueError: on an invalid n-gram range.
    """

    name = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 3, eos_ids: Sequence[int] = ()):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.eos_ids = frozenset(int(t) for t in eos_ids)

    def open_session(self, token_ids: Sequence[int], sampling: SamplingParams, seed: int) -> PromptLookupSession:
        return PromptLookupSession(self, token_ids)
