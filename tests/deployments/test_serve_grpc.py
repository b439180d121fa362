"""End to end through Ray Serve's gRPC proxy on tiny models, target TP=2 on CPU (gloo).

One Ray + Serve + application per module (2 CPUs): Router (ingress) -> Draft (decoding loop and
draft model) -> Target (2 TP workers in its STRICT_PACK placement group). Every request goes
through the real gRPC port; the error codes come from real bad requests.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from deployments import convert
from deployments.client import SpecDecClient, SpecDecError as ClientError
from deployments.grpc_status import RETRY_AFTER_KEY
from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from protos.specdec.v1 import specdec_pb2_grpc as pb_grpc
from specdec.request import SamplingParams
from specdec.types import DraftBlock
from tests.conftest import load_tiny, target_greedy
from tests.deployments.serving import (
    APP,
    KEYS,
    MD,
    deployment_handle,
    maps_torch,
    replica_pids,
    serve_tiny_app,
    sessions,
    wait_no_sessions,
    wait_running,
)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.serve


def _md(tenant: str | None) -> tuple:
    auth = () if tenant is None else (("authorization", f"Bearer {KEYS[tenant]}"),)
    return (("application", APP),) + auth


@pytest.fixture(scope="module")
def target_alone(models):
    return load_tiny(models[0])


@pytest.fixture(scope="module")
def served(models):
    """(cfg, channel, observed_while_loading): the app deployed without blocking, then ready."""
    from ray import serve

    with serve_tiny_app(models, target_tp=2) as cfg:
        channel = grpc.insecure_channel(f"localhost:{cfg.grpc_port}")
        stub = pb_grpc.SpecDecStub(channel)
        observed: list[tuple[grpc.StatusCode, str]] = []
        end = time.time() + 120
        while time.time() < end:  # ask while the models load: our UNAVAILABLE, not INTERNAL
            try:
                stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=1), metadata=MD, timeout=10)
                break
            except grpc.RpcError as e:
                observed.append((e.code(), e.details() or ""))
                time.sleep(0.3)
        wait_running(serve, APP)
        yield cfg, channel, observed
        channel.close()


def _client(served) -> SpecDecClient:
    cfg, _, _ = served
    return SpecDecClient(f"localhost:{cfg.grpc_port}", application=APP, api_key=KEYS["alpha"])


# --- readiness -------------------------------------------------------------------------------


def test_unavailable_while_the_models_load(served):
    _, _, observed = served
    codes = {code for code, _ in observed}
    assert grpc.StatusCode.INTERNAL not in codes, observed
    # Our own UNAVAILABLE (the router is up, the TP target still loads): the exact message.
    ours = [d for code, d in observed if code == grpc.StatusCode.UNAVAILABLE and "still loading" in d]
    assert ours, f"no UNAVAILABLE 'still loading' seen while deploying: {observed}"


# --- exactness ---------------------------------------------------------------------------------


PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self", "for i in range(10):"]


@pytest.mark.parametrize("proposer", ["draft", "ngram", "none"])
def test_greedy_tp2_served_equals_target_alone(served, target_alone, proposer):
    client = _client(served)
    for prompt in PROMPTS:
        res = client.generate(prompt=prompt, max_tokens=24, proposer=proposer, max_k=4)
        ids = target_alone.tokenizer.encode(prompt)
        ref = target_greedy(target_alone, ids, 24)
        assert res.token_ids == ref[: len(res.token_ids)], prompt
        assert len(res.token_ids) == 24 or res.finish_reason.value == "eos"
        assert res.stats.steps > 0
        if proposer == "draft":
            assert res.stats.proposed > 0
    client.close()


def test_draft_min_confidence_hint_reaches_the_draft_replica(served, target_alone):
    """At threshold 1.0 no drafted token is sure enough, so every block is one token; the
    served output is still the target's own."""
    client = _client(served)
    prompt = PROMPTS[0]
    res = client.generate(prompt=prompt, max_tokens=24, proposer="draft", max_k=4, draft_min_confidence=1.0)
    client.close()
    ref = target_greedy(target_alone, target_alone.tokenizer.encode(prompt), 24)
    assert res.token_ids == ref[: len(res.token_ids)]
    assert len(res.token_ids) == 24 or res.finish_reason.value == "eos"
    assert 0 < res.stats.proposed <= res.stats.steps


