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
    #: ``ks`` is where coordinate ascent stopped because no move priced better: no tenant's K alone
    #: and no group move (:func:`_ascend`); a what-if that changes one tenant's load next to it
    #: need only try that tenant's moves (``settled`` of :func:`choose_batch_ks`). False after an
    #: exhaustive search or an ascent stopped by :data:`ASCENT_ROUNDS`.
    settled: bool = False


#: Adjustable tenants (more than one K allowed) up to which :func:`choose_batch_ks` prices every
#: combination of their K, when there are at most :data:`EXHAUSTIVE_CANDIDATES` of them (17³: three
#: tenants of K 0..16, serving's largest); beyond either, coordinate ascent.
EXHAUSTIVE_TENANTS = 3
EXHAUSTIVE_CANDIDATES = 17 ** 3
#: Rounds of coordinate ascent at most (a round that moves no tenant ends it sooner).
ASCENT_ROUNDS = 8


class _Pricer:
    """The candidates of one decision, priced from their tenants' counts.

    A candidate's step is the shape it gives the batch (:meth:`BatchCostModel.shape_s`: rows,
    positions Σ n_t (K_t + 1), and the rows drafting at each draft position), so pricing one
    takes O(tenants + K) arithmetic and the memoised forwards, not a list of every session.
    :meth:`evaluate` gives the same floats, summed in the same order, as pricing the sessions one
    by one (:meth:`BatchCostModel.step_s`); :meth:`trial` prices a change of some tenants' K from
    running totals (O(K) per tenant changed), for the search's comparisons only.
    """

    def __init__(self, loads: dict[str, TenantLoad], options: dict[str, list[int]], cost, horizon: int):
        self.loads, self.cost = loads, cost
        # the forwards' prices, computed once per cost model version (BatchCostModel.prices)
        self.memo: dict = cost.prices() if hasattr(cost, "prices") else {}
        self.rows = sum(load.sessions for load in loads.values())
        self.tokens: dict[str, dict[int, float]] = {}
        self.catchup: dict[str, dict[int, float]] = {}
        for name, load in loads.items():
            alpha = min(max(load.alpha, 0.0), 1.0)
            self.tokens[name], self.catchup[name] = {}, {}
            for k in options.get(name, ()):
                e = expected_tokens_per_step(alpha, k)
                self.tokens[name][k] = load.sessions * e
                if k > 0 and load.drafted and load.catchup_s > 0:
                    steps = horizon if load.tokens_left is None else load.tokens_left / e
                    self.catchup[name][k] = load.catchup_s / max(steps, 1.0)
                else:
                    self.catchup[name][k] = 0.0
        self.top = max((k for o in options.values() for k in o), default=0)
        #: (positions, drafted rows per K) -> the step's seconds: the shapes the search's trials
        #: share (32 tenants of one session at K = 0: every single-tenant trial of a K is one shape)
        self.steps: dict[tuple[int, tuple[int, ...]], float] = {}

    def _step(self, positions: int, drafting: list[int]) -> float:
        """The step's seconds; ``drafting[k]``: drafted rows at K = k (memoised per shape)."""
        key = (positions, tuple(drafting))
        got = self.steps.get(key)
        if got is None:
            got = self.steps[key] = self._price(positions, drafting)
        return got

    def _price(self, positions: int, drafting: list[int]) -> float:
        draft_rows, above = [], 0
        for k in range(len(drafting) - 1, 0, -1):  # rows drafting more than j tokens, from the top down
            above += drafting[k]
            if above:
                draft_rows.append(above)
        draft_rows.reverse()
        return self.cost.shape_s(self.rows, positions, draft_rows, self.memo)

    def _totals(self, ks: dict[str, int]) -> tuple[float, float, int, list[int]]:
        """(tokens, catch-up seconds, positions, drafted rows per K) of the candidate ``ks``, summed
        over the loads in their order (the per-session pricing's order)."""
        tokens = catchup = 0.0
        positions = 0
        drafting = [0] * (self.top + 1)
        for name, load in self.loads.items():
            k = ks[name]
            tokens += self.tokens[name][k]
            catchup += self.catchup[name][k]
            positions += load.sessions * (k + 1)
            if load.drafted and k > 0:
                drafting[k] += load.sessions
        return tokens, catchup, positions, drafting

    def _shifted(self, changes: dict[str, int]) -> tuple[float, float, int, list[int]]:
        """The running totals with the tenants of ``changes`` at their K there (the totals' own
        ``drafting`` list is not changed)."""
        tokens, catchup, positions, drafting = self.sum_tokens, self.sum_catchup, self.positions, self.drafting
        copied = False
        for name, k in changes.items():
            old, load = self.ks[name], self.loads[name]
            tokens += self.tokens[name][k] - self.tokens[name][old]
            catchup += self.catchup[name][k] - self.catchup[name][old]
            positions += load.sessions * (k - old)
            if load.drafted:
                if not copied:
                    drafting, copied = list(drafting), True
                if old > 0:
                    drafting[old] -= load.sessions
                if k > 0:
                    drafting[k] += load.sessions
        return tokens, catchup, positions, drafting

    def evaluate(self, ks: dict[str, int]) -> tuple[float, float]:
        """``(tokens/s, step seconds)`` of the candidate ``ks`` (every load's K)."""
        tokens, catchup, positions, drafting = self._totals(ks)
        step = self._step(positions, drafting)
        return tokens / max(step + catchup, 1e-12), step  # a step priced at 0 s (all measured 0): no crash

    def start(self, ks: dict[str, int]) -> None:
        """Set the running totals of :meth:`trial` to the candidate ``ks`` (exact sums, no drift)."""
        self.ks = dict(ks)
        self.sum_tokens, self.sum_catchup, self.positions, self.drafting = self._totals(ks)

    def trial(self, changes: dict[str, int]) -> float:
        """Tokens/s of the current candidate with the tenants of ``changes`` at their K there (nothing kept)."""
        tokens, catchup, positions, drafting = self._shifted(changes)
        return tokens / max(self._step(positions, drafting) + catchup, 1e-12)

    def move(self, changes: dict[str, int]) -> None:
        """Make the K of the tenants of ``changes`` theirs there, in the running totals."""
        self.sum_tokens, self.sum_catchup, self.positions, self.drafting = self._shifted(changes)
        self.ks.update(changes)


