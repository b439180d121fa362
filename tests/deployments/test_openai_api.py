"""The OpenAI-compatible HTTP API without Ray: the real Router, its FastAPI app and the real
``openai`` client over an in-process ASGI transport; the Draft replica runs in process too (its
target over serialized protos). The same requests through the real ports are in
``test_serve_http.py``."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx2
import openai
import pytest

from deployments import openai_api
from deployments.config import AppConfig
from deployments.controller_client import ControllerClient
from deployments.draft import Draft
from deployments.metrics import SpecDecMetrics
from deployments.router import Router
from deployments.tenancy import TenancyGate
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.testing.tiny import build_tiny_model
from tests.conftest import load_tiny, target_greedy
from tests.deployments.grpc_context import RecordingContext
from tests.deployments.test_draft import Wire

KEY = "sk-http-alpha-0001"
SMALL_KEY = "sk-http-small-0002"
MODEL = "specdec"


def _tenants(path) -> str:
    import yaml

    from specdec.control.tenants import hash_api_key

    any_proposer = {"allowed_proposers": ["draft", "ngram", "none"], "k_min": 0, "k_max": 8}
    tenants = [
        {"id": "alpha", "api_key_hashes": [hash_api_key(KEY)],
         "limits": {"max_concurrent_requests": 16, "max_tokens": 1024, "max_prompt_tokens": 4096},
         "speculation": {**any_proposer, "adaptive": False, "fixed_k": 4}},
        {"id": "small", "api_key_hashes": [hash_api_key(SMALL_KEY)],
         "limits": {"max_concurrent_requests": 4, "tokens_per_minute": 20, "max_tokens": 8, "max_prompt_tokens": 64},
         "speculation": {"allowed_proposers": ["ngram"], "k_min": 0, "k_max": 2, "adaptive": False}},
    ]
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return str(path)


class LocalStream:
    """What ``handle.options(stream=True).Generate.remote(...)`` returns, over an in-process Draft."""

    def __init__(self, agen):
        self.agen = agen

    def __aiter__(self):
        return self.agen.__aiter__()

    def cancel(self):
        asyncio.ensure_future(self.agen.aclose())


class LocalDraftHandle:
    """A Serve handle of the Draft deployment, in process."""

    def __init__(self, draft: Draft, ready: bool = True, settled: bool = True):
        self.draft = draft
        self.ready = ready
        self.settled = settled  # the start-up calibration has ended (Draft.Settled)

    def options(self, **_):
        return self

    class _Method:
        def __init__(self, fn):
            self.remote = fn

    @property
    def Generate(self):
        return self._Method(lambda payload: LocalStream(self.draft.Generate(payload)))

    @property
    def Ready(self):
        async def ready():
            if not self.ready:
                await asyncio.sleep(3600)
            return True

        return self._Method(ready)

    @property
    def Settled(self):
        async def settled():
            if not (self.ready and self.settled):
                await asyncio.sleep(3600)
            return True

        return self._Method(settled)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    t = build_tiny_model(root / "target", seed=0)
    target = load_tiny(t)
    d = build_tiny_model(root / "draft", seed=1, base=target.model, noise=0.03)
    cfg = AppConfig(target_model=str(t), draft_model=str(d), cpu_threads=1, ready_timeout_s=0.3,
                    tenants_file=_tenants(root / "tenants.yaml"))
    wire = Wire(target)
    draft = Draft(cfg, send_factory=lambda key: wire.send)

    def make_router(ready: bool = True, settled: bool = True) -> Router:
        gate = TenancyGate(cfg.tenants_file, ControllerClient.local({}), SpecDecMetrics(backend=None))
        return Router(cfg, draft=LocalDraftHandle(draft, ready, settled), gate=gate)

    router = make_router()
    return dict(cfg=cfg, target=target, draft=draft, wire=wire, router=router, app=openai_api.build_app(router),
                make_router=make_router)


def _run(coro):
    """``coro`` in an event loop of its own, the draft streams drained after their final chunk
    included (:func:`deployments.ingress.relay.drained`: the draft replica's cleanup is done)."""
    from deployments.ingress.relay import drained

    async def main():
        try:
            return await coro
        finally:
            await drained()

    return asyncio.run(main())


def _client(app, key: str | None = KEY) -> openai.AsyncOpenAI:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(api_key=key or "unused", base_url="http://test/v1", http_client=http, max_retries=0,
                              default_headers={} if key else {"Authorization": ""})


async def _raw(app, method: str, path: str, body=None, headers=None) -> httpx2.Response:
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test") as c:
        h = {"Authorization": f"Bearer {KEY}", **(headers or {})}
        if body is None:
            return await c.request(method, path, headers=h)
        return await c.request(method, path, headers=h, content=body if isinstance(body, (bytes, str)) else json.dumps(body))


def _grpc(router: Router, req: pb.GenerateRequest, key: str = KEY) -> tuple[pb.GenerateResponse, RecordingContext]:
    ctx = RecordingContext((("authorization", f"Bearer {key}"),))
    return _run(router.Generate(req, ctx)), ctx


PROMPT = "def add(a, b):"


# --- same tokens as the gRPC path ----------------------------------------------------------------


def test_completion_unary_and_stream_equal_grpc_and_target_alone(stack):
    router, target = stack["router"], stack["target"]
    ref = target_greedy(target, target.tokenizer.encode(PROMPT), 12)
    grpc_resp, ctx = _grpc(router, pb.GenerateRequest(prompt=PROMPT, max_tokens=12, ignore_eos=True,
                                                       speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT)))
    assert ctx.code is None
    assert list(grpc_resp.token_ids) == ref[: len(grpc_resp.token_ids)] and len(grpc_resp.token_ids) == 12

    async def go():
        client = _client(stack["app"])
        args = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                    extra_body={"ignore_eos": True, "speculation": {"proposer": "draft"}})
        unary = await client.completions.create(**args)
        chunks = [c async for c in await client.completions.create(stream=True, **args)]
        return unary, chunks

    unary, chunks = _run(go())
    choice = unary.choices[0]
    assert choice.text == grpc_resp.text and choice.model_extra["token_ids"] == list(grpc_resp.token_ids)
    assert choice.finish_reason == "length" and choice.model_extra["finish_detail"] == "max_tokens"
    assert unary.usage.completion_tokens == 12 and unary.usage.prompt_tokens == grpc_resp.usage.prompt_tokens
    assert unary.usage.total_tokens == 12 + grpc_resp.usage.prompt_tokens
    stats = unary.model_extra["speculation_stats"]
    assert stats["steps"] > 0 and stats["proposed"] > 0 and 0 <= stats["acceptance_rate"] <= 1
    assert "".join(c.choices[0].text for c in chunks) == grpc_resp.text
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks), []) == list(grpc_resp.token_ids)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].model_extra["speculation_stats"]["steps"] == stats["steps"]


def test_cache_salt_reaches_the_draft_job_from_both_apis_and_changes_no_token(stack, monkeypatch):
    """vLLM's ``cache_salt`` in the OpenAI body and gRPC's ``GenerateRequest.cache_salt`` travel in
    the draft job's request (the draft replica scopes both models' prefix caches with it); the
    tokens are the unsalted request's."""
    from protos.specdec.v1 import exchange_pb2 as xpb

    draft, salts = stack["draft"], []
    inner = draft.Generate

    def recording(payload):
        job = xpb.DraftJob.FromString(payload)
        salts.append((job.tenant, job.request.cache_salt if job.request.HasField("cache_salt") else None))
        return inner(payload)

    monkeypatch.setattr(draft, "Generate", recording)
    router, ref = stack["router"], None

    async def http(salt):
        body = {"ignore_eos": True} | ({"cache_salt": salt} if salt is not None else {})
        r = await _client(stack["app"]).completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                                            extra_body=body)
        return r.choices[0].model_extra["token_ids"]

    ref = _run(http(None))
    assert _run(http("salt-http-1")) == ref
    resp, ctx = _grpc(router, pb.GenerateRequest(prompt=PROMPT, max_tokens=6, ignore_eos=True, cache_salt="salt-grpc"))
    assert ctx.code is None and list(resp.token_ids) == ref
    assert salts == [("alpha", None), ("alpha", "salt-http-1"), ("alpha", "salt-grpc")]


def test_chat_unary_and_stream_equal_grpc(stack):
    router = stack["router"]
    msgs = [{"role": "system", "content": "be short"}, {"role": "user", "content": "add two numbers"}]
    req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in msgs]), max_tokens=10,
                             ignore_eos=True, logprobs=True)
    grpc_resp, ctx = _grpc(router, req)
    assert ctx.code is None and len(grpc_resp.token_ids) == 10

    async def go():
        client = _client(stack["app"])
        args = dict(model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0, logprobs=True,
                    extra_body={"ignore_eos": True})
        unary = await client.chat.completions.create(**args)
        chunks = [c async for c in await client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **args)]
        return unary, chunks

    unary, chunks = _run(go())
    msg = unary.choices[0].message
    assert msg.role == "assistant" and msg.content == grpc_resp.text
    assert unary.choices[0].model_extra["token_ids"] == list(grpc_resp.token_ids)
    lp = unary.choices[0].logprobs.content
    assert [e.logprob for e in lp] == pytest.approx(list(grpc_resp.logprobs), abs=1e-5)
    assert [e.token for e in lp] == [stack["target"].tokenizer.decode([t]) for t in grpc_resp.token_ids]
    assert all(e.top_logprobs == [] for e in lp)
    # bytes: each token's own UTF-8 bytes (OpenAI's definition), together the content
    assert b"".join(bytes(e.bytes) for e in lp).decode("utf-8", errors="replace") == msg.content
    # streaming: role first, content deltas, then a usage chunk with no choices
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == grpc_resp.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    streamed_lp = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed_lp == pytest.approx(list(grpc_resp.logprobs), abs=1e-5)
    assert chunks[-1].model_extra["speculation_stats"]["steps"] > 0


