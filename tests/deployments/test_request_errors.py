"""What a new user's bad calls get, over the OpenAI API and gRPC (the real Router and its FastAPI
app in process, as ``test_openai_api.py``): OpenAI's ``param`` names the offending field; an
over-long session id is refused; a gRPC call for another Serve application is NOT_FOUND."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from deployments.grpc_status import StreamAborted
from deployments.client import SpecDecClient
from deployments.ingress.checks import deadline_from_metadata
from deployments.metadata import MAX_SESSION_ID_CHARS, TIMEOUT_KEY
from deployments.openai_responses import error_param
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.errors import InvalidRequestError, ResourceExhaustedError
from tests.deployments.grpc_context import RecordingContext
from tests.deployments.test_openai_api import (  # noqa: F401 (stack: fixture)
    KEY,
    MODEL,
    PROMPT,
    _client,
    _grpc,
    _raw,
    _run,
    _status_of,
    stack,
)
from tests.conftest import target_greedy

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize("endpoint, body, param", [
    ("completions", {**COMPLETION, "top_p": 1.5}, "top_p"),
    ("completions", {**COMPLETION, "temperature": -1}, "temperature"),
    ("completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("completions", {**COMPLETION, "max_tokens": "5"}, "max_tokens"),
    ("completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("completions", {**COMPLETION, "prompt": [5] * 300}, "prompt"),
    ("completions", {**COMPLETION, "prompt": [99999]}, "prompt"),
    ("completions", {**COMPLETION, "speculation": {"max_k": 99}}, "speculation.max_k"),
    ("completions", {**COMPLETION, "stop_token_ids": [99999]}, "stop_token_ids"),
    ("completions", {**COMPLETION, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {**COMPLETION, "logit_bias": {"1": 300}}, "logit_bias"),
    ("completions", {**COMPLETION, "min_tokens": 5}, "min_tokens"),
    ("completions", {**COMPLETION, "n": 0}, "n"),
    ("completions", {**COMPLETION, "frobnicate": 1, "zzz": 2}, "frobnicate"),
    ("completions", {**COMPLETION, "model": ""}, "model"),
    ("completions", {**COMPLETION, "echo": True}, "echo"),
    ("chat", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages.0.name"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": "x " * 3000}]}, "messages"),
    ("chat", {**CHAT, "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ("chat", {**{k: v for k, v in CHAT.items() if k != "max_tokens"}, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat", [1, 2], None),
])
def test_openai_error_param_names_the_offending_field(stack, endpoint, body, param):
    """``param`` was always null; OpenAI's clients show it (``BadRequestError.param``) and
    OpenAI's API sets it to the body field at fault, as the body spells it."""
    resp = _run(_raw(stack["app"], "POST", f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}",
                     json.dumps(body)))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()


def test_error_param_is_null_off_a_bad_request():
    """OpenAI's 401/404/429 carry no param; a 400 whose message starts with no body field
    (a header's value) neither."""
    assert error_param(ResourceExhaustedError("max_tokens=9 over tokens_per_minute", "tokens_per_minute")) is None
    with pytest.raises(InvalidRequestError) as info:
        deadline_from_metadata({TIMEOUT_KEY: "-1"}, 300)
    assert error_param(info.value) is None
    assert error_param(InvalidRequestError("invalid request: sampling.top_k: Input should be ...")) == "top_k"