def _evaluate(loads: dict[str, TenantLoad], ks: dict[str, int], cost: BatchCostModel,
              horizon: int) -> tuple[float, float]:
    """``(tokens/s, step seconds)`` of one candidate ``ks`` (K per load) of :func:`choose_batch_ks`."""
    return _Pricer(loads, {n: [k] for n, k in ks.items()}, cost, horizon).evaluate(ks)


def _moves_pay(pricer: _Pricer, options: dict[str, list[int]], adjustable: list[str], top: int, tenant: str,
               tps: float) -> bool:
    """Whether a round of :func:`_ascend` from the pricer's current candidate (at ``tps``) would
    move by a move of ``tenant``: one of its own K, or a group move that includes it, each priced
    as the round prices it before anything moved."""
    if tenant in adjustable:
        cur = pricer.ks[tenant]
        if any(pricer.trial({tenant: k}) > tps * (1 + 1e-12) for k in options[tenant] if k != cur):
            return True
    level = pricer.ks[tenant]
    if tenant not in adjustable or level > top:
        return False
    for step in (1, -1):
        group = {n: level + step for n in adjustable
                 if pricer.ks[n] == level and options[n][0] <= level + step <= options[n][-1]}
        if tenant in group and len(group) > 1 and pricer.trial(group) > tps * (1 + 1e-12):
            return True
    return False


def _ascend(pricer: _Pricer, options: dict[str, list[int]], adjustable: list[str],
            start: dict[str, int] | None = None, settled: str | None = None) -> tuple[dict[str, int], bool]:
    """Coordinate ascent for many adjustable tenants. Two starts: every tenant at its k_min, and
    the best candidate that gives all tenants the same K (clipped to each one's range); with
    ``start`` (a what-if near a decision: :meth:`BatchKController.probe_k`) from that one alone,
    each K clipped to its tenant's range. A round
    moves each tenant in turn to its best K with the others fixed, then tries the group moves:
    every tenant at K = L to L + 1, or to L - 1, together (the draft forwards are shared, so
    raising one tenant alone can cost a whole draft position that several raised together pay
    for); rounds go on until one moves nothing (at most :data:`ASCENT_ROUNDS`). The best of the
    local optima: on 300 random loads of 4-6 tenants (tests/test_batch_choice_search.py) the
    exhaustive optimum in all but a few, within 2 % of it in every one.

    ``settled`` (with ``start``): a tenant such that ``start`` is a settled decision
    (:attr:`BatchKDecision.settled`) of the same loads, prices, budget and horizon but for that
    tenant's acceptance and K range (not its sessions or weight, which move the others' shares), its
    tokens and catch-up at its K in ``start`` unchanged. Every move of another
    tenant then prices as it did when that ascent stopped, none better; so when no move of
    ``settled`` pays (:func:`_moves_pay`), the first round would move nothing and ``start`` is the
    answer without it (a probe's what-if of 32 tenants: ~150 trials -> under 10); otherwise the
    ascent runs as without ``settled``.

    Returns:
        (K per tenant, whether the ascent stopped because no move paid: the decision's ``settled``).
    """
    top = max((options[n][-1] for n in adjustable), default=0)
    if start is not None:
        starts = [{n: min(max(start.get(n, o[0]), o[0]), o[-1]) for n, o in options.items()}]
        if settled is not None and settled in options and starts[0] == start:
            pricer.start(starts[0])
            if not _moves_pay(pricer, options, adjustable, top, settled, pricer.evaluate(pricer.ks)[0]):
                return dict(pricer.ks), True
    else:
        uniform = []
        for k in range(top + 1):
            ks = {n: (min(max(k, o[0]), o[-1])) for n, o in options.items()}
            uniform.append((pricer.evaluate(ks)[0], k, ks))
        starts = [uniform[0][2], max(uniform, key=lambda u: u[0])[2]]
    best: tuple[float, dict[str, int], bool] | None = None
    for ks in starts:
        pricer.start(ks)
        tps = pricer.evaluate(pricer.ks)[0]
        converged = False
        for _ in range(ASCENT_ROUNDS):
            moved = False
            for n in adjustable:
                cur = pricer.ks[n]
                for k in options[n]:
                    if k != cur:
                        t = pricer.trial({n: k})
                        if t > tps * (1 + 1e-12):
                            tps, cur = t, k
                if cur != pricer.ks[n]:
                    pricer.move({n: cur})
                    moved = True
            for level in range(top + 1):
                for step in (1, -1):
                    group = {n: level + step for n in adjustable
                             if pricer.ks[n] == level and options[n][0] <= level + step <= options[n][-1]}
                    if len(group) > 1:
                        t = pricer.trial(group)
                        if t > tps * (1 + 1e-12):
                            tps = t
                            pricer.move(group)
                            moved = True
            if not moved:
                converged = True
                break
            pricer.start(pricer.ks)  # the running totals re-summed exactly each round
            tps = pricer.evaluate(pricer.ks)[0]
        if best is None or tps > best[0] + 1e-12:
            best = (tps, dict(pricer.ks), converged)
    return best[1], best[2]


