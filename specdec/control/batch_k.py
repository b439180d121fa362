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

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from specdec.control.acceptance import AcceptanceEstimator
from specdec.control.objective import expected_tokens_per_step
from specdec.control.cost_model import CostModel


class BatchCostModel:
    """Measured seconds of batched forwards, as functions of what the batch holds.

    - ``verify_s(rows, positions)``: one batched target forward of ``positions`` positions over
      ``rows`` sessions = a per-positions curve + ``row_s`` per row beyond the first (cache
      gathering, per-row decisions; an EWMA of the residuals against the curve). The curve is
      an EWMA of the measured seconds per positions count, linear between measured counts,
      above the largest on the least-squares slope of the measured points (never decreasing),
      and **below the smallest on the line through the origin**: ``t_lo · positions / p_lo``;
      above the largest, from the dearest measured forward on the least-squares slope of the
      measured points, clamped at >= 0 (``extrapolation="monotone"`` of
      :class:`specdec.control.cost_model.CostModel`).
    - ``draft_s(rows)``: one batched draft forward (one draft position) of ``rows`` sessions.

    Why the origin below. The first forwards a replica measures are its prompts' prefill
    chunks (tens to hundreds of positions); every decode forward (rows · (K + 1) positions) lies
    below them. Extrapolated on the measured slope, which between two noisy prefill forwards
    is often <= 0 and then clamped flat (the per-request model's ``below="trend"``), a decode
    forward of 8 positions (K = 0) and one of 40 (K = 4) were both predicted at the prefill's
    5.5 s: speculation looked free, the controller chose K = 4, and running at K = 4 it never
    measured a forward small enough to learn otherwise (served, int4 target, 2-core CPU,
    docs/bench/batching/int4/served-tenants-guard.md); and above the largest, 72 positions (K = 8)
    at the 64-position forward's 3.1 s, cheaper than the 57-position one. Proportional extrapolation is exact
    where a forward's cost is linear in its positions (compute-bound: the CPU), and elsewhere
    (memory-bound: a GPU's small forwards cost about the same) it errs towards the smaller
    forward: the controller then runs it and measures a decode-sized forward, after which the
    curve is interpolated between measured points. The flat error never corrects itself, this
    one does after one decision.

    Args:
        max_positions: largest positions count recorded (the positions budget, or more).
        prior_verify_s, prior_draft_s: priors of a 1-position verify and a 1-row draft forward
            (seconds).
        verify_extrapolation: of the verify curve outside its measured positions counts,
            ``"monotone"`` (above) or ``"trend"`` (the model before it, kept for comparison in
            tests).
    """

    def __init__(self, *, max_positions: int = 4096, prior_verify_s: float = 0.05, prior_draft_s: float = 0.01,
                 verify_extrapolation: str = "monotone"):
        self.verify = CostModel(prior_verify_s=prior_verify_s, prior_verify_slope=0.05, max_positions=max_positions,
                                extrapolation=verify_extrapolation)
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


@dataclass
class _ProbeState:
    """Per tenant: its steps held at K = 0 since the last probe, the probe in progress."""

    held: int = 0  # steps at K = 0 since the last probe (or since it was held)
    interval: int = 0  # held steps before the next probe (grows while probes find nothing)
    left: int = 0  # steps left in the probe in progress
    k: int = 0  # the probe's K


