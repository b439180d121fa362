"""The objective K is chosen by: expected tokens per second under measured costs.

Model (Leviathan et al. 2023, §3.3–3.4): with i.i.d. per-token acceptance α a step with K = k
drafts emits on average

    E[N(k)] = (1 - α^(k+1)) / (1 - α)          (k + 1 when α = 1)

tokens and takes ``step_time(k)`` seconds (:class:`specdec.control.cost_model.CostModel`: measured
draft, verify-by-positions and round-trip terms in place of the paper's constant c). The
controller picks the k in the tenant's range maximising tokens per second
``E[N(k)] / step_time(k)``; the predicted speedup is that rate over plain decoding's,
``E[N(k)] · step_time(0) / step_time(k)`` (1 for K = 0 by definition). With
``step_time(k) = 1 + c·k`` this is exactly the paper's S(γ).

Position-dependent acceptance: measured acceptance decays with the draft position
(anchors.md §2.1), so when the estimator has enough data for the leading positions
(``position_min_reached`` decayed trials each), ``E[N(k)] = 1 + Σ_{j<k} Π_{i≤j} α_i`` with the
measured conditional α_i, and the i.i.d. α̂ for positions without enough data.

Variable-length proposers (prompt lookup: K is a cap): :func:`evaluate_variable_k` weighs the
same terms by the distribution of block lengths (:func:`block_length_distribution`); the
model is in :mod:`specdec.control.controller`'s module docstring.

Early stop (a draft-model proposer with ``min_confidence``): K is a cap there too, a block
ends after its first unsure token. With ``h_j`` the probability that a block that drafted
position j ends there (cap above j; learned per position by the controller, extrapolated
beyond the positions seen), the block length d = min(L, K) has

    P(d) = Π_{i<d} (1 - h_i) · h_d  (d < K),    P(K) = Π_{i<K} (1 - h_i)

(:func:`early_stop_lengths`), and K is evaluated as a cap with :func:`evaluate_variable_k`:
E[N(K)] = Σ_d P(d) · E[N | d drafted] and E[T(K)] = Σ_d P(d) · step_time(d), so a block that stops
early costs the draft and verify positions it used, not K's. All ``h_j`` = 0 is the fixed-length
model.

Pure functions of α (or per-position α_i), block lengths and a cost model (anything with
``step_time(k) -> seconds``); the stateful per-tenant choice (hysteresis, probing, policies,
the histograms) is :class:`specdec.control.controller.KController`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: Proposers whose block length is set by the proposer itself (K is a cap, not every block's
#: length: prompt lookup); evaluated with :func:`evaluate_variable_k` (see
#: :mod:`specdec.control.controller`).
VARIABLE_LENGTH_PROPOSERS = frozenset({"ngram"})


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E[N(k)] = (1 - α^(k+1)) / (1 - α), tokens emitted per step (k + 1 at α = 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if alpha > 1.0 - 1e-12:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_per_step_positional(alpha: float, k: int, position_alphas: Sequence[float] = ()) -> float:
    """E[N(k)] = 1 + Σ_{j<k} Π_{i≤j} α_i, with α_i = position_alphas[i] where given, else α."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    total, prod = 1.0, 1.0
    for j in range(k):
        a = position_alphas[j] if j < len(position_alphas) else alpha
        prod *= a
        total += prod
    return total


@dataclass(frozen=True)
class KCandidate:
    """One K considered: expected tokens per step, step seconds, predicted speedup."""

    k: int
    expected_tokens: float
    step_time_s: float
    speedup: float