def test_completion_logprobs_shape_and_token_id_prompt(stack):
    router, target = stack["router"], stack["target"]
    ids = target.tokenizer.encode(PROMPT)
    grpc_resp, _ = _grpc(router, pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), max_tokens=6,
                                                     ignore_eos=True, logprobs=True))

    async def go():
        return await _client(stack["app"]).completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                                              logprobs=0, extra_body={"ignore_eos": True})

    choice = _run(go()).choices[0]
    assert choice.model_extra["token_ids"] == list(grpc_resp.token_ids)
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx(list(grpc_resp.logprobs), abs=1e-5)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_logprobs_show_special_tokens_by_name_but_offsets_and_bytes_follow_the_text(stack):
    """Logprob token strings are the decode of each id alone, special tokens by name, as vLLM's
    (``'<|endoftext|>'``, ``'<|im_end|>'``: a client sees the end of the answer among the
    alternatives), while ``text`` skips special tokens. ``text_offset`` indexes ``text`` (it
    counted ``'<|endoftext|>'``'s 13 characters and one per piece of a split character, so
    offsets ran past the text) and chat's ``bytes`` are each token's own bytes (a byte of a split
    character was ``[239, 191, 189]``, the bytes of U+FFFD). Tiny target, greedy: "hello" gives
    ``<|endoftext|>`` (id 0) as its 4th token and lone bytes of split characters."""
    tok = stack["target"].tokenizer

    async def go():
        client = _client(stack["app"])
        args = dict(model=MODEL, prompt="hello", max_tokens=12, temperature=0, logprobs=2)
        unary = await client.completions.create(**args)
        chunks = [c async for c in await client.completions.create(stream=True, **args)]
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=40, temperature=0, logprobs=True, top_logprobs=1)
        return unary, chunks, chat

    unary, chunks, chat = _run(go())
    c = unary.choices[0]
    ids = c.model_extra["token_ids"]
    assert ids == [208, 138, 216, 0, 235, 22, 24, 274, 298, 68, 80, 103]
    assert c.logprobs.tokens[3] == "<|endoftext|>" and "<|endoftext|>" not in c.text
    # offset i = the length of the text of tokens 0..i-1 (special tokens skipped, as in text)
    expected = [len(tok.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]
    assert c.logprobs.text_offset == expected == [0, 1, 2, 3, 3, 4, 5, 6, 8, 18, 19, 20]
    assert all(c.text[o:].startswith(t) for o, t in zip(expected, c.logprobs.tokens) if t.isalnum())
    streamed = [o for ch in chunks for o in ch.choices[0].logprobs.text_offset]
    assert streamed == expected and "".join(ch.choices[0].text for ch in chunks) == c.text
    # chat: every token with its own bytes; the last is EOS, shown by name, not in the content
    content = chat.choices[0].message.content
    lp = chat.choices[0].logprobs.content
    assert chat.choices[0].finish_reason == "stop" and lp[-1].token == "<|im_end|>"
    assert lp[-1].bytes == list(b"<|im_end|>") and "<|im_end|>" not in content
    assert lp[1].token == "\ufffd" and lp[1].bytes == [130]  # a lone byte of a split character
    assert b"".join(bytes(e.bytes) for e in lp[:-1]).decode("utf-8", errors="replace") == content
    assert all(e.top_logprobs[0].bytes == e.bytes for e in lp)  # greedy: the top alternative is the token


def test_token_bytes_and_offsets_of_characters_split_over_tokens():
    """Byte-level BPE spells a character outside its vocabulary with one token per byte: the
    bytes of the tokens join to the character, and offsets count it once (tiny tokenizer: 320
    ids, so '中' and '😀' are 3 and 4 tokens). Special tokens take no characters, also one
    outside the tokenizer's ``all_special_ids`` (``<|im_start|>``, as Qwen's 18 others)."""
    from deployments.openai_responses import TextOffsets, TokenText
    from specdec.testing.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    text = TokenText(tok)
    ids = tok.encode("a中<|im_end|>😀<|im_start|> b", add_special_tokens=False)
    assert ids[4] == tok.eos_token_id and ids[9] == 1 and 1 not in tok.all_special_ids  # special all the same
    assert [len(text.bytes_of(i)) for i in ids] == [1, 1, 1, 1, 10, 1, 1, 1, 1, 12, 2]
    assert b"".join(text.bytes_of(i) for i in ids) == "a中<|im_end|>😀<|im_start|> b".encode()
    offsets = TextOffsets(text)
    got = offsets.starts(ids[:5]) + offsets.starts(ids[5:])  # fed in two chunks, as a stream
    assert got == [len(tok.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]
    assert got == [0, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3]


def test_completion_top_logprobs_is_a_list_in_every_chunk(stack):
    """With ``logprobs`` N > 0, a chunk without tokens (the last one of a stream cut by a stop
    string) and an answer cut to no tokens had ``top_logprobs: null`` instead of a list."""
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, logprobs=3, extra_body={"ignore_eos": True})

    async def go():
        client = _client(stack["app"])
        full = await client.completions.create(**args)
        stop = full.choices[0].text[12:14]
        chunks = [c async for c in await client.completions.create(stream=True, stop=[stop], **args)]
        empty = await client.completions.create(stop=[full.choices[0].text[:1]], **args)
        return chunks, empty

    chunks, empty = _run(go())
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].logprobs.tokens == []
    assert all(isinstance(c.choices[0].logprobs.top_logprobs, list) for c in chunks)
    assert [len(c.choices[0].logprobs.top_logprobs) for c in chunks] == [len(c.choices[0].logprobs.tokens) for c in chunks]
    assert empty.choices[0].text == "" and empty.choices[0].logprobs.top_logprobs == []


def test_n_choices_are_independent_generations(stack):
    """n = 3 sampled with a seed: choice i is the gRPC answer of seed + i."""
    router = stack["router"]
    grpc_ids = []
    for i in range(3):
        resp, _ = _grpc(router, pb.GenerateRequest(prompt=PROMPT, max_tokens=8, ignore_eos=True,
                                                   sampling=pb.SamplingParams(temperature=1.0, seed=40 + i)))
        grpc_ids.append(list(resp.token_ids))
    assert len({tuple(x) for x in grpc_ids}) > 1  # the seeds give different samples

    async def go():
        client = _client(stack["app"])
        args = dict(model=MODEL, prompt=PROMPT, max_tokens=8, n=3, seed=40, extra_body={"ignore_eos": True})
        unary = await client.completions.create(**args)
        chunks = [c async for c in await client.completions.create(stream=True, stream_options={"include_usage": True},
                                                                   **args)]
        return unary, chunks

    unary, chunks = _run(go())
    assert [c.index for c in unary.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in unary.choices] == grpc_ids
    assert unary.usage.completion_tokens == 24
    pooled = unary.model_extra["speculation_stats"]
    assert pooled["steps"] == sum(c.model_extra["speculation_stats"]["steps"] for c in unary.choices)
    streamed = {i: [] for i in range(3)}
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.model_extra["token_ids"]
    assert [streamed[i] for i in range(3)] == grpc_ids
    assert chunks[-1].usage.completion_tokens == 24


def test_n_above_the_free_admission_slots_completes_instead_of_deadlocking(stack):
    """n = 16 choices with 8 admission slots (the router's default): the first 8 were admitted
    and each held its slot while waiting for the other choices' first chunks, which waited for a
    slot: the request hung until the client gave up. Every choice now runs to its end on its
    own, so the later ones get the freed slots; unary and streamed give the target-alone ids."""
    assert stack["cfg"].router_admission_slots() == 8
    target = stack["target"]
    ref = target_greedy(target, target.tokenizer.encode(PROMPT), 5)
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, n=16, extra_body={"ignore_eos": True})

    async def go():
        client = _client(stack["app"])
        unary = await asyncio.wait_for(client.completions.create(**args), 60)
        chunks = await asyncio.wait_for(_collect(await client.completions.create(stream=True, **args)), 60)
        return unary, chunks

    async def _collect(stream):
        return [c async for c in stream]

    unary, chunks = _run(go())
    assert [c.model_extra["token_ids"] for c in unary.choices] == [ref] * 16
    streamed = {i: [] for i in range(16)}
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.model_extra["token_ids"]
    assert list(streamed.values()) == [ref] * 16
    assert stack["router"].gate.admission.running == 0 and stack["draft"].Sessions() == []


def test_tenant_stats_of_an_unknown_proposer_value_is_invalid_argument(stack):
    """GetTenantStats with a Proposer enum value the server does not know (a newer client's)
    answered with the default proposer's statistics as if it were unset."""
    router = stack["router"]
    ctx = RecordingContext((("authorization", f"Bearer {KEY}"),))
    _run(router.GetTenantStats(pb.GetTenantStatsRequest(proposer=9), ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT
    assert ctx.details == ("invalid request: proposer: Input should be PROPOSER_DRAFT, PROPOSER_NGRAM, PROPOSER_NONE "
                           "or unset, got 9")
    ctx = RecordingContext((("authorization", f"Bearer {KEY}"),))
    got = _run(router.GetTenantStats(pb.GetTenantStatsRequest(proposer=pb.PROPOSER_NGRAM), ctx))
    assert ctx.code is None and got.tenant_id == "alpha" and got.proposer == pb.PROPOSER_NGRAM


# --- one validation for both APIs ----------------------------------------------------------------


@pytest.mark.parametrize(
    "grpc_req, body",
    [
        (pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(temperature=1.0, top_p=1.5)),
         {"prompt": PROMPT, "top_p": 1.5}),
        (pb.GenerateRequest(prompt=PROMPT, max_tokens=0), {"prompt": PROMPT, "max_tokens": 0}),
        (pb.GenerateRequest(prompt=""), {"prompt": ""}),
        (pb.GenerateRequest(prompt=PROMPT, speculation=pb.SpeculationHints(max_k=99)),
         {"prompt": PROMPT, "speculation": {"max_k": 99}}),
        (pb.GenerateRequest(prompt=PROMPT, stop_token_ids=[99999]), {"prompt": PROMPT, "stop_token_ids": [99999]}),
        (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5] * 300)), {"prompt": [5] * 300}),
        (pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(temperature=float("nan"))),
         {"prompt": PROMPT, "temperature": "NaN"}),
        (pb.GenerateRequest(prompt=PROMPT, cache_salt=""), {"prompt": PROMPT, "cache_salt": ""}),
    ],
    ids=["top_p", "max_tokens", "empty", "k", "stop-id", "too-long", "nan", "empty-salt"],
)
def test_grpc_and_http_share_one_validation(stack, grpc_req, body):
    _, ctx = _grpc(stack["router"], grpc_req)
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT
    if body.get("temperature") == "NaN":
        raw = json.dumps({"model": MODEL, **{**body, "temperature": 0}}).replace('"temperature": 0', '"temperature": NaN')
    else:
        raw = json.dumps({"model": MODEL, "temperature": 0, **body})
    resp = _run(_raw(stack["app"], "POST", "/v1/completions", raw))
    assert resp.status_code == 400
    err = resp.json()["error"]
    # the same message, naming the field as the body spells it (top_p, not gRPC's sampling.top_p)
    assert err["message"] == ctx.details.replace("sampling.", "") and err["type"] == "invalid_request_error"


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "functions": []},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 0},
    "not json",
], ids=["unknown-model", "unknown-field", "bad-n", "not-json"])
@pytest.mark.parametrize("auth, message", [("Bearer sk-not-a-key", "unknown API key"), (None, None)],
                         ids=["unknown-key", "no-key"])
