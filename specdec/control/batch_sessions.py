"""K under load for generations stepped concurrently by one serving replica (the draft replica's).

Part of :mod:`specdec.control.batch_k`: :class:`BatchKSessions` wraps a
:class:`specdec.control.batch_controller.BatchKController` for sessions stepping in their own
threads, with one :class:`specdec.control.goodput_guard.GoodputGuard` per tenant and the
acceptance exchange of :class:`specdec.control.batch_exchange.AcceptanceExchange`.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from specdec.control.batch_controller import BatchKController
from specdec.control.batch_exchange import AcceptanceExchange
from specdec.control.goodput_guard import GoodputGuard

#: steps held back at most (then every quiet guard records them: _settle_all_locked); one quiet
#: guard records its steps per step (round robin) and entries are dropped at the end of a round,
#: so the log holds up to about twice as many steps as there are quiet guards
_LOG_MAX = 4096
#: the longest quiet run asked of a guard (plain decoding while nothing is forced: any)
_QUIET_MAX = 1 << 40


@dataclass
class _Joined:
    tenant: str
    proposer: str
    adaptive: bool
    k: int = 0  # a fixed session's K (an adaptive one's ceiling)
    last_k: int | None = None  # the K of its last step (None: no step yet)
    k_min: int = 0  # an adaptive session's K while its tenant's guard forces K = 0
    behind: int = 0  # tokens its draft has not fed yet: the prompt, then those decoded at K = 0
    left: int | None = None  # tokens it has left to generate (None: unknown)
    #: tokens its target session holds (committed): its prompt (a resumed one's history), then + each
    #: step's; its KV cache holds one fewer (the last token is fed with the next block)
    context: int = 0
    #: a start-up calibration run (:meth:`BatchKSessions.join`): None (a request), "warmup"
    #: (its steps measure nothing) or "measure" (its forwards feed the cost model, nothing else)
    calibration: str | None = None


class BatchKSessions(AcceptanceExchange):
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
    here, per tenant and proposer, with the tokens their drafts are behind by: the prompt until
    a session's first drafting step, then one per step it runs at K = 0, none after a drafting
    step) when the sessions changed or a new forward was measured, at most once per such change.

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
        #: steps' measured goodput says its speculation does not pay (read it through :attr:`guards`)
        self._guards: dict[str, GoodputGuard] = {}
        # Steps held back from quiet guards (GoodputGuard.quiet_run; _guard_step_locked): each step's
        # (tokens, seconds, sessions) since the absolute index _log_base, recorded into a quiet guard
        # (GoodputGuard.record_quiet_steps, bit for bit its record() calls) before anything reads it
        self._log: list[tuple[float, float, int]] = []
        self._log_base = 0
        #: tenant -> [absolute index of its first step not recorded, of its first step that is not
        #: quiet, whether it was unforced (quiet because the decision has it at K = 0)]
        self._quiet: dict[str, list] = {}
        self._loud: list[str] = []  # tenants with a guard among the active, not quiet, sorted
        self._active_sorted: list[str] = []
        self._exploring_static = 0  # exploring guards that are not loud (they stay so while not loud)
        self._min_expiry: float = float("inf")
        self._rr: list[str] = []  # this round's quiet guards (_settle_next_locked), from _rr_at on
        self._rr_at = 0
        self._epoch = 0  # bumped by join, leave and reads of `guards`: classify the guards afresh
        self._cls: tuple | None = None  # (epoch, controller.last, sessions serving) of the classification
        self._trace = open(trace, "a", buffering=1) if trace else None
        self._lock = threading.Lock()
        self._joined: dict[Any, _Joined] = {}
        # (generations serving requests, tenants with adaptive sessions stepped by a proposer) of
        # _joined, recounted after a join or leave (None: to recount), not on every step
        self._counts: tuple[int, frozenset] | None = None
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
    def guards(self) -> dict[str, GoodputGuard]:
        """tenant -> its :class:`GoodputGuard` (the tenants that joined adaptive generations).
        The steps held back from quiet guards (:meth:`_guard_step_locked`) are recorded into them
        first (bit for bit what recording each step at once gives), and the next step classifies
        the guards afresh, so a caller may read a guard, or change one, right after. Reading the
        dict later, after more steps, may see a quiet guard without its latest steps: read it
        through this property again."""
        with self._lock:
            self._settle_all_locked()
            self._epoch += 1
        return self._guards

    @property
    def probes(self) -> int:
        """Probes started of tenants held at K = 0 (:meth:`BatchKController.step_k`)."""
        return self.controller.probes

    def join(self, key: Any, tenant: str, proposer: str, *, adaptive: bool = True, weight: float = 1.0,
             k_range: tuple[int, int] = (0, 8), prompt_tokens: int = 0, max_tokens: int | None = None,
             calibration: str | None = None, context_tokens: int | None = None) -> None:
        """A generation starts (``key``: any hashable id). Adaptive ones get their K from the
        decision; the others count in it at their own K (``k_range[1]``).

        **Start-up calibration** (``calibration`` "warmup" or "measure"; :meth:`set_calibration`
        switches it): a generation on a dummy prompt that a replica runs before it reports ready,
        at the K its requests will run (deployments.draft_calibration). Its steps count in no
        decision, no acceptance estimate, no goodput guard and no tenant's statistics; in
        "measure" its verify forwards, draft forwards and the draft's catch-up feed the cost
        model (as a request's do: its first drafting step's draft forwards, which also feed the
        prompt, are left out), so a fresh replica's first request is priced from measured
        forwards instead of the cost priors; in "warmup" nothing (a fresh process's first
        forward of each shape is dearer: kernels are created and cached). Its verify forwards
        do not count as a decode forward measured under load (``measure_first`` of
        :class:`BatchKController`: one session's forwards say nothing of a batch's).

        Args:
            weight: the tenant's fair-share weight (policy ``batch_weight``).
            k_range: the tenant's (k_min, k_max); for a non-adaptive generation (k, k) with its K.
            prompt_tokens: its prompt's length (the draft prefills it on the first drafting step).
            context_tokens: the tokens its target session starts with (a resumed one's whole
                history; None: ``prompt_tokens``): with the tokens of each step, what its target
                forwards attend to (forwards are priced at the sessions' mean,
                :meth:`BatchCostModel.set_context`).
            max_tokens: the most tokens it generates (None: unknown): what it has left spreads
                the cost of its draft's catch-up (:meth:`BatchKController.decide`).

        Raises:
            ValueError: ``weight <= 0``, an empty K range, ``prompt_tokens`` or ``context_tokens`` < 0, or
                ``max_tokens < 1``.
        """
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        if not 0 <= k_range[0] <= k_range[1]:
            raise ValueError(f"bad K range {k_range}")
        if prompt_tokens < 0 or (max_tokens is not None and max_tokens < 1) or (context_tokens or 0) < 0:
            raise ValueError(f"need prompt_tokens >= 0, context_tokens >= 0 and max_tokens >= 1, got {prompt_tokens}, "
                             f"{context_tokens}, {max_tokens}")
        if calibration not in (None, "warmup", "measure"):
            raise ValueError(f"calibration must be None, 'warmup' or 'measure', got {calibration!r}")
        with self._lock:
            self._counts = None
            self._epoch += 1
            self._joined[key] = _Joined(tenant, proposer, adaptive, int(k_range[1]), k_min=int(k_range[0]),
                                        behind=int(prompt_tokens), left=None if max_tokens is None else int(max_tokens),
                                        context=int(prompt_tokens if context_tokens is None else context_tokens),
                                        calibration=calibration)
            if calibration is not None:
                return
            self.controller.weights[tenant] = float(weight)
            if adaptive:
                self.controller.k_ranges[tenant] = (int(k_range[0]), int(k_range[1]))
                if self.guard is not None and tenant not in self._guards:
                    self._guards[tenant] = self.guard.fresh()
            self._dirty = True

    def set_calibration(self, key: Any, mode: str) -> None:
        """Switch the calibration run ``key`` between "warmup" and "measure" (:meth:`join`).

        Raises:
            ValueError: ``key`` is not a calibration run, or an unknown mode.
        """
        if mode not in ("warmup", "measure"):
            raise ValueError(f"mode must be 'warmup' or 'measure', got {mode!r}")
        with self._lock:
            j = self._joined.get(key)
            if j is None or j.calibration is None:
                raise ValueError("not a calibration run")
            j.calibration = mode

    def _recount(self) -> tuple[int, frozenset]:
        """(generations serving requests, tenants with adaptive sessions stepped by a proposer), kept
        until the next join or leave. Call under ``_lock``."""
        if self._counts is None:
            self._counts = (sum(1 for j in self._joined.values() if j.calibration is None),
                            frozenset(j.tenant for j in self._joined.values() if j.adaptive and j.proposer != "none"))
        return self._counts

    def _serving(self) -> int:
        """Generations joined that serve requests (calibration runs left out)."""
        return self._recount()[0]

    def leave(self, key: Any) -> None:
        """The generation ``key`` ended (idempotent)."""
        with self._lock:
            if self._joined.pop(key, None) is not None:
                self._dirty = True
                self._counts = None
                self._epoch += 1

    def _decide_locked(self) -> None:
        counts: dict[tuple[str, str], int] = {}
        fixed: dict[tuple[str, str, int], int] = {}
        behind: dict[str, int] = {}
        left: dict[str, list[int]] = {}
        contexts: list[int] = []
        for j in self._joined.values():
            if j.calibration is not None:
                continue
            contexts.append(max(0, j.context - 1))
            if j.adaptive and j.proposer != "none" and self._forced_locked(j.tenant):
                key = (j.tenant, j.proposer, j.k_min)  # held at k_min by its guard: decided for the others
                fixed[key] = fixed.get(key, 0) + 1
            elif j.adaptive and j.proposer != "none":
                counts[(j.tenant, j.proposer)] = counts.get((j.tenant, j.proposer), 0) + 1
                behind[j.tenant] = behind.get(j.tenant, 0) + j.behind
                if j.left is not None:
                    left.setdefault(j.tenant, []).append(j.left)
            else:
                key = (j.tenant, j.proposer, j.k if j.proposer != "none" else 0)
                fixed[key] = fixed.get(key, 0) + 1
        if counts:
            d = self.controller.decide(counts, fixed, behind, {t: max(1.0, sum(v) / len(v)) for t, v in left.items()},
                                       context=sum(contexts) / len(contexts) if contexts else None)
            self.decisions += 1
            if self._trace is not None:
                self._settle_all_locked()  # the guards' snapshots below
                self._write_trace({"decision": d.ks, "step_s": d.step_s, "tokens_per_s": d.tokens_per_s,
                                   "rows": d.rows, "positions": d.positions,
                                   "loads": {t: [l.sessions, l.alpha, l.fixed_k, l.catchup_s] for t, l in self.controller._loads.items()},
                                   "cost": self.controller.cost.snapshot(),
                                   "guard": {t: g.snapshot() for t, g in self._guards.items()}})
        self._dirty = False

    def _forced_locked(self, tenant: str) -> bool:
        g = self._guards.get(tenant)
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
                it, batched or (unbatched target) its own of one row (each forward is measured
                once however many of its rows report it).
            draft_forwards: ``(rows, wall seconds)`` of draft forwards run since the last call
                (batched, or one row each with unbatched drafting).
                Left out when this is the generation's first drafting step or its first after a
                K = 0 step: the block's first draft forward then also fed the prompt or every
                token decoded at K = 0 (the draft does not run at K = 0), a prefill that is no
                cost of a draft position and, taken as one, held a tenant at K = 0.
        """
        with self._lock:
            j = self._joined.get(key)
            if j is not None and j.calibration is not None:
                self._observe_calibration_locked(j, k, accepted, batch, draft_forwards, draft_s)
                return
            if self._trace is not None:
                self._write_trace({"step": id(key), "tenant": None if j is None else j.tenant, "k": int(k),
                                   "accepted": int(accepted), "draft_s": draft_s, "verify_wall_s": verify_s,
                                   "batch": None if batch is None else [batch.forward, batch.rows, batch.positions,
                                                                        batch.seconds],
                                   "draft_forwards": list(draft_forwards)})
            if j is not None and j.adaptive and self._guards and j.last_k is not None \
                    and draft_s is not None and verify_s is not None and draft_s + verify_s > 0:
                self._guard_step_locked(j.tenant, int(k), (int(accepted) + 1) * self._serving(),
                                        draft_s + verify_s)
            if j is not None:
                if k > 0 and j.last_k in (None, 0):
                    draft_forwards = ()
                if k > 0 and j.behind >= 8 and draft_s is not None and j.proposer == "draft":
                    own = int(k) * self.controller.cost.draft_s(self._serving())  # its K draft forwards
                    self.controller.cost.observe_catchup(j.behind, max(0.0, float(draft_s) - own))
                j.last_k = int(k)
                j.behind = 0 if k > 0 else j.behind + int(accepted) + 1
                if j.left is not None:
                    j.left = max(0, j.left - int(accepted) - 1)
                j.context += int(accepted) + 1
                self.k_steps[j.tenant].append(int(k))
                if k > 0 and j.proposer != "none":
                    self.controller.observe_row(j.tenant, j.proposer, int(k), int(accepted))
                    self._unsynced[(j.tenant, j.proposer, int(k), int(accepted))] += 1
                    if j.adaptive and self.controller.k_for(j.tenant) == 0:
                        self._dirty = True  # a probe's step: decide again with what it measured
                if batch is not None:
                    self._shapes[j.tenant].append((int(batch.rows), int(batch.positions)))
            new_forward = False
            if batch is not None and batch.rows == 1:
                # a forward of one row answered this step alone: new, whatever its number (the
                # forward counters of two target replicas, or of a restarted one, coincide)
                new_forward = True
            elif batch is not None and batch.rows > 1:
                fkey = (batch.forward, batch.rows, batch.positions)
                if fkey not in self._seen:
                    self._seen[fkey] = None
                    if len(self._seen) > 4096:
                        self._seen.popitem(last=False)
                    new_forward = True
            if new_forward or draft_forwards:
                self.controller.observe_tick(
                    batch.rows if new_forward else 0, max(batch.positions, batch.rows) if new_forward else 0,
                    batch.seconds if new_forward else 0.0, list(draft_forwards),
                    context=getattr(batch, "context", None) if new_forward else None)
                self._dirty = True

    def _observe_calibration_locked(self, j: _Joined, k: int, accepted: int, batch: Any,
                                    draft_forwards: Sequence[tuple[int, float]], draft_s: float | None) -> None:
        """A calibration run's step (:meth:`join`): in "measure" its forwards and catch-up feed the cost model."""
        measure = j.calibration == "measure"
        if self._trace is not None:
            self._write_trace({"calibration": j.calibration, "k": int(k), "accepted": int(accepted), "draft_s": draft_s,
                               "batch": None if batch is None else [batch.forward, batch.rows, batch.positions,
                                                                    batch.seconds],
                               "draft_forwards": list(draft_forwards)})
        cost = self.controller.cost
        if k > 0 and j.last_k in (None, 0):
            if measure and j.behind >= 8 and draft_s is not None and j.proposer == "draft" and j.last_k == 0:
                # a catch-up after K = 0 steps (not the prompt's first prefill: a fresh process's dearest)
                cost.observe_catchup(j.behind, max(0.0, float(draft_s) - int(k) * cost.draft_s(1)))
            draft_forwards = ()
        j.last_k = int(k)
        j.behind = 0 if k > 0 else j.behind + int(accepted) + 1
        if not measure:
            return
        if batch is not None and batch.rows >= 1:
            cost.observe_verify(batch.rows, max(batch.positions, batch.rows), batch.seconds,
                                prefill=batch.positions > batch.rows * (self.controller.k_top() + 1),
                                calibration=True, context=getattr(batch, "context", None))
        for r, s in draft_forwards:
            if r >= 1:
                cost.observe_draft(r, s)
        self._dirty = True

    def _guard_step_locked(self, tenant: str, k: int, tokens: float, seconds: float) -> None:
        """Record one adaptive step of ``tenant`` at K = ``k`` (``tokens`` weighted by the sessions
        stepping, ``seconds`` of wall time) in the guard of every tenant that has adaptive
        sessions here, each in its own regime (:class:`GoodputGuard`, "One guard per tenant").
        A probe's step (K > 0 while the model holds ``tenant`` at K = 0) and a K > 0 step of a
        tenant whose guard forces K = 0 (it straddled the start of the forcing) count in none.
        A guard whose forcing starts or ends marks the decision stale.

        Quiet guards (:meth:`GoodputGuard.quiet_run`: plain decoding while nothing is forced, or
        a forcing with steps left that no step here can end) do not record each step: the step
        goes to ``_log`` once, and a quiet guard records its held-back steps in one
        :meth:`GoodputGuard.record_quiet_steps` call (bit for bit its record() calls) before
        anything reads it (:attr:`guards`, :meth:`tenant_stats`, :meth:`stats`, the decision's
        trace), when its quiet run ends, and in turn, one quiet guard per step (round robin: the
        log holds about as many steps as there are quiet guards, and no step records them all).
        Its ``forced`` and ``exploring``, the only state the others' steps and the decision read,
        stay as they are through the run. So a step costs O(guards recording it one by one), not
        O(tenants) record() calls, plus the held-back arithmetic (one inlined loop per guard and
        step). The guards are classified again after a join or leave (the sessions serving, the
        tenants) and after a decision (a tenant's regime)."""
        if k > 0 and (self._forced_locked(tenant) or self.controller.k_for(tenant) == 0):
            return
        active = self._recount()[1]
        bound = self._plain_bound_locked()
        serving = self._serving()
        cls = self._cls
        if cls is None or cls[0] != self._epoch or cls[2] != serving:
            self._classify_locked(active, serving)
        elif cls[1] is not self.controller.last:
            self._reclassify_regimes_locked(serving)
        if self._min_expiry <= self._log_base + len(self._log):
            self._expire_locked(serving)
        if (self._loud or self._quiet) and not seconds < float("inf"):  # as the first guard's record() would
            raise ValueError(f"need tokens >= 1 and 0 < seconds < inf, got {tokens}, {seconds}")
        guards = self._guards
        # guards exploring now, kept as each records (only a guard's own record changes it, and a
        # quiet or inactive guard's stays as it is): "another tenant's guard is exploring" in O(1)
        exploring = self._exploring_static + sum(1 for t in self._loud if guards[t].exploring)
        turned: list[str] = []
        for t in self._loud:  # in tenant order, as all of them were
            g = guards[t]
            was, was_exploring = g.forced, g.exploring
            regime = "plain" if was or not (self.controller.k_for(t) or 0) > 0 else "spec"
            g.record(regime, tokens, seconds, may_explore=exploring - was_exploring == 0, plain_bound=bound,
                     sessions=serving)
            exploring += g.exploring - was_exploring
            if g.forced != was:
                self._dirty = True
            if was or g.forced:  # a forcing runs or ended: the guard may be quiet from the next step on
                turned.append(t)
        if self._quiet:
            self._log.append((tokens, seconds, serving))
            if len(self._log) >= _LOG_MAX:
                self._settle_all_locked()
            else:
                self._settle_next_locked()
        if turned:
            cursor = self._log_base + len(self._log)
            if sum(self._try_quiet_locked(t, cursor, serving) for t in turned):
                self._loud = [t for t in self._loud if t not in self._quiet]

    def _try_quiet_locked(self, t: str, cursor: int, serving: int) -> bool:
        """Make ``t``'s guard (settled, not quiet) quiet from the step of absolute index ``cursor``
        on, for as many steps as :meth:`GoodputGuard.quiet_run` allows in its regime now (False: none)."""
        g = self._guards[t]
        unforced = not g.forced
        regime = "plain" if not unforced or not (self.controller.k_for(t) or 0) > 0 else "spec"
        run = g.quiet_run(regime, _QUIET_MAX, serving)
        if run <= 0:
            return False
        self._quiet[t] = [cursor, cursor + run, unforced]
        self._min_expiry = min(self._min_expiry, cursor + run)
        self._exploring_static += g.exploring
        return True

    def _settle_locked(self, t: str) -> None:
        """Record the steps held back from ``t``'s guard into it (nothing when it is not quiet)."""
        q = self._quiet.get(t)
        if q is None:
            return
        start = q[0] - self._log_base
        if start < len(self._log):
            self._guards[t].record_quiet_steps("plain", self._log[start:])
            q[0] = self._log_base + len(self._log)

    def _settle_next_locked(self) -> None:
        """One quiet guard records its held-back steps, round robin over the quiet guards: each holds
        back about as many steps as there are quiet guards, and no step pays for all of them at
        once. When a round ends, the log entries that every quiet guard has recorded are dropped."""
        rr = self._rr
        while self._rr_at < len(rr):
            t = rr[self._rr_at]
            self._rr_at += 1
            if t in self._quiet:
                self._settle_locked(t)
                return
        low = min((q[0] for q in self._quiet.values()), default=self._log_base + len(self._log))
        del self._log[:low - self._log_base]
        self._log_base = low
        self._rr, self._rr_at = list(self._quiet), 0

    def _settle_all_locked(self) -> None:
        """Record every quiet guard's held-back steps, then empty the log (the guards stay quiet)."""
        for t in self._quiet:
            self._settle_locked(t)
        self._log_base += len(self._log)
        self._log.clear()

    def _unquiet_locked(self, t: str) -> None:
        """Settle ``t``'s guard and make it loud (the caller rebuilds ``_loud``)."""
        self._settle_locked(t)
        del self._quiet[t]
        self._exploring_static -= self._guards[t].exploring

    def _rebuild_loud_locked(self) -> None:
        self._loud = [t for t in self._active_sorted if t in self._guards and t not in self._quiet]
        self._min_expiry = min((q[1] for q in self._quiet.values()), default=float("inf"))

    def _classify_locked(self, active: frozenset, serving: int) -> None:
        """Settle every guard and classify the active tenants' guards quiet or loud afresh."""
        self._settle_all_locked()
        self._quiet.clear()
        self._active_sorted = sorted(active)
        self._exploring_static = sum(1 for t, g in self._guards.items() if g.exploring and t not in active)
        self._min_expiry = float("inf")
        cursor = self._log_base
        for t in self._active_sorted:
            if t in self._guards:
                self._try_quiet_locked(t, cursor, serving)
        self._rebuild_loud_locked()
        self._cls = (self._epoch, self.controller.last, serving)

    def _reclassify_regimes_locked(self, serving: int) -> None:
        """A new decision: a quiet guard held by nothing but the decision's K = 0 whose tenant now
        speculates turns loud; a loud guard that is quiet now (plain decoding) turns quiet."""
        for t in [t for t, q in self._quiet.items() if q[2] and (self.controller.k_for(t) or 0) > 0]:
            self._unquiet_locked(t)
        cursor = self._log_base + len(self._log)
        for t in self._active_sorted:
            if t in self._guards and t not in self._quiet:
                self._try_quiet_locked(t, cursor, serving)
        self._rebuild_loud_locked()
        self._cls = (self._epoch, self.controller.last, serving)

    def _expire_locked(self, serving: int) -> None:
        """Quiet runs that end at this step: settle those guards, then quiet again or loud."""
        cursor = self._log_base + len(self._log)
        for t in [t for t, q in self._quiet.items() if q[1] <= cursor]:
            self._unquiet_locked(t)
            self._try_quiet_locked(t, cursor, serving)
        self._rebuild_loud_locked()

    def _plain_bound_locked(self) -> float | None:
        """The most tokens/s plain decoding could reach here by the measured forwards (the goodput
        guard's ``plain_bound``): ``1 / verify_s(1 position)`` for one session alone when that
        forward was measured at least 3 times (the start-up calibration measures it); None
        under load (several sessions: the batch's per-row costs are not all measured) or
        before."""
        if self._serving() != 1:
            return None
        t = self.controller.cost.measured_verify_s(1)
        return 1.0 / t if t is not None and t > 0 else None

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
            tenants = set(self._shapes) | {j.tenant for j in self._joined.values() if j.calibration is None} | set(
                self.controller.k_by_tenant)
        return {t: self.tenant_view(t) for t in sorted(tenants)}

    def alpha(self, tenant: str, proposer: str) -> float:
        """The acceptance estimate α̂ of (``tenant``, ``proposer``) here (pooled with the other
        replicas' after an exchange; the prior for an unseen key)."""
        with self._lock:
            return self.controller.estimator.alpha((tenant, proposer))

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
            self._settle_locked(tenant)
            g = self._guards.get(tenant)
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
                "sessions": sum(1 for j in self._joined.values() if j.tenant == tenant and j.calibration is None),
            }

    def stats(self) -> dict:
        """:meth:`tenant_stats` of every tenant seen, plus the controller's :meth:`BatchKController.stats`."""
        with self._lock:
            tenants = set(self._shapes) | {j.tenant for j in self._joined.values() if j.calibration is None} | set(
                self.controller.k_by_tenant)
        out = {t: self.tenant_stats(t) for t in sorted(tenants)}
        with self._lock:
            self._settle_all_locked()
            return {"tenants": out, "controller": self.controller.stats(), "decisions": self.decisions,
                    "guards": {t: g.snapshot() for t, g in sorted(self._guards.items())}}
