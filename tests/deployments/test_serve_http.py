"""The OpenAI-compatible HTTP API through Ray Serve's real HTTP port, beside the gRPC API of the
same application, with the real ``openai`` client. Tiny models, target TP=1, one Ray + Serve +
application for the module (2 CPUs)."""

from __future__ import annotations

import json
import time

import grpc
import httpx2
import openai
import pytest

from deployments import convert
from protos.specdec.v1 import specdec_pb2 as pb
from protos.specdec.v1 import specdec_pb2_grpc as pb_grpc
from tests.conftest import load_tiny, target_greedy
from tests.deployments.serving import (
    APP,
    KEYS,
    MD,
    maps_torch,
    replica_pids,
    serve_tiny_app,
    sessions,
    wait_no_sessions,
    wait_running,
)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.serve

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def served(models):
    """(cfg, grpc channel, HTTP statuses seen while the models loaded)."""
    from ray import serve

    with serve_tiny_app(models, target_tp=1) as cfg:
        observed: list[tuple[int, str]] = []
        url = f"http://localhost:{cfg.http_port}/{APP}/v1/completions"
        body = {"model": APP, "prompt": "x", "max_tokens": 1}
        end = time.time() + 120
        while time.time() < end:  # ask while the models load: our 503, not a 500
            try:
                r = httpx2.post(url, json=body, headers={"Authorization": f"Bearer {KEYS['alpha']}"}, timeout=10)
            except httpx2.TransportError as e:
                observed.append((0, type(e).__name__))
                time.sleep(0.3)
                continue
            if r.status_code == 200:
                break
            observed.append((r.status_code, r.text))
            time.sleep(0.3)
        wait_running(serve, APP)
        channel = grpc.insecure_channel(f"localhost:{cfg.grpc_port}")
        yield cfg, channel, observed
        channel.close()


def _base(cfg) -> str:
    return f"http://localhost:{cfg.http_port}/{APP}"


def _client(served, key: str | None = KEYS["alpha"]) -> openai.OpenAI:
    cfg = served[0]
    return openai.OpenAI(api_key=key or "none", base_url=_base(cfg) + "/v1", max_retries=0, timeout=120,
                         default_headers=None if key else {"Authorization": ""})


def test_loading_answers_503_in_openai_shape(served):
    _, _, observed = served
    assert not [o for o in observed if o[0] == 500], observed
    ours = [json.loads(text) for status, text in observed if status == 503 and '"service_unavailable"' in text]
    assert ours, f"no 503 'still loading' while deploying: {observed}"
    assert ours[0]["error"]["message"] == "the models are still loading; retry in a few seconds"


def test_completions_and_chat_equal_the_grpc_api(served, models):
    cfg, channel, _ = served
    stub = pb_grpc.SpecDecStub(channel)
    client = _client(served)
    target = load_tiny(models[0])
    # completions, greedy, draft proposer: the gRPC answer, the target's own
    req = pb.GenerateRequest(prompt=PROMPT, max_tokens=16, ignore_eos=True,
                             speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4))
    g = stub.Generate(req, metadata=MD, timeout=60)
    assert list(g.token_ids) == target_greedy(target, target.tokenizer.encode(PROMPT), 16)
    args = dict(model=APP, prompt=PROMPT, max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True, "speculation": {"proposer": "draft", "max_k": 4}})
    unary = client.completions.create(**args)
    assert unary.choices[0].model_extra["token_ids"] == list(g.token_ids) and unary.choices[0].text == g.text
    assert unary.model_extra["speculation_stats"]["proposed"] > 0
    chunks = list(client.completions.create(stream=True, **args))
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks), []) == list(g.token_ids)
    assert "".join(c.choices[0].text for c in chunks) == g.text
    # chat, seeded sampling: the same sample on both APIs
    msgs = [{"role": "user", "content": "write add"}]
    req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in msgs]), max_tokens=12,
                             ignore_eos=True, sampling=pb.SamplingParams(temperature=0.8, top_p=0.9, seed=5))
    g = stub.Generate(req, metadata=MD, timeout=60)
    args = dict(model=APP, messages=msgs, max_tokens=12, temperature=0.8, top_p=0.9, seed=5,
                extra_body={"ignore_eos": True})
    unary = client.chat.completions.create(**args)
    assert unary.choices[0].model_extra["token_ids"] == list(g.token_ids)
    assert unary.choices[0].message.content == g.text
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == g.text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == g.usage.prompt_tokens


