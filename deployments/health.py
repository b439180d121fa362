"""Standard gRPC health checking (``grpc.health.v1``) in Ray Serve's gRPC proxy.

Ray Serve's proxy takes a list of "servicer functions" (``add_XServicer_to_server(servicer,
server)``-style callables, called by the proxy with ``(servicer, server)``). Its server
(``ray.serve._private.grpc_util.gRPCGenericServer``, Ray 2.60) rewrites every registered handler
to route to a deployment method of the same name, except for *passthrough* services (Serve
uses this for reflection). :func:`add_health_servicer` marks ``grpc.health.v1.Health`` as
passthrough before registering it, so health is served *directly in the proxy* (not routed to
a deployment). On a server without ``add_passthrough_service`` (another Ray version) the
health RPCs would be routed to an ingress method named ``Check``; then upgrade this helper. So ``grpcurl ... grpc.health.v1.Health/Check`` works next to
Serve's own ``/ray.serve.RayServeAPIService/Healthz``. It reports SERVING for the whole server
("") and for ``specdec.v1.SpecDec`` while the proxy is up; whether the models are loaded is
what Serve's application status and ``UNAVAILABLE`` from the SpecDec methods say.
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

#: Services reported as SERVING.
SERVICES = ("", "specdec.v1.SpecDec")


def add_health_servicer(_servicer, server) -> None:
    """Servicer function for ``grpc_options.grpc_servicer_functions`` (ignores Serve's servicer)."""
    if hasattr(server, "add_passthrough_service"):
        server.add_passthrough_service(health.SERVICE_NAME)
    servicer = health.HealthServicer()
    for name in SERVICES:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
