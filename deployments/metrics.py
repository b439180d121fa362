"""specdec's Prometheus metrics, through Ray's metrics API.

Defined with :mod:`ray.serve.metrics` (inside a Serve replica it adds the ``application``,
``deployment`` and ``replica`` tags; elsewhere, or without Ray running, recording is a cheap
no-op export). Ray exports each metric as ``ray_<name>`` (Counters additionally ``_total``) on
every node's metrics port; ``k8s/grafana/specdec-dashboard.json`` reads them (names in
:data:`METRICS`, documented in ``k8s/README.md``).

Labels are bounded: ``tenant`` (from the tenants file; ``"unknown"`` before authentication),
``proposer`` (draft, ngram, none), ``status`` (gRPC code names), ``position`` (0..15), ``model``
(target, draft). Never a
request id, prompt, key or free text.

Every value recorded is also kept in :attr:`SpecDecMetrics.values` (counters and gauges) and
:attr:`SpecDecMetrics.observations` (histograms: count and sum), so tests and the stats RPC can
read them without a Prometheus.
"""

from __future__ import annotations

import collections
from typing import Any, Mapping

#: name -> (kind, description, tag keys, histogram boundaries or None). The exported names are
#: "ray_" + name (+ "_total" for counters).
METRICS: dict[str, tuple[str, str, tuple[str, ...], list[float] | None]] = {
    "specdec_requests": ("counter", "Finished requests by gRPC status code name.", ("tenant", "status"), None),
    "specdec_prompt_tokens": ("counter", "Prompt tokens of admitted requests.", ("tenant",), None),
    "specdec_generated_tokens": ("counter", "Completion tokens generated.", ("tenant",), None),
    "specdec_proposed_tokens": ("counter", "Draft tokens proposed.", ("tenant", "proposer"), None),
    "specdec_accepted_tokens": ("counter", "Draft tokens accepted by the verifier.", ("tenant", "proposer"), None),
    "specdec_accepted_tokens_by_position": (
        "counter", "Draft tokens accepted at each 0-based draft position.", ("tenant", "proposer", "position"), None),
    "specdec_proposed_tokens_by_position": (
        "counter", "Draft tokens proposed at each 0-based draft position.", ("tenant", "proposer", "position"), None),
    "specdec_acceptance_rate": (
        "gauge", "The controller's acceptance estimate alpha (pooled, decayed).", ("tenant", "proposer"), None),
    "specdec_chosen_k": ("gauge", "K the controller chose for the tenant's last request.", ("tenant", "proposer"), None),
    "specdec_predicted_speedup": (
        "gauge", "Predicted tokens/s at the chosen K over plain decoding (cost model).", ("tenant", "proposer"), None),
    "specdec_measured_speedup": (
        "gauge", "Measured decoding tokens/s of the last request over the cost model's plain-decoding rate.",
        ("tenant", "proposer"), None),
    "specdec_speculation_k": (
        "histogram", "K used per speculation step.", ("tenant",), [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 12.5, 16.5]),
    "specdec_draft_seconds": (
        "histogram", "Draft proposal seconds per step (each request's mean).", (),
        [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]),
    "specdec_verify_seconds": (
        "histogram", "Target verification seconds per step (each request's mean).", (),
        [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]),
    "specdec_ttft_seconds": (
        "histogram", "Time to first token.", ("tenant",), [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]),
    "specdec_inter_token_seconds": (
        "histogram", "Mean time between tokens after the first, per request.", ("tenant",),
        [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]),
    "specdec_queue_seconds": (
        "histogram", "Seconds a request waited for a fair-admission slot.", ("tenant",),
        [0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30]),
    "specdec_target_sessions": (
        "gauge", "Target sessions (KV caches) held by the replica after its last sweep.", (), None),
    "specdec_target_sessions_swept": (
        "counter", "Target sessions freed because nobody used them for target_session_idle_timeout_s.", (), None),
    "specdec_batch_rows": (
        "histogram", "Sessions whose blocks one batched target forward verified (continuous batching).", (),
        [1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5]),
    "specdec_batch_positions": (
        "histogram", "Positions one batched target forward scored (sum of K + 1, plus prefill chunks).", (),
        [1.5, 4.5, 8.5, 16.5, 32.5, 64.5, 128.5, 256.5, 512.5]),
    "specdec_batch_k": (
        "gauge", "K under load: the K the draft replica's batch controller chose for the tenant at its last "
        "decision (whole-batch tokens/s within fair shares; 0 = speculation off under the current load).",
        ("tenant", "proposer"), None),
    "specdec_batch_rows_seen": (
        "gauge", "Mean sessions (rows) of the batched target forwards the tenant's recent steps ran in.",
        ("tenant",), None),
    "specdec_batch_positions_seen": (
        "gauge", "Mean positions of the batched target forwards the tenant's recent steps ran in.",
        ("tenant",), None),
    "specdec_prefix_cache_hits": (
        "counter", "Sessions whose KV cache started from a prefix another session held (automatic prefix "
        "caching, AppConfig.prefix_cache_entries), by model (target, draft).", ("model",), None),
    "specdec_prefix_cache_shared_positions": (
        "counter", "Positions copied from another session's KV cache instead of computed (prefix caching).",
        ("model",), None),
    "specdec_exchange_bytes": (
        "histogram", "Draft<->target bytes per speculation step.", (),
        [256, 1024, 4096, 16384, 65536, 262144, 1048576]),
}