def test_an_unauthenticated_caller_gets_401_whatever_its_body(stack, body, auth, message):
    """The key is checked before the body, as on the gRPC path (and OpenAI's API): a bad body
    with an unknown key was answered 404 (unknown model) or 400, telling an unauthenticated
    caller about the server."""
    raw = body if isinstance(body, str) else json.dumps(body)
    resp = _run(_raw(stack["app"], "POST", "/v1/chat/completions", raw, headers={"Authorization": auth or ""}))
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    if message:
        assert resp.json()["error"]["message"] == message



def _status_of(coro):
    try:
        _run(coro)
    except openai.APIStatusError as e:
        return e
    raise AssertionError("no error")


def test_errors_through_the_openai_client(stack):
    app = stack["app"]
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    e = _status_of(_client(app, key=None).chat.completions.create(**chat))
    assert isinstance(e, openai.AuthenticationError) and e.status_code == 401
    assert e.body["message"] == "missing API key: send 'authorization: Bearer <key>' (gRPC metadata or HTTP header)"
    e = _status_of(_client(app, key="sk-wrong").chat.completions.create(**chat))
    assert e.status_code == 401 and e.body["message"] == "unknown API key"
    e = _status_of(_client(app).chat.completions.create(**{**chat, "model": "gpt-4"}))
    assert isinstance(e, openai.NotFoundError) and e.body["type"] == "not_found_error"
    assert e.body["code"] == "model_not_found"  # OpenAI's code of this 404
    assert e.body["message"] == "the model 'gpt-4' does not exist; this server serves 'specdec'"
    e = _status_of(_client(app).chat.completions.create(**{**chat, "messages": [{"role": "robot", "content": "x"}]}))
    assert isinstance(e, openai.BadRequestError) and "messages.0.role" in e.body["message"]
    e = _status_of(_client(app).chat.completions.create(**chat, extra_body={"frobnicate": 1}))
    assert e.status_code == 400 and e.body["message"] == "unsupported field(s): frobnicate"
    e = _status_of(_client(app).completions.create(model=MODEL, prompt=["a", "b"]))
    assert e.body["message"] == "prompt: a batch of several prompts is not supported; send one prompt per request"
    e = _status_of(_client(app).chat.completions.create(**chat, n=0))
    assert e.body["message"] == "n must be a whole number in 1..16, got 0"
    # a message field the server cannot honour was ignored (name: several users in one chat)
    e = _status_of(_client(app).chat.completions.create(**{**chat, "messages": [
        {"role": "user", "content": "hi", "name": "bob", "tool_call_id": None}]}))
    assert e.status_code == 400 and e.body["message"] == "messages.0: unsupported field(s): name"
    # a message without content was answered as if its content were empty
    for msg in ({"role": "user"}, {"role": "user", "content": None}):
        e = _status_of(_client(app).chat.completions.create(**{**chat, "messages": [msg]}))
        assert e.status_code == 400
        assert e.body["message"] == "messages.0.content is required (a string or a list of text parts)"


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", True, "max_tokens must be a whole number, got True"),
    ("max_tokens", "5", "max_tokens must be a whole number, got '5'"),
    ("seed", 1.0, "seed must be a whole number, got 1.0"),
    ("top_k", "3", "top_k must be a whole number, got '3'"),
    ("min_tokens", False, "min_tokens must be a whole number, got False"),
    ("temperature", "0.5", "temperature must be a number, got '0.5'"),
    ("top_p", True, "top_p must be a number, got True"),
    ("ignore_eos", "no", "ignore_eos must be true or false, got 'no'"),
    ("ignore_eos", 1, "ignore_eos must be true or false, got 1"),
    ("stop_token_ids", ["7"], "stop_token_ids must be a list of token ids, got ['7']"),
    ("stop", 5, "stop must be a string or a list of strings, got 5"),
    ("logit_bias", {"5": "1.5"}, "logit_bias must be an object of token id -> number, got {'5': '1.5'}"),
    ("speculation", {"max_k": "4"}, "speculation.max_k must be a whole number, got '4'"),
    ("speculation", {"draft_min_confidence": True}, "speculation.draft_min_confidence must be a number, got True"),
    ("user", 5, "user must be a string, got 5"),
    ("cache_salt", 5, "cache_salt must be a string, got 5"),
])
def test_wrong_json_types_are_400_naming_the_field(stack, field, value, message):
    """pydantic's loose conversion took ``"max_tokens": true`` as 1 token, ``"5"`` as 5 and
    ``"ignore_eos": "no"`` as false; a JSON value of the wrong type is refused, as gRPC's proto
    types never allow it."""
    resp = _run(_raw(stack["app"], "POST", "/v1/completions",
                     {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, field: value}))
    assert resp.status_code == 400 and resp.json()["error"]["message"] == message


def test_a_tenants_policy_refusal_names_the_body_field_as_param(stack):
    """A proposer the tenant does not allow was 400 with ``param: null`` (its message began
    "proposer 'draft' is not allowed"), a chat prompt over the tenant's ``max_prompt_tokens``
    had ``param: "prompt"`` and a chat ``max_completion_tokens`` over the limit ``param:
    "max_tokens"``, fields those bodies do not have. gRPC gives the same message."""
    long_text = "ab " * 40  # 81 prompt tokens as a completion, 98 templated as chat: over small's 64
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "speculation": {"proposer": "draft"}},
         "speculation.proposer: 'draft' is not allowed for tenant 'small'; allowed: ['ngram', 'none']",
         "speculation.proposer"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                  "speculation": {"proposer": "draft", "max_k": 2}},
         "speculation.proposer: 'draft' is not allowed for tenant 'small'; allowed: ['ngram', 'none']",
         "speculation.proposer"),
        ("/v1/completions", {"model": MODEL, "prompt": long_text, "max_tokens": 4},
         "prompt is 81 tokens but tenant 'small' allows at most 64 (limits.max_prompt_tokens)", "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": long_text}], "max_tokens": 4},
         "prompt is 98 tokens but tenant 'small' allows at most 64 (limits.max_prompt_tokens)", "messages"),
        # OpenAI's current name for it (param and message said "max_tokens", a field this body did not send)
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "max_completion_tokens": 9},
         "max_completion_tokens=9 exceeds the limit of tenant 'small', 8 (limits.max_tokens)", "max_completion_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 9},
         "max_tokens=9 exceeds the limit of tenant 'small', 8 (limits.max_tokens)", "max_tokens"),
    ]
    for path, body, message, param in cases:
        resp = _run(_raw(stack["app"], "POST", path, body, headers={"Authorization": f"Bearer {SMALL_KEY}"}))
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param,
                                        "code": None}
    _, ctx = _grpc(stack["router"], pb.GenerateRequest(
        prompt="x", max_tokens=4, speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT)), key=SMALL_KEY)
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details == cases[0][2]
    # refused before admission: nothing of small's tokens per minute is spent (test_rate_limit_... counts them)
    ok = _run(_raw(stack["app"], "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4,
                                                            "ignore_eos": True, "speculation": {"proposer": "draft"}}))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_a_default_max_tokens_is_at_most_the_tenants_limit(stack):
    """A request that sets no max_tokens gets the server's default (chat and gRPC 128,
    completions 16) clipped to its tenant's ``limits.max_tokens``: tenant small (8) had every
    request without max_tokens refused with "max_tokens=128 (or 16) exceeds the limit", a number
    the caller never sent. A max_tokens the caller sets over the limit is still 400."""
    spec = {"ignore_eos": True, "speculation": {"proposer": "ngram"}}

    async def go(app):
        small = await _client(app, key=SMALL_KEY).completions.create(model=MODEL, prompt="x", temperature=0,
                                                                     extra_body=spec)
        plain = await _client(app).completions.create(model=MODEL, prompt="x", temperature=0, extra_body=spec)
        return small, plain

    app = openai_api.build_app(stack["make_router"]())
    small, plain = _run(go(app))
    over = _status_of(_client(app, key=SMALL_KEY).completions.create(model=MODEL, prompt="x", max_tokens=9,
                                                                      extra_body=spec))
    assert small.usage.completion_tokens == 8 and small.choices[0].finish_reason == "length"
    assert over.status_code == 400
    assert over.body["message"] == "max_tokens=9 exceeds the limit of tenant 'small', 8 (limits.max_tokens)"
    assert plain.usage.completion_tokens == 16  # OpenAI's completions default, under alpha's 1024
    got, ctx = _grpc(stack["make_router"](), pb.GenerateRequest(
        prompt="x", ignore_eos=True, speculation=pb.SpeculationHints(proposer=pb.PROPOSER_NGRAM)), key=SMALL_KEY)
    assert ctx.code is None and len(got.token_ids) == 8 and got.finish_reason == pb.FINISH_REASON_MAX_TOKENS
    got, ctx = _grpc(stack["router"], pb.GenerateRequest(prompt="x", ignore_eos=True, max_tokens=0))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT  # an explicit 0 is the caller's, still refused


def test_rate_limit_is_429_with_retry_after(stack):
    """Tenant small: 20 tokens per minute; each request reserves prompt + max_tokens = 1 + 8."""
    router = stack["make_router"]()
    app = openai_api.build_app(router)

    async def go():
        client = _client(app, key=SMALL_KEY)
        done = 0
        try:
            for _ in range(5):
                await client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0,
                                                extra_body={"ignore_eos": True, "speculation": {"proposer": "ngram"}})
                done += 1
        except openai.RateLimitError as e:
            return done, e

    done, e = _run(go())
    assert done == 2  # 2 x 9 = 18 <= 20 < 27
    assert e.status_code == 429 and e.body["code"] == "tokens_per_minute"
    assert "tenant 'small' is over its limit of 20 tokens per minute" in e.body["message"]
    assert 1 <= int(e.response.headers["retry-after"]) <= 27


