"""The router's tenancy façade: authenticate, apply policy and limits, admit fairly, pick K.

A router replica holds one :class:`TenancyGate` and calls, per request
(:class:`deployments.router.Router`)::

    adm = await gate.admit(metadata, request, prompt_tokens=len(prompt))  # may raise (grpc_status)
    try:
        # a DraftJob from adm.request, adm.proposer, adm.chosen_k and the probe steps of
        # adm.decision; relay the draft replica's stream, join it into a result
        ...
    except BaseException as e:
        await gate.complete(adm, e)
        raise
    await gate.complete(adm, result, ttft_s=ttft, inter_token_s=itl, costs=step_costs)

and ``await gate.tenant_stats(metadata, proposer)`` for ``GetTenantStats`` (a proposer the tenant may
not use is INVALID_ARGUMENT there too).

What :meth:`TenancyGate.admit` does, in order, and the error of each step (gRPC code via
:mod:`deployments.grpc_status`):

1. authenticate ``authorization: Bearer <key>`` from the gRPC metadata against the tenants
   file (:meth:`specdec.control.tenants.TenantRegistry.authenticate`): missing, malformed or unknown key
   -> :class:`AuthenticationError` (UNAUTHENTICATED). A router authenticates first, before it
   tokenizes the prompt (:meth:`TenancyGate.authenticate_caller`), and passes the tenant on;
2. the tenant's policy (:meth:`TenantRegistry.check_request`): prompt too long, ``max_tokens``
   over the limit, proposer not allowed -> :class:`InvalidRequestError` (INVALID_ARGUMENT);
   a request that named no proposer gets the first server proposer the tenant allows;
   K above the tenant's ``k_max`` is clipped (K never changes a greedy output);
3. the shared rate limits (tokens per minute, concurrent requests; one state for all router
   replicas of the application, :mod:`deployments.controller_actor`) -> :class:`ResourceExhaustedError`
   (RESOURCE_EXHAUSTED) naming the limit, with ``retry_after_s``;
4. a slot of this replica's :class:`specdec.control.limits.FairAdmission` (``capacity`` requests run at
   once; when full, waiting tenants are served by fewest running slots, round robin, not first
   come first served; a tenant with ``max_queue_per_tenant`` already queued ->
   RESOURCE_EXHAUSTED ``max_queued_requests``);
5. the K decision of the shared controller for (tenant, proposer) within the tenant's policy
   and the request's own ``speculation.k`` (a ceiling): the returned :class:`Admission` carries
   the request rewritten with that K (K = 0: the draft is not even opened); a probe
   (``decision["probe"]``) speculates only its first ``decision["probe_steps"]`` steps. A sampled request with a
   ``seed`` is not adapted: it runs at the tenant's ``fixed_k``, else its own ``k`` clipped to
   the tenant's range, so that the same seeded request gives the same output every time (a
   sampled output depends on K, its distribution does not). With ``batch_k`` (the config's
   ``served_batch_k``) an adaptive request (policy adaptive, a proposer, a ceiling K > 0) is
   *batch-adaptive*: the draft replica's batch controller chooses its K per step (K under load,
   :mod:`specdec.control.batch_k`), so the per-request controller is not asked
   (``decision["batch"]``, K = the ceiling, no probe) and, in :meth:`TenancyGate.complete`, not
   fed: the request's steps reach the draft replicas' acceptance pool, the one place its K and
   acceptance come from (``GetTenantStats`` too).

:meth:`TenancyGate.complete` releases the slot and the lease (refunding tokens not generated),
feeds the request's counters and step timings to the controller, adds usage and records the
metrics. It is idempotent and never raises.

**Open mode.** With no tenants file (``AppConfig.tenants_file`` None) the gate runs open: every
request, with or without an ``authorization`` header, is the anonymous tenant ``"default"``
(no rate limits, ``max_tokens``/prompt limits only those of the request model, any proposer,
adaptive K in [0, 16] capped by the request's own ``k``). Fair admission and adaptive K still
apply, and ``GetTenantStats`` answers for ``"default"``. Use it for local runs and tests; a
deployment reachable by others needs a tenants file.
"""


from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Callable, Iterable, Mapping

