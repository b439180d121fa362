"""The OpenAI-compatible HTTP API, served by the Router beside the gRPC API.

    GET  /specdec/                      a short JSON description of the endpoints
    GET  /specdec/v1/models             the served model id(s)
    POST /specdec/v1/completions        text completion (prompt: a string or token ids)
    POST /specdec/v1/chat/completions   chat completion (the target's chat template)

(``/specdec`` is the Serve application's route prefix, ``AppConfig.app_name``; an OpenAI client
uses ``base_url="http://HOST:8000/specdec/v1"``.)

One code path behind both APIs: this module only *translates*. :func:`translate` turns an
OpenAI body into the plain request dict that :func:`specdec.request.parse_request` validates
(the same dict the gRPC API builds from its proto with ``convert.request_to_dict``), and
:meth:`deployments.router.Router.generate_stream` runs it: validation, tokenizing, tenancy
(the API key comes as ``Authorization: Bearer <key>``), K, the draft replica's stream. A bad
value of a field both APIs have is refused by the core with the same message on both.
Only what gRPC has no field for is checked here (``model``, ``n``, ``stream``, the shapes of
``prompt``, ``messages``, ``stop`` and ``logprobs``), with :class:`InvalidRequestError`.

Field mapping (OpenAI -> core request): ``prompt`` (string, or a list of token ids) ->
``prompt`` / ``prompt_token_ids``; ``messages`` -> ``messages`` (``developer`` is ``system``;
content parts of type ``text`` are joined); ``max_tokens`` / ``max_completion_tokens`` ->
``max_tokens`` (completions default 16 as OpenAI's, chat the server's 128); ``temperature``
(default 1.0, as OpenAI: send 0 for greedy), ``top_p``, ``seed`` and the non-OpenAI ``top_k``
(``-1`` = off, as vLLM) -> ``sampling``; ``stop`` (a string or a list) -> ``stop``;
``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` ->
``sampling``; ``stop_token_ids``, ``ignore_eos``, ``min_tokens`` as is; ``logprobs`` (chat:
``true`` with ``top_logprobs`` N; completions: the integer N) -> ``logprobs`` + ``top_logprobs``;
``speculation: {proposer, max_k, draft_min_confidence}`` -> ``speculation``. ``n`` runs n independent generations (each admitted
as one request; with a ``seed``, choice i uses ``seed + i``). ``user`` is accepted and ignored.

Responses follow OpenAI's shapes: ``finish_reason`` ``stop`` (EOS, a stop token, a stop string)
or ``length`` (``max_tokens``, the context limit; the exact reason is in the extra
``choices[i].finish_detail``), ``usage`` (the prompt counted once), ``logprobs`` in each
endpoint's own shape (the target's own log-probabilities at temperature 1). Every response
carries the speculation stats in the extra field ``speculation_stats`` (per choice, and pooled
over the choices at the top level of a unary response and of the streamed usage chunk).

Streaming (``stream: true``): server-sent events, ``data: {chunk}`` lines then ``data: [DONE]``;
with ``stream_options: {"include_usage": true}`` a last chunk with empty ``choices`` carries
``usage``. Errors found before the first token (all validation, tenancy, loading) answer with
their HTTP status; an error after the stream started is sent as ``data: {"error": ...}`` before
``[DONE]``. A client that disconnects cancels its generations: the draft and target caches are
freed and the tenant's slot and tokens returned.

Errors use OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}`` with the
status of :data:`HTTP_STATUS_BY_GRPC` (one table, from the gRPC code of
:mod:`deployments.grpc_status`): 400 bad request, 401 missing/unknown key, 404 unknown model or
path, 405 wrong method, 429 over a tenant limit (with ``Retry-After`` in whole seconds), 503
while the models load (``Retry-After: 1``), 504 deadline passed, 500 anything unexpected.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, Sequence

import grpc
from fastapi import Request  # module level: route annotations are resolved from these globals

from deployments.aio import finish_despite_cancellation
from deployments.grpc_status import details_for, status_for
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.errors import InvalidRequestError, ModelNotFoundError

#: gRPC status -> HTTP status, the one mapping of the HTTP API.
HTTP_STATUS_BY_GRPC: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.INTERNAL: 500,
}
#: HTTP status -> OpenAI's error ``type``.
ERROR_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}
#: Most independent generations (``n``) per request.
MAX_N = 16
#: Most alternatives per position in ``top_logprobs`` / completions ``logprobs``.
MAX_TOP_LOGPROBS = 20
#: Header of the session id (sticky routing; Serve's HTTP proxy reads the same header).
SESSION_HEADER = "x-session-id"

_FINISH = {
    pb.FINISH_REASON_EOS: ("stop", "eos"),
    pb.FINISH_REASON_STOP_TOKEN: ("stop", "stop_token"),
    pb.FINISH_REASON_STOP_STRING: ("stop", "stop_string"),
    pb.FINISH_REASON_MAX_TOKENS: ("length", "max_tokens"),
    pb.FINISH_REASON_CONTEXT_LENGTH: ("length", "context_length"),
    pb.FINISH_REASON_CANCELLED: ("stop", "cancelled"),
}

# Fields each endpoint takes (anything else is refused, naming the field: silently ignoring a
# parameter would give a wrong answer). Values of the shared ones are the core's to check.
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
    "presence_penalty", "frequency_penalty", "logit_bias",
    # not OpenAI's, as vLLM / SGLang take them
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "speculation",
}
_FIELDS = {
    "completions": _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                       "response_format", "parallel_tool_calls"},
}
#: Body fields that go into the core request's ``sampling`` as they are.
_SAMPLING = ("top_p", "seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")


@dataclass
class OpenAIRequest:
    """One translated OpenAI request.

    Attributes:
        endpoint: ``"completions"`` or ``"chat"``.
        model: the model id the caller named.
        data: the core request dict (:func:`specdec.request.parse_request`'s input) of choice 0.
        n: independent generations.
        stream: answer with server-sent events.
        include_usage: streaming: a last chunk carries ``usage``.
        top_logprobs: None (no logprobs), else alternatives per position (0..20).
    """

    endpoint: str
    model: str
    data: dict
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def choice_data(self, i: int) -> dict:
        """The core request dict of choice ``i`` (a seeded request: seed + i)."""
        data = json.loads(json.dumps(self.data))  # a deep copy of plain JSON data
        seed = (data.get("sampling") or {}).get("seed")
        if i and isinstance(seed, int) and not isinstance(seed, bool):
            data["sampling"]["seed"] = (seed + i) % 2**63
        return data


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_id_list(x: Any) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(_is_int(t) for t in x)


def _prompt(value: Any, data: dict) -> None:
    if isinstance(value, list) and len(value) == 1 and (isinstance(value[0], str) or _token_id_list(value[0])):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        data["prompt"] = value
    elif _token_id_list(value):
        data["prompt_token_ids"] = value
    elif isinstance(value, list) and value == []:
        data["prompt_token_ids"] = []  # the core refuses it: "prompt_token_ids is empty"
    elif isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise InvalidRequestError("prompt: a batch of several prompts is not supported; send one prompt per request")
    else:
        raise InvalidRequestError("prompt must be a string or a list of token ids")


def _content(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"messages.{i}.content: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(f"messages.{i}.content must be a string or a list of text parts")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise InvalidRequestError("messages must be a list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise InvalidRequestError(f"messages.{i} must be an object with 'role' and 'content'")
        role = m.get("role")
        if m.get("tool_calls"):
            raise InvalidRequestError(f"messages.{i}.tool_calls: tool calls are not supported")
        # the core checks the role (same message as gRPC's); 'developer' is OpenAI's new 'system'
        out.append({"role": "system" if role == "developer" else role, "content": _content(i, m.get("content"))})
    return out


def translate(body: Any, endpoint: str, model_ids: Sequence[str]) -> OpenAIRequest:
    """An OpenAI request body -> :class:`OpenAIRequest` (the core dict, n, stream, logprobs).

    Args:
        body: the parsed JSON body.
        endpoint: ``"completions"`` or ``"chat"``.
        model_ids: the model ids this server answers to.

    Raises:
        InvalidRequestError: a field gRPC does not have is malformed, an unknown or unsupported
            field (HTTP 400).
        ModelNotFoundError: ``model`` is not served (HTTP 404).
    """
    if not isinstance(body, Mapping):
        raise InvalidRequestError("the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # JSON null = not set
    unknown = sorted(set(body) - _FIELDS[endpoint])
    if unknown:
        raise InvalidRequestError(f"unsupported field(s): {', '.join(unknown)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("model is required: one of " + ", ".join(repr(m) for m in model_ids))
    if model not in model_ids:
        raise ModelNotFoundError(f"the model '{model}' does not exist; this server serves "
                                 + ", ".join(repr(m) for m in model_ids))
    n = body.get("n", 1)
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be a whole number in 1..{MAX_N}, got {n!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequestError(f"stream must be true or false, got {stream!r}")
    include_usage = False
    if "stream_options" in body:
        opts = body["stream_options"]
        if not stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true")
        if not isinstance(opts, Mapping) or set(opts) - {"include_usage"} or not isinstance(
                opts.get("include_usage", False), bool):
            raise InvalidRequestError("stream_options must be {\"include_usage\": true|false}")
        include_usage = bool(opts.get("include_usage", False))

    data: dict = {}
    if endpoint == "completions":
        if "prompt" not in body:
            raise InvalidRequestError("prompt is required")
        _prompt(body["prompt"], data)
        if body.get("echo"):
            raise InvalidRequestError("echo is not supported")
        if body.get("suffix"):
            raise InvalidRequestError("suffix is not supported")
        best_of = body.get("best_of", n)
        if best_of != n:
            raise InvalidRequestError("best_of other than n is not supported")
        top = body.get("logprobs")
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be a whole number in 0..{MAX_TOP_LOGPROBS}, got {top!r}")
        data["max_tokens"] = body.get("max_tokens", 16)  # OpenAI's default for completions
    else:
        if "messages" not in body:
            raise InvalidRequestError("messages is required")
        data["messages"] = _messages(body["messages"])
        for name in ("tools", "tool_choice"):
            if body.get(name) not in (None, [], "none"):
                raise InvalidRequestError(f"{name}: tool calls are not supported")
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise InvalidRequestError("response_format: only {\"type\": \"text\"} is supported")
        if "max_tokens" in body and "max_completion_tokens" in body and body["max_tokens"] != body["max_completion_tokens"]:
            raise InvalidRequestError("give max_tokens or max_completion_tokens, not two different values")
        if "max_completion_tokens" in body:
            data["max_tokens"] = body["max_completion_tokens"]
        elif "max_tokens" in body:
            data["max_tokens"] = body["max_tokens"]
        want = body.get("logprobs", False)
        if not isinstance(want, bool):
            raise InvalidRequestError(f"logprobs must be true or false, got {want!r}")
        top = body.get("top_logprobs")
        if top is not None:
            if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(f"top_logprobs must be a whole number in 0..{MAX_TOP_LOGPROBS}, got {top!r}")
            if not want:
                raise InvalidRequestError("top_logprobs needs logprobs: true")
        top = (top or 0) if want else None

    sampling: dict = {"temperature": body.get("temperature", 1.0)}  # OpenAI's default
    for name in _SAMPLING:
        if name in body:
            sampling[name] = body[name]
    if "top_k" in body:
        sampling["top_k"] = 0 if body["top_k"] == -1 else body["top_k"]
    data["sampling"] = sampling
    if "stop" in body:
        stop = body["stop"]
        data["stop"] = [stop] if isinstance(stop, str) else stop
    for name in ("stop_token_ids", "ignore_eos", "min_tokens"):
        if name in body:
            data[name] = body[name]
    if top is not None:
        data["logprobs"] = True
        if top:
            data["top_logprobs"] = top
    if "speculation" in body:
        spec = body["speculation"]
        if not isinstance(spec, Mapping):
            raise InvalidRequestError("speculation must be an object {proposer, max_k, draft_min_confidence}")
        data["speculation"] = {("k" if k == "max_k" else k): v for k, v in spec.items() if v is not None}
    kind = "cmpl" if endpoint == "completions" else "chatcmpl"
    return OpenAIRequest(endpoint=endpoint, model=model, data=data, n=n, stream=stream,
                         include_usage=include_usage, top_logprobs=top, id=f"{kind}-{uuid.uuid4().hex}")


def metadata_from_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The router's metadata from HTTP headers: ``authorization``, ``x-session-id`` as
    ``session_id``, ``specdec-timeout-s``."""
    from deployments.metadata import SESSION_KEY, TIMEOUT_KEY

    out: dict[str, str] = {}
    for src, dst in (("authorization", "authorization"), (SESSION_HEADER, SESSION_KEY), (TIMEOUT_KEY, TIMEOUT_KEY)):
        v = headers.get(src)
        if v is not None:
            out[dst] = v
    return out


# --- errors --------------------------------------------------------------------------------------


def http_status_for(exc: BaseException) -> int:
    """HTTP status of ``exc`` (via its gRPC code: one error table for both APIs)."""
    return HTTP_STATUS_BY_GRPC.get(status_for(exc), 500)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "error"), "param": param, "code": code}}


