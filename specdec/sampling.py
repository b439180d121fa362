"""Logits to token distributions, applied identically to draft (q) and target (p).

Speculative sampling is exact for the *warped* target distribution only if the draft's
distribution is warped by the same rule (Leviathan et al. 2023, §2.3 applies to any pair of
distributions p, q; we apply temperature → top-k → top-p to both). Greedy decoding uses
:func:`greedy_token` everywhere: argmax with the lowest id winning ties.
"""

from __future__ import annotations

import torch

from specdec.request import SamplingParams


_SEED_MIX = 0x9E3779B97F4A7C15


def derive_seeds(seed: int) -> tuple[int, int]:
    """Split a request seed into independent seeds for the draft and the target sides."""
    return seed % 2**63, (seed * _SEED_MIX + 1) % 2**63


def step_generator(seed: int, position: int) -> torch.Generator:
    """The random generator of one speculation step, seeded from (seed, position).

    Seeding per step from the committed length (tokens) instead of carrying one generator
    through the request makes a seeded request reproducible even when a session is rebuilt from
    its token history on another replica: the same position gives the same random stream.
    """
    return torch.Generator().manual_seed((seed * _SEED_MIX + position * 0xBF58476D1CE4E5B9 + 1) % 2**63)


def mask_unemittable(logits: torch.Tensor, emittable: int) -> torch.Tensor:
    """Set logits of ids ``>= emittable`` (padding rows of the embedding matrix) to -inf.

    Args:
        logits: ``[..., V]`` float.
        emittable: number of ids the tokenizer knows; ids at or past it are never emitted.

    Returns:
        ``[..., V]`` float, a new tensor when masking was needed, else ``logits`` itself.
    """
    if emittable >= logits.shape[-1]:
        return logits
    out = logits.clone()
    out[..., emittable:] = float("-inf")
    return out


def greedy_token(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim, lowest id on ties (the one tie-break rule of specdec).

    Args:
        logits: ``[..., V]`` float.

    Returns:
        ``[...]`` int64.
    """
    # torch.argmax returns the first maximal index; made explicit so the rule cannot drift.
    top = logits.max(dim=-1, keepdim=True).values
    is_top = logits == top
    ids = torch.arange(logits.shape[-1], device=logits.device).expand_as(logits)
    big = torch.full_like(ids, logits.shape[-1])
    return torch.where(is_top, ids, big).min(dim=-1).values


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the sampling distribution: temperature, then top-k, then top-p.

    Follows the semantics of transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper``
    (ties with the k-th value are kept) and ``TopPLogitsWarper`` (the smallest set whose
    mass reaches ``top_p`` is kept, at least one token).

    Args:
        logits: ``[N, V]`` float32 (already masked to emittable ids).
        params: sampling parameters; ``params.temperature`` must be > 0.

    Returns:
        ``[N, V]`` float32 probabilities; rows sum to 1 and are 0 outside the allowed set.

    Raises:
        ValueError: when called with temperature 0 (greedy has no distribution).
    """
    if params.temperature <= 0:
        raise ValueError("warp_probs needs temperature > 0; greedy decoding uses greedy_token")
    # Shift by the row maximum before dividing: softmax, top-k and top-p do not change, and a tiny
    # temperature (1e-40) then drives the other scores to -inf instead of overflowing the
    # maximum to inf (inf - inf = nan): the distribution tends to the argmax, as it should.
    # Temperatures below float32's smallest normal number act as that number (the result is the
    # argmax either way; 0 / a float32-rounded 1e-300 would be 0 / 0).
    logits = logits.float()
    temperature = max(float(params.temperature), torch.finfo(torch.float32).tiny)
    scores = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1.0 - params.top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(dim=-1)


def restrict_support(probs: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Restrict each row of a distribution to its ``m`` most likely ids and renormalise.

    The result is the proposal distribution q' a draft samples from and sends to the verifier:
    sparse (``m`` ids per position instead of the whole vocabulary) and still exact, because
    rejection sampling is exact for any proposal distribution the verifier knows.

    Args:
        probs: ``[N, V]`` float32 rows summing to 1.
        m: support size per row (clipped to V).

    Returns:
        ``(ids, q)``: ``[N, m]`` int64 ids sorted by probability, ``[N, m]`` float32 summing to 1
        per row (ids outside the original support carry probability 0).
    """
    m = min(m, probs.shape[-1])
    q, ids = torch.topk(probs, m, dim=-1)
    q = q / q.sum(dim=-1, keepdim=True)
    return ids, q