def test_n_over_the_tenants_concurrency_is_a_bad_request_naming_n(stack):
    """Tenant small runs at most 4 requests at once; n = 5 was refused as "already has 4
    requests in flight ... retry when one finishes" (Retry-After), though nothing ran and no
    retry could succeed; then as 429 without Retry-After, which OpenAI's client still retried
    (429 is retryable): it is an invalid request, 400 with param n, never retried."""
    router = stack["make_router"]()
    app = openai_api.build_app(router)

    async def go(n, stream=False):
        return await _client(app, key=SMALL_KEY).completions.create(
            model=MODEL, prompt="x", max_tokens=1, temperature=0, n=n, stream=stream,
            extra_body={"speculation": {"proposer": "ngram"}})

    for stream in (False, True):
        e = _status_of(go(5, stream))
        assert isinstance(e, openai.BadRequestError) and e.status_code == 400
        assert e.body == {"message": "n=5 choices run as 5 concurrent requests but tenant 'small' may run at most 4 at "
                                     "once (limits.max_concurrent_requests); lower n to at most 4",
                          "type": "invalid_request_error", "param": "n", "code": None}
        assert "retry-after" not in e.response.headers
    assert router.gate.metrics.value("specdec_requests", tenant="small", status="INVALID_ARGUMENT") == 2
    assert router.gate.metrics.value("specdec_requests", tenant="small", status="RESOURCE_EXHAUSTED") == 0
    assert len(_run(go(4)).choices) == 4


def test_the_openai_client_does_not_retry_n_over_the_tenants_concurrency(stack, tmp_path):
    """n = 3 for a tenant of 2 requests at once, through a client with its default retries: one
    HTTP request, answered 400 (429 was retried twice, each time refused again)."""
    router = _billed_router(stack, tmp_path)
    app = openai_api.build_app(router)
    seen = []

    async def go():
        async def count(request):
            seen.append(request.url.path)

        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test",
                                  event_hooks={"request": [count]})
        client = openai.AsyncOpenAI(api_key=BILL_KEY, base_url="http://test/v1", http_client=http)
        return await client.completions.create(model=MODEL, prompt="x", max_tokens=1, n=3)

    e = _status_of(go())
    assert isinstance(e, openai.BadRequestError) and e.body["param"] == "n"
    assert e.body["message"] == ("n=3 choices run as 3 concurrent requests but tenant 'bill' may run at most 2 at "
                                 "once (limits.max_concurrent_requests); lower n to at most 2")
    assert seen == ["/v1/completions"]
    assert _books(router)["statuses"] == {"INVALID_ARGUMENT": 1}


def test_loading_is_503(stack):
    app = openai_api.build_app(stack["make_router"](ready=False))
    e = _status_of(_client(app).completions.create(model=MODEL, prompt="x", max_tokens=2))
    assert isinstance(e, openai.InternalServerError) and e.status_code == 503
    assert e.body["message"] == "the models are still loading; retry in a few seconds"
    assert e.response.headers["retry-after"] == "1"
    resp = _run(_raw(app, "GET", "/health"))
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable"


def test_health_is_503_while_the_draft_replica_calibrates_and_requests_are_served(stack):
    """GET /health (a Kubernetes readiness probe) waits for the start-up calibration
    (Draft.Settled): 503 while it runs, so no traffic is sent into it; a request that comes
    anyway is served (Draft.Ready: the models answer)."""
    app = openai_api.build_app(stack["make_router"](settled=False))
    resp = _run(_raw(app, "GET", "/health"))
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable"
    assert resp.json()["error"]["message"] == ("the draft replica is still calibrating its cost model; "
                                               "retry in a few seconds")
    out = _run(_client(app).completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0,
                                               extra_body={"ignore_eos": True}))
    assert out.usage.completion_tokens == 2


def test_router_settled_is_what_health_answers(stack):
    """Router.Settled (what the gRPC health servicer in Serve's proxy reports for
    specdec.v1.SpecDec, deployments.health) is False while GET /health answers 503 (loading or
    calibrating) and True when it answers 200."""
    for kw, status in [({"ready": False}, 503), ({"settled": False}, 503), ({}, 200)]:
        router = stack["make_router"](**kw)
        assert _run(_raw(openai_api.build_app(router), "GET", "/health")).status_code == status
        assert _run(router.Settled()) is (status == 200)


def test_every_path_answers_something_useful(stack):
    app = stack["app"]
    root = _run(_raw(app, "GET", "/"))
    assert root.status_code == 200 and "POST /v1/chat/completions" in root.json()["endpoints"]
    models = _run(_raw(app, "GET", "/v1/models"))
    assert models.json() == {"object": "list", "data": [{"id": MODEL, "object": "model", "created": models.json()["data"][0]["created"],
                                                          "owned_by": "specdec", "root": stack["router"].info.name}]}
    assert _run(_raw(app, "GET", "/v1/models/nope")).status_code == 404
    for method, path, status in [("GET", "/nowhere", 404), ("GET", "/v1/completions", 405),
                                 ("POST", "/v1/embeddings", 404)]:
        resp = _run(_raw(app, method, path))
        assert resp.status_code == status
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    bad = _run(_raw(app, "POST", "/v1/completions", b"{not json"))
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "the request body is not valid JSON"
    assert _run(_raw(app, "GET", "/health")).json() == {"status": "ok"}


@pytest.mark.parametrize("body", ["[" * 100_000 + "]" * 100_000,
                                  '{"model": "specdec", "prompt": ' + "[" * 50_000 + "]" * 50_000 + "}"])
