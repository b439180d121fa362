"""K under load: speculation lengths per tenant that maximise the tokens/s of the whole batch.

With continuous batching one target forward verifies every running session, so a tenant's K
costs everyone: a step takes

    T(K) = Σ_{j < max K} D(rows drafting at position j) + V(rows, P),   P = Σ_sessions (K_s + 1)

seconds (D: one batched draft forward, V: one batched verify forward, both measured by
:class:`BatchCostModel`), and emits Σ_s E[N(α_t(s), K_s)] tokens (E[N] of Leviathan et al. 2023,
§3.3, per tenant acceptance α̂). :func:`choose_batch_ks` picks one K per tenant maximising

    tokens/s = Σ_t n_t · E[N(α_t, K_t)] / T(K)

within each tenant's K range, under a fair share of the positions budget: tenant t may use at
most max(n_t, B · w_t / Σ_active w) positions (weights from the tenant policy). A tenant whose
speculation slows the others more than it gains lands at K = 0 because that maximises the sum.
This extends :mod:`specdec.controller` (one request's step time) to the batch; the per-tenant
α̂ comes from the same :class:`specdec.control.acceptance.AcceptanceEstimator`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from specdec.control.acceptance import AcceptanceEstimator
from specdec.control.objective import expected_tokens_per_step
from specdec.control.cost_model import CostModel


class BatchCostModel:
    """Measured seconds of batched forwards, as functions of what the batch holds.

    - ``verify_s(rows, positions)``: one batched target forward of ``positions`` positions over
      ``rows`` sessions = a per-positions curve (measured per positions, interpolated as
      :meth:`specdec.control.cost_model.CostModel.verify_s`) + ``row_s`` per row beyond the first
      (cache gathering, per-row decisions; an EWMA of the residuals).
    - ``draft_s(rows)``: one batched draft forward (one draft position) of ``rows`` sessions.

    Args:
        max_positions: largest positions count recorded (the positions budget, or more).
        prior_verify_s, prior_draft_s: priors of a 1-position verify and a 1-row draft forward.
    """

    def __init__(self, *, max_positions: int = 4096, prior_verify_s: float = 0.05, prior_draft_s: float = 0.01):
        self.verify = CostModel(prior_verify_s=prior_verify_s, prior_verify_slope=0.05, max_positions=max_positions)
        self.draft = CostModel(prior_verify_s=prior_draft_s, prior_verify_slope=0.05, max_positions=max_positions)
        self._row_s = 0.0
        self._row_n = 0

    def observe_verify(self, rows: int, positions: int, seconds: float) -> None:
        """One batched verify forward of ``rows`` sessions and ``positions`` positions took ``seconds``."""
        if rows < 1 or positions < rows:
            raise ValueError(f"need 1 <= rows <= positions, got rows={rows}, positions={positions}")
        if rows > 1 and positions in self.verify._verify:
            residual = (seconds - self.verify.verify_s(positions)) / (rows - 1)
            self._row_n += 1
            self._row_s += max(0.2, 1.0 / self._row_n) * (max(residual, 0.0) - self._row_s)
        self.verify.observe_verify(positions, seconds)

    def observe_draft(self, rows: int, seconds: float) -> None:
        """One batched draft forward (one draft position) of ``rows`` sessions took ``seconds``."""
        self.draft.observe_verify(rows, seconds)

    def verify_s(self, rows: int, positions: int) -> float:
        return self.verify.verify_s(positions) + self._row_s * max(0, rows - 1)

    def draft_s(self, rows: int) -> float:
        return 0.0 if rows <= 0 else self.draft.verify_s(rows)

    def step_s(self, ks: Sequence[int], drafted: Sequence[bool]) -> float:
        """Seconds of one batched step where session s drafts ``ks[s]`` tokens (0: plain decoding).

        Args:
            ks: K per session.
            drafted: whether session s's drafts need draft forwards (False for prompt lookup).
        """
        drafting = [k for k, d in zip(ks, drafted) if d and k > 0]
        t = sum(self.draft_s(sum(1 for k in drafting if k > j)) for j in range(max(drafting, default=0)))
        return t + self.verify_s(len(ks), sum(k + 1 for k in ks))

    def snapshot(self) -> dict:
        return {"verify_s_by_positions": self.verify.snapshot()["verify_s"], "verify_row_s": self._row_s,
                "draft_s_by_rows": self.draft.snapshot()["verify_s"]}


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
    """

    sessions: int
    alpha: float
    weight: float = 1.0
    k_min: int = 0
    k_max: int = 8
    drafted: bool = True
    fixed_k: int | None = None


@dataclass
class BatchKDecision:
    """The K per tenant chosen for the current batch and what the model predicts for it."""

    ks: dict[str, int]
    tokens_per_s: float
    step_s: float
    positions: int
    rows: int
    by_tenant_share: dict[str, int] = field(default_factory=dict)


def _evaluate(loads: dict[str, TenantLoad], ks: dict[str, int], cost: BatchCostModel) -> tuple[float, float]:
    per_session_k: list[int] = []
    drafted: list[bool] = []
    tokens = 0.0
    for name, load in loads.items():
        per_session_k += [ks[name]] * load.sessions
        drafted += [load.drafted] * load.sessions
        tokens += load.sessions * expected_tokens_per_step(min(max(load.alpha, 0.0), 1.0), ks[name])
    step = cost.step_s(per_session_k, drafted)
    return tokens / step, step


