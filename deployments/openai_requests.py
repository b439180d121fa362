"""OpenAI request bodies -> the core request dict: the request half of the HTTP API
(:mod:`deployments.openai_api` serves it; :mod:`deployments.openai_responses` shapes the answers).

One code path behind both APIs: the HTTP API only *translates*. :func:`translate` turns an
OpenAI body into the plain request dict that :func:`specdec.request.parse_request` validates
(the same dict the gRPC API builds from its proto with ``convert.request_to_dict``), and
:meth:`deployments.router.Router.generate_stream` runs it: validation, tokenizing, tenancy
(the API key comes as ``Authorization: Bearer <key>``), K, the draft replica's stream. A bad
value of a field both APIs have is refused by the core with the same message on both.
Only what gRPC has no field for is checked here (``model``, ``n``, ``stream``, the shapes of
``prompt``, ``messages``, ``stop`` and ``logprobs``), the JSON types of the scalar fields
(which gRPC's proto types fix) and OpenAI's ranges where they are narrower than the core's
(:class:`OpenAIRanges`: ``temperature`` 0..2, at most 4 ``stop`` strings; completions
``logprobs`` 0..5), with :class:`InvalidRequestError`: a body OpenAI's API refuses with 400 is
refused here too, while gRPC keeps the core's wider ranges (temperature 0..100, 16 stop strings,
20 alternatives).

Field mapping (OpenAI -> core request): ``prompt`` (string, or a list of token ids) ->
``prompt`` / ``prompt_token_ids``; ``messages`` -> ``messages`` (``developer`` is ``system``;
content parts of type ``text`` are joined with a newline, empty parts skipped, as vLLM);
``max_tokens`` / ``max_completion_tokens`` ->
``max_tokens`` (completions default 16 as OpenAI's, chat the server's 128, either at most the tenant's limit); ``temperature``
(default 1.0, as OpenAI: send 0 for greedy), ``top_p``, ``seed`` and the non-OpenAI ``top_k``
(``-1`` = off, as vLLM) -> ``sampling``; ``stop`` (a string or a list) -> ``stop``;
``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` ->
``sampling``; ``stop_token_ids``, ``ignore_eos``, ``min_tokens`` as is; ``logprobs`` (chat:
``true`` with ``top_logprobs`` N; completions: the integer N) -> ``logprobs`` + ``top_logprobs``;
``speculation: {proposer, max_k, draft_min_confidence}`` -> ``speculation``; vLLM's ``cache_salt``
(a non-empty string: only requests with the same salt share cached prompt prefixes) as is. ``n`` runs n independent generations (each admitted
as one request; with a ``seed``, choice i uses ``seed + i``). ``user`` is accepted and ignored.
Fields whose only honoured value is "nothing asked" are taken with that value alone (and
their JSON type): chat ``tools: []``, ``tool_choice: "none"``, ``response_format: {"type":
"text"}``, ``parallel_tool_calls`` (a boolean: there are no tools); completions ``echo: false``,
``suffix: ""``, ``best_of`` equal to ``n``; any other value is refused.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.errors import InvalidRequestError, ModelNotFoundError
from specdec.request import MAX_TOKENS, SEED_RANGE

#: Most independent generations (``n``) per request.
MAX_N = 16
#: Most alternatives per position in chat's ``top_logprobs`` (OpenAI's 0..20; also the core's).
MAX_TOP_LOGPROBS = 20
#: Most alternatives per position in completions' ``logprobs`` (OpenAI's "maximum value for
#: logprobs is 5"; chat's ``top_logprobs`` gives up to 20).
MAX_COMPLETION_LOGPROBS = 5
#: ``max_tokens`` of a completions request that sets none (OpenAI's default; chat: the server's).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: Header of the session id (sticky routing; Serve's HTTP proxy reads the same header).
SESSION_HEADER = "x-session-id"

# Fields each endpoint takes (anything else is refused, naming the field: silently ignoring a
# parameter would give a wrong answer). Values of the shared ones are the core's to check.
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
    "presence_penalty", "frequency_penalty", "logit_bias",
    # not OpenAI's, as vLLM / SGLang take them
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "speculation",
    "cache_salt",
}
_FIELDS = {
    "completions": _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                       "response_format", "parallel_tool_calls"},
}
#: Every body field of either endpoint (what an error's ``param`` may name).
BODY_FIELDS = frozenset(_FIELDS["completions"] | _FIELDS["chat"])
#: Fields of ``speculation`` (gRPC's SpeculationHints); the core's other fields (``k``,
#: ``ngram_min``, ...) are not part of the API.
_SPECULATION_FIELDS = ("proposer", "max_k", "draft_min_confidence")
#: Fields of a chat message that are honoured (``tool_calls`` is refused with its own message).
_MESSAGE_FIELDS = {"role", "content", "tool_calls"}
#: JSON types of the body's scalar fields (checked here: the core's pydantic models convert
#: loosely, so ``"max_tokens": true`` was 1 token and ``"ignore_eos": "no"`` false; gRPC's proto
#: types never allow either). ``n``, ``stream`` and ``logprobs`` are checked where they are read.
_WHOLE = ("max_tokens", "max_completion_tokens", "seed", "top_k", "min_tokens", "best_of")
_NUMBER = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty")
_BOOL = ("ignore_eos", "echo", "parallel_tool_calls")
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
        default_max_tokens: ``max_tokens`` when the body sets none (completions: 16; None: the
            server's), at most the tenant's limit (the router applies it).
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
    default_max_tokens: int | None = None

    def choice_data(self, i: int) -> dict:
        """The core request dict of choice ``i`` (a seeded request: seed + i, modulo 2**64, the
        seeds' range: choice 1 of seed 2**64 - 1 uses seed 0)."""
        data = json.loads(json.dumps(self.data))  # a deep copy of plain JSON data
        seed = (data.get("sampling") or {}).get("seed")
        if i and isinstance(seed, int) and not isinstance(seed, bool):
            data["sampling"]["seed"] = (seed + i) % SEED_RANGE
        return data


class OpenAIRanges(BaseModel):
    """OpenAI's bounds of the body fields whose core range is wider (the gRPC API keeps the
    core's: ``temperature`` up to 100, 16 stop strings), so a body OpenAI's API refuses with 400
    is refused here too. Both bounds are checked, so ``temperature`` -1 and 3 get the pair of
    messages the core gives (pydantic's, as :func:`specdec.request.parse_request` words them).

    Attributes:
        temperature: 0..2, finite (OpenAI's ``minimum: 0, maximum: 2``).
        stop: at most 4 strings (OpenAI's ``maxItems: 4``; a single string is one).
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    stop: list[str] | None = Field(None, max_length=4)


def _check_openai_ranges(body: Mapping[str, Any]) -> None:
    """Refuse a value outside :class:`OpenAIRanges` (the JSON types are already checked), with
    the core's wording: ``invalid request: temperature: Input should be less than or equal to
    2``, ``invalid request: stop: List should have at most 4 items after validation, not 5``
    (clauses joined by ``; ``; the error's ``param`` is the first field,
    :func:`deployments.openai_errors.error_param`).

    Raises:
        InvalidRequestError: a value out of OpenAI's range (HTTP 400).
    """
    values = {name: body[name] for name in ("temperature", "stop") if name in body}
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    try:
        OpenAIRanges.model_validate(values)
    except ValidationError as e:
        raise InvalidRequestError("invalid request: " + "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())) from None


def _refusal(message: str, param: str) -> InvalidRequestError:
    """An InvalidRequestError whose OpenAI ``param`` is ``param`` (a field its message does not
    start with; :func:`deployments.openai_responses.error_param`)."""
    err = InvalidRequestError(message)
    err.param = param
    return err


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_id_list(x: Any) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(_is_int(t) for t in x)


def _check_json_types(body: Mapping[str, Any]) -> None:
    """Refuse a scalar field of the wrong JSON type (a string for a number, a boolean for a whole
    number, ...), naming the field; values are the core's to check."""
    for name in _WHOLE:
        if name in body and not _is_int(body[name]):
            raise InvalidRequestError(f"{name} must be a whole number, got {body[name]!r}")
    for name in _NUMBER:
        if name in body and (isinstance(body[name], bool) or not isinstance(body[name], (int, float))):
            raise InvalidRequestError(f"{name} must be a number, got {body[name]!r}")
    for name in _BOOL:
        if name in body and not isinstance(body[name], bool):
            raise InvalidRequestError(f"{name} must be true or false, got {body[name]!r}")
    for name in ("user", "cache_salt", "suffix"):
        if name in body and not isinstance(body[name], str):
            raise InvalidRequestError(f"{name} must be a string, got {body[name]!r}")
    ids = body.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is_int(t) for t in ids)):
        raise InvalidRequestError(f"stop_token_ids must be a list of token ids, got {ids!r}")
    if body.get("logit_bias") is not None:
        _check_logit_bias(body["logit_bias"])
    spec = body.get("speculation")
    if isinstance(spec, Mapping):
        extra = sorted(k for k, v in spec.items() if k not in _SPECULATION_FIELDS and v is not None)
        if extra:  # e.g. "k" went on to the core's own speculation.k as if it were max_k
            raise _refusal(f"speculation: unsupported field(s): {', '.join(extra)}; it takes "
                           + ", ".join(_SPECULATION_FIELDS), f"speculation.{extra[0]}")
        if spec.get("max_k") is not None and not _is_int(spec["max_k"]):
            raise InvalidRequestError(f"speculation.max_k must be a whole number, got {spec['max_k']!r}")
        conf = spec.get("draft_min_confidence")
        if conf is not None and (isinstance(conf, bool) or not isinstance(conf, (int, float))):
            raise InvalidRequestError(f"speculation.draft_min_confidence must be a number, got {conf!r}")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")