def test_json_nested_too_deeply_is_400_not_500(stack, body):
    """json's decoder recursed past Python's limit: a RecursionError answered as a 500."""
    resp = _run(_raw(stack["app"], "POST", "/v1/completions", body))
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "the request body is JSON nested too deeply"
    ok = _run(_raw(stack["app"], "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}))
    assert ok.status_code == 200


def test_the_prefix_without_a_slash_is_the_root(stack):
    """Serve mounts the app under /specdec (root_path): GET /specdec answers, not a redirect."""

    async def go():
        transport = httpx2.ASGITransport(app=stack["app"], root_path="/specdec")
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.get("/specdec"), await c.get("/specdec/v1/nope")

    root, nope = _run(go())
    assert root.status_code == 200 and root.json()["openai_base_url"] == "/specdec/v1"
    assert nope.status_code == 404 and nope.json()["error"]["message"] == (
        "no such endpoint: GET /specdec/v1/nope; see GET /specdec/ for the endpoints")


def test_openai_models_list_through_the_client(stack):
    async def go():
        return [m.id async for m in _client(stack["app"]).models.list()]

    assert _run(go()) == [MODEL]


def test_stream_errors_before_the_first_token_have_their_status(stack):
    resp = _run(_raw(stack["app"], "POST", "/v1/chat/completions",
                     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True, "top_p": 0}))
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["message"] == "invalid request: top_p: Input should be greater than 0"


# --- the sampling surface over HTTP ----------------------------------------------------------------


def test_sampling_surface_over_http_equals_grpc(stack):
    """min-p, the penalties, logit bias, min_tokens and top-N logprobs: the same tokens and
    alternatives as the gRPC API, in each endpoint's logprobs shape."""
    router = stack["router"]
    sampling = pb.SamplingParams(temperature=0.8, seed=3, min_p=0.05, repetition_penalty=1.5, presence_penalty=0.5,
                                 frequency_penalty=0.3, logit_bias={40: 3.0})
    msgs = [{"role": "user", "content": "add two numbers"}]
    req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in msgs]), max_tokens=10,
                             min_tokens=6, logprobs=True, top_logprobs=3, sampling=sampling)
    g, ctx = _grpc(router, req)
    assert ctx.code is None and len(g.top_logprobs) == len(g.token_ids)
    tok = stack["target"].tokenizer
    body = dict(temperature=0.8, seed=3, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"40": 3.0},
                logprobs=True, top_logprobs=3, max_tokens=10)
    extra = {"min_p": 0.05, "repetition_penalty": 1.5, "min_tokens": 6}

    async def go():
        client = _client(stack["app"])
        chat = await client.chat.completions.create(model=MODEL, messages=msgs, extra_body=extra, **body)
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        cmpl = await client.completions.create(
            model=MODEL, prompt=tok.encode(ids, add_special_tokens=False), logprobs=3, extra_body=extra,
            **{k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")})
        return chat, cmpl

    chat, cmpl = _run(go())
    assert chat.choices[0].model_extra["token_ids"] == list(g.token_ids)
    content = chat.choices[0].logprobs.content
    assert [[a.token for a in e.top_logprobs] for e in content] == [[tok.decode([i]) for i in t.ids] for t in g.top_logprobs]
    assert [[a.logprob for a in e.top_logprobs] for e in content] == [pytest.approx(list(t.logprobs), abs=1e-5)
                                                                      for t in g.top_logprobs]
    assert cmpl.choices[0].model_extra["token_ids"] == list(g.token_ids)
    tops = cmpl.choices[0].logprobs.top_logprobs
    # the top 3 and the sampled token (up to 4 entries, as OpenAI's legacy completions and vLLM)
    assert [set(d) for d in tops] == [{tok.decode([i]) for i in t.ids} | {tok.decode([s])}
                                      for t, s in zip(g.top_logprobs, g.token_ids)]
    for d, t, s, v_s in zip(tops, g.top_logprobs, g.token_ids, g.logprobs):
        first = {}  # ids decoding alike share a key: the most likely one's logprob
        for i, v in zip(t.ids, t.logprobs):
            first.setdefault(tok.decode([i]), v)
        first.setdefault(tok.decode([s]), v_s)
        assert d == pytest.approx(first, abs=1e-5)
    assert any(s not in t.ids for t, s in zip(g.top_logprobs, g.token_ids))  # temperature 0.8: one sampled outside


def test_bad_sampling_values_have_the_grpc_message_with_the_body_field(stack):
    """The HTTP message is the gRPC one with the field as the body spells it (it named
    ``sampling.presence_penalty``, a path only the gRPC request has)."""
    _, ctx = _grpc(stack["router"], pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(presence_penalty=3)))
    resp = _run(_raw(stack["app"], "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "presence_penalty": 3}))
    assert ctx.details == "invalid request: sampling.presence_penalty: Input should be less than or equal to 2"
    assert resp.status_code == 400 and resp.json()["error"]["message"] == (
        "invalid request: presence_penalty: Input should be less than or equal to 2")
    _, ctx = _grpc(stack["router"], pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(logit_bias={99999: 1})))
    resp = _run(_raw(stack["app"], "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "logit_bias": {"99999": 1}}))
    assert resp.status_code == 400 and resp.json()["error"]["message"] == ctx.details
    assert ctx.details == "logit_bias: id 99999 is outside the vocabulary 0..319"


@pytest.mark.parametrize("path,body,message,param", [
    ("completions", {"temperature": -1}, "invalid request: temperature: Input should be greater than or equal to 0",
     "temperature"),
    ("chat", {"top_p": 1.5}, "invalid request: top_p: Input should be less than or equal to 1", "top_p"),
    ("completions", {"logit_bias": {"abc": 1}},
     "invalid request: logit_bias key 'abc': Input should be a valid integer, unable to parse string as an integer",
     "logit_bias"),
    ("completions", {"logit_bias": {"5": 200}},
     "invalid request: logit_bias: the bias of token 5 must be in -100..100, got 200.0", "logit_bias"),
    ("completions", {"prompt": []}, "invalid request: prompt is empty", "prompt"),
    ("completions", {"prompt": [1, -2]}, "prompt: id -2 is outside the vocabulary 0..319", "prompt"),
    ("chat", {"max_completion_tokens": 0},
     "invalid request: max_completion_tokens: Input should be greater than or equal to 1", "max_completion_tokens"),
    ("completions", {"speculation": {"max_k": 99}},
     "invalid request: speculation.max_k: Input should be less than or equal to 16", "speculation.max_k"),
])
def test_http_messages_name_the_field_the_body_sent(stack, path, body, message, param):
    """Messages named the core request's path (``sampling.temperature``, ``prompt_token_ids``,
    ``sampling.logit_bias.abc.[key]``, ``sampling: logit_bias``) while the body field is
    ``temperature`` / ``prompt`` / ``logit_bias``; ``param`` was already right."""
    base = {"model": MODEL, "prompt": PROMPT} if path == "completions" else {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    url = "/v1/completions" if path == "completions" else "/v1/chat/completions"
    for stream in (False, True):
        limit = {} if "max_completion_tokens" in body else {"max_tokens": 2}
        resp = _run(_raw(stack["app"], "POST", url, {**base, **limit, **body, "stream": stream}))
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": None}


def _bad_request(app, kind: str, body: dict, stream: bool) -> openai.APIStatusError:
    """The error the ``openai`` client raises for ``body`` on endpoint ``kind`` (``"completions"``
    with ``PROMPT``, ``"chat"`` with one user message; ``max_tokens`` 2 unless ``body`` sets a
    limit)."""
    client = _client(app)
    limit = {} if {"max_tokens", "max_completion_tokens"} & set(body) else {"max_tokens": 2}
    if kind == "completions":
        return _status_of(client.completions.create(model=MODEL, prompt=PROMPT, stream=stream, **limit, **body))
    return _status_of(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], stream=stream, **limit, **body))


FIVE_STOPS = ["\n\n", "###", "END", "</s>", "Q:"]


@pytest.mark.parametrize("kind, body, message, param", [
    ("completions", {"temperature": 3}, "invalid request: temperature: Input should be less than or equal to 2",
     "temperature"),
    ("chat", {"temperature": 2.01}, "invalid request: temperature: Input should be less than or equal to 2",
     "temperature"),
    ("chat", {"temperature": -0.5}, "invalid request: temperature: Input should be greater than or equal to 0",
     "temperature"),
    ("completions", {"stop": FIVE_STOPS},
     "invalid request: stop: List should have at most 4 items after validation, not 5", "stop"),
    ("chat", {"stop": FIVE_STOPS + ["A:"]},
     "invalid request: stop: List should have at most 4 items after validation, not 6", "stop"),
    ("chat", {"temperature": 2.5, "stop": FIVE_STOPS},
     "invalid request: temperature: Input should be less than or equal to 2; "
     "stop: List should have at most 4 items after validation, not 5", "temperature"),
    ("completions", {"logprobs": 6}, "logprobs must be a whole number in 0..5, got 6", "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs must be a whole number in 0..20, got 21",
     "top_logprobs"),
    ("completions", {"top_p": 1.01}, "invalid request: top_p: Input should be less than or equal to 1", "top_p"),
    ("chat", {"top_p": 0}, "invalid request: top_p: Input should be greater than 0", "top_p"),
    ("completions", {"presence_penalty": 2.5},
     "invalid request: presence_penalty: Input should be less than or equal to 2", "presence_penalty"),
    ("chat", {"frequency_penalty": -2.5},
     "invalid request: frequency_penalty: Input should be greater than or equal to -2", "frequency_penalty"),
    ("completions", {"n": 17}, "n must be a whole number in 1..16, got 17", "n"),
    ("completions", {"max_tokens": 0}, "invalid request: max_tokens: Input should be greater than or equal to 1",
     "max_tokens"),
    ("chat", {"max_completion_tokens": 0},
     "invalid request: max_completion_tokens: Input should be greater than or equal to 1", "max_completion_tokens"),
    ("completions", {"logit_bias": {"5": -101}},
     "invalid request: logit_bias: the bias of token 5 must be in -100..100, got -101.0", "logit_bias"),
    ("chat", {"seed": -1}, "invalid request: seed: Input should be greater than or equal to 0", "seed"),
], ids=["temperature-3", "temperature-2.01", "temperature-negative", "stop-5", "stop-6", "two-fields",
        "completions-logprobs-6", "top_logprobs-21", "top_p-over-1", "top_p-0", "presence_penalty", "frequency_penalty",
        "n-17", "max_tokens-0", "max_completion_tokens-0", "logit_bias", "seed-negative"])
def test_values_outside_openais_ranges_are_400_through_the_openai_client(stack, kind, body, message, param):
    """``temperature`` 3 and five ``stop`` strings were answered (the core allows 100 and 16, the
    gRPC API's ranges); OpenAI's API refuses both with 400 (temperature 0..2, at most 4 stop
    sequences), and completions ``logprobs`` above 5, so this API does too: ``invalid_request_error``
    with ``param`` the field, unary and streamed (refused before the first token). Every other
    range the API takes is pinned here too, as the ``openai`` client sees it."""
    for stream in (False, True):
        e = _bad_request(stack["app"], kind, body, stream)
        assert isinstance(e, openai.BadRequestError) and e.status_code == 400
        assert e.body == {"message": message, "type": "invalid_request_error", "param": param, "code": None}


def test_openais_bounds_themselves_are_answered_and_grpc_keeps_its_wider_ranges(stack):
    """temperature 2, four stop strings and completions ``logprobs`` 5 (OpenAI's bounds) are
    answered, with the gRPC API's tokens and alternatives for the same values; the gRPC API still
    answers temperature 3 and five stop strings (its documented ranges: 0..100, 16)."""
    router = stack["router"]
    stops = FIVE_STOPS[:4]
    ids = [5, 17, 42, 9]
    g, ctx = _grpc(router, pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=ids), max_tokens=8, stop=stops, logprobs=True, top_logprobs=5,
        sampling=pb.SamplingParams(temperature=2.0, seed=11)))
    assert ctx.code is None, ctx.details
    assert len(g.token_ids) >= 1 and all(len(t.ids) == 5 for t in g.top_logprobs)
    tok = stack["target"].tokenizer

    async def go():
        return await _client(stack["app"]).completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=2,
                                                              seed=11, stop=stops, logprobs=5)

    cmpl = _run(go())
    assert cmpl.choices[0].model_extra["token_ids"] == list(g.token_ids)
    assert cmpl.choices[0].text == g.text
    assert [set(d) for d in cmpl.choices[0].logprobs.top_logprobs] == [
        {tok.decode([i]) for i in t.ids} | {tok.decode([s])} for t, s in zip(g.top_logprobs, g.token_ids)]
    wide, ctx = _grpc(router, pb.GenerateRequest(prompt=PROMPT, max_tokens=4, stop=FIVE_STOPS,
                                                 sampling=pb.SamplingParams(temperature=3.0, seed=1)))
    assert ctx.code is None and len(wide.token_ids) >= 1, ctx.details


def test_out_of_range_top_k_and_lone_surrogates_are_400_not_500(stack):
    """A top_k past uint32 (failed building the draft job's proto) and a JSON lone surrogate
    escape in the prompt, a chat message or a stop string (failed in the tokenizer) were 500
    internal errors; they are 400 naming the field, and the server answers as before."""
    target = stack["target"]
    ref = target_greedy(target, target.tokenizer.encode(PROMPT), 6)
    cases = [
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": PROMPT, "top_k": 2**32}),
         "invalid request: top_k: Input should be less than or equal to 4294967295", "top_k"),
        ("/v1/completions", '{"model": "specdec", "prompt": "ab\\ud800cd", "max_tokens": 2}',
         "invalid request: prompt: not valid Unicode text: a lone surrogate U+D800 at character 2", "prompt"),
        ("/v1/chat/completions", '{"model": "specdec", "messages": [{"role": "user", "content": "\\udfff"}], "stream": true}',
         "invalid request: messages.0.content: not valid Unicode text: a lone surrogate U+DFFF at character 0",
         "messages.0.content"),
        ("/v1/completions", '{"model": "specdec", "prompt": "x", "stop": ["\\ud83d"]}',
         "invalid request: stop: not valid Unicode text: a lone surrogate U+D83D at character 0", "stop"),
    ]
    for path, raw, message, param in cases:
        resp = _run(_raw(stack["app"], "POST", path, raw))
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    ok = _run(_raw(stack["app"], "POST", "/v1/completions",
                   {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                    "top_k": 2**32 - 1}))
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == ref