def test_an_over_long_session_id_is_refused_on_both_apis(stack):
    """``x-session-id`` had no length limit over HTTP (a 100,000-character id was a routing key
    and part of every session key); gRPC's own metadata limit is 16 KiB. Both now refuse more
    than MAX_SESSION_ID_CHARS, naming the limit; at the limit the answer is the target's."""
    long_id = "s" * (MAX_SESSION_ID_CHARS + 1)
    message = (f"metadata session_id (HTTP header x-session-id) is {MAX_SESSION_ID_CHARS + 1} characters; "
               f"at most {MAX_SESSION_ID_CHARS}")
    resp = _run(_raw(stack["app"], "POST", "/v1/completions", json.dumps(COMPLETION), headers={"x-session-id": long_id}))
    assert resp.status_code == 400 and resp.json()["error"]["message"] == message
    ctx = RecordingContext((("authorization", f"Bearer {KEY}"), ("session_id", long_id)))
    _run(stack["router"].Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=2), ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details == message
    resp = _run(_raw(stack["app"], "POST", "/v1/completions", json.dumps(COMPLETION),
                     headers={"x-session-id": "s" * MAX_SESSION_ID_CHARS}))
    target = stack["target"]
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["token_ids"] == target_greedy(target, target.tokenizer.encode(PROMPT), 2)


def _timeout_message(raw: str, request_timeout_s: float = 300) -> str:
    return (f"specdec-timeout-s (gRPC metadata or HTTP header) must be a number of seconds greater than 0 and "
            f"finite, got {raw!r} (a value above this server's request_timeout_s of {request_timeout_s:g} s is "
            "capped to it)")


BAD_TIMEOUTS = ["-1", "0", "-0", "-0.5", "nan", "inf", "-inf", "1e400", "abc", "", " ", "1s"]


@pytest.mark.parametrize("raw", BAD_TIMEOUTS)
def test_a_timeout_outside_its_range_is_refused_naming_the_key_and_range(raw):
    """``specdec-timeout-s: -1`` (or 0) was a 504 / DEADLINE_EXCEEDED "the request's deadline had
    passed before it started", as if the server were slow; ``abc`` was a 400. Every value outside
    0 < seconds < inf is now the caller's mistake: INVALID_ARGUMENT / 400 naming the key and the
    range (1e400 reads as inf; an empty value is no number)."""
    with pytest.raises(InvalidRequestError) as info:
        deadline_from_metadata({TIMEOUT_KEY: raw}, 300)
    assert str(info.value) == _timeout_message(raw)


def test_a_timeout_in_range_is_capped_by_the_servers():
    """Absent: the server's request_timeout_s; more than it (a huge value included): capped to it."""
    import time

    for md, budget in (({}, 300), ({TIMEOUT_KEY: "30"}, 30), ({TIMEOUT_KEY: " 2.5 "}, 2.5),
                       ({TIMEOUT_KEY: "1e-6"}, 1e-6), ({TIMEOUT_KEY: "1e300"}, 300), ({TIMEOUT_KEY: "301"}, 300)):
        before = time.time()
        deadline = deadline_from_metadata(md, 300)
        assert before + budget <= deadline <= time.time() + budget, (md, deadline - before)


@pytest.mark.parametrize("raw", ["-1", "0", "abc", "1e400"])
def test_a_bad_timeout_is_refused_alike_on_both_apis(stack, raw):
    """The HTTP header and the gRPC metadata ``specdec-timeout-s``: one rule, one message (the
    server's request_timeout_s is AppConfig's default, 300 s)."""
    message = _timeout_message(raw, stack["cfg"].request_timeout_s)
    resp = _run(_raw(stack["app"], "POST", "/v1/completions", json.dumps(COMPLETION), headers={TIMEOUT_KEY: raw}))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    ctx = RecordingContext((("authorization", f"Bearer {KEY}"), (TIMEOUT_KEY, raw)))
    _run(stack["router"].Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=2), ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details == message


def test_the_client_library_sends_its_timeout_at_full_precision():
    """A timeout of 0.0004 s was sent as "0.000", which the server now refuses; 0, negatives and
    inf are left to gRPC's own deadline (not sent)."""
    client = SpecDecClient("unused:1", channel=grpc.insecure_channel("unused:1"))
    timeouts = {t: dict(client.metadata(t)).get(TIMEOUT_KEY) for t in (0.0004, 30, 2.5, 0, -1, float("inf"), None)}
    assert timeouts == {0.0004: "0.0004", 30: "30.0", 2.5: "2.5", 0: None, -1: None, float("inf"): None, None: None}
    client.close()