class BatchKController:
    """Chooses K per tenant for a :class:`specdec.engine.batch.BatchScheduler` from what its ticks measure.

    The scheduler reports every tick (:meth:`observe_tick`) and every verified row
    (:meth:`observe_row`); before planning a tick it asks :meth:`decide` with the running
    sessions per tenant. A step of an adaptive request takes its K from :meth:`step_k`:
    ``min(request K, tenant K)``, or a probe's K.

    **Probes of a tenant held at K = 0.** A K = 0 step drafts nothing, so it teaches nothing
    about acceptance: without probes a tenant held at K = 0 stays there after its traffic became
    predictable. After ``probe_every`` steps of the tenant at K = 0 (over all its sessions),
    its next ``probe_steps`` steps are a probe, at the K the batch optimum
    (:func:`choose_batch_ks`, same load, same costs) would give the tenant if its acceptance were
    ``probe_alpha`` (the K a tenant whose traffic turned predictable would get; no probe when
    even that is K = 0: speculation cannot pay under this load at any plausible acceptance).
    When the probe starts, the tenant's old counts are scaled down to ``probe_memory`` trials
    (:meth:`AcceptanceEstimator.cap_evidence`): they predate the time at K = 0 (the step-based
    decay stood still meanwhile), so the probe's few steps move α̂ most of the way to what they
    measure, and the next decision (made as each probe step is recorded) returns the tenant to
    K > 0 if speculation pays at the measured acceptance. A probe that leaves the tenant at
    K = 0 doubles the interval before the next one, up to ``probe_every · probe_backoff``
    steps, so that a tenant whose drafts do not agree pays at most ``probe_steps /
    (probe_every · probe_backoff + probe_steps)`` of its steps for probes in the long run
    (4 / 132 ≈ 3 % with the defaults); the interval is back to ``probe_every`` once the
    tenant runs at K > 0 again. (The same idea as the per-request
    :class:`specdec.control.controller.KController`'s step-limited probes, counted in steps
    because here K is chosen per step.)

    Args:
        budget: the scheduler's positions budget.
        weights: tenant -> fair-share weight (default 1).
        k_ranges: tenant -> (k_min, k_max) (default 0..8).
        estimator: acceptance estimator (keys ``(tenant, proposer)``).
        cost: batch cost model.
        probe_every: steps held at K = 0 before a probe (0: never probe).
        probe_steps: consecutive steps of one probe (≥ 1).
        probe_alpha: the acceptance the probe's K is chosen for, in (0, 1].
        probe_memory: trials the tenant's old counts weigh when a probe starts (≥ 0).
        probe_backoff: the interval between probes that find nothing grows up to
            ``probe_every · probe_backoff`` (≥ 1; 1: fixed interval).
        clock: seconds; when each tenant's K was decided (:attr:`k_decided_at`; Unix time by
            default, comparable between replicas).

    Raises:
        ValueError: a probe setting out of its range.
    """

    def __init__(self, budget: int, *, weights: dict[str, float] | None = None,
                 k_ranges: dict[str, tuple[int, int]] | None = None,
                 estimator: AcceptanceEstimator | None = None, cost: BatchCostModel | None = None,
                 probe_every: int = 32, probe_steps: int = 4, probe_alpha: float = 0.9,
                 probe_memory: float = 8.0, probe_backoff: int = 4, clock: Callable[[], float] = time.time):
        if probe_every < 0 or probe_steps < 1 or not 0 < probe_alpha <= 1 or probe_memory < 0 or probe_backoff < 1:
            raise ValueError("need probe_every >= 0, probe_steps >= 1, 0 < probe_alpha <= 1, probe_memory >= 0, "
                             f"probe_backoff >= 1; got {probe_every}, {probe_steps}, {probe_alpha}, "
                             f"{probe_memory}, {probe_backoff}")
        self.probe_every, self.probe_steps, self.probe_alpha = int(probe_every), int(probe_steps), float(probe_alpha)
        self.probe_memory, self.probe_backoff = float(probe_memory), int(probe_backoff)
        #: probes started (all tenants) and steps run as probes
        self.probes = 0
        self.probe_step_count = 0
        self._probe: dict[str, _ProbeState] = {}
        self._loads: dict[str, TenantLoad] = {}  # the loads of the last decision
        self._proposer: dict[str, str] = {}  # tenant -> its adaptive proposer at the last decision
        #: (tenant, proposer, trials) of every evidence cap a probe applied (for a shared pool)
        self.caps: list[tuple[str, str, float]] = []
        self.budget = budget
        self.weights = dict(weights or {})
        self.k_ranges = dict(k_ranges or {})
        self.estimator = estimator or AcceptanceEstimator()
        self.cost = cost or BatchCostModel(max_positions=max(4096, budget * 4))
        self.last: BatchKDecision | None = None
        #: tenant -> the K chosen for it at the last decision that included it
        self.k_by_tenant: dict[str, int] = {}
        #: tenant -> ``clock()`` of that decision (Unix seconds by default)
        self.k_decided_at: dict[str, float] = {}
        self.clock = clock
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

    def decide(self, sessions: dict[tuple[str, str], int],
               fixed: dict[tuple[str, str, int], int] | None = None) -> BatchKDecision:
        """K per tenant for the running sessions ``{(tenant, proposer): count}`` (one proposer per tenant used).

        Args:
            fixed: sessions in the same batch whose K is not chosen here (a seeded sampled
                request, a tenant pinned to ``fixed_k``): ``{(tenant, proposer, K): count}``.
                They count in the batch's step time and tokens at their own K, and take no
                share of the budget from the tenants that adapt.
        """
        loads: dict[str, TenantLoad] = {}
        for (tenant, proposer, k), n in (fixed or {}).items():
            if n > 0:
                loads[f"{tenant}\x00{proposer}\x00{k}"] = TenantLoad(
                    sessions=n, alpha=self.estimator.alpha((tenant, proposer)) if k > 0 else 0.0,
                    weight=1e-9, k_min=k, k_max=k, drafted=proposer == "draft", fixed_k=k)
        for (tenant, proposer), n in sessions.items():
            lo, hi = self.k_ranges.get(tenant, (0, 8))
            prev = loads.get(tenant)
            loads[tenant] = TenantLoad(
                sessions=n + (prev.sessions if prev else 0),
                alpha=self.estimator.alpha((tenant, proposer)),
                weight=self.weights.get(tenant, 1.0), k_min=lo, k_max=hi, drafted=proposer == "draft",
            )
            self._proposer[tenant] = proposer
        self._loads = loads
        self.last = choose_batch_ks(loads, self.cost, self.budget)
        self.k_by_tenant.update({t: k for t, k in self.last.ks.items() if "\x00" not in t})
        now = self.clock()
        self.k_decided_at.update({t: now for t in self.last.ks if "\x00" not in t})
        return self.last

    def k_for(self, tenant: str) -> int | None:
        """The K chosen for ``tenant`` at the last decision (None before any)."""
        return None if self.last is None else self.last.ks.get(tenant)

    def probe_k(self, tenant: str, cap: int) -> int:
        """The K a probe of ``tenant`` runs at: its K in the batch optimum of the last
        decision's load if its acceptance were ``probe_alpha``, at most ``cap`` (0: a probe
        would not pay even then, or the tenant was not in the last decision)."""
        load = self._loads.get(tenant)
        if load is None or cap < 1:
            return 0
        what_if = dict(self._loads)
        what_if[tenant] = TenantLoad(load.sessions, self.probe_alpha, load.weight, min(load.k_min, cap),
                                     min(load.k_max, cap), load.drafted, load.fixed_k)
        return choose_batch_ks(what_if, self.cost, self.budget).ks.get(tenant, 0)

    def step_k(self, tenant: str, cap: int, k_min: int = 0) -> int:
        """The K of ``tenant``'s next step: its K under the last decision within
        [min(k_min, cap), cap] (``cap`` before any decision), or a probe's K while the tenant
        is held at K = 0 (class docstring). Call once per step; not thread-safe."""
        chosen = self.k_for(tenant)
        if chosen is None:
            return cap
        k = max(min(k_min, cap), min(cap, chosen))
        ps = self._probe.setdefault(tenant, _ProbeState(interval=self.probe_every))
        if k > 0:  # speculating: the next time it is held, probes start from the short interval
            ps.held, ps.left, ps.interval = 0, 0, self.probe_every
            return k
        if ps.left > 0:
            ps.left -= 1
            self.probe_step_count += 1
            return min(cap, ps.k)
        if not self.probe_every or ps.held < ps.interval:
            ps.held += 1
            return 0
        ps.held = 0
        kp = self.probe_k(tenant, cap)
        if kp <= 0:
            return 0
        ps.k, ps.left = kp, self.probe_steps - 1
        ps.interval = min(ps.interval * 2, self.probe_every * self.probe_backoff)
        proposer = self._proposer.get(tenant)
        if proposer is not None:
            self.estimator.cap_evidence((tenant, proposer), self.probe_memory)
            self.caps.append((tenant, proposer, self.probe_memory))
            del self.caps[:-1024]
        self.probes += 1
        self.probe_step_count += 1
        return kp

    def probing(self, tenant: str) -> bool:
        """Whether a probe of ``tenant`` is in progress (steps of it are left)."""
        ps = self._probe.get(tenant)
        return ps is not None and ps.left > 0

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