def choose_batch_ks(loads: dict[str, TenantLoad], cost: BatchCostModel, budget: int) -> BatchKDecision:
    """K per tenant maximising the batch's expected tokens/s under fair shares of ``budget``.

    Exhaustive over the K ranges for up to three adjustable tenants (at most 17³ evaluations),
    coordinate ascent beyond.

    Raises:
        ValueError: ``budget < 1``.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
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
    best: tuple[float, float, dict[str, int]] | None = None
    if not names:
        return BatchKDecision({}, 0.0, 0.0, 0, 0, {})
    combos = 1
    for n in names:
        combos *= len(options[n])
    if combos <= 5000:
        candidates = (dict(zip(names, c)) for c in itertools.product(*(options[n] for n in names)))
        for ks in candidates:
            tps, step = _evaluate(active, ks, cost)
            if best is None or tps > best[0] + 1e-12:
                best = (tps, step, ks)
    else:
        ks = {n: options[n][0] for n in names}
        for _ in range(4):
            for n in names:
                scored = []
                for k in options[n]:
                    trial = dict(ks, **{n: k})
                    scored.append((_evaluate(active, trial, cost)[0], k))
                ks[n] = max(scored)[1]
        tps, step = _evaluate(active, ks, cost)
        best = (tps, step, ks)
    tps, step, ks = best
    return BatchKDecision(
        ks=dict(ks), tokens_per_s=tps, step_s=step,
        positions=sum(active[t].sessions * (k + 1) for t, k in ks.items()),
        rows=sum(l.sessions for l in active.values()), by_tenant_share=shares,
    )


class BatchKController:
    """Chooses K per tenant for a :class:`specdec.engine.batch.BatchScheduler` from what its ticks measure.

    The scheduler reports every tick (:meth:`observe_tick`) and every verified row
    (:meth:`observe_row`); before planning a tick it asks :meth:`decide` with the running
    sessions per tenant. Requests submitted as adaptive use ``min(request K, tenant K)``.

    Args:
        budget: the scheduler's positions budget.
        weights: tenant -> fair-share weight (default 1).
        k_ranges: tenant -> (k_min, k_max) (default 0..8).
        estimator: acceptance estimator (keys ``(tenant, proposer)``).
        cost: batch cost model.
    """

    def __init__(self, budget: int, *, weights: dict[str, float] | None = None,
                 k_ranges: dict[str, tuple[int, int]] | None = None,
                 estimator: AcceptanceEstimator | None = None, cost: BatchCostModel | None = None):
        self.budget = budget
        self.weights = dict(weights or {})
        self.k_ranges = dict(k_ranges or {})
        self.estimator = estimator or AcceptanceEstimator()
        self.cost = cost or BatchCostModel(max_positions=max(4096, budget * 4))
        self.last: BatchKDecision | None = None
        #: tenant -> the K chosen for it at the last decision that included it
        self.k_by_tenant: dict[str, int] = {}
        #: (rows, positions) of every verify forward seen, for statistics
        self.batches: list[tuple[int, int]] = []

    def observe_row(self, tenant: str, proposer: str, k: int, accepted: int) -> None:
        self.estimator.record((tenant, proposer), k, accepted)

    def observe_tick(self, rows: int, positions: int, verify_s: float, draft_forwards: Sequence[tuple[int, float]] = ()) -> None:
        """A tick's verify forward (rows, positions fed, seconds) and its draft forwards (rows, seconds)."""
        if rows >= 1 and positions >= rows:
            self.cost.observe_verify(rows, positions, verify_s)
            self.batches.append((rows, positions))
        for r, s in draft_forwards:
            if r >= 1:
                self.cost.observe_draft(r, s)

    def decide(self, sessions: dict[tuple[str, str], int]) -> BatchKDecision:
        """K per tenant for the running sessions ``{(tenant, proposer): count}`` (one proposer per tenant used)."""
        loads: dict[str, TenantLoad] = {}
        for (tenant, proposer), n in sessions.items():
            lo, hi = self.k_ranges.get(tenant, (0, 8))
            prev = loads.get(tenant)
            loads[tenant] = TenantLoad(
                sessions=n + (prev.sessions if prev else 0),
                alpha=self.estimator.alpha((tenant, proposer)),
                weight=self.weights.get(tenant, 1.0), k_min=lo, k_max=hi, drafted=proposer == "draft",
            )
        self.last = choose_batch_ks(loads, self.cost, self.budget)
        self.k_by_tenant.update(self.last.ks)
        return self.last

    def k_for(self, tenant: str) -> int | None:
        """The K chosen for ``tenant`` at the last decision (None before any)."""
        return None if self.last is None else self.last.ks.get(tenant)

    def stats(self) -> dict:
        """Plain data for tenant stats / metrics: K per tenant, batch shape seen, cost terms, α̂."""
        recent = self.batches[-50:]
        return {
            "k_by_tenant": dict(self.k_by_tenant),
            "predicted_tokens_per_s": self.last.tokens_per_s if self.last else None,
            "mean_rows_per_forward": sum(r for r, _ in recent) / len(recent) if recent else None,
            "mean_positions_per_forward": sum(p for _, p in recent) / len(recent) if recent else None,
            "alpha": {f"{t}/{p}": self.estimator.alpha((t, p)) for t, p in self.estimator.keys()},
            "cost": self.cost.snapshot(),
        }