#: Largest draft position labelled individually (positions beyond are not exported).
MAX_POSITION_LABEL = 16


class SpecDecMetrics:
    """The metric objects plus an in-process mirror. One instance per process (replica).

    Args:
        backend: ``"ray"`` (default: :mod:`ray.serve.metrics`) or ``None`` (mirror only, no
            Ray import: unit tests, the benchmark).
    """

    def __init__(self, backend: str | None = "ray"):
        self._m: dict[str, Any] = {}
        if backend == "ray":
            from ray.serve import metrics as rm

            for name, (kind, desc, tags, bounds) in METRICS.items():
                if kind == "counter":
                    self._m[name] = rm.Counter(name, description=desc, tag_keys=tags)
                elif kind == "gauge":
                    self._m[name] = rm.Gauge(name, description=desc, tag_keys=tags)
                else:
                    self._m[name] = rm.Histogram(name, description=desc, boundaries=bounds, tag_keys=tags)
        elif backend is not None:
            raise ValueError(f"unknown metrics backend {backend!r}")
        self.values: dict[tuple, float] = collections.defaultdict(float)
        self.observations: dict[tuple, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        #: model -> (hits, shared positions) of its prefix cache when last recorded
        self._prefix_seen: dict[str, tuple[int, int]] = {}

    @staticmethod
    def _key(name: str, tags: Mapping[str, str]) -> tuple:
        return (name,) + tuple(sorted(tags.items()))

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        if value <= 0:
            return
        self.values[self._key(name, tags)] += value
        m = self._m.get(name)
        if m is not None:
            m.inc(value, tags=tags or None)

    def set(self, name: str, value: float, **tags: str) -> None:
        self.values[self._key(name, tags)] = value
        m = self._m.get(name)
        if m is not None:
            m.set(value, tags=tags or None)

    def observe(self, name: str, value: float, **tags: str) -> None:
        o = self.observations[self._key(name, tags)]
        o[0] += 1
        o[1] += value
        m = self._m.get(name)
        if m is not None:
            m.observe(value, tags=tags or None)

    def value(self, name: str, **tags: str) -> float:
        return self.values.get(self._key(name, tags), 0.0)

    def count(self, name: str, **tags: str) -> int:
        return int(self.observations.get(self._key(name, tags), [0, 0.0])[0])

    # ------------------------------------------------------------------ per request

    def record_request(
        self,
        tenant: str,
        proposer: str,
        status: str,
        result: Any = None,
        ttft_s: float | None = None,
        decision: Mapping | None = None,
        *,
        inter_token_s: float | None = None,
        prompt_tokens: int | None = None,
        queue_s: float | None = None,
        acceptance_rate: float | None = None,
    ) -> None:
        """Record one finished (or refused) request.

        Args:
            tenant: tenant id, ``"unknown"`` if authentication failed.
            proposer: the proposer used (``"none"`` for plain decoding).
            status: gRPC status code name (``"OK"``, ``"RESOURCE_EXHAUSTED"``, ...).
            result: the :class:`specdec.types.GenerationResult` (or None for a refused request):
                completion tokens, speculation counters, draft and verify seconds.
            ttft_s, inter_token_s: latencies measured by the caller.
            decision: the controller's KDecision dict (α, K, predicted speedup, baseline step).
            prompt_tokens: prompt length (counted when given).
            queue_s: fair-admission wait.
            acceptance_rate: the controller's α̂ after this request (else the decision's).
        """
        self.inc("specdec_requests", tenant=tenant, status=status)
        if prompt_tokens:
            self.inc("specdec_prompt_tokens", prompt_tokens, tenant=tenant)
        if queue_s is not None:
            self.observe("specdec_queue_seconds", queue_s, tenant=tenant)
        if ttft_s is not None:
            self.observe("specdec_ttft_seconds", ttft_s, tenant=tenant)
        if inter_token_s is not None:
            self.observe("specdec_inter_token_seconds", inter_token_s, tenant=tenant)
        if decision is not None and proposer != "none":
            self.set("specdec_chosen_k", float(decision["k"]), tenant=tenant, proposer=proposer)
            self.set("specdec_predicted_speedup", float(decision["predicted_speedup"]), tenant=tenant, proposer=proposer)
        alpha = acceptance_rate if acceptance_rate is not None else (decision or {}).get("alpha")
        if alpha is not None and proposer != "none":
            self.set("specdec_acceptance_rate", float(alpha), tenant=tenant, proposer=proposer)
        if result is None:
            return
        tokens = int(result.usage.completion_tokens)
        self.inc("specdec_generated_tokens", tokens, tenant=tenant)
        st = result.stats
        if st is None or st.steps == 0:
            return
        self.inc("specdec_proposed_tokens", st.proposed, tenant=tenant, proposer=proposer)
        self.inc("specdec_accepted_tokens", st.accepted, tenant=tenant, proposer=proposer)
        for j, (a, p) in enumerate(zip(st.accepted_per_position, st.proposed_per_position)):
            if j >= MAX_POSITION_LABEL:
                break
            self.inc("specdec_accepted_tokens_by_position", a, tenant=tenant, proposer=proposer, position=str(j))
            self.inc("specdec_proposed_tokens_by_position", p, tenant=tenant, proposer=proposer, position=str(j))
        for k, n in sorted(st.k_counts.items()):
            for _ in range(int(n)):
                self.observe("specdec_speculation_k", float(k), tenant=tenant)
        self.observe("specdec_draft_seconds", st.draft_time_s / st.steps)
        self.observe("specdec_verify_seconds", st.verify_time_s / st.steps)
        busy = st.draft_time_s + st.verify_time_s
        if decision is not None and busy > 0 and tokens > 0 and proposer != "none":
            base = float(decision.get("baseline_step_time_s") or 0.0)
            if base > 0:
                self.set("specdec_measured_speedup", tokens * base / busy, tenant=tenant, proposer=proposer)

    def record_batch_k(self, tenant: str, proposer: str, stats: Mapping, acceptance_rate: float | None = None) -> None:
        """Set the K-under-load gauges of one tenant from
        :meth:`specdec.control.batch_k.BatchKSessions.tenant_stats`, and its acceptance-rate gauge
        from ``acceptance_rate`` when given (a batch-adaptive tenant's α̂ is the draft replica's:
        the router's per-request controller does not learn it)."""
        if stats.get("k_under_load") is not None and proposer != "none":
            self.set("specdec_batch_k", float(stats["k_under_load"]), tenant=tenant, proposer=proposer)
        if acceptance_rate is not None and proposer != "none":
            self.set("specdec_acceptance_rate", float(acceptance_rate), tenant=tenant, proposer=proposer)
        if stats.get("steps"):
            self.set("specdec_batch_rows_seen", float(stats["rows_per_step"]), tenant=tenant)
            self.set("specdec_batch_positions_seen", float(stats["positions_per_step"]), tenant=tenant)

    def record_prefix_cache(self, model: str, stats: Mapping) -> None:
        """Count what ``model``'s prefix cache (``"target"`` or ``"draft"``) did since the last call:
        ``stats`` is :func:`deployments.prefix_caching.prefix_stats` (totals since start-up)."""
        hits, positions = int(stats.get("hits", 0)), int(stats.get("shared_positions", 0))
        seen_hits, seen_positions = self._prefix_seen.get(model, (0, 0))
        self._prefix_seen[model] = (hits, positions)
        self.inc("specdec_prefix_cache_hits", hits - seen_hits, model=model)
        self.inc("specdec_prefix_cache_shared_positions", positions - seen_positions, model=model)

    def record_exchange(self, nbytes: int) -> None:
        """Bytes of one draft<->target exchange (candidate block + verification result)."""
        self.observe("specdec_exchange_bytes", float(nbytes))
