"""Choosing the speculation length K per tenant: expected tokens per second under measured costs.

The objective (:mod:`specdec.control.objective`; Leviathan et al. 2023, §3.3–3.4): the K in the
tenant's range maximising expected tokens per second ``E[N(k)] / step_time(k)`` under the
measured costs, with per-position acceptance where there is enough data.

:class:`KController` adds, per (tenant, proposer):

- Hysteresis: K moves from the current value only when the best K's predicted speedup beats
  the current K's by more than ``switch_margin`` (relative, default 3 %), or when the same
  different K has been best for ``switch_after`` consecutive decisions (default 10): noise near
  a boundary does not flap K, a persistent small gain is still taken. From K = 0 any gain
  switches at once: held at K = 0 the key gathers no evidence, so the next decisions would see
  the same α̂ and waiting would only delay the return a probe has earned.
- Re-probing: at K = 0 there is no acceptance signal, so a tenant held at K = 0 would never
  come back. Every ``probe_every_requests``-th request (default 16) at K = 0, or the first one
  after ``probe_interval_s`` (default 60 s) without a probe once at least
  ``probe_min_requests`` (default 8) requests ran at K = 0 since the last probe, is a probe.
  Intervals count the tenant's own traffic, so an idle or slow tenant is not probed on every
  request. A key with fewer than ``probe_min_steps`` (default 8) speculation steps of its own
  (the prior said K = 0, or one short probe was all it saw) is probed on its next request at
  K = 0, so a new tenant measures its own acceptance at once (two probes of four steps; with
  ``fresh_key_whole_probe``, in process, one probe of the whole request, guarded and re-tuned
  from its own acceptance like any request, also when the prior's K is above 0 but below the
  probe's: :meth:`KController.guarded_k`). A probe speculates at ``probe_k`` (default None: the K the cost model would pick
  if the tenant's acceptance were ``probe_alpha`` = 0.9, i.e. the K a tenant whose traffic
  became predictable would get; on a CPU whose verify cost is not monotonic in positions this
  is not K = 1) for its first ``probe_steps`` steps (default 4; None = the whole request),
  then decodes plainly: a probe costs a few steps, not a request
  (:meth:`KDecision.k_schedule` is the per-step K for the engine). Its counts refresh α̂; the
  probe does not move the current K, the next decision does if the refreshed α̂ says so.
  Before a probe's counts are recorded, the key's older counts are discounted by
  ``probe_discount`` (default 0.25) and then capped at ``probe_memory_trials`` trials (default
  8; :meth:`AcceptanceEstimator.cap_evidence`): they predate the time at K = 0, during which the
  step-based decay stood still, so without that a tenant whose traffic turned predictable would
  need many probes to outweigh its stale history; with it, one probe of 4 steps at K ≥ 2 weighs
  as much as the whole history or more, and the next decision follows what the probe measured.
  A probe's result is the next request recorded with drafts after a probe decision (one per
  probe decided): requests that drafted while the key is held at K = 0 for another reason (the
  draft replica's K under load chose K > 0 for their steps) are ordinary evidence, not probes.
- Policies: proposer ``"none"`` or a K range [0, 0] (the policy's or the request's own) is plain
  decoding for that request, and leaves the (tenant, proposer) state as it was; ``adaptive = False``
  uses ``fixed_k`` (or the range's top); otherwise the adaptive choice in [k_min, k_max]
  intersected with the request's own ceiling.

Variable-length proposers (:data:`VARIABLE_LENGTH_PROPOSERS`: prompt lookup): their drafts
cost nothing and a block is as long as the match supports, so K is a *cap*, not the length of
every block: a step proposes min(L, K) tokens, L being what the match offers (0 when nothing
matches: plain decoding, the cost of K = 0). The controller keeps a decayed histogram of the
block lengths ℓ >= 1 the key's steps proposed (from the requests' ``k_counts``) and evaluates a
cap c with

    E[N(c)] = Σ_ℓ P(ℓ) · (1 + Σ_{j<ℓ} Π_{i≤j} α_i),    E[T(c)] = Σ_ℓ P(ℓ) · step_time(ℓ),

ℓ = min(L, c) and speedup ``E[N(c)] · step_time(0) / E[T(c)]``. Steps without a match are left
out on purpose: they cost and emit exactly what plain decoding does whatever the cap, so they
do not change which cap is best nor whether speculating pays (their share only dilutes the
speedup towards 1). Until ``length_min_steps`` blocks were seen the fixed-length model (every
block full) stands in. Blocks observed under a cap c are censored at c, so a cap above the
ones seen is judged as if no match were longer (conservative); probes of such a key run at
the top of the range for the whole request, which refreshes the histogram up to it.

Early stop (a draft-model proposer with ``draft_min_confidence``): a block ends after its
first unsure token, so K is a cap for the draft model too. The controller counts, per key and
draft position, the blocks that stopped there and those that went on (from the requests'
``k_counts`` and the K decided; blocks of the cap's length are censored), and evaluates every K
as a cap over the block lengths those hazards give
(:func:`specdec.control.objective.early_stop_lengths`): a block costs the draft forwards and
verify positions it used (:meth:`CostModel.draft_block_s`: the first draft forward of a block
dearer than the later ones), and positions beyond those seen take the pooled stop rate, as
positions without enough acceptance data take α̂ (a geometric extrapolation, Leviathan et al.
2023 §3.1's i.i.d. α). Until a block stopped early, every block is taken to be K long. With
``decide(..., tokens=max_tokens)`` the draft's measured prompt prefill is spread over the
request too (:meth:`CostModel.request_speedup`).

Shared state across router replicas: the controller is a plain object whose methods take and
return plain data (str, int, dict, dataclasses), so one instance can live in one Ray actor that
all replicas call (``decide`` before a request, ``record`` after). Not thread-safe: its owner
serializes calls (a Ray actor does by default).

The parts: :mod:`specdec.control.k_decision` (:class:`KDecision`, :func:`k_schedule`, the
per-key state), :mod:`specdec.control.controller_feedback` (what finished requests teach it),
:mod:`specdec.control.controller_snapshot` (its learned state as plain data); this module
holds the deciding.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from specdec.control.acceptance import AcceptanceEstimator, reached_from_counts
from specdec.control.controller_feedback import RequestFeedback
from specdec.control.controller_snapshot import LearnedState
from specdec.control.cost_model import CostModel
from specdec.control.goodput_guard import GoodputGuard
from specdec.control.step_guard import GuardedK
from specdec.control.k_decision import KDecision, KState, k_schedule
from specdec.control.objective import (VARIABLE_LENGTH_PROPOSERS, KCandidate, block_length_distribution, choose_k,
                                       early_stop_lengths, evaluate_k, evaluate_variable_k)

__all__ = ["KController", "KDecision", "VARIABLE_LENGTH_PROPOSERS", "k_schedule"]

log = logging.getLogger(__name__)


def _policy_fields(policy: Any) -> tuple[int, int, bool, int | None]:
    if isinstance(policy, Mapping):
        return (
            int(policy.get("k_min", 0)),
            int(policy.get("k_max", 8)),
            bool(policy.get("adaptive", True)),
            policy.get("fixed_k"),
        )
    return int(policy.k_min), int(policy.k_max), bool(policy.adaptive), policy.fixed_k


class KController(LearnedState, RequestFeedback):
    """Per-(tenant, proposer) K decisions from acceptance estimates and measured costs.

    Args:
        estimator: the acceptance estimator (a default :class:`AcceptanceEstimator` if None).
        cost_model_factory: makes the :class:`CostModel` of a proposer the first time it is seen
            (one cost model per proposer, shared by all tenants: costs are the hardware's).
        clock: seconds (monotonic), for probe intervals.
        switch_margin: relative predicted gain needed to move K at once (0.03 = 3 %).
        switch_after: consecutive decisions with the same different best K that move K anyway.
        probe_every_requests: at K = 0, every n-th request is a probe.
        probe_interval_s: at K = 0, probe the first request after this many seconds without one
            (once ``probe_min_requests`` requests ran at K = 0 since the last probe).
        probe_min_requests: K = 0 requests needed before an interval-triggered probe.
        probe_k: K of a probe (clipped to the allowed range); None: the best K under the cost
            model at acceptance ``probe_alpha``.
        probe_alpha: see ``probe_k``.
        probe_steps: steps a probe speculates before plain decoding; None: the whole request.
        probe_min_steps: a key with fewer K > 0 steps of its own is probed on every K = 0 request.
        position_min_reached: decayed trials a draft position needs before its measured
            acceptance replaces α̂ (None: always i.i.d.). Ignored with ``position_prior_trials``.
        position_prior_trials: None (the default, and served) or w > 0: every draft position
            gets its own acceptance, the measured one shrunk with w pseudo-trials towards α̂
            (position 0) or towards the run rate of positions >= 1 (the others, and positions
            never reached): :func:`specdec.control.acceptance.shrunk_position_alphas`, in
            :meth:`decide` and :meth:`in_request_k` (there with the request's own counts added).
            Clustered acceptance (a hard stretch of text rejects the first token of a block,
            a block that got going goes on) then no longer makes an α̂ learned at a short K
            undervalue longer ones. The in-process bench's controller
            (``benchmarks.inprocess_adaptive``) uses 4.
        retune_memory_trials: None (the default) or T >= 0: in :meth:`in_request_k` the key's
            counts (prior included; per position too) are scaled to hold at most T trials
            before the running request's own counts are added, so the request's acceptance
            steers its remaining steps after a few of them (acceptance is the prompt's: the
            demo pair accepted ~0.96 of its drafts on code-prime where the 4 code requests
            before it read α̂ 0.87). The in-process bench uses 16.
        fresh_key_whole_probe: with ``in_request_retune`` and ``step_guard`` (in process only):
            a key with fewer than ``probe_min_steps`` own steps runs its next request at the
            larger of the K decided and the probe's K (``probe_k``/``probe_alpha``), for the whole
            request, guarded and re-tuned (reason ``"probe: fresh key"``, or ``"probe"`` from K =
            0), instead of a 4-step probe from K = 0 or the prior's K: with measured costs the
            prior α 0.5 gives K = 1 on code with the demo pair, whose blocks teach the estimate
            too little to leave K = 1 within a 32-token request. Off by default.
        probe_discount: weight kept by a key's older counts when a probe's counts arrive.
        probe_memory_trials: after that, the older counts are capped at this many trials
            (accepted + rejections, prior included); None: no cap.
        stop_min_trials: decayed blocks a draft position needs before its own early-stop rate
            replaces the pooled one (:meth:`stop_hazards`).
        learn_early_stop: learn early-stop hazards from the requests' ``k_counts`` under the K
            decided (in process, where a block is shorter than the K decided only when its draft
            stopped: ``benchmarks.inprocess_adaptive``). Off by default, and served: there the
            draft replica's K under load (:mod:`specdec.control.batch_sessions`) also shortens
            blocks, which would read as early stops.
        in_request_retune: with ``step_guard``, a running request's K is re-chosen before every
            step from α̂ with the request's own counts so far added (:meth:`in_request_k`), so a
            fresh tenant whose prior said K = 2 reaches a longer K within its first request.
            Off by default (served: the draft replica chooses the per-step K).
        step_guard: a :class:`specdec.control.goodput_guard.GoodputGuard` whose settings each
            (tenant, proposer) key's own in-request guard takes (:meth:`guarded_k`,
            :mod:`specdec.control.step_guard`); None (the default, and served, where the draft
            replica guards the steps): :meth:`guarded_k` passes the decided K through.
    """

    def __init__(
        self,
        estimator: AcceptanceEstimator | None = None,
        cost_model_factory: Callable[[str], CostModel] | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        switch_margin: float = 0.03,
        switch_after: int = 10,
        probe_every_requests: int = 16,
        probe_interval_s: float = 60.0,
        probe_min_requests: int = 8,
        probe_k: int | None = None,
        probe_alpha: float = 0.9,
        probe_steps: int | None = 4,
        probe_min_steps: int = 8,
        position_min_reached: float | None = 50.0,
        position_prior_trials: float | None = None,
        retune_memory_trials: float | None = None,
        fresh_key_whole_probe: bool = False,
        probe_discount: float = 0.25,
        probe_memory_trials: float | None = 8.0,
        length_half_life_steps: float = 200.0,
        length_min_steps: float = 8.0,
        step_guard: GoodputGuard | None = None,
        stop_min_trials: float = 8.0,
        learn_early_stop: bool = False,
        in_request_retune: bool = False,
    ):
        if switch_margin < 0 or switch_after < 1 or probe_every_requests < 1 or (probe_k is not None and probe_k < 1):
            raise ValueError("need switch_margin >= 0, switch_after >= 1, probe_every_requests >= 1, probe_k >= 1")
        if probe_min_requests < 1 or (probe_steps is not None and probe_steps < 1) or not 0 < probe_alpha <= 1:
            raise ValueError("need probe_min_requests >= 1, probe_steps >= 1 or None, 0 < probe_alpha <= 1")
        self.estimator = estimator if estimator is not None else AcceptanceEstimator()
        self.cost_model_factory = cost_model_factory or (lambda proposer: CostModel())
        self.clock = clock
        self.switch_margin = switch_margin
        self.switch_after = switch_after
        self.probe_every_requests = probe_every_requests
        self.probe_interval_s = probe_interval_s
        self.probe_k = probe_k
        self.probe_alpha = probe_alpha
        self.probe_steps = probe_steps
        self.probe_min_requests = probe_min_requests
        self.probe_min_steps = probe_min_steps
        self.position_min_reached = position_min_reached
        if position_prior_trials is not None and not position_prior_trials > 0:
            raise ValueError(f"position_prior_trials must be > 0 or None, got {position_prior_trials}")
        self.position_prior_trials = position_prior_trials
        if retune_memory_trials is not None and not retune_memory_trials >= 0:
            raise ValueError(f"retune_memory_trials must be >= 0 or None, got {retune_memory_trials}")
        self.retune_memory_trials = retune_memory_trials
        self.fresh_key_whole_probe = bool(fresh_key_whole_probe and in_request_retune and step_guard is not None)
        if not 0.0 <= probe_discount <= 1.0:
            raise ValueError(f"probe_discount must be in [0, 1], got {probe_discount}")
        self.probe_discount = probe_discount
        if probe_memory_trials is not None and not probe_memory_trials >= 0:
            raise ValueError(f"probe_memory_trials must be >= 0 or None, got {probe_memory_trials}")
        self.probe_memory_trials = probe_memory_trials
        if length_half_life_steps <= 0 or length_min_steps < 0:
            raise ValueError("need length_half_life_steps > 0 and length_min_steps >= 0")
        self.length_half_life_steps = length_half_life_steps
        self.length_min_steps = length_min_steps
        if not stop_min_trials >= 0:
            raise ValueError(f"stop_min_trials must be >= 0, got {stop_min_trials}")
        self.stop_min_trials = stop_min_trials
        self.learn_early_stop = learn_early_stop
        self.in_request_retune = in_request_retune
        self.step_guard = step_guard
        #: (tenant, proposer) -> its in-request goodput guard (:meth:`guarded_k`)
        self._guards: dict[tuple[str, str], GoodputGuard] = {}
        self._costs: dict[str, CostModel] = {}
        self._state: dict[tuple[str, str], KState] = {}
        #: (tenant, proposer) -> decayed histogram of block lengths >= 1 (variable-length proposers)
        self._lengths: dict[tuple[str, str], list[float]] = {}
        #: (tenant, proposer) -> decayed (stopped, continued) counts per draft position (early stop)
        self._stops: dict[tuple[str, str], tuple[list[float], list[float]]] = {}

    def cost_model(self, proposer: str) -> CostModel:
        """The cost model of ``proposer`` (created on first use)."""
        cm = self._costs.get(proposer)
        if cm is None:
            cm = self._costs[proposer] = self.cost_model_factory(proposer)
        return cm

    # ------------------------------------------------------------------ deciding

    def decide(self, tenant: str, proposer: str, policy: Any, requested_k: int | None = None,
               tokens: int | None = None) -> KDecision:
        """The K for the next request of ``tenant`` with ``proposer``.

        Args:
            policy: a :class:`specdec.control.tenants.SpeculationPolicy` or a mapping with ``k_min``,
                ``k_max``, ``adaptive``, ``fixed_k``.
            requested_k: the request's own largest K (``SpeculationParams.k``); None = no cap.
            tokens: the request's new tokens at most (``max_tokens``), or None: with it, the
                draft's measured prompt prefill is spread over the request's steps in every
                K > 0 candidate's speedup (:meth:`CostModel.request_speedup`), so a short
                request speculates only when that pays too.
        """
        p_min, p_max, adaptive, fixed_k = _policy_fields(policy)
        k_max = p_max if requested_k is None else min(p_max, max(0, int(requested_k)))
        if proposer == "none":
            k_max = 0
        k_min = min(p_min, k_max)
        key = (tenant, proposer)
        st = self._state.setdefault(key, KState())
        st.decisions += 1
        cm = self.cost_model(proposer)
        alpha = self.estimator.alpha(key)
        pos = ()
        if self.position_prior_trials is not None:
            pos = tuple(self.estimator.shrunk_position_alphas(key, k_max, self.position_prior_trials))
        elif self.position_min_reached is not None:
            pos = tuple(self.estimator.position_alphas(key, self.position_min_reached))
        variable = proposer in VARIABLE_LENGTH_PROPOSERS
        hist = self._lengths.get(key) if variable else None
        use_lengths = hist is not None and sum(hist) >= self.length_min_steps
        hazards = () if variable else self.stop_hazards(tenant, proposer, k_max)
        early_stop = any(h > 0 for h in hazards)
        cands = self._candidates(tenant, proposer, alpha, pos, k_min, k_max, tokens)
        by_k = {c.k: c for c in cands}
        best = cands[0]
        for c in cands[1:]:
            if c.speedup > best.speedup * (1 + 1e-12):
                best = c

        probe = False
        probe_whole = False
        now = self.clock()
        if k_max == 0:
            # this request alone decodes plainly: the tenant's held K, pending switch and probe
            # counters stay (else requests finishing meanwhile would count as probes)
            k, reason = 0, "speculation off"
        elif not adaptive:
            k = min(max(fixed_k if fixed_k is not None else k_max, k_min), k_max)
            reason = "fixed"
        else:
            k, reason = self._adaptive(st, best, by_k, now)
            if k == 0 and k_max >= 1:
                st.zero_requests += 1
                since = st.zero_since if st.last_probe_at is None else max(st.zero_since, st.last_probe_at)
                due_by_time = now - since >= self.probe_interval_s and st.zero_requests >= self.probe_min_requests
                snap = getattr(self.estimator, "snapshot", None)
                own_steps = snap(key).raw_steps if snap is not None else self.probe_min_steps
                thin = own_steps < self.probe_min_steps
                if st.zero_requests >= self.probe_every_requests or due_by_time or thin:
                    if variable:  # free drafts: probe the whole cap, measuring the lengths too
                        k = k_max
                    elif self.probe_k is not None:
                        k = min(max(self.probe_k, 1), k_max)
                    else:
                        k, _ = choose_k(self.probe_alpha, cm, max(1, k_min), k_max)
                    reason, probe = "probe", True
                    if thin and self.fresh_key_whole_probe and not variable:
                        # in process, a fresh key's probe runs the whole request, measured and
                        # re-tuned (guarded_k): 4 steps then plain decoding spent most of a short
                        # request plainly where its own acceptance could have set its K
                        probe_whole = True
                    st.zero_requests = 0
                    st.last_probe_at = now
                    st.probes += 1
                    st.probes_pending += 1
            elif k > 0 and self.fresh_key_whole_probe and not variable:
                # in process, a fresh key (fewer than probe_min_steps own steps) starts where a
                # predictable tenant would (the probe's K), guarded and re-tuned for the whole
                # request: from the prior α its K was one whose blocks teach little (K = 1 on
                # code with the demo pair's measured costs, then K = 1 for the whole request)
                snap = getattr(self.estimator, "snapshot", None)
                if snap is not None and snap(key).raw_steps < self.probe_min_steps:
                    pk = (min(max(self.probe_k, 1), k_max) if self.probe_k is not None
                          else choose_k(self.probe_alpha, cm, max(1, k_min), k_max)[0])
                    if pk > k:
                        k, reason, probe, probe_whole = pk, "probe: fresh key", True, True
                        st.probes += 1
        chosen = by_k.get(k) or evaluate_k(alpha, cm, k, k, pos)[0]
        probe_steps = None if (variable or probe_whole) else self.probe_steps
        terms = cm.step_terms(k)
        if (use_lengths or early_stop) and k > 0:  # the expected terms over the block lengths the cap gives
            dist = block_length_distribution(hist, k) if use_lengths else early_stop_lengths(hazards, k)
            per = [cm.step_terms(ell) for ell in range(k + 1)]
            terms = {name: sum(p * t[name] for p, t in zip(dist, per)) for name in terms}
        d = KDecision(
            tenant=tenant,
            proposer=proposer,
            k=k,
            reason=reason,
            alpha=alpha,
            alpha_evidence=self.estimator.evidence(key),
            position_alphas=pos,
            expected_tokens=chosen.expected_tokens,
            predicted_speedup=chosen.speedup,
            draft_s=terms["draft_s"],
            verify_s=terms["verify_s"],
            round_trip_s=terms["round_trip_s"],
            step_time_s=terms["total_s"],
            baseline_step_time_s=cm.step_time(0),
            k_min=k_min,
            k_max=k_max,
            best_k=best.k,
            probe=probe,
            probe_steps=probe_steps if probe else None,
            candidates=tuple(cands),
        )
        if k_max > 0:  # a "speculation off" decision says nothing about the tenant's K
            st.last_decision = d
        return d

    def _candidates(self, tenant: str, proposer: str, alpha: float, pos: tuple, k_min: int, k_max: int,
                    tokens: int | None) -> list[KCandidate]:
        """Every K in [k_min, k_max] at acceptance ``alpha`` (and per-position ``pos``): a
        variable-length proposer's caps over its block-length histogram, a draft model's over its
        early-stop hazards, else fixed-length blocks; with ``tokens``, the draft's prefill spread
        over the request (module docstring)."""
        key = (tenant, proposer)
        cm = self.cost_model(proposer)
        variable = proposer in VARIABLE_LENGTH_PROPOSERS
        hist = self._lengths.get(key) if variable else None
        hazards = () if variable else self.stop_hazards(tenant, proposer, k_max)
        if hist is not None and sum(hist) >= self.length_min_steps:
            cands = [evaluate_variable_k(alpha, cm, c, block_length_distribution(hist, c), pos)
                     for c in range(k_min, k_max + 1)]
        elif any(h > 0 for h in hazards):
            cands = [evaluate_variable_k(alpha, cm, c, early_stop_lengths(hazards, c), pos)
                     for c in range(k_min, k_max + 1)]
        else:
            cands = evaluate_k(alpha, cm, k_min, k_max, pos)
        if tokens is not None and cm.draft_prefill_s > 0:
            cands = [c if c.k == 0 else KCandidate(c.k, c.expected_tokens, c.step_time_s,
                                                   cm.request_speedup(c.expected_tokens, c.step_time_s, tokens))
                     for c in cands]
        return cands

    def _adaptive(self, st: KState, best: KCandidate, by_k: dict[int, KCandidate], now: float) -> tuple[int, str]:
        cur = st.current_k
        if cur is None:
            self._set_k(st, best.k, now)
            return best.k, "initial"
        if cur not in by_k:  # the range changed under the current K
            k = min(by_k) if cur < min(by_k) else max(by_k)
            self._set_k(st, k, now)
            return k, "clipped to range"
        if best.k == cur:
            st.pending_k, st.pending_count = None, 0
            return cur, "hold"
        gain = best.speedup / by_k[cur].speedup - 1.0
        if gain > self.switch_margin:
            self._set_k(st, best.k, now)
            return best.k, "switch: gain"
        if cur == 0 and gain > 0:
            # at K = 0 no evidence arrives, so waiting for consistent decisions only delays
            self._set_k(st, best.k, now)
            return best.k, "switch: from K = 0"
        if st.pending_k == best.k:
            st.pending_count += 1
        else:
            st.pending_k, st.pending_count = best.k, 1
        if st.pending_count >= self.switch_after:
            self._set_k(st, best.k, now)
            return best.k, "switch: consistent"
        return cur, "hold"

    def _set_k(self, st: KState, k: int, now: float) -> None:
        if st.current_k is not None and st.current_k != k:
            st.switches += 1
        if k == 0 and st.current_k != 0:
            st.zero_requests = 0
            st.zero_since = now
            st.probes_pending = 0
        st.current_k = k
        st.pending_k, st.pending_count = None, 0

    def guarded_k(self, tenant: str, proposer: str, decision: KDecision) -> GuardedK:
        """The per-step K to run ``decision`` with in process: its :meth:`KDecision.k_schedule`
        under the key's goodput guard (:mod:`specdec.control.step_guard`; made from
        ``step_guard`` on first use). A probe, a decision at K = 0 or a controller without
        ``step_guard`` runs the schedule as it is, except that with ``in_request_retune`` a probe
        of the whole request (``probe_steps`` None: a fresh key's, :meth:`decide`) runs guarded
        and re-tuned like any decision. Call ``.attach(generation.stats)`` before the
        first step."""
        guard = None
        # a fresh key's whole-request probe in process (decide) is measured and re-tuned like any request
        whole = (decision.probe and decision.probe_steps is None and self.in_request_retune
                 and proposer not in VARIABLE_LENGTH_PROPOSERS)
        if self.step_guard is not None and decision.k > 0:
            key = (tenant, proposer)
            guard = self._guards.get(key)
            if guard is None:
                guard = self._guards[key] = self.step_guard.fresh()
        retune = None
        if (guard is not None and self.in_request_retune and (not decision.probe or whole)
                and proposer not in VARIABLE_LENGTH_PROPOSERS):
            retune = lambda stats, k: self.in_request_k(tenant, proposer, decision, stats, k)  # noqa: E731
        return GuardedK(decision.k_schedule(), guard, measure=not decision.probe or whole,
                        plain_bound=lambda: self.plain_bound(proposer), retune=retune)

    def in_request_k(self, tenant: str, proposer: str, decision: KDecision, stats: Any, current: int) -> int:
        """The K for the next step of a running request decided by ``decision``, now at K =
        ``current`` (>= 1), whose live :class:`specdec.types.SpeculationStats` are ``stats``.

        α is the key's estimate with the request's own counts added (the truncated-geometric MLE
        of :mod:`specdec.control.acceptance` over both: Σa / (Σa + R)); a key never recorded
        counts the prior a first record would seed (``prior_weight`` trials at the global α), and
        the prior fades by the request's steps as a record would fade it
        (``prior_half_life_steps``); with ``retune_memory_trials`` the key's counts (prior
        included) are first scaled to at most that many trials. The K in [max(1, k_min,
        decision.k), k_max] (never below the K decided: a K that speculation does not pay at is
        the goodput guard's to drop to 0, and the early-stop counts read blocks shorter than the
        K decided as stopped) that maximises the predicted speedup at that α (costs and early
        stop as in :meth:`decide`; per-position α only with ``position_prior_trials``, the key's
        (scaled) and the request's per-position counts together) replaces ``current`` when it
        beats it by more than ``switch_margin``; else ``current`` stays.
        """
        key = (tenant, proposer)
        est = self.estimator
        snap = est.snapshot(key)
        d = stats.as_dict() if hasattr(stats, "as_dict") else dict(stats)
        acc, rej = float(d.get("accepted", 0)), float(d.get("rejected_steps", 0))
        steps = float(d.get("steps", 0)) - float((d.get("k_counts") or {}).get(0, 0))
        pa, pr = snap.prior_accepted, snap.prior_rejected
        if snap.raw_steps == 0 and pa + pr == 0:  # never recorded: the prior a first record seeds
            w = float(getattr(est, "prior_weight", 0.0))
            pa, pr = w * snap.alpha, w * (1.0 - snap.alpha)
        hl = getattr(est, "prior_half_life_steps", None)
        fade = 0.5 ** (max(steps, 0.0) / hl) if hl else 1.0
        ka, kr = snap.accepted + pa * fade, snap.rejected_steps + pr * fade  # the key's trials
        scale = 1.0
        if self.retune_memory_trials is not None and ka + kr > self.retune_memory_trials:
            scale = self.retune_memory_trials / (ka + kr)
        num = ka * scale + acc
        den = num + kr * scale + rej
        if not den > 0:
            return current
        k_lo, k_hi = max(1, decision.k_min, decision.k), decision.k_max
        if k_hi < k_lo:
            return current
        alpha = min(num / den, 1.0)
        pos: tuple = ()
        if self.position_prior_trials is not None:
            acc_pos = [float(x) for x in d.get("accepted_per_position") or []]
            reached = reached_from_counts(acc_pos, [float(x) for x in d.get("proposed_per_position") or []])
            pos = tuple(est.shrunk_position_alphas(key, k_hi, self.position_prior_trials, acc_pos, reached,
                                                   alpha=alpha, scale=scale))
        cands = self._candidates(tenant, proposer, alpha, pos, k_lo, k_hi, None)
        by_k = {c.k: c for c in cands}
        best = cands[0]
        for c in cands[1:]:
            if c.speedup > best.speedup * (1 + 1e-12):
                best = c
        now = by_k.get(current)
        if now is None or best.speedup > now.speedup * (1.0 + self.switch_margin):
            return best.k
        return current

    def plain_bound(self, proposer: str, min_observations: int = 3) -> float | None:
        """The most tokens/s plain decoding could reach by the cost model's measured one-position
        verify (``1 / verify_s(1)``; no per-step overhead); None until it was measured
        ``min_observations`` times."""
        cm = self.cost_model(proposer)
        if cm.snapshot()["verify_observations"].get(1, 0) < min_observations:
            return None
        t = cm.verify_s(1)
        return 1.0 / t if t > 0 else None

    def guard_stats(self, tenant: str, proposer: str) -> dict | None:
        """The key's in-request guard (:meth:`GoodputGuard.snapshot`), None before it has one."""
        g = self._guards.get((tenant, proposer))
        return None if g is None else g.snapshot()

    # ------------------------------------------------------------------ views

    def current_k(self, tenant: str, proposer: str) -> int | None:
        """The K the tenant is held at (probes aside); None before its first decision."""
        st = self._state.get((tenant, proposer))
        return None if st is None else st.current_k

    def tenant_stats(self, tenant: str) -> dict:
        """Plain-data view of one tenant's controller state, per proposer (for its stats RPC)."""
        out = {}
        for (t, proposer), st in self._state.items():
            if t != tenant:
                continue
            out[proposer] = {
                "current_k": st.current_k,
                "decisions": st.decisions,
                "probes": st.probes,
                "switches": st.switches,
                "acceptance": self.estimator.snapshot((t, proposer)).as_dict(),
                "last_decision": None if st.last_decision is None else st.last_decision.as_dict(),
            }
        return out