def error_response(exc: BaseException):
    """A JSONResponse in OpenAI's error shape, with ``Retry-After`` on 429 and 503."""
    from fastapi.responses import JSONResponse

    status = http_status_for(exc)
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if status == 429 and retry is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry)))
    elif status == 503:
        headers["Retry-After"] = "1"
    code = getattr(exc, "limit", None)
    return JSONResponse(error_body(status, details_for(exc), code), status_code=status, headers=headers)


# --- responses -----------------------------------------------------------------------------------


def stats_dict(stats: pb.SpeculationStats, elapsed_s: float | None = None) -> dict:
    """The speculation stats of one generation as JSON (the extra field ``speculation_stats``)."""
    from deployments import convert

    out = convert.stats_from_proto(stats).as_dict()
    out["wire_bytes_per_step"] = stats.wire_bytes_per_step
    out["round_trip_s"] = stats.round_trip_s
    out["target_compute_s"] = stats.target_compute_s
    if elapsed_s is not None:
        out["elapsed_s"] = elapsed_s
    return out


def pooled_stats(all_stats: Sequence[pb.SpeculationStats]) -> dict:
    """The counters of several generations pooled (ratios derived from the sums)."""
    from deployments import convert
    from specdec.types import SpeculationStats

    pooled = SpeculationStats()
    for s in all_stats:
        one = convert.stats_from_proto(s)
        pooled.steps += one.steps
        pooled.proposed += one.proposed
        pooled.accepted += one.accepted
        pooled.rejected_steps += one.rejected_steps
        for name in ("accepted_per_position", "proposed_per_position"):
            acc, add = getattr(pooled, name), getattr(one, name)
            acc.extend([0] * (len(add) - len(acc)))
            for j, v in enumerate(add):
                acc[j] += v
        for k, v in one.k_counts.items():
            pooled.k_counts[k] = pooled.k_counts.get(k, 0) + v
        pooled.draft_time_s += one.draft_time_s
        pooled.verify_time_s += one.verify_time_s
    return pooled.as_dict()