from specdec.errors import AuthenticationError, ResourceExhaustedError, SpecDecError
from specdec.control.limits import FairAdmission
from specdec.request import GenerationRequest
from specdec.control.tenants import Tenant, TenantRegistry, TenantsConfig

from deployments.controller_client import ControllerClient
from deployments.ingress.admission import (  # noqa: F401 (Admission and the helpers are re-exported)
    OPEN_TENANT,
    OPEN_TENANT_ID,
    UNKNOWN_TENANT,
    Admission,
    authorization_from_metadata,
    status_name,
)
from deployments.ingress.tenant_stats import (  # noqa: F401 (re-exported: GetTenantStats' proto)
    proposer_name,
    stats_proposer,
    tenant_stats_to_proto,
    uses_batch_k,
)
from deployments.metrics import SpecDecMetrics

log = logging.getLogger(__name__)


class TenancyGate:
    """Authentication, policy, limits, fair admission and K per request (module docstring).

    Args:
        tenants: a :class:`TenantRegistry`, a path to the tenants YAML, or None (open mode).
        controller: the shared-state client (:meth:`ControllerClient.for_app` in a replica:
            the shared actor of its application and model pair; :meth:`ControllerClient.local` in tests);
            default: :meth:`ControllerClient.auto` (local without Ray; under Ray give one, or
            use :meth:`from_config`).
        metrics: :class:`SpecDecMetrics` (default: a new one on Ray's metrics API).
        capacity: requests this replica runs at once (fair-admission slots); e.g. the Router
            deployment's ``max_ongoing_requests``.
        max_queue_per_tenant: queued requests per tenant before RESOURCE_EXHAUSTED.
        count_prompt_tokens: ``request -> prompt tokens`` (e.g. ``len(engine.encode(r))``);
            without it only ``prompt_token_ids`` requests are measured exactly, text prompts
            are estimated at one token per 4 characters (an upper-bound-ish guess for limits).
        batch_k: adaptive requests are batch-adaptive (K under load on the draft replica;
            module docstring); False: the per-request controller decides every request's K.
    """

    def __init__(
        self,
        tenants: TenantRegistry | str | os.PathLike | None,
        controller: ControllerClient | None = None,
        metrics: SpecDecMetrics | None = None,
        *,
        capacity: int = 8,
        max_queue_per_tenant: int = 64,
        count_prompt_tokens: Callable[[GenerationRequest], int] | None = None,
        batch_k: bool = False,
    ):
        self.batch_k = bool(batch_k)
        if isinstance(tenants, (str, os.PathLike)):
            tenants = TenantRegistry.from_yaml(tenants)
        self._open = tenants is None
        self.registry: TenantRegistry = tenants or TenantRegistry(TenantsConfig(tenants=[OPEN_TENANT]))
        self.controller = controller if controller is not None else ControllerClient.auto()
        self.metrics = metrics if metrics is not None else SpecDecMetrics()
        # weighted by each tenant's batch_weight: its share of the slots under contention
        self.admission = FairAdmission(capacity, max_queue_per_tenant, weights={
            t.id: float(getattr(t.speculation, "batch_weight", 1.0)) for t in self.registry.tenants})
        self.count_prompt_tokens = count_prompt_tokens

    @classmethod
    def from_config(cls, cfg, controller: ControllerClient | None = None, **kw) -> "TenancyGate":
        """A gate for an :class:`deployments.config.AppConfig`: its ``tenants_file`` (None: open
        mode) and :meth:`deployments.config.AppConfig.router_admission_slots` as capacity (what the
        draft replica steps at once, so requests beyond it wait here, fairly by tenant, rather
        than in Serve's first-come queue). Default ``controller``:
        :meth:`ControllerClient.for_app` (the shared actor of ``cfg.app_name`` and
        ``cfg.model_pair()`` under Ray)."""
        if controller is None:
            controller = ControllerClient.for_app(cfg)
        kw.setdefault("capacity", cfg.router_admission_slots())
        kw.setdefault("batch_k", cfg.served_batch_k)
        return cls(cfg.tenants_file, controller, **kw)

    @property
    def open_mode(self) -> bool:
        return self._open

    # ------------------------------------------------------------------ helpers

    def authenticate(self, metadata: Any) -> Tenant:
        """The caller's tenant (open mode: ``"default"``). Raises AuthenticationError."""
        if self._open:
            return OPEN_TENANT
        return self.registry.authenticate(authorization_from_metadata(metadata))

    def _prompt_tokens(self, request: GenerationRequest) -> int:
        if request.prompt_token_ids is not None:
            return len(request.prompt_token_ids)
        if self.count_prompt_tokens is not None:
            return int(self.count_prompt_tokens(request))
        text = request.prompt if request.prompt is not None else "".join(m.content for m in request.messages or [])
        return max(1, (len(text) + 3) // 4)

    def _refused(self, tenant_id: str, proposer: str, exc: BaseException) -> None:
        try:
            self.metrics.record_request(tenant_id, proposer, status_name(exc))
        except Exception:  # metrics never break serving
            log.exception("metrics")

    # ------------------------------------------------------------------ per request

    def authenticate_caller(self, metadata: Any, proposer: str = "unknown") -> Tenant:
        """:meth:`authenticate`, counting a refusal in the metrics (tenant ``"unknown"``).

        Routers call it before any work on the request (parsing aside): an unauthenticated
        caller must not make the server tokenize its prompt.

        Raises:
            AuthenticationError: no, malformed or unknown key.
        """
        try:
            return self.authenticate(metadata)
        except AuthenticationError as e:
            self._refused(UNKNOWN_TENANT, proposer, e)
            raise

    async def admit(self, metadata: Any, request: GenerationRequest, prompt_tokens: int | None = None,
                    default_proposers: Iterable[str] | None = None, *, tenant: Tenant | None = None,
                    timeout_s: float | None = None, batch_k: bool | None = None) -> Admission:
        """Authenticate, check, rate-limit, wait for a fair slot and decide K (module docstring).

        Args:
            metadata: the gRPC invocation metadata (or the grpc context, or a mapping).
            request: the validated request.
            prompt_tokens: the prompt length if the caller already tokenized it.
            default_proposers: the request named no proposer: the server's proposers in order of
                preference (see :meth:`specdec.control.tenants.TenantRegistry.check_request`).
            tenant: the caller's tenant when already authenticated (:meth:`authenticate_caller`).
            timeout_s: the request's time budget in seconds: its rate lease lives that long
                (plus a grace) before it expires unreleased; None: the shared state's default.
            batch_k: whether an adaptive request is batch-adaptive (module docstring); None:
                the gate's own ``batch_k``.

        Raises:
            AuthenticationError, InvalidRequestError, ResourceExhaustedError.
        """
        proposer = request.speculation.proposer
        if tenant is None:
            tenant = self.authenticate_caller(metadata, proposer)
        tid = tenant.id
        try:
            n_prompt = prompt_tokens if prompt_tokens is not None else self._prompt_tokens(request)
            checked = self.registry.check_request(
                tenant, n_prompt, request.max_tokens, request.speculation.k, proposer,
                None if default_proposers is None else list(default_proposers),
            )
        except SpecDecError as e:
            self._refused(tid, proposer, e)
            raise
        pol = tenant.speculation
        policy = {"k_min": pol.k_min, "k_max": pol.k_max, "adaptive": pol.adaptive, "fixed_k": pol.fixed_k}
        if not request.sampling.greedy and request.sampling.seed is not None:
            policy["adaptive"] = False  # reproducible: a sampled output depends on K
        limits = tenant.limits.model_dump()
        batch_adaptive = ((self.batch_k if batch_k is None else bool(batch_k)) and bool(policy["adaptive"]) and checked.proposer != "none"
                          and int(checked.k_max or 0) > 0)
        got = await self.controller.admit(
            tid, limits, n_prompt + request.max_tokens, checked.proposer, policy, checked.k_max, timeout_s,
            batch_adaptive,
        )
        if "error" in got:
            err = got["error"]
            e = ResourceExhaustedError(err["message"], limit=err["limit"], retry_after_s=err["retry_after_s"])
            self._refused(tid, proposer, e)
            raise e
        adm = Admission(
            batch_weight=float(getattr(pol, "batch_weight", 1.0)),
            tenant_id=tid,
            request=request,
            proposer=checked.proposer,
            decision=got["decision"],
            prompt_tokens=n_prompt,
            clipped=checked.clipped,
            lease_id=got["lease"],
            k_cap=int(checked.k_max or 0),
            k_min=int(checked.k_min),
            adaptive=bool(policy["adaptive"]),
            batch_adaptive=batch_adaptive,
        )
        t_q = time.perf_counter()
        try:
            await self.admission.acquire(tid)
        except BaseException as e:
            await self.controller.complete(adm.lease_id, tid, adm.proposer, used_tokens=n_prompt,
                                           batch_adaptive=batch_adaptive)
            adm._done = True
            if isinstance(e, SpecDecError):
                self._refused(tid, proposer, e)
            raise
        adm._slot = True
        adm.queued_s = time.perf_counter() - t_q
        spec = request.speculation.model_copy(update={"k": adm.chosen_k})
        adm.request = request.model_copy(update={"speculation": spec})
        return adm

    async def complete(
        self,
        admission: Admission,
        outcome: Any = None,
        *,
        ttft_s: float | None = None,
        inter_token_s: float | None = None,
        costs: Mapping | None = None,
    ) -> None:
        """End ``admission``: ``outcome`` is a :class:`specdec.control.adaptive.TimedRun`, a
        :class:`specdec.types.GenerationResult`, or the exception that ended the request (a
        cancellation, or ``GeneratorExit``: its consumer stopped before the final chunk, counts
        as ``CANCELLED``; a generation whose final chunk was handed on is a result, not this).

        Releases the fair slot and the rate lease (charging prompt + generated tokens), feeds
        the controller (counters, and step costs when known), adds usage, records metrics.
        Idempotent; never raises (errors are logged).
        """
        if admission._done:
            return
        admission._done = True
        if admission._slot:
            admission._slot = False
            self.admission.release(admission.tenant_id)
        result, exc = None, None
        if isinstance(outcome, BaseException):
            exc = outcome
        elif outcome is not None and hasattr(outcome, "result") and hasattr(outcome, "costs"):
            result = outcome.result
            costs = costs if costs is not None else outcome.costs.as_dict()
            ttft_s = ttft_s if ttft_s is not None else outcome.ttft_s
            inter_token_s = inter_token_s if inter_token_s is not None else outcome.inter_token_s
        else:
            result = outcome
        completion = int(result.usage.completion_tokens) if result is not None else 0
        stats = result.stats.as_dict() if result is not None and result.stats is not None else None
        try:
            await self.controller.complete(
                admission.lease_id, admission.tenant_id, admission.proposer, stats, costs,
                admission.prompt_tokens, completion, admission.prompt_tokens + completion,
                admission.batch_adaptive,
            )
        except Exception:
            log.exception("controller.complete failed for tenant %r", admission.tenant_id)
        try:
            self.metrics.record_request(
                admission.tenant_id,
                admission.proposer,
                "CANCELLED" if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) else status_name(exc),
                result,
                ttft_s,
                None if admission.batch_adaptive else admission.decision,  # no per-request K to gauge
                inter_token_s=inter_token_s,
                prompt_tokens=admission.prompt_tokens,
                queue_s=admission.queued_s,
            )
        except Exception:
            log.exception("metrics")

    # ------------------------------------------------------------------ stats

    async def tenant_stats(self, metadata: Any, proposer: str | None = None) -> dict:
        """The caller's own tenant's stats (never another's: the tenant comes from the key).

        Args:
            proposer: the proposer the caller asks about (None: the tenant's default); one the
                tenant may not use is refused as a request naming it is.

        Raises:
            AuthenticationError: no or unknown key.
            InvalidRequestError: ``proposer`` is not allowed for the tenant
                (:meth:`specdec.control.tenants.TenantRegistry.check_proposer`).
        """
        tenant = self.authenticate(metadata)
        if proposer is not None:
            self.registry.check_proposer(tenant, proposer)
        stats = await self.controller.tenant_stats(tenant.id)
        stats["default_proposer"] = next((p for p in tenant.speculation.allowed_proposers if p != "none"), "none")
        return stats