def test_prompt_over_the_context_has_openai_code_not_the_limit_number(stack):
    """The error's ``code`` was the context limit as a number (256); OpenAI's clients read a
    string code, and OpenAI's own for this case is ``context_length_exceeded``."""
    name = stack["router"].info.name

    async def go():
        return await _client(stack["app"]).completions.create(model=MODEL, prompt=[5] * 300, max_tokens=2)

    e = _status_of(go())
    assert isinstance(e, openai.BadRequestError) and e.code == "context_length_exceeded"
    assert e.body == {"message": f"prompt is 300 tokens but the target '{name}' holds 256 positions; at most 255 "
                                 "prompt tokens leave room for one generated token",
                      "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}
    resp = _run(_raw(stack["app"], "POST", "/v1/completions",
                     {"model": MODEL, "prompt": [5] * 300, "max_tokens": 2, "stream": True}))
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    # refused before tokenizing (more characters than 256 positions can spell): the same code
    resp = _run(_raw(stack["app"], "POST", "/v1/chat/completions",
                     {"model": MODEL, "messages": [{"role": "user", "content": "a" * 5000}]}))
    assert resp.status_code == 400 and resp.json()["error"] == {
        "message": f"prompt is 5000 characters: more than the 256 positions of the target '{name}' can hold (at most "
                   "3328 characters)", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}


def test_too_many_chat_messages_are_refused_before_the_chat_template(stack, monkeypatch):
    """50,000 empty messages passed the characters check (their contents are empty) and were
    templated and tokenized on the router (seconds with a real tokenizer) before being refused."""
    router = stack["router"]
    templated = []
    real_template = router.info.tokenizer.apply_chat_template

    def counting_template(*args, **kwargs):
        templated.append(len(args[0]))
        return real_template(*args, **kwargs)

    monkeypatch.setattr(router.info.tokenizer, "apply_chat_template", counting_template)
    many = [{"role": "user", "content": ""}] * 50_000
    message = "messages: 50000 messages are more than this server's limit of 2048 (max_chat_messages)"
    resp = _run(_raw(stack["app"], "POST", "/v1/chat/completions", {"model": MODEL, "messages": many}))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {"message": message, "type": "invalid_request_error", "param": "messages",
                                    "code": None}
    req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="")] * 50_000))
    _, ctx = _grpc(router, req)
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details == message
    assert templated == []
    # the limit comes from the config: at the limit the request runs, one above it is refused
    monkeypatch.setattr(router, "cfg", stack["cfg"].model_copy(update={"max_chat_messages": 2}))
    two = [{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]
    ok = _run(_raw(stack["app"], "POST", "/v1/chat/completions", {"model": MODEL, "messages": two, "max_tokens": 2}))
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2 and templated == [2]
    resp = _run(_raw(stack["app"], "POST", "/v1/chat/completions",
                     {"model": MODEL, "messages": two + [{"role": "user", "content": "!"}]}))
    assert resp.status_code == 400 and resp.json()["error"]["message"] == (
        "messages: 3 messages are more than this server's limit of 2 (max_chat_messages)")
    assert templated == [2]


def test_deadline_is_504_before_the_first_token(stack):
    resp = _run(_raw(stack["app"], "POST", "/v1/completions",
                     {"model": MODEL, "prompt": PROMPT, "max_tokens": 50, "temperature": 0, "stream": True},
                     headers={"specdec-timeout-s": "0.000001"}))
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "timeout"
    assert resp.json()["error"]["message"] == "the request's deadline passed during generation"


class StallingDraftHandle(LocalDraftHandle):
    """Streams the first chunk of the real draft replica, then stalls before the next unless
    cancelled: ``stall_s`` seconds (a step on a loaded CPU, a long prefill), or forever with None
    (a long generation). Closing it closes the draft replica's stream (its session and both caches
    are freed). ``stalled``: the streams that sent their first chunk and stall; ``stalls``: how
    each stall ended early (``"cancelled"``)."""

    def __init__(self, draft: Draft, stall_s: float | None = None):
        super().__init__(draft)
        self.stall_s = stall_s
        self.stalled = 0
        self.stalls: list[str] = []

    @property
    def Generate(self):
        async def gen(payload):
            inner = self.draft.Generate(payload)
            try:
                async for raw in inner:
                    yield raw
                    self.stalled += 1
                    try:
                        await (asyncio.Event().wait() if self.stall_s is None else asyncio.sleep(self.stall_s))
                    except asyncio.CancelledError:
                        self.stalls.append("cancelled")
                        raise
            finally:
                await inner.aclose()

        return self._Method(lambda payload: LocalStream(gen(payload)))


def test_a_step_that_outlasts_the_deadline_is_cut_at_the_deadline(stack):
    """The draft replica checks the deadline between steps, so a step that outlasted it (demo pair
    on a loaded CPU: specdec-timeout-s 1 answered 504 after 13.8 s) held the answer back; the
    router keeps the deadline too: 504 at the deadline, the generation cancelled, slot freed."""
    import time

    cfg = stack["cfg"]
    gate = TenancyGate(cfg.tenants_file, ControllerClient.local({}), SpecDecMetrics(backend=None))
    handle = StallingDraftHandle(stack["draft"], stall_s=60)
    router = Router(cfg, draft=handle, gate=gate)
    t0 = time.perf_counter()
    resp = _run(_raw(openai_api.build_app(router), "POST", "/v1/completions",
                     {"model": MODEL, "prompt": PROMPT, "max_tokens": 50, "temperature": 0},
                     headers={"specdec-timeout-s": "1.5"}))
    took = time.perf_counter() - t0
    assert resp.status_code == 504 and resp.json()["error"] == {
        "message": "the request's deadline passed during generation", "type": "timeout", "param": None, "code": None}
    assert took < 10, took  # not the 60 s stall
    assert handle.stalls == ["cancelled"] and gate.admission.running == 0 and stack["draft"].Sessions() == []
    ctx = RecordingContext((("authorization", f"Bearer {KEY}"), ("specdec-timeout-s", "1.5")))
    _run(router.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=50), ctx))
    assert ctx.code == grpc.StatusCode.DEADLINE_EXCEEDED and ctx.details == resp.json()["error"]["message"]


class FailingDraftHandle(LocalDraftHandle):
    """Streams the first chunk of the real draft replica, then fails (a target that went away)."""

    @property
    def Generate(self):
        from specdec.errors import ModelNotReadyError

        async def gen(payload):
            async for raw in self.draft.Generate(payload):
                yield raw
                raise ModelNotReadyError("the target replica is gone")

        return self._Method(lambda payload: LocalStream(gen(payload)))