@dataclass
class _Joined:
    tenant: str
    proposer: str
    adaptive: bool
    k: int = 0  # a fixed session's K (an adaptive one's ceiling)
    last_k: int | None = None  # the K of its last step (None: no step yet)
    k_min: int = 0  # an adaptive session's K while its tenant's guard forces K = 0


def merge_report(pool: AcceptanceEstimator, report: dict, max_steps: int = 1_000_000) -> int:
    """Add one replica's :meth:`BatchKSessions.take_sync_report` to a shared ``pool``, in the
    replica's order: each segment's steps (each recorded as :meth:`AcceptanceEstimator.record`
    records one step), then the segment's evidence cap. Everything is checked before anything is
    added.

    Returns:
        the number of steps added.

    Raises:
        ValueError: a malformed entry (names not strings, K or accepted out of range, a count
            below 1, more than ``max_steps`` steps in all, a negative cap).
    """
    plan = []
    total = 0
    for seg in report.get("segments", []):
        steps = []
        for entry in seg.get("steps", []):
            t, p, k, a, n = entry
            if not isinstance(t, str) or not isinstance(p, str):
                raise ValueError(f"step entry {entry!r}: tenant and proposer must be strings")
            k, a, n = int(k), int(a), int(n)
            if not (1 <= k <= 1024 and 0 <= a <= k and n >= 1):
                raise ValueError(f"step entry {entry!r}: need 1 <= K <= 1024, 0 <= accepted <= K, count >= 1")
            steps.append(((t, p), k, a, n))
            total += n
        cap = seg.get("cap")
        if cap is not None:
            t, p, x = cap
            if not isinstance(t, str) or not isinstance(p, str) or not float(x) >= 0:
                raise ValueError(f"cap {cap!r}: need tenant, proposer, trials >= 0")
            cap = ((t, p), float(x))
        plan.append((steps, cap))
    if total > max_steps:
        raise ValueError(f"a report of more than {max_steps} steps")
    for steps, cap in plan:
        for key, k, a, n in steps:
            for _ in range(n):
                pool.record(key, k, a)
        if cap is not None:
            pool.cap_evidence(*cap)
    return total


def _segment_data(counts, cap) -> dict:
    return {"steps": [[t, p, k, a, n] for (t, p, k, a), n in sorted(counts.items())],
            "cap": None if cap is None else [cap[0], cap[1], float(cap[2])]}