def test_every_error_status_from_a_real_bad_request(served):
    chat = dict(model=APP, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e400:
        _client(served).chat.completions.create(**{**chat, "max_tokens": 0})
    assert e400.value.body["message"] == "invalid request: max_tokens: Input should be greater than or equal to 1"
    with pytest.raises(openai.AuthenticationError) as e401:
        _client(served, key="sk-not-a-key").chat.completions.create(**chat)
    assert e401.value.body["message"] == "unknown API key"
    with pytest.raises(openai.NotFoundError) as e404:
        _client(served).chat.completions.create(**{**chat, "model": "gpt-4o"})
    assert e404.value.body["type"] == "not_found_error" and e404.value.body["code"] == "model_not_found"
    # tenant small: 40 tokens per minute, 1 + 8 reserved per request
    small = _client(served, KEYS["small"])
    with pytest.raises(openai.RateLimitError) as e429:
        for _ in range(10):
            small.completions.create(model=APP, prompt="x", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True, "speculation": {"proposer": "ngram"}})
    assert e429.value.body["code"] == "tokens_per_minute"
    assert 1 <= int(e429.value.response.headers["retry-after"]) <= 14


def test_grpc_and_http_give_the_same_message_for_the_same_bad_request(served):
    _, channel, _ = served
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.SpecDecStub(channel).Generate(
            pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(temperature=1.0, top_p=1.5)),
            metadata=MD, timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        _client(served).completions.create(model=APP, prompt=PROMPT, top_p=1.5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the same message, naming the field as each API spells it
    assert info.value.details() == "invalid request: sampling.top_p: Input should be less than or equal to 1"
    assert e.value.body["message"] == "invalid request: top_p: Input should be less than or equal to 1"


def test_max_tokens_over_the_context_is_refused_through_both_ports(served):
    """A prompt plus an explicit max_tokens over the tiny target's 256 positions was admitted and
    cut short at the context; through Serve's real proxies it is HTTP 400 context_length_exceeded
    and gRPC INVALID_ARGUMENT, with OpenAI's message and numbers. At the limit it is answered."""
    _, channel, _ = served
    prompt = [5] * 200
    message = ("This model's maximum context length is 256 tokens. However, you requested 257 tokens "
               "(200 in the prompt, 57 in the completion). Please reduce the length of the prompt or completion.")
    with pytest.raises(openai.BadRequestError) as e:
        _client(served).completions.create(model=APP, prompt=prompt, max_tokens=57)
    assert e.value.status_code == 400
    assert e.value.body == {"message": message, "type": "invalid_request_error", "param": "max_tokens",
                            "code": "context_length_exceeded"}
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.SpecDecStub(channel).Generate(
            pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=57), metadata=MD, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details() == message
    r = _client(served).completions.create(model=APP, prompt=prompt, max_tokens=56, temperature=0,
                                           extra_body={"ignore_eos": True, "speculation": {"proposer": "ngram"}})
    assert r.usage.completion_tokens == 56 and r.choices[0].model_extra["finish_detail"] == "max_tokens"


def test_disconnect_cancels_the_generation_and_frees_both_caches(served):
    cfg = served[0]
    assert wait_no_sessions() == ([], [])
    body = {"model": APP, "prompt": PROMPT, "max_tokens": 220, "temperature": 0, "stream": True, "ignore_eos": True,
            "speculation": {"proposer": "none"}}
    with httpx2.Client(timeout=60) as http:
        with http.stream("POST", _base(cfg) + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {KEYS['alpha']}"}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["token_ids"]
            d, t = sessions()
            assert len(d) == 1 and d == t  # held while streaming
        # leaving the block closes the connection mid-stream
    assert wait_no_sessions() == ([], [])


def test_outputs_of_one_chunk_are_ok_and_counted_in_full_through_serve(served):
    """Through Serve's HTTP port and the openai client: requests whose whole output came in one
    chunk (max_tokens 1 or 2) were answered 200 with the right usage but recorded as failed,
    their completion tokens never reaching GetTenantStats (n = 2: one choice CANCELLED). Also:
    n above the tenant's concurrency is 400 naming n (was a 429 the client retries), and
    GetTenantStats for a proposer the tenant may not use is INVALID_ARGUMENT as Generate."""
    cfg, channel, _ = served
    stub = pb_grpc.SpecDecStub(channel)
    md = (("application", APP), ("authorization", f"Bearer {KEYS['lookup']}"))

    def usage():
        u = stub.GetTenantStats(pb.GetTenantStatsRequest(), metadata=md, timeout=30).usage
        return u.requests, u.prompt_tokens, u.completion_tokens

    client = _client(served, KEYS["lookup"])
    greedy = dict(model=APP, temperature=0, extra_body={"ignore_eos": True})
    before = usage()
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=1, **greedy)
    two = client.completions.create(prompt="x", max_tokens=2, n=2, **greedy)
    chunks = list(client.completions.create(prompt="x", max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}, **greedy))
    assert (chat.usage.completion_tokens, two.usage.completion_tokens, chunks[-1].usage.completion_tokens) == (1, 4, 2)
    assert len([c for c in chunks if c.choices and c.choices[0].model_extra["token_ids"]]) == 1  # one chunk
    after = usage()
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (
        4, chat.usage.prompt_tokens + 2 * two.usage.prompt_tokens + chunks[-1].usage.prompt_tokens, 7)

    small = openai.OpenAI(api_key=KEYS["small"], base_url=_base(cfg) + "/v1", timeout=60)  # default retries
    with pytest.raises(openai.BadRequestError) as ei:
        small.completions.create(model=APP, prompt="x", max_tokens=1, n=2)
    assert ei.value.body == {"message": "n=2 choices run as 2 concurrent requests but tenant 'small' may run at most 1 "
                                        "at once (limits.max_concurrent_requests); lower n to at most 1",
                             "type": "invalid_request_error", "param": "n", "code": None}

    with pytest.raises(grpc.RpcError) as ei:
        stub.GetTenantStats(pb.GetTenantStatsRequest(proposer=pb.PROPOSER_DRAFT), metadata=md, timeout=30)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details() == ("speculation.proposer: 'draft' is not allowed for tenant 'lookup'; allowed: "
                                  "['ngram', 'none']")


