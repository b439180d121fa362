"""End to end through Ray Serve's gRPC proxy: a real request reaches the router and comes back.

One Ray + Serve per module (2 CPUs): Router (in-process engine on tiny models) and Target
(TP=2 workers over gloo in its STRICT_PACK placement group).
"""

from __future__ import annotations

import socket

import grpc
import pytest

from deployments import convert
from deployments.config import HEALTH_SERVICER, SPECDEC_SERVICER, AppConfig
from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from protos.specdec.v1 import specdec_pb2_grpc as pb_grpc
from specdec.request import SamplingParams
from specdec.testing.tiny import build_tiny_model
from specdec.types import DraftBlock

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.serve

APP = "specdec"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    return str(build_tiny_model(root / "target", seed=0)), str(build_tiny_model(root / "draft", seed=1))


@pytest.fixture(scope="module")
def served(models):
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from deployments.app import build_app

    target, draft = models
    cfg = AppConfig(target_model=target, draft_model=draft, target_tp=2, grpc_port=_free_port(), http_port=_free_port())
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(
            http_options=HTTPOptions(port=cfg.http_port),
            grpc_options=gRPCOptions(port=cfg.grpc_port, grpc_servicer_functions=[SPECDEC_SERVICER, HEALTH_SERVICER]),
        )
        serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
        channel = grpc.insecure_channel(f"localhost:{cfg.grpc_port}")
        yield cfg, channel
        channel.close()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


MD = (("application", APP),)


def _expected(models, req: pb.GenerateRequest):
    from specdec.engine import SpeculativeEngine
    from specdec.models.loader import load_model
    from specdec.models.spec import parse_model_spec

    target, draft = models
    engine = SpeculativeEngine(load_model(parse_model_spec(target)), load_model(parse_model_spec(draft)))
    return engine.generate(convert.request_from_proto(req))


def test_generate_round_trip_equals_in_process(models, served):
    _, channel = served
    req = pb.GenerateRequest(prompt="def add(a, b):", max_tokens=12)
    resp = pb_grpc.SpecDecStub(channel).Generate(req, metadata=MD, timeout=60)
    expected = _expected(models, req)
    assert list(resp.token_ids) == expected.token_ids and resp.text == expected.text
    assert resp.usage.completion_tokens == len(resp.token_ids) > 0
    assert resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED and resp.stats.steps > 0


def test_stream_concatenates_to_unary(served):
    _, channel = served
    stub = pb_grpc.SpecDecStub(channel)
    req = pb.GenerateRequest(prompt="for i in range(10):", max_tokens=10)
    unary = stub.Generate(req, metadata=MD, timeout=60)
    chunks = list(stub.GenerateStream(req, metadata=MD, timeout=60))
    assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    joined = convert.join_chunks(chunks)
    assert (joined.text, list(joined.token_ids), joined.finish_reason) == (unary.text, list(unary.token_ids), unary.finish_reason)


@pytest.mark.parametrize(
    "req, fragment",
    [
        (pb.GenerateRequest(prompt=""), "prompt is empty"),
        (pb.GenerateRequest(prompt="x", max_tokens=0), "max_tokens"),
        (pb.GenerateRequest(prompt="x", speculation=pb.SpeculationHints(max_k=99)), "speculation.k"),
    ],
)
@pytest.mark.parametrize("streaming", [False, True])
def test_bad_request_is_invalid_argument_not_internal(served, req, fragment, streaming):
    _, channel = served
    stub = pb_grpc.SpecDecStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        if streaming:
            list(stub.GenerateStream(req, metadata=MD, timeout=30))
        else:
            stub.Generate(req, metadata=MD, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert fragment in info.value.details()


def test_tenant_stats_is_permission_denied_without_tenants(served):
    _, channel = served
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.SpecDecStub(channel).GetTenantStats(pb.GetTenantStatsRequest(), metadata=MD, timeout=30)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_health_check_is_served_by_the_proxy(served):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, channel = served
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "specdec.v1.SpecDec"):
        assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(served):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    _, channel = served
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "specdec.v1.SpecDec" in services
    assert "grpc.health.v1.Health" in services


def test_target_deployment_verifies_serialized_blocks(served):
    from ray import serve

    handle = serve.get_deployment_handle("Target", app_name=APP).options(session_id="s-handle")
    open_msg = convert.session_open_to_proto([1, 5, 9, 33], SamplingParams(), seed=0, logprobs=False)
    block = convert.draft_block_to_proto(DraftBlock(token_ids=__import__("torch").tensor([7, 7])), "s-handle", 4, open_msg)
    reply = xpb.VerificationResult.FromString(handle.Verify.remote(block.SerializeToString()).result(timeout_s=60))
    assert reply.status == xpb.VERIFY_STATUS_OK and reply.committed_len == 4 + reply.accepted + 1
    closed = xpb.CloseSessionResponse.FromString(
        handle.CloseSession.remote(xpb.CloseSessionRequest(session_id="s-handle").SerializeToString()).result(timeout_s=30)
    )
    assert closed.existed
