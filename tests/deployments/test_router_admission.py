"""The router authenticates a caller before it tokenizes anything, and gives the shared state
the request's own timeout as the lease's TTL (Router built without Serve, tiny target)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from deployments.config import AppConfig, Scaling
from deployments.controller_actor import LEASE_GRACE_S
from deployments.controller_client import ControllerClient
from deployments.metrics import SpecDecMetrics
from deployments.router import TIMEOUT_KEY, Router
from deployments.target_info import TargetInfo
from deployments.tenancy import TenancyGate
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.control.tenants import hash_api_key
from tests.deployments.grpc_context import RecordingContext

KEY = "sk-router-order-key"


class Clock:
    t = 5000.0

    def __call__(self):
        return self.t


@pytest.fixture()
def router(tmp_path, tiny_model_folder):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - id: acme\n    api_key_hashes: [{hash_api_key(KEY)}]\n")
    cfg = AppConfig(target_model=str(tiny_model_folder), draft_model=None, tenants_file=str(tenants),
                    request_timeout_s=600, router=Scaling(max_ongoing_requests=8))
    clock = Clock()
    gate = TenancyGate(cfg.tenants_file, ControllerClient.local(clock=clock), SpecDecMetrics(backend=None))
    r = Router(cfg, info=TargetInfo.load(cfg.target_model), gate=gate)
    calls = []
    encode = r._encode

    def spy(req, *args):
        calls.append(threading.current_thread().name)
        return encode(req, *args)

    r._encode = spy
    return r, calls, clock


def test_unauthenticated_caller_is_refused_before_tokenizing(router):
    r, calls, _ = router
    big = pb.GenerateRequest(prompt="word " * 200, max_tokens=4)
    for metadata, details in [
        ([], "missing API key: send 'authorization: Bearer <key>' (gRPC metadata or HTTP header)"),
        ([("authorization", "Bearer sk-wrong")], "unknown API key"),
    ]:
        ctx = RecordingContext(metadata)
        asyncio.run(r.Generate(big, ctx))
        assert (ctx.code.name, ctx.details) == ("UNAUTHENTICATED", details)
    # also a request that would fail validation: the unauthenticated caller learns nothing more
    ctx = RecordingContext([])
    asyncio.run(r.Generate(pb.GenerateRequest(prompt="x", max_tokens=0), ctx))
    assert ctx.code.name == "UNAUTHENTICATED"
    assert calls == []
    assert r.gate.metrics.value("specdec_requests", tenant="unknown", status="UNAUTHENTICATED") == 3


def test_authenticated_request_is_tokenized_once_and_its_lease_lives_as_long_as_it(router):
    r, calls, clock = router

    async def main():
        metadata = {"authorization": f"Bearer {KEY}", TIMEOUT_KEY: "450"}
        t0 = time.time()
        job, _, adm = await r._prepare({"prompt": "def add(a, b):", "max_tokens": 4}, metadata)
        state = r.gate.controller.state
        expires = state._leases[adm.lease_id][1]
        await r.gate.complete(adm, None)
        return job, adm, expires, t0

    job, adm, expires, t0 = asyncio.run(main())
    assert adm.tenant_id == "acme"
    # tokenized once, on the router's own pool (sized by its max_ongoing_requests, not the host)
    assert len(calls) == 1 and calls[0].startswith("specdec-tokenize")
    assert r.encode_executor._max_workers == r.cfg.router.max_ongoing_requests == 8
    assert job.deadline_unix_s == pytest.approx(t0 + 450, abs=2)
    # the lease expires LEASE_GRACE_S after the request's own 450 s (not the 300 s default)
    assert expires == pytest.approx(clock.t + 450 + LEASE_GRACE_S, abs=2)
    assert r.gate.controller.state.active_leases() == 0