class GoodputGuard:
    """Measured goodput of speculating against plain decoding: overrules the cost model when
    measurement contradicts it.

    The batch cost model predicts a step from the seconds of the batched forwards it saw. Served,
    part of a step's wall time is in no forward it measures: sessions stepping in their own
    threads at K > 0 fall into groups that alternate drafting and verifying (fewer rows per
    target forward, each group's draft forwards competing with the other's verify for the same
    cores), a block that misses the gathering window waits a whole forward, and the draft's
    prefill and catch-up are left out of the draft costs. On the 2-core CPU with the int4 demo
    pair the model predicted K > 0 to pay while K = 0 measured 1.7x faster (served, two
    tenants, 8 clients). So, as a rate controller backs off when measurement contradicts its
    model, this guard compares what the two regimes *measured*:

        goodput(regime) = Σ n_s · tokens_s / Σ seconds_s      (tokens per second of the batch)

    over the adaptive sessions' steps s (tokens_s = accepted + 1, seconds_s = drafting + the
    verify round trip as the session saw them, n_s = sessions stepping concurrently when it
    ended: a session's rate tokens_s / seconds_s times the sessions running is the batch's rate,
    so a batch that drains while one regime runs does not flatter it), each sum decayed by
    ``decay`` per step recorded in that regime (memory ~ 1 / (1 - decay) steps).

    **One guard per tenant** (:class:`BatchKSessions`): tenant t's guard gets the steps of
    *every* adaptive session (any tenant's), each in regime ``spec`` when the model had t at
    K > 0 and ``plain`` when it had t at K = 0 or t's guard forces K = 0 (a probe's steps and a
    generation's first step, which also prefills the target, count in no guard). So it compares
    the whole batch's goodput with and without t's speculation, including what t's speculation
    costs the other tenants (their steps slow down too), and a veto holds only t at K = 0: a
    tenant whose speculation pays keeps its K. Explorations of different tenants do not
    overlap (``may_explore`` of :meth:`record`): with two tenants exploring at once, each
    guard's ``plain`` would hold the other's K = 0 as well.

    Policy, in adaptive steps (summed over all sessions):

    - **explore**: while ``spec`` runs and ``plain`` has fewer than ``min_steps`` fresh steps,
      every ``explore_every`` steps (the first time after ``min_steps`` steps) force K = 0 for
      ``min_steps`` steps, so that there is a measured ``plain`` to compare with (an
      exploration due while ``may_explore`` is False waits for the next ``spec`` step);
    - **veto**: once both regimes hold ``min_steps`` fresh steps and
      ``goodput(spec) < goodput(plain) · (1 - margin)``, force K = 0 for ``hold`` steps (doubled
      after each veto that a recheck confirms, up to ``hold · max_backoff``), then let the
      model's K run again with ``spec``'s old measurement cleared, so that ``min_steps`` fresh
      steps are compared again (a recheck);
    - otherwise the model's choice stands; a veto's hold falls back to ``hold`` once a recheck
      finds speculation paying.

    Not thread-safe (its owner locks).

    Args:
        min_steps: fresh steps per regime before comparing (≥ 1).
        explore_every: steps between explorations of K = 0 while it is unmeasured (≥ min_steps).
        hold: steps K = 0 is forced after a veto (≥ 1).
        max_backoff: the hold grows up to ``hold · max_backoff`` (≥ 1).
        margin: relative shortfall of ``spec`` that vetoes, in [0, 1).
        decay: per-step decay of a regime's sums, in (0, 1].

    Raises:
        ValueError: a setting out of its range.
    """

    def __init__(self, *, min_steps: int = 12, explore_every: int = 64, hold: int = 96, max_backoff: int = 4,
                 margin: float = 0.0, decay: float = 0.97):
        if (min_steps < 1 or explore_every < min_steps or hold < 1 or max_backoff < 1
                or not 0 <= margin < 1 or not 0 < decay <= 1):
            raise ValueError("need min_steps >= 1, explore_every >= min_steps, hold >= 1, max_backoff >= 1, "
                             f"0 <= margin < 1, 0 < decay <= 1; got {min_steps}, {explore_every}, {hold}, "
                             f"{max_backoff}, {margin}, {decay}")
        self.min_steps, self.explore_every, self.hold = int(min_steps), int(explore_every), int(hold)
        self.max_backoff, self.margin, self.decay = int(max_backoff), float(margin), float(decay)
        #: regime -> [decayed tokens, decayed seconds, fresh steps]
        self._sums = {"spec": [0.0, 0.0, 0], "plain": [0.0, 0.0, 0]}
        self._forced_left = 0  # steps left with K = 0 forced
        self._forced_why: str | None = None  # "explore" or "veto"
        self._since_explore = 0  # spec steps since the last exploration
        self._hold = self.hold
        self._rechecking = False  # spec was cleared after a veto: the next comparison is a recheck
        #: vetoes and explorations started, for statistics and tests
        self.vetoes = 0
        self.explorations = 0

    def fresh(self) -> "GoodputGuard":
        """A new guard with this one's settings and nothing measured (one per tenant)."""
        return GoodputGuard(min_steps=self.min_steps, explore_every=self.explore_every, hold=self.hold,
                            max_backoff=self.max_backoff, margin=self.margin, decay=self.decay)

    @property
    def forced(self) -> bool:
        """Whether K = 0 is forced now (an exploration or a veto)."""
        return self._forced_left > 0

    @property
    def exploring(self) -> bool:
        """Whether K = 0 is forced now for an exploration (not a veto)."""
        return self._forced_left > 0 and self._forced_why == "explore"

    def goodput(self, regime: str) -> float | None:
        """Measured tokens per step-second of ``regime`` ("spec" or "plain"), None before any step."""
        tok, sec, _ = self._sums[regime]
        return tok / sec if sec > 0 else None

    def steps(self, regime: str) -> int:
        """Fresh steps measured in ``regime``."""
        return self._sums[regime][2]

    def record(self, regime: str, tokens: float, seconds: float, may_explore: bool = True) -> None:
        """One adaptive step of ``regime`` emitted ``tokens`` tokens (weighted: n_s · tokens_s of
        the class docstring) in ``seconds`` seconds of wall time; then the policy (class
        docstring) moves on by one step. ``may_explore`` False: an exploration due now waits
        (another tenant's guard is exploring).

        Raises:
            ValueError: an unknown regime, tokens < 1 or seconds not finite and > 0.
        """
        if regime not in self._sums:
            raise ValueError(f"regime must be 'spec' or 'plain', got {regime!r}")
        if tokens < 1 or not 0 < seconds < float("inf"):
            raise ValueError(f"need tokens >= 1 and 0 < seconds < inf, got {tokens}, {seconds}")
        s = self._sums[regime]
        s[0], s[1], s[2] = s[0] * self.decay + tokens, s[1] * self.decay + seconds, s[2] + 1
        if self._forced_left > 0:
            self._forced_left -= 1
            if self._forced_left == 0 and self._forced_why == "veto":
                self._sums["spec"] = [0.0, 0.0, 0]  # recheck speculation with fresh steps
                self._rechecking = True
            if self._forced_left == 0:
                self._forced_why = None
            return
        if regime != "spec":
            return
        self._since_explore += 1
        ns, npl = self.steps("spec"), self.steps("plain")
        if ns >= self.min_steps and npl >= self.min_steps:
            if self.goodput("spec") < self.goodput("plain") * (1.0 - self.margin):
                if self._rechecking:  # speculation lost again: hold longer
                    self._hold = min(self._hold * 2, self.hold * self.max_backoff)
                self._rechecking = False
                self.vetoes += 1
                self._forced_left, self._forced_why = self._hold, "veto"
                return
            if self._rechecking:
                self._rechecking, self._hold = False, self.hold
        if may_explore and ns >= self.min_steps and (npl < self.min_steps or self._since_explore >= self.explore_every):
            self._sums["plain"] = [0.0, 0.0, 0]  # explore with fresh steps
            self._since_explore = 0
            self.explorations += 1
            self._forced_left, self._forced_why = self.min_steps, "explore"

    def snapshot(self) -> dict:
        """Plain data: goodput and fresh steps per regime, whether K = 0 is forced and why, counters."""
        return {"goodput_spec": self.goodput("spec"), "goodput_plain": self.goodput("plain"),
                "steps_spec": self.steps("spec"), "steps_plain": self.steps("plain"),
                "forced": self._forced_why if self.forced else None, "forced_left": self._forced_left,
                "vetoes": self.vetoes, "explorations": self.explorations}