def test_n_choices_all_reach_the_draft_replica_through_serve(served, models):
    """n = 3..16 choices of one HTTP request through Serve: the choices' draft calls shared the
    request's Serve internal id, and Serve's request router left one of them waiting for a
    replica forever (n = 3 hung until the client's timeout). Once more, after the previous test's
    disconnect: the n admissions waited 30 s on the shared controller actor behind a lease release
    that Serve's cancellation had taken (tests/deployments/test_shared_actor_calls.py). Every
    choice is now the target-alone answer, unary and streamed, and a disconnect mid-stream frees
    every choice's caches."""
    cfg = served[0]
    target = load_tiny(models[0])
    ref = target_greedy(target, target.tokenizer.encode(PROMPT), 5)
    client = openai.OpenAI(api_key=KEYS["alpha"], base_url=_base(cfg) + "/v1", max_retries=0, timeout=30)
    args = dict(model=APP, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    for n in (3, 8, 16):
        r = client.completions.create(n=n, **args)
        assert [c.model_extra["token_ids"] for c in r.choices] == [ref] * n
    streamed = {i: [] for i in range(4)}
    for chunk in client.completions.create(n=4, stream=True, **args):
        for ch in chunk.choices:
            streamed[ch.index] += ch.model_extra["token_ids"]
    assert list(streamed.values()) == [ref] * 4
    body = {"model": APP, "prompt": PROMPT, "max_tokens": 220, "temperature": 0, "stream": True, "ignore_eos": True,
            "n": 4, "speculation": {"proposer": "none"}}
    with httpx2.Client(timeout=60) as http:
        with http.stream("POST", _base(cfg) + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {KEYS['alpha']}"}) as resp:
            assert resp.status_code == 200
            next(line for line in resp.iter_lines() if line.startswith("data: "))
    assert wait_no_sessions() == ([], [])


def test_every_http_path_answers(served):
    cfg = served[0]
    root = httpx2.get(_base(cfg), timeout=30)
    assert root.status_code == 200 and root.json()["openai_base_url"] == f"/{APP}/v1"
    nope = httpx2.get(_base(cfg) + "/v2/whatever", timeout=30)
    assert nope.status_code == 404 and nope.json()["error"]["type"] == "not_found_error"
    assert nope.json()["error"]["code"] is None  # no such route: not a model
    assert [m.id for m in _client(served).models.list()] == [APP]


def _watch_until_serving(health, service: str) -> list[int]:
    """The statuses grpc.health.v1 Watch streams for ``service`` up to SERVING (60 s deadline)."""
    from grpc_health.v1 import health_pb2

    seen = []
    call = health.Watch(health_pb2.HealthCheckRequest(service=service), timeout=60)
    for resp in call:
        seen.append(resp.status)
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            break
    call.cancel()
    assert set(seen) <= {health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING}
    return seen


def test_grpc_health_and_reflection_still_answer(served):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    _, channel, _ = served
    health = health_pb2_grpc.HealthStub(channel)
    # specdec.v1.SpecDec's status comes from the router through Serve (Router.Settled, what GET
    # /health answers; no start-up calibration in this app): SERVING once the proxy has asked it
    assert _watch_until_serving(health, "specdec.v1.SpecDec")[-1] == health_pb2.HealthCheckResponse.SERVING
    assert httpx2.get(_base(served[0]) + "/health", timeout=30).json() == {"status": "ok"}
    for service in ("", "specdec.v1.SpecDec"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
    assert {"specdec.v1.SpecDec", "grpc.health.v1.Health"} <= set(ProtoReflectionDescriptorDatabase(channel).get_services())
    res = convert.join_chunks(list(pb_grpc.SpecDecStub(channel).GenerateStream(
        pb.GenerateRequest(prompt=PROMPT, max_tokens=4, ignore_eos=True), metadata=MD, timeout=60)))
    assert len(res.token_ids) == 4


def test_sampling_surface_through_both_ports(served, models):
    """Penalties, logit bias, min-p, min_tokens and top-N logprobs reach the target's TP worker
    with the session (greedy: the target alone through transformers' generate)."""
    import torch

    _, channel, _ = served
    target = load_tiny(models[0])
    ids = target.tokenizer.encode(PROMPT)
    with torch.inference_mode():  # the reference: transformers' own processors
        out = target.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                    repetition_penalty=1.6, sequence_bias={(40,): 4.0},
                                    eos_token_id=target.eos_token_ids, pad_token_id=target.tokenizer.pad_token_id)
    ref = out[0, len(ids):].tolist()
    req = pb.GenerateRequest(prompt=PROMPT, max_tokens=16, logprobs=True, top_logprobs=5,
                             sampling=pb.SamplingParams(repetition_penalty=1.6, logit_bias={40: 4.0}),
                             speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4))
    g = pb_grpc.SpecDecStub(channel).Generate(req, metadata=MD, timeout=60)
    assert list(g.token_ids) == ref and len(g.top_logprobs) == len(ref)
    r = _client(served).completions.create(model=APP, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=5,
                                           logit_bias={"40": 4.0}, extra_body={"repetition_penalty": 1.6,
                                                                              "speculation": {"proposer": "draft"}})
    assert r.choices[0].model_extra["token_ids"] == ref
    # completions' shape: token text -> logprob (ids that decode alike share a key, the most likely kept)
    expected = []
    for t in g.top_logprobs:
        d: dict = {}
        for i, v in zip(t.ids, t.logprobs):
            d.setdefault(target.tokenizer.decode([i]), v)
        expected.append(d)
    got = r.choices[0].logprobs.top_logprobs
    assert [list(d) for d in got] == [list(d) for d in expected]
    assert [list(d.values()) for d in got] == [pytest.approx(list(d.values()), abs=1e-5) for d in expected]


def test_router_replica_serving_http_holds_no_torch(served):
    """The OpenAI API's requests above (completions, chat, streams, errors) left the router replica
    without torch (test_serve_grpc.py checks the target replica too)."""
    routers = replica_pids("Router")
    assert len(routers) >= 1 and [maps_torch(pid) for pid in routers] == [False] * len(routers)
    assert all(maps_torch(pid) for pid in replica_pids("Draft"))


def test_a_float32_pair_is_served_without_prefix_caching(served):
    """``prefix_cache_entries`` is 8 by default, but the tests' float32 pair (not shape-invariant)
    is served without it: start-up did not fail, and both deployments report it off
    (tests/deployments/test_serve_prefix_cache.py serves a bfloat16 pair with it on)."""
    from tests.deployments.serving import deployment_handle

    off = {"enabled": False, "entries": 0, "held": 0, "hits": 0, "shared_positions": 0}
    assert [deployment_handle(name).PrefixCacheStats.remote().result(timeout_s=30)
            for name in ("Target", "Draft")] == [off, off]
