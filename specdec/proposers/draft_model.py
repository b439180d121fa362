"""The draft-model proposer: a small causal LM drafts K tokens autoregressively.

Greedy requests draft the draft's argmax (q one-hot). Sampling requests draft from the draft's
distribution warped exactly like the target's (:func:`specdec.sampling.warp_probs`) and
restricted to its ``top_m`` most likely ids (:func:`specdec.sampling.restrict_support`), which is
what the block carries to the verifier (Leviathan et al. 2023, §2.3: any proposal distribution is
exact as long as the verifier uses it).

The draft KV cache is kept across steps; after a rejection it is cut back lazily on the next
``propose`` to the prefix shared with the committed sequence (:class:`CachedSequence`), and a
session rebuilt from a token history simply starts with an empty cache.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.kv_cache import CachedSequence
from specdec.models.loaded import LoadedModel
from specdec.request import SamplingParams
from specdec.sampling import greedy_token, mask_unemittable, restrict_support, step_generator, warp_probs
from specdec.types import DraftBlock

#: default support size M of the proposal distribution sent per drafted position
DEFAULT_TOP_M = 64


class DraftModelSession:
    """One sequence drafted by a draft model. See :class:`specdec.proposers.base.ProposerSession`."""

    def __init__(self, proposer: "DraftModelProposer", token_ids: Sequence[int], sampling: SamplingParams, seed: int):
        self._proposer = proposer
        self.sampling = sampling
        self.seed = seed
        self.seq = CachedSequence(proposer.draft.model, [int(t) for t in token_ids])

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    def propose(self, k: int) -> DraftBlock:
        """Draft up to ``k`` tokens; fewer at an EOS or the draft's context limit.

        Returns:
            A block with ``token_ids [k']`` int64 and, when sampling, ``q_ids``/``q_probs``
            ``[k', M]``; :meth:`DraftBlock.empty` when ``k' == 0``.
        """
        draft = self._proposer.draft
        # Drafting token j (1-based) feeds position len + j - 2: stay below the draft's limit.
        k = min(k, draft.max_positions - len(self.seq.token_ids) + 1)
        if k <= 0:
            return DraftBlock.empty()
        keep = self.seq.sync(self.seq.token_ids)
        logits = self.seq.feed(self.seq.token_ids[keep:], keep=1)  # [1, V]
        generator = step_generator(self.seed, len(self.seq.token_ids))
        tokens: list[int] = []
        q_ids: list[torch.Tensor] = []
        q_probs: list[torch.Tensor] = []
        eos = self._proposer.eos_ids
        for j in range(k):
            logits = mask_unemittable(logits, draft.emittable_vocab)
            if self.sampling.greedy:
                token = int(greedy_token(logits[0]))
            else:
                ids, q = restrict_support(warp_probs(logits, self.sampling), self._proposer.top_m)  # [1, M]
                pick = int(torch.multinomial(q[0], 1, generator=generator))
                token = int(ids[0, pick])
                q_ids.append(ids[0])
                q_probs.append(q[0])
            tokens.append(token)
            if token in eos or j == k - 1:
                break  # never propose past an EOS; the last draft need not be fed
            logits = self.seq.feed([token])  # [1, V]
        ids_t = torch.tensor(tokens, dtype=torch.long)
        if self.sampling.greedy:
            return DraftBlock(token_ids=ids_t)
        return DraftBlock(token_ids=ids_t, q_ids=torch.stack(q_ids), q_probs=torch.stack(q_probs).float())

    def commit(self, token_ids: Sequence[int]) -> None:
        self.seq.commit(token_ids)

    def close(self) -> None:
        self.seq.close()


class DraftModelProposer:
    """Drafts with a small causal LM that shares the target's vocabulary.

    Args:
        draft: the loaded draft model (checked against the target beforehand with
            :func:`specdec.models.vocab.check_pair_compatible`).
        top_m: support size M of the proposal distribution under sampling.
        eos_ids: ids after which nothing is proposed (defaults to the draft's EOS ids).
    """

    name = "draft"

    def __init__(self, draft: LoadedModel, top_m: int = DEFAULT_TOP_M, eos_ids: Sequence[int] | None = None):
        if top_m < 1:
            raise ValueError(f"top_m must be >= 1, got {top_m}")
        self.draft = draft
        self.top_m = top_m
        self.eos_ids = set(eos_ids if eos_ids is not None else draft.eos_token_ids)

    def open_session(self, token_ids: Sequence[int], sampling: SamplingParams, seed: int) -> DraftModelSession:
        return DraftModelSession(self, token_ids, sampling, seed)