@pytest.mark.parametrize("method, request_msg, response_type", [
    ("Generate", pb.GenerateRequest(prompt=PROMPT, max_tokens=2), pb.GenerateResponse),
    ("GetTenantStats", pb.GetTenantStatsRequest(), pb.GetTenantStatsResponse),
])
def test_a_grpc_call_for_another_application_is_not_found(stack, method, request_msg, response_type):
    """Serve's gRPC proxy routes a call to its only application whatever ``application``
    metadata it carries, so ``application: bogus`` was answered by specdec. It is NOT_FOUND,
    as Serve answers with several applications; the right name and no name both work."""
    router = stack["router"]
    ctx = RecordingContext((("application", "bogus"), ("authorization", f"Bearer {KEY}")))
    _run(getattr(router, method)(request_msg, ctx))
    assert ctx.code == grpc.StatusCode.NOT_FOUND
    assert ctx.details == "Application 'bogus' not found; this server serves the application 'specdec'"
    for md in ((("application", "specdec"),), ()):
        ctx = RecordingContext(md + (("authorization", f"Bearer {KEY}"),))
        got = _run(getattr(router, method)(request_msg, ctx))
        assert ctx.code is None and isinstance(got, response_type)


def test_a_stream_for_another_application_is_not_found(stack):
    ctx = RecordingContext((("application", "bogus"), ("authorization", f"Bearer {KEY}")))

    async def drain():
        return [c async for c in stack["router"].GenerateStream(pb.GenerateRequest(prompt=PROMPT, max_tokens=2), ctx)]

    with pytest.raises(StreamAborted, match="Application 'bogus' not found"):
        _run(drain())
    assert ctx.code == grpc.StatusCode.NOT_FOUND


def test_a_body_larger_than_any_valid_request_is_413_unread(stack):
    """A 300 MB completions body was read, parsed and held in the router (4.3 s on the tiny
    pair) before being refused for its prompt; a body larger than any request that can fit
    the context is now 413 from its Content-Length, and a streamed (chunked) one as soon as it
    passes the limit. The server answers as before."""
    from deployments.openai_requests import max_body_bytes

    router = stack["router"]
    limit = max_body_bytes(router.info.max_positions, router._max_token_chars, router.info.vocab_rows)
    assert limit == 6 * 256 * 13 + 32 * 320 + 16 * 2**20  # the tiny pair: 256 positions, 13 characters, 320 ids
    body = json.dumps({**COMPLETION, "prompt": "a" * limit})
    resp = _run(_raw(stack["app"], "POST", "/v1/completions", body))
    assert resp.status_code == 413
    assert resp.json()["error"] == {
        "message": f"the request body is {len(body)} bytes: more than this server's limit of {limit} bytes (no request "
                   "that fits the model's context is that large)",
        "type": "invalid_request_error", "param": None, "code": None}

    async def chunked():
        import httpx2

        async def parts():
            yield b'{"model": "specdec", "prompt": "'
            for _ in range(limit // 2**16 + 1):
                yield b"a" * 2**16
            yield b'"}'

        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=stack["app"]), base_url="http://test") as c:
            return await c.post("/v1/completions", content=parts(), headers={"Authorization": f"Bearer {KEY}"})

    resp = _run(chunked())
    assert resp.status_code == 413 and resp.json()["error"]["message"] == (
        f"the request body is more than {limit} bytes: more than this server's limit of {limit} bytes (no request "
        "that fits the model's context is that large)")
    target = stack["target"]
    resp = _run(_raw(stack["app"], "POST", "/v1/completions", json.dumps(COMPLETION)))
    assert resp.json()["choices"][0]["token_ids"] == target_greedy(target, target.tokenizer.encode(PROMPT), 2)


