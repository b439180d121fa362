"""Prompt lookup decoding: draft by n-gram match against the prompt and the text so far.

Saxena 2023, "Prompt Lookup Decoding" (the method behind transformers'
``prompt_lookup_num_tokens``): take the last n tokens of the sequence, find an earlier
occurrence of the same n-gram, and propose the tokens that followed it. Longer n-grams are tried
first (``ngram_max`` down to ``ngram_min``); among matches of one length the most recent wins,
except that a match followed at once by an end-of-sequence id (EOS) loses to an earlier match of
the same n-gram followed by anything else. In a chat prompt the user's turn ends with the
template's end-of-turn id, so the latest match of the text that ends the user's message (the
closing fence of a code block to rewrite) proposed ending the answer: on the copy prompt of
``specdec bench`` (code-rename, 32 tokens) the step after the opening fence proposed
``<|im_end|>`` where the earlier occurrence, the opening fence of the code to copy, proposes the
copy itself (4 steps become 3; the whole rewrite 22 steps become 21). A match that only EOS
follows is still proposed (the end of a copy).
The proposal is deterministic (q is one-hot), so it is exact under sampling too. No match means
an empty block (plain decoding for that step), never an error.

Block length: a session proposes as many tokens as its match supports (what followed the
matched n-gram, up to the end of the sequence or an EOS), at most the step's K, which for prompt
lookup is a cap rather than a choice: its drafts cost nothing, so a request copying from its
prompt speculates long (the K controller treats it as a variable-length proposer).

Incremental: a session keeps an index of the latest start of every n-gram (``ngram_min`` to
``ngram_max`` tokens) and updates it with each committed token, so a proposal costs
O(ngram_max + K) whatever the length of the sequence (:func:`find_continuation` is the same
rule by a full scan, kept as the reference).
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
        eos_ids: a proposal ends at (and includes) the first of these ids; a match they follow
            at once loses to an earlier match of the same n-gram (module docstring).

    Returns:
        The proposed ids (possibly empty).
    """
    seq = list(token_ids)
    length = len(seq)
    if k <= 0:
        return []
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        tail = seq[length - n :]
        # latest start s < length - n whose n-gram equals the tail (it has a continuation), one
        # whose continuation starts with an EOS id only when no other start has another one
        before_eos: list[int] = []
        for s in range(length - n - 1, -1, -1):
            if seq[s : s + n] == tail:
                if seq[s + n] in eos_ids:
                    before_eos.append(s)
                    continue
                out: list[int] = []
                for t in seq[s + n : s + n + k]:
                    out.append(t)
                    if t in eos_ids:
                        break
                return out
        if before_eos:
            return [seq[before_eos[0] + n]]
    return []


class NgramIndex:
    """The latest start of every n-gram of a growing sequence, for n in ``ngram_min..ngram_max``.

    Only n-grams ending before the last token are indexed, so looking up the sequence's own tail
    finds its latest *earlier* occurrence, which always has a continuation. An occurrence followed
    by one of ``eos_ids`` does not replace an earlier one followed by another id (module
    docstring). Appending a token costs O(ngram_max²) (one tuple per n), a lookup O(ngram_max + k).

    Args:
        ngram_min, ngram_max: n-gram lengths indexed.
        token_ids: the sequence so far.
        eos_ids: end-of-sequence ids (see above); give the same ids to :meth:`continuation`.

    Attributes:
        seq: the sequence (token ids).
        work: tokens touched so far (indexed, compared or copied): a cost counter for tests.
    """

    def __init__(self, ngram_min: int, ngram_max: int, token_ids: Sequence[int] = (),
                 eos_ids: set[int] | frozenset[int] = frozenset()):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.seq: list[int] = []
        self._tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(ngram_min, ngram_max + 1)}
        #: the n-grams whose indexed start is followed by an EOS id (a later start replaces it)
        self._before_eos: set[tuple[int, ...]] = set()
        self._indexed_end = 0  # n-grams ending at positions < this are indexed
        self.work = 0
        self.extend(token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens and index the n-grams that now end before the last token."""
        self.seq.extend(int(t) for t in token_ids)
        seq = self.seq
        for end in range(self._indexed_end, len(seq) - 1):  # n-gram = seq[end - n + 1 : end + 1]
            eos_next = seq[end + 1] in self.eos_ids
            for n, table in self._tables.items():
                start = end - n + 1
                if start >= 0:
                    key = tuple(seq[start : end + 1])
                    self.work += n
                    if eos_next:
                        if key in table and key not in self._before_eos:
                            continue  # an earlier start followed by another id wins
                        self._before_eos.add(key)
                    else:
                        self._before_eos.discard(key)
                    table[key] = start
        self._indexed_end = max(self._indexed_end, len(seq) - 1)

    def continuation(self, k: int, eos_ids: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """:func:`find_continuation` of the sequence (same result), from the index."""
        seq, length = self.seq, len(self.seq)
        if k <= 0:
            return []
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            self.work += n
            start = self._tables[n].get(tuple(seq[length - n :]))
            if start is None:
                continue
            out: list[int] = []
            for t in seq[start + n : start + n + k]:
                out.append(t)
                if t in eos_ids:
                    break
            self.work += len(out)
            if out:
                return out
        return []


class PromptLookupSession:
    """One sequence drafted by n-gram lookup. See :class:`specdec.engine.proposers.base.ProposerSession`."""

    def __init__(self, proposer: "PromptLookupProposer", token_ids: Sequence[int]):
        self._proposer = proposer
        self.index = NgramIndex(proposer.ngram_min, proposer.ngram_max, token_ids, proposer.eos_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.index.seq

    def propose(self, k: int) -> DraftBlock:
        """Up to ``k`` tokens: what followed the latest earlier match of the tail (see module doc)."""
        tokens = self.index.continuation(k, self._proposer.eos_ids)
        if not tokens:
            return DraftBlock.empty()
        return DraftBlock(token_ids=torch.tensor(tokens, dtype=torch.long, device="cpu"))

    def commit(self, token_ids: Sequence[int]) -> None:
        self.index.extend(token_ids)

    def close(self) -> None:
        self.index = NgramIndex(self._proposer.ngram_min, self._proposer.ngram_max, (), self._proposer.eos_ids)


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