class BatchKSessions:
    """K under load for generations stepped concurrently by one serving replica (thread-safe).

    The served counterpart of ``BatchScheduler(controller=BatchKController(...))``: a draft
    replica steps each generation in its own thread (its verify is a remote call that the target
    batches with the other sessions'), so there is no tick to hook. Instead each generation
    :meth:`join` s when it starts and :meth:`leave` s when it ends; its K per step comes from
    :meth:`schedule` (the tenant's K under the current load, at most the request's K); and after
    every step :meth:`observe_step` gets the block's K and accepted count, the batched target
    forward that verified it (:class:`specdec.types.BatchShape`, reported back by the target:
    rows, positions, seconds) and the batched draft forwards run since (rows, seconds). The
    controller decides again (:meth:`BatchKController.decide` over the adaptive sessions held
    here, per tenant and proposer) when the sessions changed or a new forward was measured,
    at most once per such change.

    Per tenant it keeps, for statistics, the K chosen at the last decision and the rows and
    positions of the forwards its recent steps ran in (:meth:`tenant_stats`).

    Args:
        controller: the batch controller (its ``budget`` is the target's positions budget;
            its probe settings say how a tenant held at K = 0 is re-probed).
        recent: steps per tenant the rows/positions means are over.
        guard: a :class:`GoodputGuard` whose settings every tenant's own guard takes
            (:meth:`GoodputGuard.fresh`, made when the tenant first joins; :attr:`guards`):
            while tenant t's guard forces K = 0 every adaptive step of t runs at t's k_min (no
            probes) and the model decides the other tenants' K with t's sessions at that K;
            every adaptive step's tokens and wall seconds (``draft_s + verify_s`` of
            :meth:`observe_step`) feed every tenant's guard (:class:`GoodputGuard`, "One guard
            per tenant"). None: the model alone.
        trace: a file that gets one JSON line per step observed and per decision (diagnostics:
            the decision's predicted step seconds and the cost terms it used, against each
            step's measured draft and verify seconds and the forward that verified it); None: off.
    """

    def __init__(self, controller: BatchKController, recent: int = 200, trace: str | None = None,
                 guard: GoodputGuard | None = None):
        self.controller = controller
        #: the settings of the per-tenant guards (None: no guard)
        self.guard = guard
        #: tenant -> its guard: overrules the model with K = 0 for that tenant when the adaptive
        #: steps' measured goodput says its speculation does not pay
        self.guards: dict[str, GoodputGuard] = {}
        self._trace = open(trace, "a", buffering=1) if trace else None
        self._lock = threading.Lock()
        self._joined: dict[Any, _Joined] = {}
        self._dirty = True
        self._seen: collections.OrderedDict = collections.OrderedDict()  # forward keys measured
        self._recent = recent
        self._shapes: dict[str, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=recent))
        #: tenant -> K used per step (most recent ``recent``), for tests and statistics
        self.k_steps: dict[str, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=recent))
        self.decisions = 0
        #: (tenant, proposer, K, accepted) -> steps recorded since the last sync report (or
        #: since the last probe's evidence cap: earlier ones are in ``_segments``)
        self._unsynced: collections.Counter = collections.Counter()
        #: (steps, the cap that followed them) since the last sync report, oldest first
        self._segments: list[tuple[collections.Counter, tuple[str, str, float]]] = []

    @property
    def probes(self) -> int:
        """Probes started of tenants held at K = 0 (:meth:`BatchKController.step_k`)."""
        return self.controller.probes

    def join(self, key: Any, tenant: str, proposer: str, *, adaptive: bool = True, weight: float = 1.0,
             k_range: tuple[int, int] = (0, 8)) -> None:
        """A generation starts (``key``: any hashable id). Adaptive ones get their K from the
        decision; the others count in it at their own K (``k_range[1]``).

        Args:
            weight: the tenant's fair-share weight (policy ``batch_weight``).
            k_range: the tenant's (k_min, k_max); for a non-adaptive generation (k, k) with its K.

        Raises:
            ValueError: ``weight <= 0`` or an empty K range.
        """
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        if not 0 <= k_range[0] <= k_range[1]:
            raise ValueError(f"bad K range {k_range}")
        with self._lock:
            self._joined[key] = _Joined(tenant, proposer, adaptive, int(k_range[1]), k_min=int(k_range[0]))
            self.controller.weights[tenant] = float(weight)
            if adaptive:
                self.controller.k_ranges[tenant] = (int(k_range[0]), int(k_range[1]))
                if self.guard is not None and tenant not in self.guards:
                    self.guards[tenant] = self.guard.fresh()
            self._dirty = True

    def leave(self, key: Any) -> None:
        """The generation ``key`` ended (idempotent)."""
        with self._lock:
            if self._joined.pop(key, None) is not None:
                self._dirty = True

    def _decide_locked(self) -> None:
        counts: dict[tuple[str, str], int] = {}
        fixed: dict[tuple[str, str, int], int] = {}
        for j in self._joined.values():
            if j.adaptive and j.proposer != "none" and self._forced_locked(j.tenant):
                key = (j.tenant, j.proposer, j.k_min)  # held at k_min by its guard: decided for the others
                fixed[key] = fixed.get(key, 0) + 1
            elif j.adaptive and j.proposer != "none":
                counts[(j.tenant, j.proposer)] = counts.get((j.tenant, j.proposer), 0) + 1
            else:
                key = (j.tenant, j.proposer, j.k if j.proposer != "none" else 0)
                fixed[key] = fixed.get(key, 0) + 1
        if counts:
            d = self.controller.decide(counts, fixed)
            self.decisions += 1
            if self._trace is not None:
                self._write_trace({"decision": d.ks, "step_s": d.step_s, "tokens_per_s": d.tokens_per_s,
                                   "rows": d.rows, "positions": d.positions,
                                   "loads": {t: [l.sessions, l.alpha, l.fixed_k] for t, l in self.controller._loads.items()},
                                   "cost": self.controller.cost.snapshot(),
                                   "guard": {t: g.snapshot() for t, g in self.guards.items()}})
        self._dirty = False

    def _forced_locked(self, tenant: str) -> bool:
        g = self.guards.get(tenant)
        return g is not None and g.forced

    def _write_trace(self, rec: dict) -> None:
        import json
        import time

        rec["t"] = time.time()
        try:
            self._trace.write(json.dumps(rec, default=str) + "\n")
        except Exception:  # diagnostics never break serving
            pass

    def k_for(self, tenant: str, cap: int, k_min: int = 0) -> int:
        """The K of ``tenant``'s next step: its K under the current load within [k_min, cap]
        (``cap`` before any decision)."""
        with self._lock:
            if self._dirty:
                self._decide_locked()
            chosen = self.controller.k_for(tenant)
        return cap if chosen is None else max(min(k_min, cap), min(cap, chosen))

    def schedule(self, tenant: str, cap: int, k_min: int = 0, probe_steps: int = 0):
        """A ``k`` callable for :meth:`specdec.engine.engine.SpeculativeEngine.start`: ``cap`` for
        the first ``probe_steps`` steps (a probe of the per-request controller), then
        :meth:`BatchKController.step_k` each step: the tenant's K under the current load within
        [k_min, cap], or, while the tenant is held at K = 0, now and then a probe of a few
        consecutive steps (counted over all the tenant's generations here) so that its
        acceptance estimate keeps learning and the tenant comes back when speculation pays."""
        calls = [0]

        def k() -> int:
            calls[0] += 1
            if calls[0] <= probe_steps:
                return cap
            with self._lock:
                if self._dirty:
                    self._decide_locked()
                if self._forced_locked(tenant):
                    return min(k_min, cap)
                chosen = self.controller.step_k(tenant, cap, k_min)
                if self.controller.caps:  # a probe capped the evidence: order matters to the pool
                    for c in self.controller.caps:
                        self._segments.append((self._unsynced, c))
                        self._unsynced = collections.Counter()
                    self.controller.caps.clear()
                return chosen

        return k

    def observe_step(self, key: Any, k: int, accepted: int, batch: Any = None,
                     draft_forwards: Sequence[tuple[int, float]] = (), *, draft_s: float | None = None,
                     verify_s: float | None = None) -> None:
        """One step of generation ``key`` ended.

        Args:
            k: drafts in its block; accepted: drafts the target accepted.
            batch: the :class:`specdec.types.BatchShape` of the target forward that verified
                it (each forward is measured once however many of its rows report it).
            draft_forwards: ``(rows, seconds)`` of batched draft forwards run since the last call.
                Left out when this is the generation's first drafting step or its first after a
                K = 0 step: the block's first draft forward then also fed the prompt or every
                token decoded at K = 0 (the draft does not run at K = 0), a prefill that is no
                cost of a draft position and, taken as one, held a tenant at K = 0.
        """
        with self._lock:
            j = self._joined.get(key)
            if self._trace is not None:
                self._write_trace({"step": id(key), "tenant": None if j is None else j.tenant, "k": int(k),
                                   "accepted": int(accepted), "draft_s": draft_s, "verify_wall_s": verify_s,
                                   "batch": None if batch is None else [batch.forward, batch.rows, batch.positions,
                                                                        batch.seconds],
                                   "draft_forwards": list(draft_forwards)})
            if j is not None and j.adaptive and self.guards and j.last_k is not None \
                    and draft_s is not None and verify_s is not None and draft_s + verify_s > 0:
                self._guard_step_locked(j.tenant, int(k), (int(accepted) + 1) * len(self._joined),
                                        draft_s + verify_s)
            if j is not None:
                if k > 0 and j.last_k in (None, 0):
                    draft_forwards = ()
                j.last_k = int(k)
                self.k_steps[j.tenant].append(int(k))
                if k > 0 and j.proposer != "none":
                    self.controller.observe_row(j.tenant, j.proposer, int(k), int(accepted))
                    self._unsynced[(j.tenant, j.proposer, int(k), int(accepted))] += 1
                    if j.adaptive and self.controller.k_for(j.tenant) == 0:
                        self._dirty = True  # a probe's step: decide again with what it measured
                if batch is not None:
                    self._shapes[j.tenant].append((int(batch.rows), int(batch.positions)))
            new_forward = False
            if batch is not None and batch.rows >= 1:
                fkey = (batch.forward, batch.rows, batch.positions)
                if fkey not in self._seen:
                    self._seen[fkey] = None
                    if len(self._seen) > 4096:
                        self._seen.popitem(last=False)
                    new_forward = True
            if new_forward or draft_forwards:
                self.controller.observe_tick(
                    batch.rows if new_forward else 0, max(batch.positions, batch.rows) if new_forward else 0,
                    batch.seconds if new_forward else 0.0, list(draft_forwards))
                self._dirty = True

    def _guard_step_locked(self, tenant: str, k: int, tokens: float, seconds: float) -> None:
        """Record one adaptive step of ``tenant`` at K = ``k`` (``tokens`` weighted by the sessions
        stepping, ``seconds`` of wall time) in the guard of every tenant that has adaptive
        sessions here, each in its own regime (:class:`GoodputGuard`, "One guard per tenant").
        A probe's step (K > 0 while the model holds ``tenant`` at K = 0) and a K > 0 step of a
        tenant whose guard forces K = 0 (it straddled the start of the forcing) count in none.
        A guard whose forcing starts or ends marks the decision stale."""
        if k > 0 and (self._forced_locked(tenant) or self.controller.k_for(tenant) == 0):
            return
        active = {j.tenant for j in self._joined.values() if j.adaptive and j.proposer != "none"}
        for t in sorted(active):
            g = self.guards.get(t)
            if g is None:
                continue
            was = g.forced
            regime = "plain" if was or not (self.controller.k_for(t) or 0) > 0 else "spec"
            others = any(o.exploring for n, o in self.guards.items() if n != t)
            g.record(regime, tokens, seconds, may_explore=not others)
            if g.forced != was:
                self._dirty = True

    # --- acceptance shared by the replicas ------------------------------------------------------

    def take_sync_report(self) -> dict:
        """The speculation steps recorded here since the last report, for the pool of
        acceptance counts all draft replicas share (:meth:`merge_pooled`), as plain data::

            {"segments": [{"steps": [[tenant, proposer, K, accepted, count], ...],
                           "cap": [tenant, proposer, trials] or None}, ...],
             "raw_steps": [[tenant, proposer, K > 0 steps this replica's estimate holds], ...],
             "tenants": {tenant: its K under load here, :meth:`tenant_view`}}

        A segment's ``cap`` is the evidence cap a probe started here applied after the
        segment's steps (:meth:`AcceptanceEstimator.cap_evidence`), so that the pool caps the
        same history the replica did. Acceptance is the tenant's (its traffic against the
        draft/target pair), not the replica's, so every replica should estimate it from all
        replicas' steps; the costs (batched forwards of this replica's hardware and batch) and
        the K chosen from them stay per replica. The steps are taken out:
        :meth:`restore_report` puts them back when the report could not be delivered.
        """
        with self._lock:
            segs = [_segment_data(c, cap) for c, cap in self._segments] + [_segment_data(self._unsynced, None)]
            self._segments, self._unsynced = [], collections.Counter()
            est = self.controller.estimator
            raw = [[t, p, est.raw_steps((t, p))] for t, p in est.keys()]
        return {"segments": segs, "raw_steps": raw, "tenants": self.tenant_views()}

    def tenant_view(self, tenant: str) -> dict:
        """``tenant``'s K under load here as plain scalars: :meth:`tenant_stats` with the guard's
        snapshot replaced by ``"guard_forced"`` (whether its guard holds it at K = 0 now)."""
        st = self.tenant_stats(tenant)
        guard = st.pop("guard")
        st["guard_forced"] = bool(guard and guard["forced"])
        return st

    def tenant_views(self) -> dict[str, dict]:
        """Every tenant seen here -> :meth:`tenant_view` (for the shared controller, which answers
        ``GetTenantStats`` with every draft replica's K under load)."""
        with self._lock:
            tenants = set(self._shapes) | {j.tenant for j in self._joined.values()} | set(self.controller.k_by_tenant)
        return {t: self.tenant_view(t) for t in sorted(tenants)}

    def restore_report(self, report: dict) -> None:
        """A report of :meth:`take_sync_report` was not delivered: its steps (and caps) go with
        the next, before those recorded since."""
        with self._lock:
            old = []
            for seg in report["segments"]:
                c = collections.Counter({(t, p, int(k), int(a)): int(n) for t, p, k, a, n in seg["steps"]})
                old.append((c, None if seg.get("cap") is None else tuple(seg["cap"])))
            last_counts, _ = old.pop()  # the open segment of the report: merge with the steps since
            if self._segments:
                first_counts, first_cap = self._segments[0]
                self._segments[0] = (last_counts + first_counts, first_cap)
            else:
                self._unsynced = last_counts + self._unsynced
            self._segments = old + self._segments

    def merge_pooled(self, pooled: dict, report: dict) -> list[tuple[str, str]]:
        """Adopt the shared pool's counts after it merged ``report`` (the pool's
        :meth:`AcceptanceEstimator.export_counts`): each key's counts become the pool's, then the
        steps (and probe caps) recorded here since ``report`` was taken are replayed onto them
        (they go to the pool with the next report). A key for which the pool holds fewer steps
        than this replica did when ``report`` was taken keeps its own counts (the pool lost
        data, e.g. a controller actor restarted without its snapshot). The global pools (priors
        of keys new to this replica) are taken as they are.

        Returns:
            the keys whose counts were taken from the pool.

        Raises:
            ValueError, TypeError, KeyError: ``pooled`` is not of that shape (nothing changed).
        """
        entries = [(str(t), str(p), c) for t, p, c in pooled["keys"]]
        glob = dict(pooled.get("global") or {})
        had = {(t, p): int(n) for t, p, n in report.get("raw_steps", [])}
        taken = []
        with self._lock:
            est = self.controller.estimator
            backup = est.export_counts()
            try:
                for proposer, counts in glob.items():
                    est.set_global(proposer, counts)
                for t, p, counts in entries:
                    if int(counts.get("raw_steps", 0)) < had.get((t, p), 0):
                        continue
                    est.set_counts((t, p), counts)
                    taken.append((t, p))
            except Exception:
                est.import_counts(backup)
                raise
            for counts, cap in self._segments + [(self._unsynced, None)]:
                for (t, p, k, a), n in counts.items():
                    if (t, p) in taken:
                        for _ in range(n):
                            est.record((t, p), k, a)
                if cap is not None and (cap[0], cap[1]) in taken:
                    est.cap_evidence((cap[0], cap[1]), cap[2])
            self._dirty = True
        return taken

    def tenant_stats(self, tenant: str) -> dict:
        """One tenant's K under load here, as plain data::

            {"k_under_load": the K its adaptive steps run at now (its k_min while its guard
                 forces K = 0, else the K of the last decision that included it; None before any),
             "k_model": the K of the last decision that included it (None before any),
             "decided_at": Unix time (s) of that decision (None before any),
             "guard": its guard's GoodputGuard.snapshot() (None without a guard),
             "rows_per_step", "positions_per_step": means over its recent steps (0.0 without any),
             "steps": how many, "sessions": sessions of it held now}
        """
        with self._lock:
            shapes = list(self._shapes.get(tenant, ()))
            n = len(shapes)
            model_k = self.controller.k_by_tenant.get(tenant)
            g = self.guards.get(tenant)
            k = model_k
            if g is not None and g.forced:
                k = self.controller.k_ranges.get(tenant, (0, 0))[0]
            return {
                "k_under_load": k,
                "k_model": model_k,
                "decided_at": self.controller.k_decided_at.get(tenant),
                "guard": None if g is None else g.snapshot(),
                "rows_per_step": sum(r for r, _ in shapes) / n if n else 0.0,
                "positions_per_step": sum(p for _, p in shapes) / n if n else 0.0,
                "steps": n,
                "sessions": sum(1 for j in self._joined.values() if j.tenant == tenant),
            }

    def stats(self) -> dict:
        """:meth:`tenant_stats` of every tenant seen, plus the controller's :meth:`BatchKController.stats`."""
        with self._lock:
            tenants = set(self._shapes) | {j.tenant for j in self._joined.values()} | set(self.controller.k_by_tenant)
        out = {t: self.tenant_stats(t) for t in sorted(tenants)}
        with self._lock:
            return {"tenants": out, "controller": self.controller.stats(), "decisions": self.decisions,
                    "guards": {t: g.snapshot() for t, g in sorted(self.guards.items())}}