def choose_batch_ks(loads: dict[str, TenantLoad], cost: BatchCostModel, budget: int,
                    horizon: int = 32, start: dict[str, int] | None = None,
                    settled: str | None = None) -> BatchKDecision:
    """K per tenant maximising the batch's expected tokens/s under fair shares of ``budget``.

    A tenant given K > 0 whose draft is behind (``TenantLoad.catchup_s`` > 0) pays that catch-up
    once, spread over the batch steps its sessions have left at that K, H_t = tokens_left /
    E[N(α_t, K_t)] (``horizon`` steps when ``tokens_left`` is unknown; at least 1):
    tokens/s = tokens / (T(K) + Σ_t catch-up_t / H_t) (``step_s`` of the decision is T(K) alone).

    Exhaustive over the K ranges for up to :data:`EXHAUSTIVE_TENANTS` adjustable tenants (at most
    :data:`EXHAUSTIVE_CANDIDATES` candidates), coordinate ascent beyond (:func:`_ascend`: a local
    optimum; until session 27 the search was exhaustive up to 5000 candidates, e.g. 4 tenants of K
    0..4). Each candidate is priced from its tenants' counts (:class:`_Pricer`: O(tenants + K)
    each, a change of some tenants' K O(K) per tenant), and the forwards' prices are shared by the
    decisions of one cost version (:meth:`BatchCostModel.prices`). A tick's controller work
    (decision and probes, 2-core EPYC, docs/bench/batching/tenants-s27/), median / largest: 4
    tenants 6.3 / 33 ms before, 0.36 / 1.3 after; 32 tenants 14 / 451 ms before, 1.4 / 21 after.

    ``start``: K per tenant to start the coordinate ascent from, alone (a what-if of one tenant's
    acceptance next to a decision, whose optimum lies near it); no effect on an exhaustive search.
    ``settled``: with ``start`` a settled decision (:attr:`BatchKDecision.settled`) of the same
    loads, prices, budget and horizon but for this tenant's acceptance and K range (its tokens and
    catch-up at its K in ``start`` unchanged): only its moves are tried first (:func:`_ascend`); the
    same answer.

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
    if not names:
        return BatchKDecision({}, 0.0, 0.0, 0, 0, {})
    pricer = _Pricer(active, options, cost, horizon)
    adjustable = [n for n in names if len(options[n]) > 1]
    combos = 1
    for n in adjustable:
        combos *= len(options[n])
    if len(adjustable) <= EXHAUSTIVE_TENANTS and combos <= EXHAUSTIVE_CANDIDATES:
        best: tuple[float, float, dict[str, int]] | None = None
        for c in itertools.product(*(options[n] for n in names)):
            ks = dict(zip(names, c))
            tps, step = pricer.evaluate(ks)
            if best is None or tps > best[0] + 1e-12:
                best = (tps, step, ks)
        tps, step, ks = best
        converged = False
    else:
        ks, converged = _ascend(pricer, options, adjustable, start, settled)
        tps, step = pricer.evaluate(ks)
    return BatchKDecision(
        ks=dict(ks), tokens_per_s=tps, step_s=step,
        positions=sum(active[t].sessions * (k + 1) for t, k in ks.items()),
        rows=sum(l.sessions for l in active.values()), by_tenant_share=shares, settled=converged,
    )
