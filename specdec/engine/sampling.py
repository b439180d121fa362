"""Logits to token distributions, applied identically to draft (q) and target (p).

Speculative sampling is exact for the *warped* target distribution only if the draft's
distribution is warped by the same rule (Leviathan et al. 2023, §2.3 applies to any pair of
distributions p, q; we apply temperature → top-k → top-p to both). Greedy decoding uses
:func:`greedy_token` everywhere: argmax with the lowest id winning ties.
"""

from __future__ import annotations

import hashlib

import torch

from specdec.request import SamplingParams


#: The two sides of a speculation step that draw random numbers.
DRAFT, TARGET = "draft", "target"
_SIDE_BIT = {DRAFT: 0, TARGET: 1}

#: Where every random draw of sampling and verification is made: the CPU generator, whatever
#: device the models run on, so a seeded request gives the same draws on any device and layout
#: (values are moved to the model's device after drawing where needed).
RANDOM_DEVICE = torch.device("cpu")


def _hash64(*parts: object) -> int:
    """A 64-bit integer from blake2b over the parts' text (stable across processes and hosts)."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8, person=b"specdec-seed").digest(), "little")


def derive_seeds(seed: int) -> tuple[int, int]:
    """Split a request seed into the draft side's and the target side's seeds (63-bit each).

    A hash, not an affine mix: seeds that differ only in high bits give unrelated values.
    The streams of the two sides are kept apart by :func:`step_generator` whatever these are.
    """
    return _hash64(DRAFT, seed) >> 1, _hash64(TARGET, seed) >> 1


def stream_seed(side: str, seed: int, position: int) -> int:
    """The seed of one (side, seed, position) random stream: a 32-bit value.

    torch's CPU generator (mt19937) keeps only the low 32 bits of ``manual_seed``, so the value is
    32 bits on purpose: 31 bits of blake2b over (seed, position) and, as the lowest bit, the
    side (0 draft, 1 target). A draft stream and a target stream therefore never coincide, for
    any seeds and positions; two (seed, position) pairs of one side collide only by hash
    chance (2^-31), never structurally (seeds differing only above bit 32 no longer alias).

    Args:
        side: :data:`DRAFT` or :data:`TARGET`.
        seed: the side's seed (any non-negative int).
        position: the committed length (tokens) the step starts from.

    Raises:
        ValueError: an unknown side.
    """
    if side not in _SIDE_BIT:
        raise ValueError(f"side must be {DRAFT!r} or {TARGET!r}, got {side!r}")
    return ((_hash64(seed, position) & 0x7FFFFFFF) << 1) | _SIDE_BIT[side]


def step_generator(seed: int, position: int, side: str) -> torch.Generator:
    """The CPU random generator of one speculation step, seeded from (side, seed, position).

    Seeding per step from the committed length (tokens) instead of carrying one generator
    through the request makes a seeded request reproducible even when a session is rebuilt from
    its token history on another replica: the same position gives the same random stream. That
    holds when the rebuilt history ends where a step ended (a :class:`specdec.types.Checkpoint`):
    a step's tokens are not a function of per-token streams (a drafted position and a bonus
    position draw differently), so resuming inside a step's emitted tokens would start a block
    where the uninterrupted run never did. The
    generator is always on :data:`RANDOM_DEVICE` (CPU), so draws do not depend on the model's
    device; see :func:`sample_from` for drawing a token from a distribution on any device.
    """
    return torch.Generator(device=RANDOM_DEVICE).manual_seed(stream_seed(side, seed, position))


def uniform(generator: torch.Generator) -> float:
    """One U[0, 1) draw from ``generator`` (a CPU generator), as a Python float."""
    return float(torch.rand((), generator=generator, device=generator.device))


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one index from the distribution ``probs`` with the CPU ``generator``.

    Args:
        probs: ``[V]`` float, non-negative, on any device (copied to the CPU for the draw, so the
            draw is the same whatever device the distribution was computed on).
        generator: a CPU generator (:func:`step_generator`).

    Returns:
        The drawn index (int).
    """
    return int(torch.multinomial(probs.to(generator.device, torch.float32), 1, generator=generator))


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
    # torch.argmax returns the first maximal index (documented on CPU and CUDA; tests/test_verifier.py
    # pins the rule, full vocabulary size included): one pass over V instead of five, which
    # matters per token with a 151,936-token vocabulary.
    return torch.argmax(logits, dim=-1)


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the sampling distribution: temperature, then top-k, top-p, min-p.

    Follows the semantics of transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper``
    (ties with the k-th value are kept), ``TopPLogitsWarper`` (the smallest set whose
    mass reaches ``top_p`` is kept, at least one token) and ``MinPLogitsWarper`` (ids below
    ``min_p`` times the most likely one's probability are dropped, at least one kept). The
    output-dependent processors (:mod:`specdec.engine.processors`) come before, on the logits.

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
    if params.min_p > 0.0:
        # transformers' MinPLogitsWarper: drop ids below min_p x the top probability (the top kept)
        probs = scores.softmax(dim=-1)
        top = probs.max(dim=-1, keepdim=True).values
        remove = probs < params.min_p * top
        remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(dim=-1)


def restrict_support(probs: torch.Tensor, m: int, emittable: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Restrict each row of a distribution to its ``m`` most likely emittable ids and renormalise.

    The result is the proposal distribution q' a draft samples from and sends to the verifier:
    sparse (``m`` ids per position instead of the whole vocabulary) and still exact, because
    rejection sampling is exact for any proposal distribution the verifier knows.

    Args:
        probs: ``[N, V]`` float32 rows summing to 1 (zero at ids ``>= emittable``).
        m: support size per row (clipped to the ids considered).
        emittable: only ids below this are considered (None: all V). When fewer than ``m`` ids
            have non-zero probability (small top-k or top-p, low temperature) the rest of the
            row is filled with zero-probability ids; with ``emittable`` set these too lie in
            ``0..emittable-1``, never on padding rows a verifier would refuse.

    Returns:
        ``(ids, q)``: ``[N, m]`` int64 ids sorted by probability, ``[N, m]`` float32 summing to 1
        per row (ids outside the original support carry probability 0); on ``probs``' device.
    """
    if emittable is not None and emittable < probs.shape[-1]:
        probs = probs[..., :emittable]
    m = min(m, probs.shape[-1])
    q, ids = torch.topk(probs, m, dim=-1)
    q = q / q.sum(dim=-1, keepdim=True)
    return ids, q