def test_seeds_take_the_whole_uint64_range_on_both_apis(stack):
    """A gRPC seed >= 2**63 was refused (INVALID_ARGUMENT) although the proto field is uint64.
    Every uint64 seed is now used as it is: the served answer is the in-process engine's with
    that seed, the same every time, and not that of the seed 2**63 below it; OpenAI's choice 1 of
    seed 2**64 - 1 is seed 0 (seed + i modulo 2**64); 2**64 itself is refused over HTTP with 400
    naming the range (gRPC's uint64 cannot carry it)."""
    from specdec.engine.engine import SpeculativeEngine
    from specdec.request import GenerationRequest, SamplingParams, SpeculationParams
    from tests.conftest import load_tiny

    top = 2**64 - 1
    engine = SpeculativeEngine(stack["target"], load_tiny(stack["cfg"].draft_model))

    def in_process(seed):
        return engine.generate(GenerationRequest(
            prompt_token_ids=[5, 17, 42, 9], max_tokens=10, ignore_eos=True,
            sampling=SamplingParams(temperature=1.0, seed=seed),
            speculation=SpeculationParams(proposer="draft", k=4))).token_ids

    def served(seed):
        resp, ctx = _grpc(stack["router"], pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=[5, 17, 42, 9]), max_tokens=10, ignore_eos=True,
            sampling=pb.SamplingParams(temperature=1.0, seed=seed),
            speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4)))
        assert ctx.code is None, ctx.details
        return list(resp.token_ids)

    expected = {s: in_process(s) for s in (0, 2**63 - 1, 2**63, top)}
    assert expected[top] != expected[2**63 - 1] and expected[2**63] != expected[0]
    for s in (2**63, top, top):
        assert served(s) == expected[s]
    body = {"model": MODEL, "prompt": [5, 17, 42, 9], "max_tokens": 10, "ignore_eos": True, "temperature": 1.0,
            "seed": top, "n": 2, "speculation": {"proposer": "draft", "max_k": 4}}
    resp = _run(_raw(stack["app"], "POST", "/v1/completions", json.dumps(body)))
    assert resp.status_code == 200, resp.text
    assert [c["token_ids"] for c in resp.json()["choices"]] == [expected[top], expected[0]]
    resp = _run(_raw(stack["app"], "POST", "/v1/completions", json.dumps({**body, "seed": 2**64, "n": 1})))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "seed", resp.text
    assert "less than 18446744073709551616" in resp.json()["error"]["message"], resp.text


@pytest.mark.parametrize("body, message", [
    ({**{k: v for k, v in CHAT.items() if k != "max_tokens"}, "max_completion_tokens": 0},
     "invalid request: max_completion_tokens: Input should be greater than or equal to 1"),
    ({**{k: v for k, v in CHAT.items() if k != "max_tokens"}, "max_completion_tokens": 10**7},
     "invalid request: max_completion_tokens: Input should be less than or equal to 1000000"),
    ({**CHAT, "max_tokens": 0}, "invalid request: max_tokens: Input should be greater than or equal to 1"),
    ({**CHAT, "model": 5}, "model must be one of 'specdec', got 5"),
    ({k: v for k, v in CHAT.items() if k != "model"}, "model is required: one of 'specdec'"),
])
def test_chat_errors_name_the_field_as_the_body_spells_it(stack, body, message):
    """max_completion_tokens 0 was refused as "max_tokens: ..." (param max_tokens), a field the
    body did not have; a model that is not a string was "model is required"."""
    resp = _run(_raw(stack["app"], "POST", "/v1/chat/completions", json.dumps(body)))
    assert resp.status_code == 400 and resp.json()["error"]["message"] == message, resp.text


# --- prompt + max_tokens over the context -----------------------------------------------------------

#: The tiny target's context (positions) and a prompt of ids that leaves 56 of them.
CONTEXT, LONG = 256, [5] * 200


def _over_context(prompt_name: str, prompt_tokens: int, max_tokens: int) -> str:
    return (f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {prompt_name}, {max_tokens} in the "
            f"completion). Please reduce the length of the {prompt_name} or completion.")