def evaluate_k(
    alpha: float,
    cost_model,
    k_min: int,
    k_max: int,
    position_alphas: Sequence[float] = (),
) -> list[KCandidate]:
    """Every K in [k_min, k_max] with E[N], step time and speedup over plain decoding."""
    if not 0 <= k_min <= k_max:
        raise ValueError(f"need 0 <= k_min <= k_max, got [{k_min}, {k_max}]")
    t0 = cost_model.step_time(0)
    out = []
    for k in range(k_min, k_max + 1):
        if position_alphas:
            e = expected_tokens_per_step_positional(alpha, k, position_alphas)
        else:
            e = expected_tokens_per_step(alpha, k)
        t = cost_model.step_time(k)
        out.append(KCandidate(k=k, expected_tokens=e, step_time_s=t, speedup=1.0 if k == 0 else e * t0 / t))
    return out


def choose_k(
    alpha: float,
    cost_model,
    k_min: int,
    k_max: int,
    position_alphas: Sequence[float] = (),
) -> tuple[int, float]:
    """The K in [k_min, k_max] maximising expected tokens per second, and its predicted speedup.

    ``cost_model`` is anything with ``step_time(k) -> seconds``. Ties (within 1e-12 relative)
    go to the smaller K. Speedup is relative to plain decoding (K = 0), whether or not K = 0
    is in the range.
    """
    cands = evaluate_k(alpha, cost_model, k_min, k_max, position_alphas)
    best = cands[0]
    for c in cands[1:]:
        if c.speedup > best.speedup * (1 + 1e-12):
            best = c
    return best.k, best.speedup


def block_length_distribution(hist: Sequence[float], cap: int) -> list[float]:
    """``P(ℓ)`` for ℓ = 0..cap from a histogram of observed block lengths (index = length),
    lengths above ``cap`` counted at ``cap`` (what the cap would have cut them to).

    Returns:
        ``cap + 1`` probabilities summing to 1 (all zero when the histogram is empty).
    """
    if cap < 0:
        raise ValueError(f"cap must be >= 0, got {cap}")
    out = [0.0] * (cap + 1)
    for length, w in enumerate(hist):
        out[min(length, cap)] += float(w)
    total = sum(out)
    return [w / total for w in out] if total > 0 else out


def early_stop_lengths(hazards: Sequence[float], cap: int) -> list[float]:
    """``P(d)`` for d = 0..cap of a block capped at ``cap`` whose draft stops after position j
    (1-based) with probability ``hazards[j - 1]`` (module docstring; positions beyond
    ``hazards`` never stop). ``P(0) = 0`` for ``cap >= 1``; ``[1.0]`` for ``cap = 0``.

    Raises:
        ValueError: ``cap < 0`` or a hazard outside [0, 1].
    """
    if cap < 0:
        raise ValueError(f"cap must be >= 0, got {cap}")
    if any(not 0.0 <= h <= 1.0 for h in hazards):
        raise ValueError(f"hazards must be in [0, 1], got {list(hazards)}")
    if cap == 0:
        return [1.0]
    out, alive = [0.0] * (cap + 1), 1.0
    for d in range(1, cap):
        h = hazards[d - 1] if d - 1 < len(hazards) else 0.0
        out[d] = alive * h
        alive *= 1.0 - h
    out[cap] = alive
    return out


def evaluate_variable_k(alpha: float, cost_model, cap: int, lengths: Sequence[float],
                        position_alphas: Sequence[float] = ()) -> KCandidate:
    """A cap ``cap`` of a variable-length proposer: E[N], E[step seconds] and speedup (module doc).

    Args:
        lengths: ``P(ℓ)`` for ℓ = 0..cap (:func:`block_length_distribution`).
    """
    if len(lengths) != cap + 1:
        raise ValueError(f"need {cap + 1} length probabilities, got {len(lengths)}")
    t0 = cost_model.step_time(0)
    if cap == 0:
        return KCandidate(k=0, expected_tokens=1.0, step_time_s=t0, speedup=1.0)
    e = sum(p * expected_tokens_per_step_positional(alpha, ell, position_alphas) for ell, p in enumerate(lengths))
    t = sum(p * cost_model.step_time(ell) for ell, p in enumerate(lengths))
    return KCandidate(k=cap, expected_tokens=e, step_time_s=t, speedup=e * t0 / t)