def test_wire_stats_bytes_and_round_trip(served):
    cfg, channel, _ = served
    resp = pb_grpc.SpecDecStub(channel).Generate(
        pb.GenerateRequest(prompt="def add(a, b):", max_tokens=16, ignore_eos=True,
                           sampling=pb.SamplingParams(temperature=0.8, seed=3)),
        metadata=MD, timeout=60,
    )
    s = resp.stats
    # sampled draft blocks carry q (K x M ids + float32 probs): far below a 600 KB dense q
    assert 0 < s.wire_bytes_per_step < 8000, s
    assert s.round_trip_s >= s.target_compute_s > 0
    # the per-step costs the router feeds its K controller: every step but the prefill one
    assert sum(c.steps for c in s.verify_costs) == s.steps - 1 and s.cost_drafted > 0


def test_stream_concatenates_to_unary(served):
    _, channel, _ = served
    stub = pb_grpc.SpecDecStub(channel)
    for req in [
        pb.GenerateRequest(prompt="for i in range(10):", max_tokens=20),
        pb.GenerateRequest(prompt="def add(a, b):", max_tokens=30, stop=["b"], ignore_eos=True,
                           sampling=pb.SamplingParams(temperature=1.0, top_k=20, seed=11), logprobs=True),
    ]:
        unary = stub.Generate(req, metadata=MD, timeout=60)
        chunks = list(stub.GenerateStream(req, metadata=MD, timeout=60))
        assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
        joined = convert.join_chunks(chunks)
        assert (joined.text, list(joined.token_ids), joined.finish_reason) == (
            unary.text, list(unary.token_ids), unary.finish_reason)
        assert list(joined.logprobs) == pytest.approx(list(unary.logprobs))
        assert joined.usage == unary.usage


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "req, fragment",
    [
        (pb.GenerateRequest(prompt=""), "prompt is empty"),
        (pb.GenerateRequest(prompt="x", max_tokens=0), "max_tokens"),
        (pb.GenerateRequest(prompt="x", speculation=pb.SpeculationHints(max_k=99)),
         "invalid request: speculation.max_k: Input should be less than or equal to 16"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=1.0, top_p=1.5)), "top_p"),
        (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5] * 300)), "prompt is 300 tokens"),
        (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 99999])), "outside the vocabulary"),
        (pb.GenerateRequest(), "exactly one of"),
        (pb.GenerateRequest(prompt="x", stop_token_ids=[99999]), "stop_token_ids: id 99999 is outside the vocabulary"),
        (pb.GenerateRequest(prompt="ab " * 1_000_000), "prompt is 3000000 characters: more than the 256 positions"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=float("nan"))),
         "sampling.temperature: Input should be a finite number"),
    ],
    ids=["empty", "max_tokens", "k", "top_p", "over-long", "bad-id", "no-input", "bad-stop-id", "huge-text", "nan"],
)
@pytest.mark.parametrize("streaming", [False, True])
def test_bad_request_is_invalid_argument(served, req, fragment, streaming):
    _, channel, _ = served
    stub = pb_grpc.SpecDecStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        if streaming:
            list(stub.GenerateStream(req, metadata=MD, timeout=30))
        else:
            stub.Generate(req, metadata=MD, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert fragment in info.value.details()


@pytest.mark.parametrize("method, raw", [
    ("Generate", b"\x0a\x05ab"),  # a prompt claiming 5 bytes, carrying 2
    ("Generate", b"\x0a\x02\xff\xfe"),  # a prompt that is not UTF-8
    ("GenerateStream", b"\x0a\x05ab"),
    ("GetTenantStats", b"\x0a\x05ab"),
], ids=["unary-truncated", "unary-not-utf8", "stream-truncated", "stats-truncated"])
def test_undecodable_bytes_are_invalid_argument(served, method, raw):
    """Bytes that are not the method's request message: INVALID_ARGUMENT (grpcio alone says UNKNOWN)."""
    _, channel, _ = served
    kind = channel.unary_stream if method == "GenerateStream" else channel.unary_unary
    call = kind(f"/specdec.v1.SpecDec/{method}")  # raw bytes in, raw bytes out
    with pytest.raises(grpc.RpcError) as info:
        out = call(raw, metadata=MD, timeout=30)
        if method == "GenerateStream":
            list(out)
    message = "GetTenantStatsRequest" if method == "GetTenantStats" else "GenerateRequest"
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith(f"the request is not a valid specdec.v1.{message} ({len(raw)} bytes): ")


LONG = dict(prompt="def add(a, b):", max_tokens=220, ignore_eos=True,
            speculation=pb.SpeculationHints(proposer=pb.PROPOSER_NONE))


@pytest.mark.parametrize("where", ["server", "client"])
def test_deadline_exceeded_and_caches_freed(served, where):
    _, channel, _ = served
    stub = pb_grpc.SpecDecStub(channel)
    if where == "server":  # the server's own deadline check (metadata set by the client library)
        kwargs = dict(metadata=MD + (("specdec-timeout-s", "0.3"),), timeout=60)
    else:  # gRPC's deadline: the call is cancelled under the server
        kwargs = dict(metadata=MD, timeout=0.5)
    t0 = time.time()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateStream(pb.GenerateRequest(**LONG), **kwargs))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
    assert time.time() - t0 < 10
    assert wait_no_sessions() == ([], [])