def test_max_tokens_over_the_context_is_400_over_http(stack):
    """A prompt that fits with a max_tokens that does not fit beside it was admitted and silently
    cut at the context (finish_detail context_length); it is 400 context_length_exceeded with
    OpenAI's message and numbers, ``param`` the field to lower, unary and streamed, completions and
    chat. Exactly at the limit the answer is the target's in full."""
    def client():
        return _client(stack["app"])

    e = _status_of(client().completions.create(model=MODEL, prompt=LONG, max_tokens=57, temperature=0))
    assert isinstance(e, openai.BadRequestError) and e.status_code == 400
    assert e.body == {"message": _over_context("prompt", 200, 57), "type": "invalid_request_error",
                      "param": "max_tokens", "code": "context_length_exceeded"}
    e = _status_of(client().completions.create(model=MODEL, prompt=LONG, max_tokens=57, stream=True))
    assert e.status_code == 400 and e.body["message"] == _over_context("prompt", 200, 57)

    target = stack["target"]
    msgs = [{"role": "user", "content": PROMPT}]
    n = len(target.tokenizer.encode(target.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                                         tokenize=False), add_special_tokens=False))
    for field in ("max_tokens", "max_completion_tokens"):
        e = _status_of(client().chat.completions.create(model=MODEL, messages=msgs, **{field: CONTEXT - n + 1}))
        assert e.status_code == 400 and e.body == {
            "message": _over_context("messages", n, CONTEXT - n + 1), "type": "invalid_request_error",
            "param": field, "code": "context_length_exceeded"}

    async def at_limit():
        return await client().completions.create(model=MODEL, prompt=LONG, max_tokens=56, temperature=0,
                                               extra_body={"ignore_eos": True})

    resp = _run(at_limit())
    assert resp.choices[0].finish_reason == "length" and resp.choices[0].model_extra["finish_detail"] == "max_tokens"
    assert resp.usage.prompt_tokens == 200 and resp.usage.completion_tokens == 56
    assert resp.choices[0].model_extra["token_ids"] == target_greedy(target, LONG, 56)


def test_no_max_tokens_still_generates_up_to_the_context(stack):
    """OpenAI's API without max_tokens is not an error: the default (completions 16, chat 128)
    is cut at the context, as before (finish_detail context_length)."""
    target = stack["target"]
    prompt = [5] * 250
    resp = _run(_raw(stack["app"], "POST", "/v1/completions",
                     json.dumps({"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True})))
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert (choice["finish_reason"], choice["finish_detail"]) == ("length", "context_length")
    assert choice["token_ids"] == target_greedy(target, prompt, 6)
    got, ctx = _grpc(stack["router"], pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), ignore_eos=True))
    assert ctx.code is None, ctx.details
    assert got.finish_reason == pb.FINISH_REASON_CONTEXT_LENGTH and list(got.token_ids) == choice["token_ids"]


def test_max_tokens_over_the_context_is_invalid_argument_over_grpc(stack):
    """The same refusal over gRPC, unary and streamed: INVALID_ARGUMENT with the same message;
    at the limit (prompt + max_tokens == context) it is answered."""
    router = stack["router"]
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=LONG), max_tokens=57, ignore_eos=True)
    got, ctx = _grpc(router, req)
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details == _over_context("prompt", 200, 57)
    assert got == pb.GenerateResponse()
    ctx = RecordingContext((("authorization", f"Bearer {KEY}"),))

    async def drain():
        return [c async for c in router.GenerateStream(req, ctx)]

    with pytest.raises(StreamAborted):
        _run(drain())
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details == _over_context("prompt", 200, 57)
    got, ctx = _grpc(router, pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=LONG), max_tokens=56, ignore_eos=True,
                                                speculation=pb.SpeculationHints(proposer=pb.PROPOSER_NGRAM)))
    assert ctx.code is None, ctx.details
    assert got.finish_reason == pb.FINISH_REASON_MAX_TOKENS and len(got.token_ids) == 56
