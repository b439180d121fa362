"""K per tenant for one batch scheduler from what its ticks measure, with probes of tenants held at K = 0.

Part of :mod:`specdec.control.batch_k`: :class:`BatchKController` keeps the acceptance
estimates and the batch cost model, decides with
:func:`specdec.control.batch_choice.choose_batch_ks` and re-probes a tenant it holds at K = 0.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from specdec.control.acceptance import AcceptanceEstimator
from specdec.control.batch_choice import BatchKDecision, TenantLoad, choose_batch_ks
from specdec.control.batch_cost import BatchCostModel
from specdec.control.objective import expected_tokens_per_step


#: how many of the latest verify forwards' (rows, positions) a controller keeps for its statistics
RECENT_BATCHES = 50
#: decisions before a tenant of unknown acceptance held at K = 0, whose probe did not pay, is
#: asked again (:meth:`BatchKController.step_k`; each ask is a batch optimum)
UNKNOWN_RECHECK = 8
#: tenants whose probe's K (:meth:`BatchKController.probe_k`, a batch optimum each) one decision
#: prices at most; another tenant's probe that comes due waits its turn (first come first served,
#: :meth:`BatchKController._may_ask`). Held tenants start their probe intervals together, so their
#: probes came due on the same tick: 32 tenants' ticks took 21 ms where the others took 1.4
#: (docs/bench/batching/tenants-s27/)
PROBE_ASKS_PER_DECISION = 4


@dataclass
class _ProbeState:
    """Per tenant: its steps held at K = 0 since the last probe, the probe in progress."""

    held: int = 0  # steps at K = 0 since the last probe (or since it was held)
    interval: int = 0  # held steps before the next probe (grows while probes find nothing)
    left: int = 0  # steps left in the probe in progress
    k: int = 0  # the probe's K
    probed: bool = False  # a probe of it started once
    #: its session counts at which a probe ran for shapes never measured in service
    explored: set = field(default_factory=set)
    #: session count -> the cost model's ``shapes_version`` when a shape probe was last considered
    checked: dict = field(default_factory=dict)
    #: (decisions, shapes_version, the batch's sessions per load) when its probe as a tenant of
    #: unknown acceptance was last found not to pay (None: never; :meth:`BatchKController._unknown_recheck_due`)
    unknown_at: tuple | None = None


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
    tenant runs at K > 0 again. One decision prices at most :data:`PROBE_ASKS_PER_DECISION`
    tenants' probe what-ifs: the probes of tenants held from the same tick come due together, and
    the others' wait their turn in a queue (first come first served). A tenant held at K = 0
    whose acceptance has less than ``probe_memory`` trials of evidence (α̂ is mostly the prior:
    held from its first steps, it never measured its drafts) and that was never probed is probed
    at its first held step (when even that probe would not pay, asked again after
    :data:`UNKNOWN_RECHECK` decisions, or as soon as a positions count is first measured or the
    batch's sessions per tenant change, not on every step: each ask is a whole batch optimum, and
    32 such tenants asking on every tick cost 27 ms a tick, docs/bench/batching/tenants-s27/):
    one client on code prompts, whose speculation paid 1.8x, spent its first 32 steps of each
    48-token request at K = 0 with α̂ at the 0.52 prior (served, w8a8 pair). (The same idea as the per-request
    :class:`specdec.control.controller.KController`'s step-limited probes, counted in steps
    because here K is chosen per step.)

    **Probes of shapes never measured in service.** A probe's K is the batch optimum at
    ``probe_alpha`` on the measured prices, or, when those give K = 0, on
    :meth:`BatchCostModel.optimistic` prices (verify forwards of positions counts never measured
    in service priced on the service's forwards alone, when the start-up calibration measured
    counts that service has not). Such a probe runs at once, at a tenant's first held
    step, once per count of its sessions (not after ``probe_every`` held steps): the prices that
    hold it came from the start-up calibration, and one probe measures what they cost in
    service. It probes prices, not acceptance: the tenant's acceptance evidence is not capped,
    the interval between its acceptance probes does not grow, and its held count goes on. Served (w7a8 pair, 2-core EPYC, ``clients-s19-guard``), the
    calibration priced 3-5 positions 1.4x what they cost in service and the lone client of a
    32-token request ran K = 0 on all its steps, its held steps never reaching ``probe_every``
    (tests/test_batch_calibrated.py).

    **Optimism** (``optimism`` z > 0): a tenant's K is priced at the upper confidence bound of
    its acceptance, :meth:`AcceptanceEstimator.upper_alpha` (the larger of α̂ and the Beta
    posterior's mean + z sd of its own evidence), not at α̂ alone. A K = 0 step measures nothing
    about acceptance, so a choice on α̂ that starts near its prior (0.5, 20 pseudo-trials)
    holds K = 0 or K = 1 while the evidence that would raise it arrives one K = 1 step at a
    time: a fresh server's first request (one client on code, acceptance 0.97, w8a8 pair) ran
    18 of its 58 steps at K = 0 and 21 at K = 1 and reached K = 4 after 50 steps (1.14x plain
    decoding; the second request, α̂ warm, K = 4 on 27 of 28 steps: 1.45x). On the bound, the
    first steps run the K a plausible acceptance earns and measure it; the bound tightens as
    trials arrive (one sd: 0.29 with no evidence, 0.05 after 4 steps of 4 accepted drafts), so
    a tenant whose drafts disagree drops to its α̂'s K within a few steps. The probes below
    remain for a tenant held at K = 0 after evidence (its bound then near α̂).

    **Leaving K = 0 costs a catch-up.** A session at K = 0 does not run the draft, which then
    feeds every token it missed (and a new session its prompt) on its next drafting step.
    :meth:`decide` takes, per tenant, the tokens its sessions' drafts are behind by and charges
    their catch-up (:meth:`BatchCostModel.catchup_s`) once, spread over the steps its sessions
    have left (or ``catchup_horizon`` batch steps when unknown), to any choice that gives the
    tenant K > 0 (:func:`choose_batch_ks`); the probe's what-if
    (:meth:`probe_k`) pays it too, so a tenant is neither moved back to K > 0 nor probed for a
    gain its catch-up would eat.

    **No speculation under load on priors alone** (``measure_first``): while no decode-sized
    verify forward (positions <= rows · (largest k_max + 1): no prompt prefill in it) has been
    measured, a decision over two or more sessions holds every adaptive tenant at its k_min
    (one session alone decides on the priors, so it speculates and measures). The first
    decisions were taken on the cost priors, which make a draft forward a fifth of a verify:
    8 sessions started at K = 1, each feeding its prompt to the draft, where K = 0 was best.

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
        catchup_horizon: batch steps a catch-up's seconds are spread over when the tokens the
            sessions have left are unknown (≥ 1).
        measure_first: hold adaptive tenants at k_min under load until a decode-sized verify
            forward is measured (class docstring).
        optimism: z of the upper confidence bound the decisions price acceptance at (class
            docstring, "Optimism"; ≥ 0; 0: α̂ alone, the controller before).

    Raises:
        ValueError: a probe setting out of its range.
    """

    def __init__(self, budget: int, *, weights: dict[str, float] | None = None,
                 k_ranges: dict[str, tuple[int, int]] | None = None,
                 estimator: AcceptanceEstimator | None = None, cost: BatchCostModel | None = None,
                 probe_every: int = 32, probe_steps: int = 4, probe_alpha: float = 0.9,
                 probe_memory: float = 8.0, probe_backoff: int = 4, clock: Callable[[], float] = time.time,
                 catchup_horizon: int = 32, measure_first: bool = True, optimism: float = 1.0):
        if (probe_every < 0 or probe_steps < 1 or not 0 < probe_alpha <= 1 or probe_memory < 0 or probe_backoff < 1
                or catchup_horizon < 1 or not optimism >= 0):
            raise ValueError("need probe_every >= 0, probe_steps >= 1, 0 < probe_alpha <= 1, probe_memory >= 0, "
                             f"probe_backoff >= 1, catchup_horizon >= 1, optimism >= 0; got {probe_every}, "
                             f"{probe_steps}, {probe_alpha}, {probe_memory}, {probe_backoff}, {catchup_horizon}, "
                             f"{optimism}")
        self.optimism = float(optimism)
        self.catchup_horizon, self.measure_first = int(catchup_horizon), bool(measure_first)
        self.probe_every, self.probe_steps, self.probe_alpha = int(probe_every), int(probe_steps), float(probe_alpha)
        self.probe_memory, self.probe_backoff = float(probe_memory), int(probe_backoff)
        #: probes started (all tenants) and steps run as probes
        self.probes = 0
        self.probe_step_count = 0
        #: of :attr:`probes`, those of shapes never measured in service (class docstring)
        self.shape_probes = 0
        self._probe: dict[str, _ProbeState] = {}
        self._loads: dict[str, TenantLoad] = {}  # the loads of the last decision
        self._load_key: tuple = ()  # their (name, sessions), sorted (the unknown-probe recheck's key)
        self._asked: set[str] = set()  # tenants whose probe's K the last decision priced (PROBE_ASKS_PER_DECISION)
        # tenants turned away for want of a pricing slot, first come first served (_may_ask) ->
        # the decision at which each last asked (one that has not asked for UNKNOWN_RECHECK decisions,
        # or has left the batch, leaves the queue)
        self._waiting: dict[str, int] = {}
        # (tenant, cap, cost version, probe_alpha, budget, catchup_horizon) -> (probe_k's answer,
        # from the optimistic prices alone) for the last decision's loads (emptied by :meth:`decide`)
        self._probe_memo: dict[tuple, tuple[int, bool]] = {}
        #: (the last decision made by :meth:`decide`, the cost version it priced at)
        self._decided: tuple[BatchKDecision | None, int | None] = (None, None)
        self._proposer: dict[str, str] = {}  # tenant -> its adaptive proposer at the last decision
        #: (tenant, proposer, trials) of every evidence cap a probe applied (for a shared pool)
        self.caps: list[tuple[str, str, float]] = []
        self.budget = budget
        self.weights = dict(weights or {})
        self.k_ranges = dict(k_ranges or {})
        self.estimator = estimator or AcceptanceEstimator()
        self.cost = cost or BatchCostModel(max_positions=max(4096, budget * 4))
        self.last: BatchKDecision | None = None
        #: decisions made (:meth:`decide`)
        self.decisions = 0
        #: tenant -> the K chosen for it at the last decision that included it
        self.k_by_tenant: dict[str, int] = {}
        #: tenant -> ``clock()`` of that decision (Unix seconds by default)
        self.k_decided_at: dict[str, float] = {}
        self.clock = clock
        #: (rows, positions) of the last :data:`RECENT_BATCHES` verify forwards, for statistics
        #: (bounded: a long-running replica observes a forward per tick)
        self.batches: deque[tuple[int, int]] = deque(maxlen=RECENT_BATCHES)

    def k_top(self) -> int:
        """The largest k_max of the tenants seen (8 before any): a forward of more than
        rows · (k_top + 1) positions holds a prompt's prefill."""
        return max((hi for _, hi in self.k_ranges.values()), default=8)

    def observe_row(self, tenant: str, proposer: str, k: int, accepted: int) -> None:
        self.estimator.record((tenant, proposer), k, accepted)

    def observe_tick(self, rows: int, positions: int, verify_s: float, draft_forwards: Sequence[tuple[int, float]] = (),
                     *, context: float | None = None) -> None:
        """A tick's verify forward (rows, positions fed, seconds) and its draft forwards (rows, seconds);
        ``context``: the mean tokens per row in the target's KV cache before the forward (None: unknown;
        :meth:`BatchCostModel.observe_verify`)."""
        if rows >= 1 and positions >= rows:
            self.cost.observe_verify(rows, positions, verify_s, prefill=positions > rows * (self.k_top() + 1),
                                     context=context)
            self.batches.append((rows, positions))
        for r, s in draft_forwards:
            if r >= 1:
                self.cost.observe_draft(r, s)

    def decide(self, sessions: dict[tuple[str, str], int],
               fixed: dict[tuple[str, str, int], int] | None = None,
               behind: dict[str, int] | None = None,
               tokens_left: dict[str, float] | None = None, context: float | None = None) -> BatchKDecision:
        """K per tenant for the running sessions ``{(tenant, proposer): count}`` (one proposer per tenant used).

        Args:
            fixed: sessions in the same batch whose K is not chosen here (a seeded sampled
                request, a tenant pinned to ``fixed_k``): ``{(tenant, proposer, K): count}``.
                They count in the batch's step time and tokens at their own K, and take no
                share of the budget from the tenants that adapt.
            behind: tenant -> tokens its adaptive sessions' drafts are behind by, in all
                (charged as a catch-up if it gets K > 0; class docstring). None: none behind.
            tokens_left: tenant -> the tokens its adaptive sessions have left, on average (the
                catch-up is spread over the steps that leaves); absent: unknown.
            context: the mean tokens in the target's KV cache per session of the batch (forwards
                are priced there: :meth:`BatchCostModel.set_context`); None: the context last set
                (before any, the last forward's).
        """
        if context is not None and hasattr(self.cost, "set_context"):
            self.cost.set_context(context)
        loads: dict[str, TenantLoad] = {}
        for (tenant, proposer, k), n in (fixed or {}).items():
            if n > 0:
                loads[f"{tenant}\x00{proposer}\x00{k}"] = TenantLoad(
                    sessions=n, alpha=self.estimator.alpha((tenant, proposer)) if k > 0 else 0.0,
                    weight=1e-9, k_min=k, k_max=k, drafted=proposer == "draft", fixed_k=k)
        k_top = self.k_top()
        unmeasured = self.measure_first and self.cost.min_positions_per_row > k_top + 1 and (
            sum(sessions.values()) + sum((fixed or {}).values()) >= 2)
        for (tenant, proposer), n in sessions.items():
            lo, hi = self.k_ranges.get(tenant, (0, 8))
            prev = loads.get(tenant)
            loads[tenant] = TenantLoad(
                sessions=n + (prev.sessions if prev else 0),
                alpha=self.decision_alpha(tenant, proposer),
                weight=self.weights.get(tenant, 1.0), k_min=lo, k_max=lo if unmeasured else hi,
                drafted=proposer == "draft",
                catchup_s=self.cost.catchup_s((behind or {}).get(tenant, 0)) if proposer == "draft" else 0.0,
                tokens_left=(tokens_left or {}).get(tenant),
            )
            self._proposer[tenant] = proposer
        self._loads = loads
        self._load_key = tuple(sorted((name, load.sessions) for name, load in loads.items()))
        self._probe_memo = {}
        self._asked = set()
        self._waiting = {t: d for t, d in self._waiting.items()
                         if t in loads and self.decisions - d < UNKNOWN_RECHECK}
        self.decisions += 1
        self.last = choose_batch_ks(loads, self.cost, self.budget, self.catchup_horizon)
        self._decided = (self.last, getattr(self.cost, "version", None))  # and the prices it was made at
        self.k_by_tenant.update({t: k for t, k in self.last.ks.items() if "\x00" not in t})
        now = self.clock()
        self.k_decided_at.update({t: now for t in self.last.ks if "\x00" not in t})
        return self.last

    def decision_alpha(self, tenant: str, proposer: str) -> float:
        """The acceptance :meth:`decide` prices an adaptive tenant's K at: α̂, or with ``optimism``
        z > 0 the upper confidence bound :meth:`AcceptanceEstimator.upper_alpha` (class
        docstring, "Optimism")."""
        key = (tenant, proposer)
        return self.estimator.upper_alpha(key, self.optimism) if self.optimism > 0 else self.estimator.alpha(key)

    def k_for(self, tenant: str) -> int | None:
        """The K chosen for ``tenant`` at the last decision (None before any)."""
        return None if self.last is None else self.last.ks.get(tenant)

    def probe_k(self, tenant: str, cap: int) -> int:
        """The K a probe of ``tenant`` runs at: its K in the batch optimum of the last
        decision's load (its catch-up charged) if its acceptance were ``probe_alpha``, at most
        ``cap`` (0: a probe would not pay even then, or the tenant was not in the last decision).
        When the measured prices give K = 0, the optimum on :meth:`BatchCostModel.optimistic`
        prices (class docstring, "Probes of shapes never measured in service").

        The answer is remembered until the next :meth:`decide` or cost observation
        (``cost.version``): each ask is a whole batch optimum (:func:`choose_batch_ks`), and a
        tenant of never measured acceptance whose probe does not pay asked on every step of every
        one of its rows, a few ms a tick at 8 rows (docs/bench/k0cost-s14/NOTES.md); since session 27
        it asks again only after :data:`UNKNOWN_RECHECK` decisions or a change of the load
        (:meth:`step_k`)."""
        load = self._loads.get(tenant)
        if load is None or cap < 1:
            return 0
        key = self._probe_key(tenant, cap)
        got = self._probe_memo.get(key)
        if got is None:
            self._asked.add(tenant)
            what_if = dict(self._loads)
            what_if[tenant] = TenantLoad(load.sessions, self.probe_alpha, load.weight, min(load.k_min, cap),
                                         min(load.k_max, cap), load.drafted, load.fixed_k, load.catchup_s,
                                         load.tokens_left)
            near = self.last.ks if self.last is not None else None  # many tenants: ascend from the decision
            # held at K = 0 (its tokens and catch-up there the same at any acceptance: checked, not assumed)
            # next to a settled decision at today's prices: only its own moves can change the answer
            settled = tenant if (near is not None and self.last.settled and near.get(tenant) == 0
                                 and self._decided[0] is self.last
                                 and self._decided[1] == getattr(self.cost, "version", None)
                                 and expected_tokens_per_step(min(max(load.alpha, 0.0), 1.0), 0)
                                 == expected_tokens_per_step(self.probe_alpha, 0)) else None
            k = choose_batch_ks(what_if, self.cost, self.budget, self.catchup_horizon, near,
                                settled).ks.get(tenant, 0)
            got = (k, False)
            if k == 0 and hasattr(self.cost, "optimistic") and self.cost.calibration_unserved():
                k = choose_batch_ks(what_if, self.cost.optimistic(), self.budget, self.catchup_horizon,
                                    near).ks.get(tenant, 0)
                got = (k, k > 0)
            self._probe_memo[key] = got
        return got[0]

    def _probe_unmeasured(self, tenant: str, cap: int) -> bool:
        """Whether :meth:`probe_k`'s K > 0 comes from the optimistic prices alone (the measured
        ones give K = 0: the shapes it would run were never measured in service)."""
        if self.probe_k(tenant, cap) <= 0:
            return False
        return self._probe_memo.get(self._probe_key(tenant, cap), (0, False))[1]

    def _shape_probe_due(self, tenant: str, cap: int, ps: _ProbeState) -> bool:
        """Whether ``tenant``, held at K = 0, gets a probe of shapes never measured in service now:
        its session count not probed so yet, and :meth:`probe_k`'s K > 0 from the optimistic prices
        alone. Asked once per session count and :attr:`BatchCostModel.shapes_version` (a
        positions count first served or calibrated), not on every step: each ask prices up to
        two batch optima (~3 ms at 8 sessions of two tenants), and the prices drift between ticks
        without changing which shapes were never measured."""
        load = self._loads.get(tenant)
        sessions = load.sessions if load is not None else 0
        cost = self.cost
        if sessions in ps.explored or not getattr(cost, "calibration_unserved", bool)():
            return False
        version = getattr(cost, "shapes_version", None)
        if ps.checked.get(sessions, -1) == version:
            return False
        if not self._may_ask(tenant):  # no pricing slot in this decision: considered again at a later one
            return False
        ps.checked[sessions] = version
        if not self._probe_unmeasured(tenant, cap):
            return False
        ps.explored.add(sessions)
        return True

    def _unknown_key(self) -> tuple[int, int | None, tuple]:
        """(decisions, the cost model's ``shapes_version``, the last decision's sessions per load) now."""
        return self.decisions, getattr(self.cost, "shapes_version", None), self._load_key

    def _unknown_recheck_due(self, ps: _ProbeState) -> bool:
        """Whether a tenant of unknown acceptance whose probe was last found not to pay is asked
        again: :data:`UNKNOWN_RECHECK` decisions later, or at once when a positions count was
        first measured (``shapes_version``) or the batch's sessions per tenant changed since (the
        probe's K is a batch optimum: another tenant leaving can make it pay)."""
        if ps.unknown_at is None:
            return True
        decisions, shapes, load = self._unknown_key()
        return decisions - ps.unknown_at[0] >= UNKNOWN_RECHECK or shapes != ps.unknown_at[1] or load != ps.unknown_at[2]

    def _probe_key(self, tenant: str, cap: int) -> tuple:
        return tenant, cap, getattr(self.cost, "version", None), self.probe_alpha, self.budget, self.catchup_horizon

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
        proposer = self._proposer.get(tenant)
        unknown = (not ps.probed and proposer is not None
                   and self.estimator.evidence((tenant, proposer)) < self.probe_memory and self._unknown_recheck_due(ps))
        due = bool(self.probe_every) and (ps.held >= ps.interval or unknown)
        if due and not self._may_ask(tenant):  # no pricing slot in this decision: the probe waits its turn
            ps.held += 1
            return 0
        if not due and self.probe_every and proposer is not None and self._shape_probe_due(tenant, cap, ps):
            # a probe of the prices, not of the acceptance (class docstring, "Probes of shapes never
            # measured in service"): no evidence cap, no backoff, the held count goes on
            ps.k, ps.left = self.probe_k(tenant, cap), self.probe_steps - 1
            self.probes += 1
            self.shape_probes += 1
            self.probe_step_count += 1
            return ps.k
        if not due:
            ps.held += 1
            return 0
        ps.held = 0
        kp = self.probe_k(tenant, cap)
        if kp <= 0:
            if unknown:
                ps.unknown_at = self._unknown_key()
            return 0
        ps.k, ps.left, ps.probed = kp, self.probe_steps - 1, True
        ps.interval = min(ps.interval * 2, self.probe_every * self.probe_backoff)
        if proposer is not None:
            self.estimator.cap_evidence((tenant, proposer), self.probe_memory)
            self.caps.append((tenant, proposer, self.probe_memory))
            del self.caps[:-1024]
        self.probes += 1
        self.probe_step_count += 1
        return kp

    def _may_ask(self, tenant: str) -> bool:
        """Whether :meth:`probe_k` may price ``tenant``'s probe in this decision (a tenant whose probe
        is due asks): it did already (remembered), or one of the :data:`PROBE_ASKS_PER_DECISION`
        slots is free for it. Tenants turned away wait in a queue, first come first served: a
        slot goes to a tenant only when fewer tenants wait ahead of it than slots are free, so a
        tenant that asks on every decision (one of unknown acceptance re-asked as the load
        changes) cannot keep the others from ever being priced, even one that steps only every
        few decisions (served, a tick can hold several decisions); a waiting tenant that has not
        asked for :data:`UNKNOWN_RECHECK` decisions, or has left the batch, leaves the queue."""
        if tenant in self._asked:
            return True
        free = PROBE_ASKS_PER_DECISION - len(self._asked)
        ahead = list(self._waiting).index(tenant) if tenant in self._waiting else len(self._waiting)
        if ahead < free:
            self._waiting.pop(tenant, None)
            return True
        self._waiting[tenant] = self.decisions  # its place in the queue kept, its last ask noted
        return False

    def probing(self, tenant: str) -> bool:
        """Whether a probe of ``tenant`` is in progress (steps of it are left)."""
        ps = self._probe.get(tenant)
        return ps is not None and ps.left > 0

    def stats(self) -> dict:
        """Plain data for tenant stats / metrics: K per tenant, batch shape seen, cost terms, α̂."""
        recent = list(self.batches)
        return {
            "k_by_tenant": dict(self.k_by_tenant),
            "predicted_tokens_per_s": self.last.tokens_per_s if self.last else None,
            "mean_rows_per_forward": sum(r for r, _ in recent) / len(recent) if recent else None,
            "mean_positions_per_forward": sum(p for _, p in recent) / len(recent) if recent else None,
            "alpha": {f"{t}/{p}": self.estimator.alpha((t, p)) for t, p in self.estimator.keys()},
            "cost": self.cost.snapshot(),
        }