@pytest.mark.parametrize("raw", ["nan", "inf", "1e400", "soon", "-1", "0"])
def test_deadline_metadata_must_be_positive_finite_seconds(served, raw):
    """-1 and 0 were DEADLINE_EXCEEDED ("passed before it started"): a caller's mistake, as nan."""
    cfg, channel, _ = served
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.SpecDecStub(channel).Generate(pb.GenerateRequest(prompt="x", max_tokens=2),
                                              metadata=MD + (("specdec-timeout-s", raw),), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        f"specdec-timeout-s (gRPC metadata or HTTP header) must be a number of seconds greater than 0 and finite, "
        f"got {raw!r} (a value above this server's request_timeout_s of {cfg.request_timeout_s:g} s is capped to it)")


def test_client_library_maps_deadline(served):
    client = _client(served)
    with pytest.raises(ClientError) as info:
        client.generate(prompt="def add(a, b):", max_tokens=220, ignore_eos=True, proposer="none", timeout=0.3)
    assert info.value.code == "DEADLINE_EXCEEDED"
    client.close()
    assert wait_no_sessions() == ([], [])


def test_cancelled_stream_stops_and_frees_both_caches(served):
    _, channel, _ = served
    assert wait_no_sessions() == ([], [])  # nothing left over from earlier tests
    call = pb_grpc.SpecDecStub(channel).GenerateStream(pb.GenerateRequest(**LONG), metadata=MD, timeout=60)
    first = next(call)
    assert first.token_ids
    draft_sessions, target_sessions = sessions()
    assert len(draft_sessions) == 1 and draft_sessions == target_sessions  # held while streaming
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert wait_no_sessions() == ([], [])


def _call(channel, req, tenant, streaming=False):
    stub = pb_grpc.SpecDecStub(channel)
    if streaming:
        return convert.join_chunks(list(stub.GenerateStream(req, metadata=_md(tenant), timeout=60)))
    return stub.Generate(req, metadata=_md(tenant), timeout=60)


