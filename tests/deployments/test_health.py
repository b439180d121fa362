"""deployments.health's servicer on a real asyncio gRPC server (no Ray): ``specdec.v1.SpecDec``
is NOT_SERVING until the probe (in Serve: every specdec application's ``Router.Settled``, what
``GET /health`` answers) says settled, for Check and for Watch; ``""`` is SERVING throughout.
The probe through Serve's proxy: tests/deployments/test_serve_http.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deployments.health import SPECDEC_SERVICE, SettledHealthServicer

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Probe:
    """A settled flag the test flips; counts the probes."""

    def __init__(self, delay_s: float = 0.0):
        self.settled, self.calls, self.delay_s = False, 0, delay_s

    async def __call__(self) -> bool:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        return self.settled


async def _serve(servicer):
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


async def _check(stub, service: str):
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


def test_check_follows_the_probe_and_stays_serving():
    async def go():
        probe = Probe()
        server, channel = await _serve(SettledHealthServicer(probe, check_wait_s=1.0, poll_s=0.05))
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            seen = [await _check(stub, ""), await _check(stub, SPECDEC_SERVICE)]
            probe.settled = True
            seen += [await _check(stub, SPECDEC_SERVICE)]
            probe.settled = False  # settled once: stays SERVING (as the router's GET /health) and probes no more
            seen += [await _check(stub, SPECDEC_SERVICE), await _check(stub, "")]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _check(stub, "nope.v1.Nope")
            return seen, probe.calls, e.value.code()
        finally:
            await channel.close()
            await server.stop(None)

    seen, calls, code = asyncio.run(go())
    assert seen == [SERVING, NOT_SERVING, SERVING, SERVING, SERVING]
    assert calls == 2
    assert code == grpc.StatusCode.NOT_FOUND


def test_check_answers_the_last_status_when_the_probe_is_slow():
    """A probe slower than check_wait_s: Check answers NOT_SERVING within the wait and the probe
    goes on; the next Check finds its result."""
    async def go():
        probe = Probe(delay_s=0.5)
        probe.settled = True
        server, channel = await _serve(SettledHealthServicer(probe, check_wait_s=0.05, poll_s=0.05))
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            first = await _check(stub, SPECDEC_SERVICE)
            await asyncio.sleep(0.8)
            return first, await _check(stub, SPECDEC_SERVICE), probe.calls
        finally:
            await channel.close()
            await server.stop(None)

    assert asyncio.run(go()) == (NOT_SERVING, SERVING, 1)


def test_watch_streams_not_serving_then_serving():
    async def go():
        probe = Probe()
        server, channel = await _serve(SettledHealthServicer(probe, check_wait_s=1.0, poll_s=0.05))
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            call = stub.Watch(health_pb2.HealthCheckRequest(service=SPECDEC_SERVICE), timeout=10)
            first = (await call.read()).status
            while probe.calls < 3:  # polled while unsettled
                await asyncio.sleep(0.02)
            probe.settled = True
            second = (await call.read()).status
            call.cancel()
            return first, second
        finally:
            await channel.close()
            await server.stop(None)

    assert asyncio.run(go()) == (NOT_SERVING, SERVING)
