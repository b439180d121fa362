"""What finished requests and timed steps teach :class:`specdec.control.controller.KController`.

:class:`RequestFeedback` is mixed into the controller (it uses its ``estimator``, ``_state``,
``_lengths``, probe settings and :meth:`cost_model`): a request's acceptance counters (a probe's
result first discounts the key's stale counts), the block lengths of a variable-length proposer
(a decayed histogram) and the measured step costs (draft seconds per token, verify seconds per
positions, round trip).
"""

from __future__ import annotations

from typing import Any, Mapping

from specdec.control.objective import VARIABLE_LENGTH_PROPOSERS


class RequestFeedback:
    """Feedback methods of :class:`specdec.control.controller.KController` (module docstring)."""

    def record(self, tenant: str, proposer: str, stats: Any, costs: Mapping | None = None) -> None:
        """Feed one finished request's :class:`specdec.types.SpeculationStats` (or its dict).

        Args:
            stats: the request's counters and draft/verify seconds.
            costs: optional per-step timings (:meth:`specdec.control.adaptive.StepCosts.as_dict`):
                ``{"verify_s_by_positions": {positions: [seconds, steps]}, "draft_s": s,
                "drafted": tokens}``, with the first step (which carries the prompt prefill of
                both models) left out; optionally ``"draft_s_by_drafted": {d: [seconds,
                blocks]}`` (draft blocks by length: :meth:`CostModel.observe_draft_block`) and
                ``"first_draft_s"``, ``"first_drafted"`` (the first step's draft seconds and
                block length: what exceeds that block's modelled cost is the draft's prompt
                prefill, :meth:`CostModel.observe_draft_prefill`). Preferred: ``stats`` alone cannot separate the prefill
                from the steps, nor the verify times of different K within a request.

        A request that drafted while the key is held at K = 0, after a probe was decided whose
        result is not recorded yet, is that probe's result: the older counts are first
        discounted by ``probe_discount`` and capped at ``probe_memory_trials`` trials.
        Acceptance: all counters go to the estimator (K = 0 steps carry no signal). Costs, with
        ``costs``: one observation of the mean verify seconds per number of positions seen,
        and draft seconds per drafted token. Without: draft seconds per drafted token of the
        whole request, and verify seconds per step of the request's dominant K (at least 3/4
        of its steps, the other steps' share subtracted with the current model; the first
        step's prefill is then included).
        """
        d = stats.as_dict() if hasattr(stats, "as_dict") else dict(stats)
        key = (tenant, proposer)
        st = self._state.get(key)
        if st is not None and st.current_k == 0 and st.probes_pending > 0 and int(d.get("proposed", 0)) > 0:
            # A probe's result (K > 0 steps while held at K = 0): older counts are stale.
            st.probes_pending -= 1
            discount = getattr(self.estimator, "discount", None)
            if discount is not None:
                discount(key, self.probe_discount)
            cap = getattr(self.estimator, "cap_evidence", None)
            if cap is not None and self.probe_memory_trials is not None:
                cap(key, self.probe_memory_trials)
        self.estimator.record_stats(key, d)
        if proposer in VARIABLE_LENGTH_PROPOSERS:
            self._record_lengths(key, d.get("k_counts") or {})
        elif self.learn_early_stop:  # in process only (KController docstring)
            cap = st.last_decision.k if st is not None and st.last_decision is not None else 0
            room = (costs or {}).get("room_limited_blocks") or {}
            self.record_stops(key, d.get("k_counts") or {}, cap, censored=room)
        cm = self.cost_model(proposer)
        if costs is not None:
            self.observe_costs(proposer, costs)
            return
        proposed = int(d.get("proposed", 0))
        if proposed > 0 and d.get("draft_time_s"):
            cm.observe_draft(proposed, float(d["draft_time_s"]))
        k_counts = {int(k): int(v) for k, v in (d.get("k_counts") or {}).items() if int(v) > 0}
        steps = sum(k_counts.values())
        verify_total = float(d.get("verify_time_s") or 0.0)
        if not k_counts or steps <= 0 or verify_total <= 0:
            return
        k_dom = max(k_counts, key=lambda k: (k_counts[k], k))
        n_dom = k_counts[k_dom]
        if n_dom * 4 < steps * 3:
            return  # too mixed to attribute
        rest = verify_total - sum(n * cm.verify_s(k + 1) for k, n in k_counts.items() if k != k_dom)
        if rest > 0:
            cm.observe_verify(k_dom + 1, rest / n_dom)

    def _record_lengths(self, key: tuple[str, str], k_counts: Mapping) -> None:
        """Add one request's block lengths >= 1 to the key's decayed histogram (module doc)."""
        counts = {int(k): float(v) for k, v in k_counts.items() if int(k) >= 1 and float(v) > 0}
        if not counts:
            return
        hist = self._lengths.setdefault(key, [])
        factor = 0.5 ** (sum(counts.values()) / self.length_half_life_steps)
        for i in range(len(hist)):
            hist[i] *= factor
        for length, n in counts.items():
            while len(hist) <= length:
                hist.append(0.0)
            hist[length] += n

    def record_stops(self, key: tuple[str, str], k_counts: Mapping, cap: int, censored: Mapping | None = None) -> None:
        """Add one request's draft block lengths to the key's early-stop counts: a block of d
        tokens shorter than ``cap`` continued past positions 1..d-1 and stopped at d; a block of
        ``cap`` tokens or more continued past 1..d-1 and is censored at d (a K re-chosen within
        the request, :meth:`KController.in_request_k`, only raises the cap above the K decided).
        ``cap``: the K decided for the request (0: the longest block). ``censored``: drafted
        tokens -> how many of the ``k_counts`` blocks of that length were cut by the room left in
        the request (:class:`specdec.control.adaptive.StepCosts`' ``room_blocks``): they went on
        past 1..d-1 and are censored at d whatever the cap (counted as stops, every 32-token
        request's last block read as an early stop: ~1 in 9 blocks on code). Decayed like the
        length histogram (``length_half_life_steps``)."""
        counts = {int(k): float(v) for k, v in k_counts.items() if int(k) >= 1 and float(v) > 0}
        if not counts:
            return
        cut = {int(k): min(float(v), counts.get(int(k), 0.0)) for k, v in (censored or {}).items()
               if int(k) >= 1 and float(v) > 0}
        cap = int(cap) if cap > 0 else max(counts)
        stopped, continued = self._stops.setdefault(key, ([], []))
        factor = 0.5 ** (sum(counts.values()) / self.length_half_life_steps)
        for lst in (stopped, continued):
            for i in range(len(lst)):
                lst[i] *= factor
            while len(lst) < max(cap, max(counts)):
                lst.append(0.0)
        for length, n in counts.items():
            for j in range(length - 1):
                continued[j] += n
            if length < cap:
                stopped[length - 1] += n - cut.get(length, 0.0)

    def stop_hazards(self, tenant: str, proposer: str, n: int) -> list[float]:
        """``h_1..h_n``, the probability that a draft block ends at each position
        (:func:`specdec.control.objective.early_stop_lengths`): per position where it has
        ``stop_min_trials`` decayed blocks that reached it with room to go on, elsewhere (and
        beyond the positions seen) the pooled rate of all positions, Σ stopped / Σ reached (a
        constant hazard: geometric block lengths, as α̂ is for acceptance). All 0 before any
        block stopped (the fixed-length model)."""
        stopped, continued = self._stops.get((tenant, proposer), ([], []))
        total_s, total = sum(stopped), sum(stopped) + sum(continued)
        pooled = total_s / total if total > 0 else 0.0
        out = []
        for j in range(n):
            trials = (stopped[j] + continued[j]) if j < len(stopped) else 0.0
            out.append(stopped[j] / trials if trials >= self.stop_min_trials else pooled)
        return out

    def block_lengths(self, tenant: str, proposer: str) -> list[float]:
        """The decayed histogram of block lengths (index = length; index 0 unused) of a
        variable-length proposer's key; empty when none was recorded."""
        return list(self._lengths.get((tenant, proposer), []))

    def observe_costs(self, proposer: str, costs: Mapping) -> None:
        """Feed aggregated per-step timings of one request (see :meth:`record`'s ``costs``)."""
        cm = self.cost_model(proposer)
        for p, (secs, n) in (costs.get("verify_s_by_positions") or {}).items():
            p, n = int(p), int(n)
            if n > 0 and 1 <= p <= cm.max_positions:
                cm.observe_verify(p, float(secs) / n)
        drafted = int(costs.get("drafted") or 0)
        if drafted > 0:
            cm.observe_draft(drafted, float(costs.get("draft_s") or 0.0))
        for d, (secs, n) in (costs.get("draft_s_by_drafted") or {}).items():
            d, n = int(d), int(n)
            if n > 0 and 1 <= d < cm.max_positions:
                cm.observe_draft_block(d, float(secs) / n)
        first_d = int(costs.get("first_drafted") or 0)
        if first_d > 0 and costs.get("draft_s_by_drafted"):
            # the first step's draft seconds beyond an ordinary block of its length: the prefill
            cm.observe_draft_prefill(max(float(costs.get("first_draft_s") or 0.0) - cm.draft_block_s(first_d), 0.0))
        rtt = costs.get("round_trip_s")
        if rtt is not None:
            cm.observe_round_trip(float(rtt))

    def observe_step(
        self, proposer: str, k: int, draft_s: float, verify_s: float, round_trip_s: float | None = None
    ) -> None:
        """Feed one step's measured times (for callers that time steps individually)."""
        cm = self.cost_model(proposer)
        if k > 0:
            cm.observe_draft(k, draft_s)
        cm.observe_verify(k + 1, verify_s)
        if round_trip_s is not None and k > 0:
            cm.observe_round_trip(round_trip_s)