class TokenText:
    """Token ids -> the text pieces and bytes OpenAI's logprobs show (the tokenizer's decode of
    each id alone)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        t = self._cache.get(token_id)
        if t is None:
            t = self.tokenizer.decode([int(token_id)])
            self._cache[token_id] = t
        return t


def completion_logprobs(ids: Sequence[int], logprobs: Sequence[float], text: TokenText, offset: int = 0,
                        top: Sequence[pb.TopLogprobs] = ()) -> dict:
    """Completions' ``logprobs`` object: tokens, token_logprobs, top_logprobs (per position a
    dict token text -> logprob, or None when N = 0; ids that decode to the same text share one
    key, with the most likely one's logprob), text_offset."""
    tokens = [text(t) for t in ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    tops = None
    if top:  # several ids may decode to the same text: the most likely one's logprob is kept
        tops = []
        for m in top:
            d: dict[str, float] = {}
            for i, v in zip(m.ids, m.logprobs):
                d.setdefault(text(i), float(v))
            tops.append(d)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in logprobs], "top_logprobs": tops,
            "text_offset": offsets}


def _token_entry(text: TokenText, token_id: int, logprob: float) -> dict:
    s = text(token_id)
    return {"token": s, "logprob": float(logprob), "bytes": list(s.encode("utf-8"))}