def _still_serves(channel) -> None:
    """Other tenants are unharmed: alpha and beta still get answers."""
    for tenant in ("alpha", "beta"):
        res = _call(channel, pb.GenerateRequest(prompt="def add(a, b):", max_tokens=4, ignore_eos=True), tenant)
        assert len(res.token_ids) == 4


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    "metadata, message",
    [
        ((("application", APP),), "missing API key: send 'authorization: Bearer <key>' (gRPC metadata or HTTP header)"),
        ((("application", APP), ("authorization", "Token abc")), "malformed authorization: expected 'Bearer <key>'"),
        ((("application", APP), ("authorization", "Bearer sk-not-a-key")), "unknown API key"),
    ],
    ids=["missing", "malformed", "unknown"],
)
def test_unauthenticated(served, metadata, message, streaming):
    _, channel, _ = served
    stub = pb_grpc.SpecDecStub(channel)
    req = pb.GenerateRequest(prompt="x", max_tokens=2)
    with pytest.raises(grpc.RpcError) as info:
        if streaming:
            list(stub.GenerateStream(req, metadata=metadata, timeout=30))
        else:
            stub.Generate(req, metadata=metadata, timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert info.value.details() == message
    with pytest.raises(grpc.RpcError) as info:
        stub.GetTenantStats(pb.GetTenantStatsRequest(), metadata=metadata, timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _still_serves(channel)


@pytest.mark.parametrize(
    "req, message",
    [
        (pb.GenerateRequest(prompt="x", max_tokens=9), "max_tokens=9 exceeds the limit of tenant 'small', 8 (limits.max_tokens)"),
        (pb.GenerateRequest(prompt="x", max_tokens=4, speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT)),
         "speculation.proposer: 'draft' is not allowed for tenant 'small'; allowed: ['ngram', 'none']"),
    ],
    ids=["max_tokens", "proposer"],
)
def test_tenant_policy_is_invalid_argument(served, req, message):
    _, channel, _ = served
    with pytest.raises(grpc.RpcError) as info:
        _call(channel, req, "small")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == message
    _still_serves(channel)


def test_request_naming_no_proposer_gets_one_its_tenant_allows(served, target_alone):
    """The server's default proposer is the draft; tenant lookup may only use ngram: a request
    that names no proposer runs with ngram instead of being refused."""
    _, channel, _ = served
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):"
    res = _call(channel, pb.GenerateRequest(prompt=prompt, max_tokens=12), "lookup")
    ref = target_greedy(target_alone, target_alone.tokenizer.encode(prompt), 12)
    assert list(res.token_ids) == ref[: len(res.token_ids)]
    stats = pb_grpc.SpecDecStub(channel).GetTenantStats(
        pb.GetTenantStatsRequest(proposer=pb.PROPOSER_NGRAM), metadata=_md("lookup"), timeout=30)
    assert stats.tenant_id == "lookup" and stats.usage.requests == 1


def test_tokens_per_minute_is_resource_exhausted(served):
    _, channel, _ = served
    # tenant small: 40 tokens per minute, each request reserves prompt + max_tokens = 5 + 8; after
    # three requests 1 token is left, and the bucket takes 18 s to refill the 12 more the fourth
    # needs (with 1 + 8 a loaded machine served four requests in the 7.5 s the fifth needed)
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6, 7, 8, 9]), max_tokens=8, ignore_eos=True,
                             speculation=pb.SpeculationHints(proposer=pb.PROPOSER_NGRAM))
    done = 0
    with pytest.raises(grpc.RpcError) as info:
        for _ in range(10):
            res = _call(channel, req, "small")
            assert len(res.token_ids) == 8  # every token reserved was generated: nothing refunded
            done += 1
    assert done == 3  # 3 x 13 = 39 <= 40 < 52
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'small' is over its limit of 40 tokens per minute (limit tokens_per_minute): request needs 13" in err.details()
    # when to retry: the message says it, and the retry-after-s trailer (through Ray Serve's proxy)
    import re

    retry = float(re.search(r"retry after ([0-9.]+) s$", err.details()).group(1))
    assert 0 < retry <= 60 * 13 / 40
    trailer = dict(err.trailing_metadata() or ())
    assert float(trailer[RETRY_AFTER_KEY]) == pytest.approx(retry, abs=0.006)
    _still_serves(channel)  # the other tenants are not limited by small's bucket


def test_tenant_stats_are_the_callers_own(served):
    _, channel, _ = served
    stub = pb_grpc.SpecDecStub(channel)
    before = stub.GetTenantStats(pb.GetTenantStatsRequest(proposer=pb.PROPOSER_DRAFT), metadata=_md("beta"), timeout=30)
    alpha_before = stub.GetTenantStats(pb.GetTenantStatsRequest(), metadata=_md("alpha"), timeout=30)
    assert (before.tenant_id, alpha_before.tenant_id) == ("beta", "alpha")  # the key decides whose stats
    req = pb.GenerateRequest(prompt="def add(a, b):", max_tokens=6, ignore_eos=True,
                             speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4))
    for _ in range(3):
        _call(channel, req, "beta")
    after = stub.GetTenantStats(pb.GetTenantStatsRequest(proposer=pb.PROPOSER_DRAFT), metadata=_md("beta"), timeout=30)
    assert after.tenant_id == "beta"
    assert after.usage.requests == before.usage.requests + 3
    assert after.usage.completion_tokens == before.usage.completion_tokens + 18
    assert after.current_k <= 4
    alpha_after = stub.GetTenantStats(pb.GetTenantStatsRequest(), metadata=_md("alpha"), timeout=30)
    assert alpha_after.usage == alpha_before.usage  # beta's requests never show in alpha's stats
    # K under load (beta adapts): the draft replica's batch controller chose a K for beta within
    # the requests' ceiling, and counted beta's steps and the batch shapes they ran in
    assert after.batch.HasField("k_under_load") and after.batch.k_under_load <= 4
    assert after.batch.tenant_steps >= before.batch.tenant_steps + 3 and after.batch.tenant_rows_per_step >= 1
    assert after.batch.tenant_positions_per_step >= after.batch.tenant_rows_per_step
    assert alpha_after.batch.tenant_steps == alpha_before.batch.tenant_steps