def test_an_error_after_the_first_token_is_an_sse_error_event(stack):
    router = stack["make_router"]()
    router.draft = FailingDraftHandle(stack["draft"])
    resp = _run(_raw(openai_api.build_app(router), "POST", "/v1/chat/completions",
                     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 30,
                      "temperature": 0, "ignore_eos": True, "stream": True}))
    assert resp.status_code == 200
    events = [line[6:] for line in resp.text.split("\n\n") if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(events[-2]) == {"error": {"message": "the target replica is gone", "type": "service_unavailable",
                                                "param": None, "code": None}}
    assert events[-1] == "[DONE]"
    assert _run(router.Debug())["resumes"] == 0 and stack["draft"].Sessions() == []


@pytest.mark.parametrize("spec, field", [({"k": 3}, "k"), ({"max_k": 2, "ngram_max": 5}, "ngram_max"),
                                         ({"proposer": "ngram", "K": 1}, "K")])
def test_speculation_fields_outside_the_api_are_refused_not_passed_on(stack, spec, field):
    """``speculation: {"k": 3}`` answered 200: the key went on to the core request's own
    ``speculation.k`` (so it acted as max_k under a name the API does not have, and
    ``ngram_min``/``ngram_max`` likewise), against "a field the server cannot honour is refused"."""
    for url, base in (("/v1/completions", {"prompt": PROMPT}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        resp = _run(_raw(stack["app"], "POST", url, {"model": MODEL, "max_tokens": 2, **base, "speculation": spec}))
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"] == {
            "message": f"speculation: unsupported field(s): {field}; it takes proposer, max_k, draft_min_confidence",
            "type": "invalid_request_error", "param": f"speculation.{field}", "code": None}
    ok = _run(_raw(stack["app"], "POST", "/v1/completions",
                   {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "speculation": {"max_k": 3, "proposer": None}}))
    assert ok.status_code == 200


# --- shutting down (Router.Drain, what `specdec serve` calls on Ctrl-C) ----------------------------


SHUTTING_DOWN = "the server is shutting down; retry once it is back (or on another replica)"


def test_drain_ends_the_generations_in_flight_with_unavailable_and_refuses_new_ones(stack):
    """Serve's shutdown kills its proxies at once: an HTTP stream in flight ended mid-chunk
    (``incomplete chunked read``) and a gRPC one with ``Stream removed (Socket closed)``.
    ``specdec serve`` now drains the router first: after the grace the generations still
    running end with UNAVAILABLE and a message (the HTTP stream with an error event after its
    tokens), their draft sessions are freed, and a new request is 503 with Retry-After."""
    router = stack["make_router"]()
    router.draft = handle = StallingDraftHandle(stack["draft"])
    app = openai_api.build_app(router)
    ctx = RecordingContext((("authorization", f"Bearer {KEY}"),))
    grpc_chunks: list = []

    async def grpc_call():
        req = pb.GenerateRequest(prompt=PROMPT, max_tokens=30, ignore_eos=True)
        try:
            async for c in router.GenerateStream(req, ctx):
                grpc_chunks.append(c)
        except Exception as e:  # StreamAborted, after the code was set on the context
            return type(e).__name__

    async def go():
        http = asyncio.ensure_future(_raw(app, "POST", "/v1/completions", {
            "model": MODEL, "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}))
        grpc_end = asyncio.ensure_future(grpc_call())
        for _ in range(2000):  # both streams have sent their first chunk and wait in the stalled draft
            if router.in_flight == 2 and handle.stalled == 2 and grpc_chunks:
                break
            await asyncio.sleep(0.01)
        drained = await router.Drain(0)
        again = await router.Drain(5)  # once: a later call answers what the first did
        refused = await _raw(app, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        return drained, again, await http, await grpc_end, refused

    drained, again, http, grpc_end, refused = _run(go())
    assert drained == again == {"replica": "local", "in_flight": 2, "cut": 2, "left": 0}
    assert grpc_end == "StreamAborted" and len(grpc_chunks) == 1 and len(grpc_chunks[0].token_ids) >= 1
    assert ctx.code == grpc.StatusCode.UNAVAILABLE and ctx.details == SHUTTING_DOWN
    events = [line[6:] for line in http.text.split("\n\n") if line.startswith("data: ")]
    assert http.status_code == 200 and json.loads(events[0])["choices"][0]["token_ids"]
    assert json.loads(events[-2]) == {"error": {"message": SHUTTING_DOWN, "type": "service_unavailable",
                                                "param": None, "code": None}}
    assert events[-1] == "[DONE]"
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json() == {"error": {"message": SHUTTING_DOWN, "type": "service_unavailable", "param": None,
                                        "code": None}}
    assert stack["draft"].Sessions() == [] and router.in_flight == 0


def test_drain_lets_a_generation_finish_within_the_grace(stack):
    """A request in flight that ends within the grace gets its whole answer (the target's
    greedy tokens); the drain reports it finished, none cut."""
    router = stack["make_router"]()
    app = openai_api.build_app(router)
    target = stack["target"]
    ref = target_greedy(target, target.tokenizer.encode(PROMPT), 12)

    async def go():
        call = asyncio.ensure_future(_raw(app, "POST", "/v1/completions", {
            "model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}))
        for _ in range(2000):
            if router.in_flight:
                break
            await asyncio.sleep(0.001)
        drained = await router.Drain(600)  # returns once the generation has ended
        return drained, await call

    drained, resp = _run(go())
    assert drained == {"replica": "local", "in_flight": 1, "cut": 0, "left": 0}
    assert resp.status_code == 200 and resp.json()["choices"][0]["token_ids"] == ref


# --- every finished generation is billed as it ended ---------------------------------------------

BILL_KEY = "sk-http-bill-0003"
BILL_TPM = 1000


def _billed_router(stack, tmp_path) -> Router:
    """A router of its own (fresh books) for tenant 'bill': ngram only, 2 requests at once,
    1000 tokens per minute on a clock that stands still (the bucket never refills)."""
    import yaml

    from specdec.control.tenants import hash_api_key

    path = tmp_path / "bill.yaml"
    path.write_text(yaml.safe_dump({"tenants": [{
        "id": "bill", "api_key_hashes": [hash_api_key(BILL_KEY)],
        "limits": {"max_concurrent_requests": 2, "tokens_per_minute": BILL_TPM, "max_tokens": 64,
                   "max_prompt_tokens": 4096},
        "speculation": {"allowed_proposers": ["ngram"], "k_min": 0, "k_max": 4, "adaptive": False, "fixed_k": 2}}]}))
    gate = TenancyGate(str(path), ControllerClient.local({}, clock=lambda: 0.0), SpecDecMetrics(backend=None))
    return Router(stack["cfg"], draft=LocalDraftHandle(stack["draft"]), gate=gate)


def _books(router: Router) -> dict:
    """What the server recorded of tenant 'bill': request statuses (Prometheus), tokens
    generated (Prometheus), usage (GetTenantStats) and tokens charged to its bucket."""
    from types import SimpleNamespace

    gate = router.gate
    statuses = {dict(k[1:])["status"]: int(v) for k, v in gate.metrics.values.items()
                if k[0] == "specdec_requests" and dict(k[1:]).get("tenant") == "bill"}
    usage = _run(gate.tenant_stats({"authorization": f"Bearer {BILL_KEY}"}))["usage"]
    bucket = gate.controller.state.limiter.available_tokens(
        SimpleNamespace(id="bill", limits=SimpleNamespace(tokens_per_minute=BILL_TPM)))
    return {"statuses": statuses, "generated": int(gate.metrics.value("specdec_generated_tokens", tenant="bill")),
            "usage": usage, "charged": BILL_TPM - round(bucket), "leases": gate.controller.state.active_leases(),
            "running": gate.admission.running}


@pytest.mark.parametrize("kind, max_tokens", [("chat", 1), ("chat-stream", 1), ("completion", 1), ("completion", 2),
                                               ("completion-stream", 2), ("completion-n2", 2), ("completion-n2-stream", 2)])
def test_an_output_of_one_chunk_is_ok_and_billed_in_full(stack, tmp_path, kind, max_tokens):
    """An HTTP request whose whole output came in one chunk (max_tokens 1 or 2: the final chunk
    is the first) got 200 with the right usage, but the server recorded it as INTERNAL (n = 2:
    OK and CANCELLED) with no completion tokens in GetTenantStats or Prometheus, and charged
    the tenant's tokens per minute for the prompt only: the HTTP layer stops iterating after the
    chunk with the finish reason, and the router took the GeneratorExit (the cancellation of a
    drained choice) for the generation's end."""
    router = _billed_router(stack, tmp_path)
    app = openai_api.build_app(router)
    n = 2 if "n2" in kind else 1
    extra = {"ignore_eos": True}

    async def go():
        client = _client(app, key=BILL_KEY)
        if kind.startswith("chat"):
            args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens,
                        temperature=0, extra_body=extra)
            create = client.chat.completions.create
        else:
            args = dict(model=MODEL, prompt="x", max_tokens=max_tokens, temperature=0, n=n, extra_body=extra)
            create = client.completions.create
        if not kind.endswith("stream"):
            return (await create(**args)).usage
        chunks = [c async for c in await create(stream=True, stream_options={"include_usage": True}, **args)]
        with_text = [c for c in chunks if c.choices and c.choices[0].model_extra["token_ids"]]
        assert len(with_text) == n and all(c.choices[0].finish_reason == "length" for c in with_text)  # one chunk each
        return chunks[-1].usage

    usage = _run(go())
    assert usage.completion_tokens == n * max_tokens
    prompt = usage.prompt_tokens  # once for all choices, as OpenAI's; each choice is admitted with it
    if kind.startswith("completion"):
        assert prompt == 1  # "x"
    assert _books(router) == {
        "statuses": {"OK": n}, "generated": n * max_tokens,
        "usage": {"requests": n, "prompt_tokens": n * prompt, "completion_tokens": n * max_tokens},
        "charged": n * (prompt + max_tokens), "leases": 0, "running": 0}


def test_a_consumer_that_stops_before_the_final_chunk_cancels_the_generation(stack, tmp_path):
    """Closing the stream mid-generation (a client gone) is CANCELLED, not INTERNAL: only the
    prompt is charged, nothing counted as generated, the draft's session freed."""
    router = _billed_router(stack, tmp_path)
    data = {"prompt": "x", "max_tokens": 40, "ignore_eos": True}
    md = {"authorization": f"Bearer {BILL_KEY}"}

    async def closed():
        gen = router.generate_stream(data, md)
        first = await gen.__anext__()
        await gen.aclose()
        return first

    async def cancelled():
        got = asyncio.Queue()

        async def consume():
            async for c in router.generate_stream(data, md):
                await got.put(c)

        task = asyncio.ensure_future(consume())
        first = await got.get()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return first

    first = _run(closed())
    assert first.finish_reason == pb.FINISH_REASON_UNSPECIFIED and len(first.token_ids) < 40
    assert _books(router) == {"statuses": {"CANCELLED": 1}, "generated": 0,
                              "usage": {"requests": 1, "prompt_tokens": 1, "completion_tokens": 0},
                              "charged": 1, "leases": 0, "running": 0}
    first = _run(cancelled())
    assert first.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert _books(router) == {"statuses": {"CANCELLED": 2}, "generated": 0,
                              "usage": {"requests": 2, "prompt_tokens": 2, "completion_tokens": 0},
                              "charged": 2, "leases": 0, "running": 0}
    assert stack["draft"].Sessions() == []


def test_grpc_generations_are_billed_in_full(stack, tmp_path):
    """The gRPC path (unary and streamed, max_tokens 2: one chunk) counts OK and every token."""
    router = _billed_router(stack, tmp_path)
    req = pb.GenerateRequest(prompt="x", max_tokens=2, ignore_eos=True)
    ctx = RecordingContext((("authorization", f"Bearer {BILL_KEY}"),))
    resp = _run(router.Generate(req, ctx))
    assert ctx.code is None and resp.usage.completion_tokens == 2

    async def streamed():
        ctx = RecordingContext((("authorization", f"Bearer {BILL_KEY}"),))
        return [c async for c in router.GenerateStream(req, ctx)], ctx

    chunks, ctx = _run(streamed())
    assert ctx.code is None and chunks[-1].usage.completion_tokens == 2
    assert _books(router) == {"statuses": {"OK": 2}, "generated": 4,
                              "usage": {"requests": 2, "prompt_tokens": 2, "completion_tokens": 4},
                              "charged": 6, "leases": 0, "running": 0}


def test_an_error_ending_the_drafts_stream_after_its_final_chunk_changes_nothing(stack, tmp_path, caplog):
    """The draft replica's stream failing after its final chunk (max_tokens 1: the first) made
    the router answer gRPC UNAVAILABLE and count the request so, with every token delivered:
    once the final chunk is relayed the generation is complete. The error is logged at INFO
    (an error of the draft replica, not a death: worth seeing, not a failed request)."""
    import logging

    router = _billed_router(stack, tmp_path)
    router.draft = FailingDraftHandle(stack["draft"])
    ctx = RecordingContext((("authorization", f"Bearer {BILL_KEY}"),))
    with caplog.at_level(logging.DEBUG, logger="deployments.ingress.relay"):
        resp = _run(router.Generate(pb.GenerateRequest(prompt="x", max_tokens=1, ignore_eos=True), ctx))
    logged = [(r.levelno, r.getMessage().split(": ", 1)[1]) for r in caplog.records
              if r.name == "deployments.ingress.relay"]
    assert logged == [(logging.INFO, "the draft's stream ended with ModelNotReadyError after its final chunk: "
                                     "the target replica is gone")]
    assert ctx.code is None and len(resp.token_ids) == 1 and resp.finish_reason == pb.FINISH_REASON_MAX_TOKENS
    assert _books(router) == {"statuses": {"OK": 1}, "generated": 1,
                              "usage": {"requests": 1, "prompt_tokens": 1, "completion_tokens": 1},
                              "charged": 2, "leases": 0, "running": 0}
    assert _run(router.Debug())["resumes"] == 0 and stack["draft"].Sessions() == []


def test_tenant_stats_of_a_proposer_the_tenant_may_not_use_is_refused_as_generate(stack, tmp_path):
    """GetTenantStats for PROPOSER_DRAFT of a tenant allowing only ngram answered statistics
    labelled PROPOSER_DRAFT, where Generate naming it is INVALID_ARGUMENT; so is a proposer the
    server does not run. Allowed ones (and plain decoding, always allowed) still answer."""
    router = _billed_router(stack, tmp_path)
    md = (("authorization", f"Bearer {BILL_KEY}"),)

    def stats(proposer, r=router):
        ctx = RecordingContext(md)
        return _run(r.GetTenantStats(pb.GetTenantStatsRequest(proposer=proposer), ctx)), ctx

    def generate(proposer, r=router):
        ctx = RecordingContext(md)
        _run(r.Generate(pb.GenerateRequest(prompt="x", max_tokens=1, speculation=pb.SpeculationHints(proposer=proposer)),
                        ctx))
        return ctx

    got, ctx = stats(pb.PROPOSER_DRAFT)
    assert (ctx.code, ctx.details) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "speculation.proposer: 'draft' is not allowed for tenant 'bill'; allowed: "
                                       "['ngram', 'none']")
    assert got == pb.GetTenantStatsResponse()
    g = generate(pb.PROPOSER_DRAFT)
    assert (g.code, g.details) == (ctx.code, ctx.details)
    for proposer in (pb.PROPOSER_NGRAM, pb.PROPOSER_NONE, pb.PROPOSER_UNSPECIFIED):
        got, ctx = stats(proposer)
        assert ctx.code is None and got.tenant_id == "bill"
        assert got.proposer == (pb.PROPOSER_NGRAM if proposer == pb.PROPOSER_UNSPECIFIED else proposer)
    bad = RecordingContext((("authorization", "Bearer sk-nobody"),))
    _run(router.GetTenantStats(pb.GetTenantStatsRequest(proposer=pb.PROPOSER_DRAFT), bad))
    assert bad.code == grpc.StatusCode.UNAUTHENTICATED  # the key before anything else
    # a server without a draft model: open mode allows every proposer, the server runs no draft
    plain = Router(stack["cfg"].model_copy(update={"draft_model": None, "tenants_file": None}),
                   draft=LocalDraftHandle(stack["draft"]), info=router.info,
                   gate=TenancyGate(None, ControllerClient.local({}), SpecDecMetrics(backend=None)))
    got, ctx = stats(pb.PROPOSER_DRAFT, plain)
    assert (ctx.code, ctx.details) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "proposer 'draft' needs a draft model; this server has none")
    g = generate(pb.PROPOSER_DRAFT, plain)
    assert (g.code, g.details) == (ctx.code, ctx.details)


def test_a_generation_cancelled_twice_is_still_completed(stack, tmp_path):
    """Serve may cancel a request's task twice (a client gone): a second cancellation arriving
    while the router cleans up must not cut the cleanup short (an admission left open holds the
    tenant's concurrency and tokens until its lease expires, and in_flight stays counted)."""
    router = _billed_router(stack, tmp_path)
    router.draft = StallingDraftHandle(stack["draft"])  # the first chunk, then nothing until cancelled
    data = {"prompt": "x", "max_tokens": 40, "ignore_eos": True}
    md = {"authorization": f"Bearer {BILL_KEY}"}
    relay, tasks = router._relay, []

    def relay_cancelled_again(*args, **kw):
        async def chunks():
            try:
                async for c in relay(*args, **kw):
                    yield c
            finally:
                tasks[0].cancel()  # the second cancellation: delivered at the cleanup's first await

        return chunks()

    router._relay = relay_cancelled_again

    async def main():
        got = asyncio.Queue()

        async def consume():
            async for c in router.generate_stream(data, md):
                await got.put(c)

        tasks.append(asyncio.ensure_future(consume()))
        await got.get()
        tasks[0].cancel()
        await asyncio.gather(tasks[0], return_exceptions=True)
        await asyncio.sleep(0.2)  # a cleanup left running in its own task ends meanwhile

    _run(main())
    assert _books(router) == {"statuses": {"CANCELLED": 1}, "generated": 0,
                              "usage": {"requests": 1, "prompt_tokens": 1, "completion_tokens": 0},
                              "charged": 1, "leases": 0, "running": 0}
    assert router.in_flight == 0 and stack["draft"].Sessions() == []


# --- the final chunk ends the request; the draft's stream ends apart ---------------------------


class HeldEndDraftHandle(LocalDraftHandle):
    """The real draft replica's chunks; its stream then ends only once ``release`` is set (the
    draft's cleanup: the step thread, a CloseSession to a busy target). ``holding`` is set when
    the stream's end is held; ``ends`` records how each stream ended ("end" or "cancelled")."""

    def __init__(self, draft: Draft):
        super().__init__(draft)
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self.ends: list[str] = []

    @property
    def Generate(self):
        async def gen(payload):
            try:
                async for raw in self.draft.Generate(payload):
                    yield raw
                self.holding.set()
                await self.release.wait()
            except asyncio.CancelledError:
                self.ends.append("cancelled")
                raise
            self.ends.append("end")

        return self._Method(lambda payload: LocalStream(gen(payload)))


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_a_unary_client_gone_after_the_final_chunk_gets_its_result_billed_in_full(stack, tmp_path, api):
    """A unary request (gRPC Generate, HTTP without stream) waited after the final chunk until
    the draft replica's stream ended, which comes after the replica's cleanup: a client that
    cancelled (or disconnected, or timed out) then got nothing, though the generation was booked
    OK and billed in full (its outcome is fixed at the final chunk). The relay now ends at the
    final chunk: the response is complete before the draft's stream ends, and the rest of that
    stream is read apart, not cancelled (the draft's request ends normally)."""
    from deployments.ingress.relay import drained

    router = _billed_router(stack, tmp_path)
    handle = router.draft = HeldEndDraftHandle(stack["draft"])
    target_sessions = set(stack["wire"].table.sessions)  # left by earlier tests, if any
    app = openai_api.build_app(router)

    async def request():
        if api == "grpc":
            ctx = RecordingContext((("authorization", f"Bearer {BILL_KEY}"),))
            resp = await router.Generate(pb.GenerateRequest(prompt="x", max_tokens=3, ignore_eos=True), ctx)
            assert ctx.code is None
            return list(resp.token_ids), resp.usage.completion_tokens
        resp = await _client(app, key=BILL_KEY).completions.create(model=MODEL, prompt="x", max_tokens=3,
                                                                   temperature=0, extra_body={"ignore_eos": True})
        return resp.choices[0].model_extra["token_ids"], resp.usage.completion_tokens

    async def main():
        task = asyncio.ensure_future(request())
        await handle.holding.wait()  # the final chunk was sent; the draft's stream has not ended
        await asyncio.sleep(0.2)
        task.cancel()  # the client gives up while the draft's stream is still open
        got = await asyncio.gather(task, return_exceptions=True)
        ends_then = list(handle.ends)
        handle.release.set()
        await drained()
        return got[0], ends_then

    got, ends_then = _run(main())
    # without the fix: CancelledError, booked {"CANCELLED": 1} and charged the prompt only (1)
    assert not isinstance(got, BaseException), got
    ids, completion = got
    assert len(ids) == 3 and completion == 3
    assert _books(router) == {
        "statuses": {"OK": 1}, "generated": 3, "usage": {"requests": 1, "prompt_tokens": 1, "completion_tokens": 3},
        "charged": 4, "leases": 0, "running": 0}
    assert ends_then == [] and handle.ends == ["end"]  # answered while it was open; then read to its end
    assert stack["draft"].Sessions() == [] and set(stack["wire"].table.sessions) <= target_sessions
    assert router.in_flight == 0


class DyingAfterFinalDraftHandle(LocalDraftHandle):
    """The real draft replica's chunks; the replica then dies (Ray's ActorDiedError) instead of
    ending its stream. ``calls``: the streams asked for (a resume asks for another)."""

    def __init__(self, draft: Draft):
        super().__init__(draft)
        self.calls = 0
        self.deaths = 0

    @property
    def Generate(self):
        from ray.exceptions import ActorDiedError

        async def gen(payload):
            self.calls += 1
            inner = self.draft.Generate(payload)
            try:
                async for raw in inner:
                    yield raw
                    if pb.GenerateStreamChunk.FromString(raw).finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        self.deaths += 1
                        raise ActorDiedError()
            finally:
                await inner.aclose()

        return self._Method(lambda payload: LocalStream(gen(payload)))


def test_a_draft_replica_dying_after_the_final_chunk_changes_nothing(stack, tmp_path, caplog):
    """The draft replica dies (ActorDiedError) after its final chunk: the generation ends OK,
    billed once, never resumed (a resume would send a second final chunk and bill again)."""
    import logging

    router = _billed_router(stack, tmp_path)
    handle = router.draft = DyingAfterFinalDraftHandle(stack["draft"])
    target_sessions = set(stack["wire"].table.sessions)  # left by earlier tests, if any
    req = pb.GenerateRequest(prompt="x", max_tokens=5, ignore_eos=True)

    async def main():
        ctx = RecordingContext((("authorization", f"Bearer {BILL_KEY}"),))
        unary = await router.Generate(req, ctx)
        assert ctx.code is None
        ctx = RecordingContext((("authorization", f"Bearer {BILL_KEY}"),))
        chunks = [c async for c in router.GenerateStream(req, ctx)]
        assert ctx.code is None
        return unary, chunks

    with caplog.at_level(logging.DEBUG, logger="deployments.ingress.relay"):
        unary, chunks = _run(main())
    assert len(unary.token_ids) == 5 and unary.finish_reason == pb.FINISH_REASON_MAX_TOKENS
    finals = [c for c in chunks if c.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert len(finals) == 1 and chunks[-1] is finals[0]  # one final chunk, no resumed one after it
    streamed = [t for c in chunks for t in c.token_ids]
    assert len(streamed) == 5 and list(unary.token_ids) == streamed
    assert (handle.calls, handle.deaths, router.resumes) == (2, 2, 0)  # each died once, none resumed
    assert _books(router) == {"statuses": {"OK": 2}, "generated": 10,
                              "usage": {"requests": 2, "prompt_tokens": 2, "completion_tokens": 10},
                              "charged": 12, "leases": 0, "running": 0}
    died = [r for r in caplog.records
            if r.name == "deployments.ingress.relay" and "died after the final chunk" in r.getMessage()]
    assert len(died) == 2 and all(r.levelno == logging.DEBUG for r in died)
    assert stack["draft"].Sessions() == [] and set(stack["wire"].table.sessions) <= target_sessions