def _check_logit_bias(bias: Any) -> None:
    """An object of token id -> number whose keys name each id once: JSON keys are strings, so
    ``"7"`` and ``"07"`` are one id, of which the core's ``dict[int, float]`` would keep one bias.
    A key that is no id is left to the core, which names it."""
    if not (isinstance(bias, Mapping) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              for v in bias.values())):
        raise InvalidRequestError(f"logit_bias must be an object of token id -> number, got {bias!r}")
    seen: dict[int, str] = {}
    for key in bias:
        try:
            tid = int(key)
        except (TypeError, ValueError):
            continue
        if tid in seen:
            raise InvalidRequestError(f"logit_bias: token id {tid} is given twice ({seen[tid]!r} and {key!r})")
        seen[tid] = key


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


#: what a message's text parts (``content: [{"type": "text", "text": ...}, ...]``) are joined with
TEXT_PART_SEPARATOR = "\n"


def _content(i: int, content: Any) -> str:
    if content is None:  # OpenAI refuses it too (it allows none only beside tool_calls, refused here)
        raise InvalidRequestError(f"messages.{i}.content is required (a string or a list of text parts)")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"messages.{i}.content: only text parts are supported")
            texts.append(part["text"])
        # one newline between non-empty parts, as vLLM joins them (its "string" content format,
        # empty parts skipped): the same parts give the same prompt, and so the same answer, as there
        return TEXT_PART_SEPARATOR.join(t for t in texts if t)
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
        extra = sorted(k for k, v in m.items() if k not in _MESSAGE_FIELDS and v is not None)
        if extra:  # e.g. name: the chat template has no place for it, and ignoring it changes the answer
            raise _refusal(f"messages.{i}: unsupported field(s): {', '.join(extra)}", f"messages.{i}.{extra[0]}")
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
            field, a value outside OpenAI's range (:class:`OpenAIRanges`) (HTTP 400).
        ModelNotFoundError: ``model`` is not served (HTTP 404).
    """
    if not isinstance(body, Mapping):
        raise InvalidRequestError("the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # JSON null = not set
    unknown = sorted(set(body) - _FIELDS[endpoint])
    if unknown:
        raise _refusal(f"unsupported field(s): {', '.join(unknown)}", unknown[0])
    model = body.get("model")
    if model is None:
        raise InvalidRequestError("model is required: one of " + ", ".join(repr(m) for m in model_ids))
    if not isinstance(model, str) or not model:
        raise InvalidRequestError(f"model must be one of {', '.join(repr(m) for m in model_ids)}, got {model!r}")
    if model not in model_ids:
        raise ModelNotFoundError(f"the model '{model}' does not exist; this server serves "
                                 + ", ".join(repr(m) for m in model_ids))
    _check_json_types(body)
    _check_openai_ranges(body)
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
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_COMPLETION_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be a whole number in 0..{MAX_COMPLETION_LOGPROBS}, got {top!r}")
        if "max_tokens" in body:
            data["max_tokens"] = body["max_tokens"]
    else:
        if "messages" not in body:
            raise InvalidRequestError("messages is required")
        data["messages"] = _messages(body["messages"])
        # only the values that ask for no tool call are taken ("tools": "none" or "tool_choice": []
        # were accepted too: a malformed body answered as if it were well formed)
        for name, off in (("tools", []), ("tool_choice", "none")):
            if body.get(name, off) != off:
                raise InvalidRequestError(f"{name}: tool calls are not supported (only {json.dumps(off)} is accepted)")
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise InvalidRequestError("response_format: only {\"type\": \"text\"} is supported")
        if "max_tokens" in body and "max_completion_tokens" in body and body["max_tokens"] != body["max_completion_tokens"]:
            raise _refusal("give max_tokens or max_completion_tokens, not two different values", "max_completion_tokens")
        if "max_completion_tokens" in body:
            limit = body["max_completion_tokens"]
            if "max_tokens" not in body and not 1 <= limit <= MAX_TOKENS:  # named as the body spells it
                bound = "greater than or equal to 1" if limit < 1 else f"less than or equal to {MAX_TOKENS}"
                raise InvalidRequestError(f"invalid request: max_completion_tokens: Input should be {bound}")
            data["max_tokens"] = limit
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
    for name in ("stop_token_ids", "ignore_eos", "min_tokens", "cache_salt"):
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
                         include_usage=include_usage, top_logprobs=top, id=f"{kind}-{uuid.uuid4().hex}",
                         default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS if endpoint == "completions" else None)


class BodyTooLargeError(InvalidRequestError):
    """A request body larger than any body that could be valid (HTTP 413, before it is read).

    Attributes:
        http_status: 413.
    """

    http_status = 413


def max_body_bytes(max_positions: int, max_token_chars: int, vocab: int) -> int:
    """The largest request body worth reading, in bytes: a prompt of the most characters the
    context can spell (``max_positions`` x ``max_token_chars``), each written as a 6-byte JSON
    escape, plus a ``logit_bias`` entry for every id of the vocabulary (32 bytes each), plus
    16 MiB for everything else (the JSON of many chat messages, stop strings, ...). A larger
    body cannot be a request that fits, so it is refused unread instead of being held (and
    parsed) in the router's memory."""
    return 6 * max_positions * max_token_chars + 32 * vocab + 16 * 2**20


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a Starlette ``request``, refused past ``limit`` bytes without reading the
    rest: at once when ``Content-Length`` says so, else as soon as the streamed chunks exceed it.

    Raises:
        BodyTooLargeError: the body is larger than ``limit``.
    """
    def refuse(size: str) -> BodyTooLargeError:
        return BodyTooLargeError(f"the request body is {size} bytes: more than this server's limit of {limit} "
                                 "bytes (no request that fits the model's context is that large)")

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise refuse(declared)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise refuse(f"more than {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


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