# --- draft replica death -----------------------------------------------------------------------


def _replica(deployment: str):
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{deployment}#" in a["name"]]
    assert len(actors) == 1, actors
    return actors[0]["name"], ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"])


@pytest.mark.parametrize("sampling", [None, pb.SamplingParams(temperature=0.9, top_k=50, seed=1234)], ids=["greedy", "seeded"])
def test_killed_draft_replica_does_not_fail_its_stream(served, sampling):
    _, channel, _ = served
    stub = pb_grpc.SpecDecStub(channel)
    req = pb.GenerateRequest(prompt="def add(a, b):", max_tokens=200, ignore_eos=True,
                             speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=1))
    if sampling is not None:
        req.sampling.CopyFrom(sampling)
    expected = stub.Generate(req, metadata=MD, timeout=120)  # uninterrupted
    resumes_before = deployment_handle("Router").Debug.remote().result(timeout_s=30)["resumes"]
    name, actor = _replica("Draft")
    chunks = []
    call = stub.GenerateStream(req, metadata=MD + (("session_id", "kill-me"),), timeout=180)
    chunks.append(next(call))
    ray.kill(actor, no_restart=True)  # mid-stream: the replica running this generation dies
    chunks.extend(call)
    got = convert.join_chunks(chunks)
    assert (got.text, list(got.token_ids), got.finish_reason) == (expected.text, list(expected.token_ids), expected.finish_reason)
    assert deployment_handle("Router").Debug.remote().result(timeout_s=30)["resumes"] > resumes_before
    assert _replica("Draft")[0] != name  # Serve replaced the replica
    assert wait_no_sessions() == ([], [])


def test_killed_target_replica_is_rebuilt_from_the_token_history(served):
    _, channel, _ = served
    stub = pb_grpc.SpecDecStub(channel)
    req = pb.GenerateRequest(prompt="for i in range(10):", max_tokens=200, ignore_eos=True,
                             speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=1))
    expected = stub.Generate(req, metadata=MD, timeout=120)
    name, actor = _replica("Target")
    call = stub.GenerateStream(req, metadata=MD, timeout=180)
    chunks = [next(call)]
    ray.kill(actor, no_restart=True)  # the target replica and its TP workers die mid-stream
    chunks.extend(call)
    got = convert.join_chunks(chunks)
    assert (got.text, list(got.token_ids)) == (expected.text, list(expected.token_ids))
    assert _replica("Target")[0] != name
    assert wait_no_sessions() == ([], [])


# --- plumbing ----------------------------------------------------------------------------------


def test_health_check_is_served_by_the_proxy(served):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, channel, _ = served
    stub = health_pb2_grpc.HealthStub(channel)
    assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    # specdec.v1.SpecDec: SERVING once the proxy's probe (Router.Settled through Serve) says settled
    call = stub.Watch(health_pb2.HealthCheckRequest(service="specdec.v1.SpecDec"), timeout=60)
    seen = []
    for resp in call:
        seen.append(resp.status)
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            break
    call.cancel()
    assert seen[-1] == health_pb2.HealthCheckResponse.SERVING
    assert stub.Check(health_pb2.HealthCheckRequest(service="specdec.v1.SpecDec"), timeout=10).status == \
        health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(served):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    _, channel, _ = served
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "specdec.v1.SpecDec" in services
    assert "grpc.health.v1.Health" in services


def test_target_deployment_verifies_serialized_blocks(served):
    import torch

    handle = deployment_handle("Target").options(session_id="s-handle")
    open_msg = convert.session_open_to_proto([1, 5, 9, 33], SamplingParams(), seed=0, logprobs=False)
    block = convert.draft_block_to_proto(DraftBlock(token_ids=torch.tensor([7, 7])), "s-handle", 4, open_msg)
    reply = xpb.VerificationResult.FromString(handle.Verify.remote(block.SerializeToString()).result(timeout_s=60))
    assert reply.status == xpb.VERIFY_STATUS_OK and reply.committed_len == 4 + reply.accepted + 1
    closed = xpb.CloseSessionResponse.FromString(
        handle.CloseSession.remote(xpb.CloseSessionRequest(session_id="s-handle").SerializeToString()).result(timeout_s=30)
    )
    assert closed.existed


