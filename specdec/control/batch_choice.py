"""The K per tenant that maximises the batch's expected tokens/s (one decision, plain functions).

Part of :mod:`specdec.control.batch_k` (module docstring there: the objective
Σ_t n_t · E[N(α_t, K_t)] / T(K) under fair shares of the positions budget).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from specdec.control.batch_cost import BatchCostModel
from specdec.control.objective import expected_tokens_per_step


@dataclass(frozen=True)
class TenantLoad:
    """One tenant's part of the batch, for :func:`choose_batch_ks`.

    Attributes:
        sessions: its running sessions (rows).
        alpha: its acceptance estimate α̂.
        weight: its fair-share weight.
        k_min, k_max: its allowed K range.
        drafted: whether its proposer runs draft forwards (draft model) or not (prompt lookup).
        fixed_k: a K the policy pins (then no choice is made).
        catchup_s: seconds the draft needs, once, to catch up with the tokens of its sessions
            it has not seen (:meth:`BatchCostModel.catchup_s`) before they can draft; charged
            when the choice gives the tenant K > 0 (0: none behind).
        tokens_left: the tokens its sessions have left to generate, on average (None:
            unknown); the catch-up is spread over the steps that leaves at its K.
    """

    sessions: int
    alpha: float
    weight: float = 1.0
    k_min: int = 0
    k_max: int = 8
    drafted: bool = True
    fixed_k: int | None = None
    catchup_s: float = 0.0
    tokens_left: float | None = None


@dataclass
class BatchKDecision:
    """The K per tenant chosen for the current batch and what the model predicts for it."""

    ks: dict[str, int]
    tokens_per_s: float
    step_s: float
    positions: int
    rows: int
    by_tenant_share: dict[str, int] = field(default_factory=dict)


def _evaluate(loads: dict[str, TenantLoad], ks: dict[str, int], cost: BatchCostModel,
              horizon: int, memo: dict | None = None) -> tuple[float, float]:
    per_session_k: list[int] = []
    drafted: list[bool] = []
    tokens = 0.0
    catchup = 0.0
    for name, load in loads.items():
        per_session_k += [ks[name]] * load.sessions
        drafted += [load.drafted] * load.sessions
        tokens += load.sessions * expected_tokens_per_step(min(max(load.alpha, 0.0), 1.0), ks[name])
        if ks[name] > 0 and load.drafted and load.catchup_s > 0:
            steps = (horizon if load.tokens_left is None else
                     load.tokens_left / expected_tokens_per_step(min(max(load.alpha, 0.0), 1.0), ks[name]))
            catchup += load.catchup_s / max(steps, 1.0)
    step = cost.step_s(per_session_k, drafted, memo)
    return tokens / max(step + catchup, 1e-12), step  # a step priced at 0 s (all measured 0): no crash


def choose_batch_ks(loads: dict[str, TenantLoad], cost: BatchCostModel, budget: int,
                    horizon: int = 32) -> BatchKDecision:
    """K per tenant maximising the batch's expected tokens/s under fair shares of ``budget``.

    A tenant given K > 0 whose draft is behind (``TenantLoad.catchup_s`` > 0) pays that catch-up
    once, spread over the batch steps its sessions have left at that K, H_t = tokens_left /
    E[N(α_t, K_t)] (``horizon`` steps when ``tokens_left`` is unknown; at least 1):
    tokens/s = tokens / (T(K) + Σ_t catch-up_t / H_t) (``step_s`` of the decision is T(K) alone). Exhaustive over the K ranges for up to three
    adjustable tenants (at most 17³ evaluations), coordinate ascent beyond.

    Raises:
        ValueError: ``budget < 1`` or ``horizon < 1``.
    """
    if budget < 1 or horizon < 1:
        raise ValueError(f"budget and horizon must be >= 1, got {budget}, {horizon}")
    active = {t: l for t, l in loads.items() if l.sessions > 0}
    total_w = sum(max(l.weight, 1e-9) for l in active.values()) or 1.0
    options: dict[str, list[int]] = {}
    shares: dict[str, int] = {}
    for t, l in active.items():
        share = max(l.sessions, int(budget * max(l.weight, 1e-9) / total_w))
        shares[t] = share
        if l.fixed_k is not None:
            options[t] = [l.fixed_k]
            continue
        # K + 1 positions per session, within the tenant's share (K >= k_min always allowed)
        k_cap = max(l.k_min, min(l.k_max, share // l.sessions - 1))
        options[t] = list(range(l.k_min, k_cap + 1))
    names = list(options)
    memo: dict = {}  # the forwards' prices, computed once per decision (BatchCostModel.step_s)
    best: tuple[float, float, dict[str, int]] | None = None
    if not names:
        return BatchKDecision({}, 0.0, 0.0, 0, 0, {})
    combos = 1
    for n in names:
        combos *= len(options[n])
    if combos <= 5000:
        candidates = (dict(zip(names, c)) for c in itertools.product(*(options[n] for n in names)))
        for ks in candidates:
            tps, step = _evaluate(active, ks, cost, horizon, memo)
            if best is None or tps > best[0] + 1e-12:
                best = (tps, step, ks)
    else:
        ks = {n: options[n][0] for n in names}
        for _ in range(4):
            for n in names:
                scored = []
                for k in options[n]:
                    trial = dict(ks, **{n: k})
                    scored.append((_evaluate(active, trial, cost, horizon, memo)[0], k))
                ks[n] = max(scored)[1]
        tps, step = _evaluate(active, ks, cost, horizon, memo)
        best = (tps, step, ks)
    tps, step, ks = best
    return BatchKDecision(
        ks=dict(ks), tokens_per_s=tps, step_s=step,
        positions=sum(active[t].sessions * (k + 1) for t, k in ks.items()),
        rows=sum(l.sessions for l in active.values()), by_tenant_share=shares,
    )
