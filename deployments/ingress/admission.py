"""Who the caller is and what an admitted request holds: the ``authorization`` metadata, open
mode's tenant, and :class:`Admission` (what :meth:`deployments.tenancy.TenancyGate.admit` returns
and :meth:`~deployments.tenancy.TenancyGate.complete` gives back)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from specdec.control.tenants import SpeculationPolicy, Tenant, TenantLimits
from specdec.request import MAX_SPECULATION_LENGTH, GenerationRequest

#: Tenant id of open mode (no tenants file).
OPEN_TENANT_ID = "default"
#: Tenant label of requests refused before authentication.
UNKNOWN_TENANT = "unknown"
#: The anonymous tenant of open mode: no rate limits, any proposer, adaptive K in [0, 16].
OPEN_TENANT = Tenant(
    id=OPEN_TENANT_ID,
    api_key_hashes=["0" * 64],  # matches no key: open mode never authenticates
    limits=TenantLimits(
        max_concurrent_requests=1_000_000, tokens_per_minute=None, max_tokens=1_000_000, max_prompt_tokens=1_000_000
    ),
    speculation=SpeculationPolicy(k_min=0, k_max=MAX_SPECULATION_LENGTH, adaptive=True),
)


def authorization_from_metadata(metadata: Any) -> str | None:
    """The ``authorization`` value from gRPC metadata.

    Accepts what routers have at hand: ``grpc_context.invocation_metadata()`` (pairs or objects
    with ``key``/``value``), a mapping, or None. Keys compare case-insensitively; the first
    ``authorization`` entry wins.
    """
    if metadata is None:
        return None
    if hasattr(metadata, "invocation_metadata"):
        metadata = metadata.invocation_metadata()
    items: Iterable = metadata.items() if isinstance(metadata, Mapping) else metadata
    for item in items:
        if hasattr(item, "key"):
            k, v = item.key, item.value
        else:
            k, v = item
        if str(k).lower() == "authorization":
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


def status_name(exc: BaseException | None) -> str:
    """gRPC status code name of ``exc`` (``"OK"`` for None)."""
    if exc is None:
        return "OK"
    from deployments.grpc_status import status_for

    return status_for(exc).name


@dataclass
class Admission:
    """One admitted request: what to run and what to give back.

    Attributes:
        tenant_id: the authenticated tenant.
        request: the request to run: the caller's, with ``speculation.k`` set to the decided K.
        proposer: the proposer (``"none"`` when K = 0 was forced by the request or policy).
        decision: the controller's KDecision as a dict (α, cost terms, predicted speedup).
        prompt_tokens: prompt length the limits were checked with.
        clipped: notes on what the policy clipped (e.g. K above k_max).
        queued_s: time spent waiting for a fair-admission slot.
    """

    tenant_id: str
    request: GenerationRequest
    proposer: str
    decision: dict
    prompt_tokens: int
    clipped: tuple[str, ...] = ()
    queued_s: float = 0.0
    lease_id: str | None = None
    batch_weight: float = 1.0
    #: K under load: the request's K ceiling (its K clipped to the tenant's k_max), the tenant's
    #: k_min, and whether the tenant's K adapts (policy adaptive, not a seeded sampled request)
    k_cap: int = 0
    k_min: int = 0
    adaptive: bool = False
    #: the draft replica's batch controller chooses its K per step (module docstring)
    batch_adaptive: bool = False
    started: float = field(default_factory=time.perf_counter)
    _slot: bool = False
    _done: bool = False

    @property
    def chosen_k(self) -> int:
        return int(self.decision["k"])