def chat_logprobs(ids: Sequence[int], logprobs: Sequence[float], text: TokenText,
                  top: Sequence[pb.TopLogprobs] = ()) -> dict:
    """Chat's ``logprobs`` object: ``content`` = one entry per token, each with its
    ``top_logprobs`` alternatives (most likely first)."""
    content = []
    for j, (t, lp) in enumerate(zip(ids, logprobs)):
        entry = _token_entry(text, t, lp)
        alts = top[j] if j < len(top) else None
        entry["top_logprobs"] = [_token_entry(text, i, v) for i, v in zip(alts.ids, alts.logprobs)] if alts else []
        content.append(entry)
    return {"content": content}


def usage_dict(finals: Sequence[pb.GenerateResponse | pb.GenerateStreamChunk]) -> dict:
    prompt = int(finals[0].usage.prompt_tokens) if finals else 0
    completion = sum(int(f.usage.completion_tokens) for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def unary_response(req: OpenAIRequest, results: Sequence[pb.GenerateResponse], text: TokenText) -> dict:
    """The whole (non-streamed) response of ``req`` from its choices' joined results."""
    choices = []
    for i, r in enumerate(results):
        reason, detail = _FINISH.get(r.finish_reason, ("stop", "unknown"))
        choice: dict = {"index": i}
        lp = None
        if req.top_logprobs is not None:
            lp = (completion_logprobs(r.token_ids, r.logprobs, text, top=r.top_logprobs) if req.endpoint == "completions"
                  else chat_logprobs(r.token_ids, r.logprobs, text, top=r.top_logprobs))
        if req.endpoint == "completions":
            choice["text"] = r.text
        else:
            choice["message"] = {"role": "assistant", "content": r.text}
        choice.update({"logprobs": lp, "finish_reason": reason, "finish_detail": detail,
                       "token_ids": list(r.token_ids), "speculation_stats": stats_dict(r.stats, r.elapsed_s)})
        choices.append(choice)
    return {
        "id": req.id,
        "object": "text_completion" if req.endpoint == "completions" else "chat.completion",
        "created": req.created,
        "model": req.model,
        "choices": choices,
        "usage": usage_dict(results),
        "speculation_stats": pooled_stats([r.stats for r in results]),
    }


def _chunk_envelope(req: OpenAIRequest, choices: list) -> dict:
    return {
        "id": req.id,
        "object": "text_completion" if req.endpoint == "completions" else "chat.completion.chunk",
        "created": req.created,
        "model": req.model,
        "choices": choices,
    }


def stream_chunk(req: OpenAIRequest, index: int, chunk: pb.GenerateStreamChunk, text: TokenText,
                 offset: int, first: bool) -> dict:
    """One SSE chunk of choice ``index`` from one relayed stream chunk."""
    last = chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    lp = None
    if req.top_logprobs is not None:
        lp = (completion_logprobs(chunk.token_ids, chunk.logprobs, text, offset, chunk.top_logprobs)
              if req.endpoint == "completions" else chat_logprobs(chunk.token_ids, chunk.logprobs, text, chunk.top_logprobs))
    choice: dict = {"index": index}
    if req.endpoint == "completions":
        choice["text"] = chunk.text
    else:
        delta: dict = {"content": chunk.text}
        if first:
            delta["role"] = "assistant"
        choice["delta"] = delta
    choice["logprobs"] = lp
    choice["finish_reason"] = _FINISH.get(chunk.finish_reason, ("stop", ""))[0] if last else None
    choice["token_ids"] = list(chunk.token_ids)
    if last:
        choice["finish_detail"] = _FINISH.get(chunk.finish_reason, ("stop", "unknown"))[1]
        choice["speculation_stats"] = stats_dict(chunk.stats, chunk.elapsed_s)
    return _chunk_envelope(req, [choice])


def sse(data: Any) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# --- running the choices -------------------------------------------------------------------------


async def _close(gen: Any) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        await finish_despite_cancellation(aclose())


async def start_choices(router: Any, req: OpenAIRequest, metadata: Mapping[str, str]) -> list[tuple[Any, Any]]:
    """Start the n generations and wait for each one's first chunk, so that every error found
    before generating (validation, tenancy, loading) is raised here, before any byte is sent.

    Returns:
        ``[(first_chunk, stream), ...]`` per choice.

    Raises:
        the first choice's error (the others are cancelled and their admissions ended).
    """
    gens = [router.generate_stream(req.choice_data(i), metadata) for i in range(req.n)]
    firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
    try:
        await asyncio.gather(*firsts)
    except BaseException:
        for f in firsts:
            f.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for g in gens:
            await _close(g)
        # the first choice's own error where it has one (the same error as n = 1 would get)
        for f in firsts:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()
        raise
    return [(f.result(), g) for f, g in zip(firsts, gens)]


async def merged(started: list[tuple[Any, Any]]) -> AsyncIterator[tuple[int, Any]]:
    """``(choice index, chunk)`` from all choices as they come; the streams are closed (and
    their generations cancelled) when this generator is."""
    if len(started) == 1:
        first, gen = started[0]
        try:
            yield 0, first
            if first.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                async for c in gen:
                    yield 0, c
        finally:
            await _close(gen)
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, first: Any, gen: Any) -> None:
        try:
            await queue.put((i, first))
            if first.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                async for c in gen:
                    await queue.put((i, c))
            await queue.put((i, done))
        except BaseException as e:
            await queue.put((i, e))
            raise
        finally:
            await _close(gen)

    tasks = [asyncio.ensure_future(pump(i, f, g)) for i, (f, g) in enumerate(started)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await finish_despite_cancellation(asyncio.gather(*tasks, return_exceptions=True))


async def run_unary(router: Any, req: OpenAIRequest, metadata: Mapping[str, str]) -> list[pb.GenerateResponse]:
    """Run all choices to the end; their joined results in choice order."""
    from deployments import convert

    started = await start_choices(router, req, metadata)
    chunks: list[list] = [[] for _ in started]
    async for i, c in merged(started):
        chunks[i].append(c)
    return [convert.join_chunks(cs) for cs in chunks]


async def sse_events(req: OpenAIRequest, started: list[tuple[Any, Any]], text: TokenText) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response."""
    offsets = [0] * len(started)
    firsts = [True] * len(started)
    finals: list = [None] * len(started)
    stream = merged(started)
    try:
        async for i, c in stream:
            yield sse(stream_chunk(req, i, c, text, offsets[i], firsts[i]))
            firsts[i] = False
            offsets[i] += len(c.text)
            if c.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finals[i] = c
        if req.include_usage:
            last = _chunk_envelope(req, [])
            last["usage"] = usage_dict(finals)
            last["speculation_stats"] = pooled_stats([f.stats for f in finals])
            yield sse(last)
    except Exception as e:  # after the first byte the status is sent: report in the stream
        from deployments.ray_errors import unwrap

        e = unwrap(e)
        yield sse(error_body(http_status_for(e), details_for(e), getattr(e, "limit", None)))
    finally:
        await _close(stream)
    yield SSE_DONE


# --- the FastAPI app -----------------------------------------------------------------------------


def model_ids(cfg: Any) -> list[str]:
    """Model ids the HTTP API answers to: the application name (what ``/v1/models`` lists)."""
    return [cfg.app_name]


class _RootWithoutSlash:
    """ASGI middleware: the application's own prefix without a trailing slash (``GET /specdec``)
    is its root ``/`` (FastAPI would answer a 307 redirect to ``/specdec/``)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        root = scope.get("root_path") or ""
        if scope.get("type") == "http" and root and scope.get("path") == root:
            scope = dict(scope, path=root + "/", raw_path=(root + "/").encode())
        await self.app(scope, receive, send)


def build_app(router: Any):
    """The FastAPI app of one Router replica (``Router.__serve_build_asgi_app__``).

    Args:
        router: the :class:`deployments.router.Router` whose :meth:`generate_stream`,
            ``gate`` and ``cfg`` the routes use.
    """
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from deployments.ray_errors import unwrap

    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_RootWithoutSlash)
    ids = model_ids(router.cfg)
    created = int(time.time())
    text = TokenText(router.info.tokenizer)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = (f"no such endpoint: {request.method} {request.url.path}; see GET {request.scope.get('root_path', '')}/ "
                   "for the endpoints")
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        return JSONResponse(error_body(exc.status_code, msg), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, exc: Exception):
        return error_response(unwrap(exc))

    @app.get("/")
    async def describe(request: Request):
        base = request.scope.get("root_path", "")
        return {
            "service": "specdec: exact speculative decoding",
            "models": ids,
            "openai_base_url": f"{base}/v1",
            "endpoints": {
                "GET /v1/models": "the served model ids",
                "POST /v1/completions": "text completion (OpenAI; stream: true for server-sent events)",
                "POST /v1/chat/completions": "chat completion (OpenAI; stream: true for server-sent events)",
                "GET /health": "whether the models are loaded",
            },
            "grpc": {"service": "specdec.v1.SpecDec", "port": router.cfg.grpc_port,
                     "metadata": {"application": router.cfg.app_name}},
            "auth": "Authorization: Bearer <key>" if not router.gate.open_mode else "none (open mode)",
        }

    @app.get("/health")
    async def health():
        try:
            await router._ensure_ready()
        except Exception as e:
            return error_response(e)
        return {"status": "ok"}

    def _model(model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "specdec",
                "root": router.info.name}

    @app.get("/v1/models")
    async def list_models(request: Request):
        try:
            router.gate.authenticate(metadata_from_headers(request.headers))
        except Exception as e:
            return error_response(e)
        return {"object": "list", "data": [_model(m) for m in ids]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        try:
            router.gate.authenticate(metadata_from_headers(request.headers))
            if model_id not in ids:
                raise ModelNotFoundError(f"the model '{model_id}' does not exist")
        except Exception as e:
            return error_response(e)
        return _model(model_id)

    async def _serve(request: Request, endpoint: str):
        try:
            try:
                body = await request.json()
            except ValueError:
                raise InvalidRequestError("the request body is not valid JSON") from None
            req = translate(body, endpoint, ids)
            metadata = metadata_from_headers(request.headers)
            if not req.stream:
                results = await run_unary(router, req, metadata)
                return JSONResponse(unary_response(req, results, text))
            started = await start_choices(router, req, metadata)
        except Exception as e:
            return error_response(unwrap(e))
        return StreamingResponse(sse_events(req, started, text), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat")

    return app
