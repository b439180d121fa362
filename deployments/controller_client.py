"""What a router or draft replica holds to reach the per-tenant state shared by all replicas of
its Serve application and model pair (:class:`deployments.controller_actor.SharedTenantState`, as
a Ray actor named after both: :func:`deployments.controller_actor.actor_name`).

A :class:`ControllerClient` (``await client.decide(...)`` etc.) is backed by the actor (:meth:`ControllerClient.shared`) or by a local ``SharedTenantState``
(:meth:`ControllerClient.local`: tests and single-process use, no Ray). If an actor call
fails (actor restarting) or is not answered within ``call_timeout_s`` (default
:data:`CALL_TIMEOUT_S`), the client falls back to a local state for that call and logs once:
serving continues with per-replica estimates rather than failing or stalling requests. Every
call is submitted outside the calling request's Ray task (:func:`deployments.aio.outside_request`),
so Serve's cancellation of a disconnected request does not cancel a lease's release with the
request; the lease of an admit whose caller stopped waiting is released when it is answered.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, Mapping

from deployments.controller_actor import ACTOR_NAMESPACE, RayKVStore, SharedTenantState, actor_name, snapshot_key

log = logging.getLogger(__name__)

#: Seconds a router or draft replica waits for the shared actor's answer to one call before its
#: local fallback answers instead (a call is a few hundred microseconds of Python; a loaded
#: 2-core machine answers within tens of ms).
CALL_TIMEOUT_S = 10.0


async def _awaited(ref: Any) -> Any:
    """Await a Ray ObjectRef in a coroutine (what :func:`asyncio.wait_for` takes)."""
    return await ref


def _actor_class():
    import ray

    return ray.remote(SharedTenantState)


def get_or_create_actor(
    controller_kwargs: Mapping | None = None,
    *,
    app_name: str,
    pair: Mapping,
    namespace: str = ACTOR_NAMESPACE,
    lease_ttl_s: float = 300.0,
):
    """The shared actor of the Serve application ``app_name`` serving the model pair ``pair``
    (:meth:`deployments.config.AppConfig.model_pair`), creating it on first use (Ray must be
    initialized): named :func:`actor_name` ``(app_name, pair)``, its snapshot under
    :func:`snapshot_key` ``(app_name, pair)`` (recording ``pair``, restored only into the same
    pair), so two applications in one cluster share nothing, nor two pairs under one
    application name (a redeploy with other models; during a rolling update old and new replicas
    each keep their own pair's actor).

    The first caller's ``controller_kwargs`` win; later callers of the same application and pair
    attach to the existing actor.
    """
    cls = _actor_class()
    return cls.options(
        name=actor_name(app_name, pair),
        namespace=namespace,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_concurrency=1,
        allow_out_of_order_execution=True,
        max_restarts=-1,
    ).remote(controller_kwargs, lease_ttl_s, None, RayKVStore(snapshot_key(app_name, pair)), pair=pair)


class ControllerClient:
    """Async access to the shared state, from an actor handle or a local object.

    Use :meth:`for_app` in a router or draft replica (its application's actor when Ray is
    initialized, else local), :meth:`shared` for an application and pair's actor, :meth:`local`
    without Ray, or :meth:`auto` (the actor of ``app_name`` and ``pair`` when Ray is initialized,
    else local).
    """

    def __init__(self, actor: Any = None, local: SharedTenantState | None = None,
                 call_timeout_s: float = CALL_TIMEOUT_S):
        if (actor is None) == (local is None):
            raise ValueError("give exactly one of actor or local")
        self.actor = actor
        #: seconds an actor call may take before the local fallback answers it
        self.call_timeout_s = call_timeout_s
        self._local = local
        self._fallback: SharedTenantState | None = None
        self._warned = False
        self._late: set = set()  # tasks releasing the leases of admits answered too late

    @classmethod
    def local(cls, controller_kwargs: Mapping | None = None, **kw) -> "ControllerClient":
        return cls(local=SharedTenantState(controller_kwargs, **kw))

    @classmethod
    def shared(cls, controller_kwargs: Mapping | None = None, *, app_name: str, pair: Mapping,
               **kw) -> "ControllerClient":
        """The shared actor of the application ``app_name`` and model pair ``pair``
        (:func:`get_or_create_actor`)."""
        return cls(actor=get_or_create_actor(controller_kwargs, app_name=app_name, pair=pair, **kw))

    @classmethod
    def auto(cls, controller_kwargs: Mapping | None = None, *, app_name: str | None = None,
             pair: Mapping | None = None, **kw) -> "ControllerClient":
        """:meth:`shared` of ``app_name`` and ``pair`` when Ray is initialized, else :meth:`local`.

        Raises:
            ValueError: Ray is initialized and no ``app_name`` or no ``pair`` was given (an actor
                without them would be shared by every application, or every pair, of the cluster).
        """
        try:
            import ray

            if ray.is_initialized():
                if app_name is None or pair is None:
                    raise ValueError("the shared controller actor is per application and model pair: "
                                     "give app_name and pair")
                return cls.shared(controller_kwargs, app_name=app_name, pair=pair, **kw)
        except ImportError:
            pass
        return cls.local(controller_kwargs)

    @classmethod
    def for_app(cls, cfg: Any, controller_kwargs: Mapping | None = None, **kw) -> "ControllerClient":
        """:meth:`auto` for the application of ``cfg`` (a :class:`deployments.config.AppConfig`):
        the actor of ``cfg.app_name`` and ``cfg.model_pair()`` (config fields only: the router's
        and the draft replicas' processes reach the same actor whatever their environment)."""
        return cls.auto(controller_kwargs, app_name=cfg.app_name, pair=cfg.model_pair(), **kw)

    @property
    def is_shared(self) -> bool:
        return self.actor is not None

    @property
    def state(self) -> SharedTenantState | None:
        """The local state (None when backed by the actor)."""
        return self._local

    async def _call(self, method: str, *args):
        """``method(*args)`` on the actor (or the local state); the fallback's answer when the
        actor is unavailable or does not answer within ``call_timeout_s``.

        Every call is submitted outside the calling request's Ray task
        (:func:`deployments.aio.outside_request`): Serve's cancellation of a request cancels its
        child calls, and a lease release cancelled so was lost (the lease held until it
        expired). A call the caller stopped waiting for (timed out, or the request cancelled)
        still runs when the actor gets to it (Ray does not take back a call an actor queued):
        an admit's lease is then released at once (:meth:`_release_late`; a timed-out admit's
        request is counted in the usage of both states).
        """
        if self._local is not None:
            return getattr(self._local, method)(*args)
        from ray.exceptions import RayActorError, RayTaskError

        from deployments.aio import outside_request

        ref = outside_request(getattr(self.actor, method).remote, *args)
        try:
            return await asyncio.wait_for(_awaited(ref), self.call_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            self._release_late_lease(method, ref, args)
            return self._on_unavailable(method, args, f"no answer within {self.call_timeout_s:g} s")
        except asyncio.CancelledError:
            self._release_late_lease(method, ref, args)
            raise
        except RayTaskError as e:  # the method itself raised: that error, not a fallback
            raise e.as_instanceof_cause() from None
        except (RayActorError, ConnectionError) as e:  # actor unavailable: per-replica state
            return self._on_unavailable(method, args, str(e))

    def _release_late_lease(self, method: str, ref: Any, args: tuple) -> None:
        """An ``admit`` nobody waits for any more: release its lease when it is answered."""
        if method != "admit":
            return
        task = asyncio.get_running_loop().create_task(self._release_late(ref, args), context=contextvars.Context())
        self._late.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self._late.discard)

    async def _release_late(self, ref: Any, admit_args: tuple) -> None:
        """Release the lease of an admit answered after its caller stopped waiting."""
        try:
            got = await ref
            if isinstance(got, dict) and got.get("lease"):
                tenant_id, _limits, _tokens, proposer = admit_args[:4]
                await self.actor.complete.remote(got["lease"], tenant_id, proposer, None, None, 0, 0, 0,
                                                 bool(admit_args[7]) if len(admit_args) > 7 else False)
        except Exception:  # the actor away: its lease expires instead
            log.warning("could not release a late lease on the shared controller actor", exc_info=True)

    def _on_unavailable(self, method: str, args: tuple, reason: str):
        """Answer ``method(*args)`` from the local fallback (logged once)."""
        if not self._warned:
            log.warning("shared controller actor unavailable (%s); using a local fallback", reason)
            self._warned = True
        if self._fallback is None:
            self._fallback = SharedTenantState()
        return getattr(self._fallback, method)(*args)

    async def admit(self, tenant_id, limits, tokens, proposer, policy, requested_k, timeout_s=None,
                    batch_adaptive=False) -> dict:
        return await self._call("admit", tenant_id, dict(limits), tokens, proposer, dict(policy), requested_k,
                                timeout_s, batch_adaptive)

    async def complete(self, lease_id, tenant_id, proposer, stats=None, costs=None,
                       prompt_tokens=0, completion_tokens=0, used_tokens=None, batch_adaptive=False) -> None:
        args = (lease_id, tenant_id, proposer, stats, costs, prompt_tokens, completion_tokens, used_tokens,
                batch_adaptive)
        if self._fallback is not None and self._fallback.holds_lease(lease_id):
            # admitted by the fallback while the actor was away: released there
            return self._fallback.complete(*args)
        # the release must outlive the request: Serve cancels a disconnected request's Ray task
        # with its child calls, and a cancelled release would hold the lease until it expires
        return await self._call("complete", *args)

    async def decide(self, tenant: str, proposer: str, policy: Mapping, requested_k: int | None = None) -> dict:
        return await self._call("decide", tenant, proposer, dict(policy), requested_k)

    async def record(self, tenant: str, proposer: str, stats: Mapping, costs: Mapping | None = None) -> None:
        return await self._call("record", tenant, proposer, dict(stats), costs)

    async def observe_step(self, proposer, k, draft_s, verify_s, round_trip_s=None) -> None:
        return await self._call("observe_step", proposer, k, draft_s, verify_s, round_trip_s)

    async def current_k(self, tenant: str, proposer: str) -> int | None:
        return await self._call("current_k", tenant, proposer)

    async def sync_batch_acceptance(self, replica: str, report: Mapping) -> dict:
        """:meth:`SharedTenantState.sync_batch_acceptance`. No local fallback: a draft replica
        whose report cannot be delivered keeps its own counts and sends the steps next time.

        Raises:
            ray.exceptions.RayActorError, ConnectionError: the actor is unavailable.
            ValueError: a malformed report.
        """
        if self._local is not None:
            return self._local.sync_batch_acceptance(replica, dict(report))
        from ray.exceptions import RayTaskError

        try:
            from deployments.aio import outside_request

            # outside the draft request that started the exchange: cancelled with it, a report
            # the actor merged anyway would be restored and sent again (its steps counted twice)
            return await outside_request(self.actor.sync_batch_acceptance.remote, replica, dict(report))
        except RayTaskError as e:
            raise e.as_instanceof_cause() from None

    async def tenant_stats(self, tenant: str) -> dict:
        return await self._call("tenant_stats", tenant)
