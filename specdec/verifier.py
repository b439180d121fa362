"""The verifier: the target scores a candidate block in one forward pass and decides.

Greedy: accept the longest prefix of drafts equal to the target's argmax, then emit the
target's argmax at the first disagreement (or after the last draft: the bonus token). The
output is token for token what greedy decoding of the target alone gives.

Sampling: modified rejection sampling (Leviathan et al. 2023, §2.3 and Algorithm 1; Chen et al.
2023, Algorithm 2). Notation follows the papers: p = target distribution, q = proposal
distribution. Draft token x at position i is accepted with probability min(1, p_i(x) / q_i(x));
at the first rejection a token is drawn from norm(max(0, p_i - q_i)); if all K are accepted a
bonus token is drawn from p_{K}. The emitted tokens are distributed exactly as sampling the
target alone.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.kv_cache import CachedSequence
from specdec.models.loaded import LoadedModel
from specdec.request import SamplingParams
from specdec.sampling import greedy_token, mask_unemittable, step_generator, warp_probs
from specdec.types import DraftBlock, VerifyResult


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, list[int]]:
    """Greedy verification of one block.

    Args:
        draft_ids: ``[K]`` int64 proposed tokens.
        target_logits: ``[K + 1, V]`` float, the target's logits at the positions that predict
            each draft token and the one after the last.

    Returns:
        ``(n, tokens)``: n accepted drafts (0..K) and the n + 1 emitted token ids.
    """
    k = int(draft_ids.shape[0])
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits must be [K+1={k + 1}, V], got {tuple(target_logits.shape)}")
    choice = greedy_token(target_logits)  # [K+1] int64
    match = (choice[:k] == draft_ids).long()
    n = int(match.cumprod(dim=0).sum()) if k else 0
    return n, draft_ids[:n].tolist() + [int(choice[n])]


def _dense_q(q_ids: torch.Tensor | None, q_probs: torch.Tensor | None, draft_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Scatter a sparse proposal distribution into ``[K, V]`` float32 (one-hot when q is None)."""
    k = int(draft_ids.shape[0])
    dense = torch.zeros(k, vocab, dtype=torch.float32)
    if q_ids is None:
        dense[torch.arange(k), draft_ids] = 1.0
    else:
        dense.scatter_add_(1, q_ids, q_probs.float())
    return dense


def rejection_sample(
    draft_ids: torch.Tensor,
    q_ids: torch.Tensor | None,
    q_probs: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, list[int]]:
    """Modified rejection sampling of one block (Leviathan et al. 2023, Algorithm 1).

    Args:
        draft_ids: ``[K]`` int64 drafts, sampled from q.
        q_ids: ``[K, M]`` int64 support of q, or None for a deterministic (one-hot) proposal.
        q_probs: ``[K, M]`` float32 q over ``q_ids``.
        p: ``[K + 1, V]`` float32 target distributions (already warped like q).
        generator: the request's own random generator.

    Returns:
        ``(n, tokens)``: n accepted drafts and the n + 1 emitted token ids.
    """
    k = int(draft_ids.shape[0])
    vocab = p.shape[-1]
    q = _dense_q(q_ids, q_probs, draft_ids, vocab)  # [K, V] float32
    for i in range(k):
        x = int(draft_ids[i])
        p_x, q_x = float(p[i, x]), float(q[i, x])
        u = float(torch.rand((), generator=generator))
        if q_x > 0 and u * q_x < p_x:  # u < p_x / q_x, without dividing
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        total = float(residual.sum())
        # p == q exactly (rejection had probability 0): fall back to p itself.
        dist = residual / total if total > 0 else p[i]
        token = int(torch.multinomial(dist, 1, generator=generator))
        return i, draft_ids[:i].tolist() + [token]
    bonus = int(torch.multinomial(p[k], 1, generator=generator))
    return k, draft_ids.tolist() + [bonus]


class TargetSession:
    """Per-sequence target state: committed tokens, KV cache, sampling parameters, generator.

    Known limits: batch size 1 per session (sessions are independent; a serving replica runs
    several sessions side by side, not batched into one forward pass).
    """

    def __init__(
        self,
        verifier: "TargetVerifier",
        token_ids: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        logprobs: bool,
    ):
        self._verifier = verifier
        self.sampling = sampling
        self.want_logprobs = logprobs
        self.seed = seed
        self.seq = CachedSequence(verifier.target.model, list(token_ids))

    @property
    def token_ids(self) -> list[int]:
        """The committed sequence (prompt + generated tokens)."""
        return self.seq.token_ids

    @property
    def committed_len(self) -> int:
        """Length of the committed sequence, in tokens."""
        return len(self.seq.token_ids)

    def verify(self, block: DraftBlock) -> VerifyResult:
        """Score ``block`` with one target forward pass, decide, and commit the emitted tokens.

        Args:
            block: K proposed tokens (K may be 0: plain decoding of one token).

        Returns:
            The :class:`VerifyResult`; the session's committed sequence grows by
            ``result.accepted + 1`` tokens and its cache is cut back to the accepted prefix.

        Raises:
            ValueError: a proposed id outside the target's emittable vocabulary, or a block that
                would use a position at or beyond the target's context limit.
        """
        target = self._verifier.target
        k = block.k
        if k and (int(block.token_ids.min()) < 0 or int(block.token_ids.max()) >= target.emittable_vocab):
            raise ValueError(f"proposed token id outside 0..{target.emittable_vocab - 1}")
        if self.committed_len + k > target.max_positions:
            raise ValueError(
                f"block of K={k} after {self.committed_len} tokens exceeds the target's "
                f"{target.max_positions} positions"
            )
        logits = self.seq.forward_with(block.token_ids.tolist(), last=k + 1)  # [K+1, V] float32
        logits = mask_unemittable(logits, target.emittable_vocab)
        if self.sampling.greedy:
            n, tokens = verify_greedy(block.token_ids, logits)
        else:
            p = warp_probs(logits, self.sampling)  # [K+1, V] float32
            generator = step_generator(self.seed, self.committed_len)
            n, tokens = rejection_sample(block.token_ids, block.q_ids, block.q_probs, p, generator)
        logprobs = None
        if self.want_logprobs:
            lp = torch.log_softmax(logits[: n + 1].float(), dim=-1)  # [n+1, V]
            logprobs = [float(lp[i, t]) for i, t in enumerate(tokens)]
        # Cache now holds committed + all K drafts; keep committed + accepted drafts.
        self.seq.commit(tokens, cached_upto=self.committed_len + n)
        return VerifyResult(accepted=n, token_ids=tokens, logprobs=logprobs, committed_len=self.committed_len)

    def close(self) -> None:
        """Free the KV cache. Idempotent."""
        self.seq.close()


class TargetVerifier:
    """Owns the target model; opens one :class:`TargetSession` per sequence."""

    def __init__(self, target: LoadedModel):
        self.target = target

    def open_session(
        self, token_ids: Sequence[int], sampling: SamplingParams, seed: int, logprobs: bool = False
    ) -> TargetSession:
        """Start verifying after ``token_ids`` (a prompt, or a full history to rebuild from).

        Raises:
            ValueError: empty ``token_ids`` or ids outside the target's vocabulary.
        """
        ids = list(token_ids)
        if not ids:
            raise ValueError("a session needs at least one token")
        if min(ids) < 0 or max(ids) >= self.target.vocab_rows:
            raise ValueError(f"token id outside 0..{self.target.vocab_rows - 1}")
        return TargetSession(self, ids, sampling, seed, logprobs)