def test_concurrent_streams_are_independent(served, target_alone):
    """Concurrent requests share batched target forwards and each equals the target alone."""
    client = _client(served)
    results: dict[str, list[int]] = {}
    before = deployment_handle("Target").BatchStats.remote().result(timeout_s=30)

    def run(prompt):
        results[prompt] = client.generate(prompt=prompt, max_tokens=16).token_ids

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for p in PROMPTS:
        ref = target_greedy(target_alone, target_alone.tokenizer.encode(p), 16)
        assert results[p] == ref[: len(results[p])]
    client.close()
    after = deployment_handle("Target").BatchStats.remote().result(timeout_s=30)
    assert after["forwards"] > before["forwards"] and after["max_rows"] >= 2  # blocks of 2+ sessions in one forward
    stats = _client(served).tenant_stats()  # the batch shape is in GetTenantStats too
    assert stats.batch.forwards >= 1 and stats.batch.max_rows >= 2 and stats.batch.mean_positions >= stats.batch.mean_rows


def test_specdec_client_command(served, capsys):
    import argparse

    from deployments import cli

    cfg, _, _ = served
    parser = argparse.ArgumentParser()
    cli.add_client_arguments(parser)
    base = ["--address", f"localhost:{cfg.grpc_port}", "--max-tokens", "8", "--api-key", KEYS["alpha"]]
    assert cli.run_client(parser.parse_args(["def add(a, b):", "--stream", *base])) == 0
    out = capsys.readouterr()
    assert "tokens/s" in out.err and out.out.strip()
    assert cli.run_client(parser.parse_args(["", *base])) == 2  # no prompt
    assert capsys.readouterr().err == "specdec client: give a prompt or --message\n"
    # out of range: refused by flag name before sending (exit 2, tests/deployments/test_serve_cli.py)
    assert cli.run_client(parser.parse_args(["x", "--proposer", "draft", "-k", "99", *base])) == 2
    assert capsys.readouterr().err == "specdec client: -k: Input should be less than or equal to 16\n"
    # what only the server knows (the vocabulary): its INVALID_ARGUMENT, exit 1, not a traceback
    assert cli.run_client(parser.parse_args(["x", "--logit-bias", "99999=1", *base])) == 1
    assert capsys.readouterr().err == ("specdec client: INVALID_ARGUMENT: logit_bias: id 99999 is outside the "
                                       "vocabulary 0..319\n")
    # no key on a server with tenants: the server's UNAUTHENTICATED says what to send on the wire
    # (gRPC metadata), the command line says which flag carries it
    assert cli.run_client(parser.parse_args(["x", *base[:4], "--api-key", ""])) == 1
    assert capsys.readouterr().err == (
        "specdec client: UNAUTHENTICATED: missing API key: send 'authorization: Bearer <key>' (gRPC metadata or "
        "HTTP header) (give the key with --api-key or $SPECDEC_API_KEY)\n")
    # --json: the shape of `specdec generate --json`, plus the wire numbers
    import json

    assert cli.run_client(parser.parse_args(["def add(a, b):", "--json", "--logprobs", *base])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["finish_reason"] in ("max_tokens", "eos") and len(data["token_ids"]) == len(data["logprobs"])
    assert data["usage"]["completion_tokens"] == len(data["token_ids"]) and data["stats"]["steps"] > 0
    assert data["wire"]["bytes_per_step"] > 0


def test_router_and_target_replicas_hold_no_torch(served):
    """After the requests above (generations, tenant stats, replicas killed and rebuilt), the router
    and target replicas have not imported torch (they hold no model: 0.2-0.3 GiB each otherwise);
    the draft replica, which holds the draft model, has (the check sees it)."""
    routers, targets, drafts = (replica_pids(name) for name in ("Router", "Target", "Draft"))
    assert len(routers) >= 1 and len(targets) >= 1 and len(drafts) >= 1
    assert {pid: maps_torch(pid) for pid in routers + targets} == {pid: False for pid in routers + targets}
    assert all(maps_torch(pid) for pid in drafts)
