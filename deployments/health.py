"""Standard gRPC health checking (``grpc.health.v1``) in Ray Serve's gRPC proxy.

Ray Serve's proxy takes a list of "servicer functions" (``add_XServicer_to_server(servicer,
server)``-style callables, called by the proxy with ``(servicer, server)``). Its server
(``ray.serve._private.grpc_util.gRPCGenericServer``, Ray 2.60) rewrites every registered handler
to route to a deployment method of the same name, except for *passthrough* services (Serve
uses this for reflection). :func:`add_health_servicer` marks ``grpc.health.v1.Health`` as
passthrough before registering it, so health is served *directly in the proxy* (not routed to
a deployment). On a server without ``add_passthrough_service`` (another Ray version) the
health RPCs would be routed to an ingress method named ``Check``; then upgrade this helper. So
``grpcurl ... grpc.health.v1.Health/Check`` works next to Serve's own
``/ray.serve.RayServeAPIService/Healthz``.

What each service name reports (the same split as HTTP's two endpoints):

- ``""`` (the whole server, as Serve's ``GET /-/healthz``): SERVING while the proxy is up.
- ``"specdec.v1.SpecDec"`` (as the router's ``GET /health``, a readiness probe): SERVING once
  every specdec application (an application with a ``Router`` deployment) is RUNNING and its
  router says the models answer and the draft replica's start-up calibration has ended
  (``Router.Settled``); NOT_SERVING before (loading, calibrating, no application deployed).
  Before, it said SERVING from the proxy's start while ``GET /health`` answered 503 through the
  whole calibration (session 12's 6b33520), so a gRPC readiness probe sent traffic into it.
  Once SERVING it stays so (as the router's ``GET /health`` remembers it has settled).

The answer is taken by asking the applications (:func:`serve_apps_settled`, Serve's public
``serve.status`` and deployment handles, from the proxy's own process), at most one probe at a
time: ``Check`` waits for a fresh probe for at most :data:`CHECK_WAIT_S` and otherwise answers
the last known status; ``Watch`` keeps a probe running every :data:`POLL_S` seconds until the
service is SERVING (grpcio's ``grpc_health.v1.aio.HealthServicer`` streams the changes).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

#: The service whose status follows the applications' readiness (``GET /health``).
SPECDEC_SERVICE = "specdec.v1.SpecDec"

#: Services served, with their status before the first probe.
SERVICES = {"": health_pb2.HealthCheckResponse.SERVING,
            SPECDEC_SERVICE: health_pb2.HealthCheckResponse.NOT_SERVING}

#: Seconds a ``Check`` of :data:`SPECDEC_SERVICE` waits for a fresh probe before it answers the
#: last known status (a Kubernetes gRPC probe's default timeout is 1 s).
CHECK_WAIT_S = 0.8

#: Seconds between probes while a ``Watch`` of :data:`SPECDEC_SERVICE` waits for SERVING.
POLL_S = 1.0

#: The deployment that marks a specdec application (:func:`deployments.app.build_app`).
ROUTER_DEPLOYMENT = "Router"


async def serve_apps_settled() -> bool:
    """Whether every specdec application of this Serve instance is settled: at least one
    application has a ``Router`` deployment, and each such application is RUNNING and its
    router's ``Settled()`` is True (the models answer and the start-up calibration has ended;
    :meth:`deployments.router.Router.Settled`). Errors (Serve not reachable, a replica gone)
    count as not settled.

    Runs in any process of the Ray cluster (the proxy's): ``serve.status()`` in a worker thread
    (it blocks on the Serve controller), then one ``Router.Settled`` call per application.
    """
    from ray import serve

    try:
        apps = (await asyncio.to_thread(serve.status)).applications
        ours = {name: app for name, app in apps.items() if ROUTER_DEPLOYMENT in app.deployments}
        if not ours or any(app.status != "RUNNING" for app in ours.values()):
            return False
        answers = await asyncio.gather(*(serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=name).Settled.remote()
                                         for name in ours))
        return all(bool(a) for a in answers)
    except Exception:  # noqa: BLE001 - a health probe answers NOT_SERVING, it never fails the proxy
        log.debug("health probe failed", exc_info=True)
        return False


class SettledHealthServicer(health.aio.HealthServicer):
    """grpcio's asyncio health servicer whose :data:`SPECDEC_SERVICE` status follows ``probe``
    (module docstring); ``""`` is SERVING from the start.

    Args:
        probe: ``async () -> bool``, whether the applications are settled
            (:func:`serve_apps_settled`; tests inject one).
        check_wait_s: see :data:`CHECK_WAIT_S`.
        poll_s: see :data:`POLL_S`.
    """

    def __init__(self, probe: Callable[[], Awaitable[bool]] = serve_apps_settled,
                 check_wait_s: float = CHECK_WAIT_S, poll_s: float = POLL_S) -> None:
        super().__init__()
        self._server_status.update(SERVICES)
        self.probe, self.check_wait_s, self.poll_s = probe, check_wait_s, poll_s
        self._settled = False
        self._probing: asyncio.Task | None = None
        self._polling: asyncio.Task | None = None

    def _probe_task(self) -> asyncio.Task:
        """The probe in flight, or a new one (one at a time)."""
        if self._probing is None or self._probing.done():
            self._probing = asyncio.get_running_loop().create_task(self._probe_once())
        return self._probing

    async def _probe_once(self) -> None:
        if await self.probe():
            self._settled = True
            await self.set(SPECDEC_SERVICE, health_pb2.HealthCheckResponse.SERVING)

    async def _poll(self) -> None:
        while not self._settled:
            await asyncio.shield(self._probe_task())
            if not self._settled:
                await asyncio.sleep(self.poll_s)

    async def Check(self, request, context):
        if request.service == SPECDEC_SERVICE and not self._settled:
            try:
                await asyncio.wait_for(asyncio.shield(self._probe_task()), self.check_wait_s)
            except (asyncio.TimeoutError, TimeoutError):
                pass  # the last known status (NOT_SERVING); the probe goes on
        return await super().Check(request, context)

    async def Watch(self, request, context):
        if request.service == SPECDEC_SERVICE and not self._settled and (self._polling is None or self._polling.done()):
            self._polling = asyncio.get_running_loop().create_task(self._poll())
        await super().Watch(request, context)


def add_health_servicer(_servicer, server) -> None:
    """Servicer function for ``grpc_options.grpc_servicer_functions`` (ignores Serve's servicer):
    registers a :class:`SettledHealthServicer` on the proxy's (asyncio) gRPC server."""
    if hasattr(server, "add_passthrough_service"):
        server.add_passthrough_service(health.SERVICE_NAME)
    health_pb2_grpc.add_HealthServicer_to_server(SettledHealthServicer(), server)
