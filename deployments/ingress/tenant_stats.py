"""``GetTenantStats``' answer: the shared state's per-tenant dict (:meth:`TenancyGate.tenant_stats`
of :mod:`deployments.tenancy`) as a ``GetTenantStatsResponse`` for one proposer."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Mapping

log = logging.getLogger(__name__)

_PROPOSER_ENUM = {"draft": 1, "ngram": 2, "none": 3}


def proposer_name(enum_value: int) -> str | None:
    """``specdec.v1.Proposer`` enum value -> proposer name (None for PROPOSER_UNSPECIFIED)."""
    return {v: k for k, v in _PROPOSER_ENUM.items()}.get(int(enum_value))


def stats_proposer(stats: Mapping, proposer: str | None) -> str:
    """The proposer a ``GetTenantStats`` answer is for: ``proposer``, else the tenant's default."""
    return proposer or stats.get("default_proposer") or "draft"


def uses_batch_k(stats: Mapping, proposer: str | None) -> bool:
    """Whether the answer's acceptance and K come from the draft replicas (K under load): their
    pool holds steps of the tenant with that proposer (:func:`tenant_stats_to_proto`)."""
    p = (stats.get("proposers") or {}).get(stats_proposer(stats, proposer)) or {}
    return bool(p.get("batch_acceptance"))


def tenant_stats_to_proto(stats: Mapping, proposer: str | None = None):
    """``GetTenantStatsResponse`` for one proposer of :meth:`TenancyGate.tenant_stats`'s dict.

    ``proposer`` None: the tenant's default proposer. A proposer the tenant never used gets
    only its id, usage and ``current_k`` 0 (acceptance and speedup unset). Acceptance is set
    only with evidence (observed trials > 0): a tenant whose steps all ran at K = 0 measured
    none, and its α̂ would be the prior (0.5, or the other tenants' pool) reported as its own. A proposer whose
    steps the draft replicas pooled (``"batch_acceptance"``: K under load) takes its acceptance
    and counters from that pool, and neither ``current_k``, ``predicted_speedup`` nor ``cost``
    from the per-request controller (its K is the draft replicas': the router sets
    ``current_k`` from ``batch.k_under_load``, :func:`uses_batch_k`).
    """
    from protos.specdec.v1 import specdec_pb2 as pb

    proposer = stats_proposer(stats, proposer)
    msg = pb.GetTenantStatsResponse(tenant_id=stats["tenant_id"], proposer=_PROPOSER_ENUM.get(proposer, 0))
    u = stats.get("usage") or {}
    msg.usage.requests = int(u.get("requests", 0))
    msg.usage.prompt_tokens = int(u.get("prompt_tokens", 0))
    msg.usage.completion_tokens = int(u.get("completion_tokens", 0))
    p = (stats.get("proposers") or {}).get(proposer)
    if not p:
        return msg
    batch = p.get("batch_acceptance")
    acc = batch or p.get("acceptance") or {}
    if acc.get("evidence", 0) > 0:  # no observed trial (e.g. every step at K = 0): unknown, left unset
        msg.acceptance_rate = float(acc["alpha"])
    msg.current_k = 0 if batch else int(p.get("current_k") or 0)
    last = None if batch else p.get("last_decision")
    if last is not None:
        msg.predicted_speedup = float(last["predicted_speedup"])
    cm = {} if batch else p.get("cost_model") or {}
    if cm:
        msg.cost.draft_per_token_s = float(cm.get("draft_s_per_token", 0.0))
        msg.cost.round_trip_s = float(cm.get("round_trip_s", 0.0))
        verify = {int(k): v for k, v in (cm.get("verify_s") or {}).items() if v is not None}
        if verify:
            msg.cost.verify_s_by_positions.extend(float(verify.get(i + 1, 0.0)) for i in range(max(verify)))
    s = msg.stats
    s.steps = int(round(acc.get("steps", 0)))
    s.proposed = int(round(acc.get("proposed", 0)))
    s.accepted = int(round(acc.get("accepted", 0)))
    s.rejected_steps = int(round(acc.get("rejected_steps", 0)))
    if s.proposed:
        s.acceptance_rate = s.accepted / s.proposed
    s.accepted_per_position.extend(int(round(x)) for x in acc.get("accepted_per_position", []))
    s.proposed_per_position.extend(int(round(x)) for x in acc.get("proposed_per_position", []))
    return msg


async def add_batch_load(msg, stats: Mapping, proposer: str | None, target: Any, draft: Any) -> None:
    """Fill ``msg.batch`` (a ``GetTenantStatsResponse``) with what the batches look like: the
    target's batch shape (``target.BatchStats``) and K under load for the tenant, the answering
    draft replica's (``draft.BatchKStats``) merged with every replica's last report in ``stats``
    (:mod:`deployments.batch_k_stats`); for a batch-adaptive proposer ``current_k`` becomes
    ``batch.k_under_load``. Best effort: a replica that does not answer within 5 s leaves its
    part unset; never raises.
    """
    from deployments.batch_k_stats import fill_batch_load, merge_views

    try:  # the batch shape the target sees (best effort: stats must not fail on it)
        load = await asyncio.wait_for(target.BatchStats.remote(), timeout=5)
        msg.batch.forwards = int(load["forwards"])
        msg.batch.mean_rows = float(load["mean_rows"])
        msg.batch.mean_positions = float(load["mean_positions"])
        msg.batch.max_rows = int(load["max_rows"])
    except Exception:
        log.debug("target BatchStats unavailable", exc_info=True)
    # K under load for this tenant: the answering draft replica's, and every replica's as
    # of its last exchange with the shared controller (deployments.batch_k_stats)
    mine = None
    try:
        mine = await asyncio.wait_for(draft.BatchKStats.remote(stats["tenant_id"]), timeout=5)
    except Exception:
        log.debug("draft BatchKStats unavailable", exc_info=True)
    try:
        fill_batch_load(msg.batch, merge_views(stats.get("batch_replicas") or [], mine), time.time())
        if uses_batch_k(stats, proposer) and msg.batch.HasField("k_under_load"):
            msg.current_k = msg.batch.k_under_load  # its K is the draft replicas', one place
    except Exception:
        log.exception("K under load views")
