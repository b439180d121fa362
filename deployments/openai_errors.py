"""Errors of the HTTP API in OpenAI's shape.

Errors use OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}`` with the
status of :data:`HTTP_STATUS_BY_GRPC` (one table, from the gRPC code of
:mod:`deployments.grpc_status`): 400 bad request, 401 missing/unknown key, 404 unknown model or
path, 405 wrong method, 413 a body larger than any valid request (an error's own
``http_status``), 429 over a tenant limit (with ``Retry-After`` in whole seconds), 503 while
the models load (``Retry-After: 1``), 504 deadline passed, 500 anything unexpected. ``param``
names the body field at fault (:func:`error_param`), as the message does (:func:`error_message`),
``code`` the tenant limit or ``context_length_exceeded`` (a prompt over the context, or with the
``max_tokens`` the caller set; :func:`error_code`).
"""

from __future__ import annotations

import math
import re

import grpc

from deployments.grpc_status import details_for, status_for

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
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}


def http_status_for(exc: BaseException) -> int:
    """HTTP status of ``exc``: its own ``http_status`` (an HTTP-only error: 413), else via its
    gRPC code (one error table for both APIs)."""
    own = getattr(exc, "http_status", None)
    return own if isinstance(own, int) else HTTP_STATUS_BY_GRPC.get(status_for(exc), 500)


def error_code(exc: BaseException) -> str | None:
    """OpenAI's ``code`` of ``exc``: ``context_length_exceeded`` for a prompt that leaves no room
    (OpenAI's own code), ``model_not_found`` for a ``model`` this server does not serve (OpenAI's
    own code of that 404), the tenant limit's name for a tenant limit (``tokens_per_minute``, ...),
    else None. Always a string or None, as OpenAI's clients expect. A prompt plus an explicit
    ``max_tokens`` over the context is ``context_length_exceeded`` too (OpenAI's, vLLM's)."""
    from specdec.errors import ContextLengthExceededError, ModelNotFoundError, PromptTooLongError

    if isinstance(exc, (PromptTooLongError, ContextLengthExceededError)):
        return "context_length_exceeded"
    if isinstance(exc, ModelNotFoundError):
        return "model_not_found"
    limit = getattr(exc, "limit", None)
    return limit if isinstance(limit, str) else None


#: Core request paths that the OpenAI body spells differently (the gRPC names are already
#: applied by ``parse_request``'s ``field_names``).
_PARAM_OF_CORE = {"prompt_token_ids": "prompt"}
#: A message's leading field path: ``max_tokens``, ``messages.0.role``, ``sampling.logit_bias.7``.
_LEADING_PATH = re.compile(r"([A-Za-z_]\w*(?:\.[\w\[\]]+)*)(?=[:= (]|$)")


def _body_path(path: str, endpoint: str | None, body: dict | None) -> str | None:
    """The body's spelling of core request path ``path`` (``sampling.temperature`` ->
    ``temperature``, ``prompt_token_ids`` -> ``prompt``, or ``messages`` on chat; ``max_tokens`` ->
    ``max_completion_tokens`` when the body sent that), or None when its head is no body field."""
    from deployments.openai_requests import BODY_FIELDS

    path = path.removeprefix("sampling.")
    head = path.split(".")[0]
    param_head = _PARAM_OF_CORE.get(head, head)
    if endpoint == "chat" and param_head == "prompt":  # a chat body's prompt is its messages
        param_head = "messages"
    path = param_head + path[len(head):]
    if path == "max_tokens" and isinstance(body, dict) and "max_tokens" not in body and "max_completion_tokens" in body:
        path = "max_completion_tokens"
    return path if path.split(".")[0] in BODY_FIELDS else None


def _leading_path(text: str) -> tuple[str, str] | None:
    """``(path, rest)`` of a validation message that starts with a field path (``sampling:
    logit_bias: ...``, a rule of the sampling object, gives ``sampling.logit_bias``), else None."""
    m = _LEADING_PATH.match(text)
    if m is None:
        return None
    if m.group(1) != "sampling":
        return m.group(1), text[m.end():]
    inner = text[m.end():].lstrip(": ")
    m = _LEADING_PATH.match(inner)
    return None if m is None else ("sampling." + m.group(1), inner[m.end():])


def error_param(exc: BaseException, endpoint: str | None = None, body: dict | None = None) -> str | None:
    """OpenAI's ``param`` of ``exc``: the request body field it is about, as the body spells it.

    An error that names its field explicitly (attribute ``param``, set where the HTTP layer
    refuses a body) gives that; a prompt over the context gives ``prompt`` (completions) or
    ``messages`` (chat), as OpenAI's own ``context_length_exceeded`` (a chat prompt over a tenant's
    ``max_prompt_tokens`` too: a chat body has no ``prompt``); a prompt that fits but not beside
    the ``max_tokens`` the caller set gives ``max_tokens`` (``max_completion_tokens`` when the
    body spelled it so: the field to lower); any other bad request gives
    the field path its message starts with (every validation message of both APIs starts with
    the field as the caller sent it: ``max_tokens: ...``, ``messages.0.role: ...``,
    ``sampling.temperature: ...`` -> ``temperature``), if that path starts with a field of the
    body; else None (also for every status but 400: OpenAI's 401/404/429 carry no param).

    Args:
        exc: the error (unwrapped from Ray's wrappers).
        endpoint: ``"completions"`` or ``"chat"`` when known.
        body: the request body when it was read: a chat body that set ``max_completion_tokens``
            (OpenAI's current name; ``max_tokens`` is its deprecated alias) gets that name back.
    """
    from specdec.errors import ContextLengthExceededError, PromptTooLongError

    explicit = getattr(exc, "param", None)
    if isinstance(explicit, str):
        return explicit
    if http_status_for(exc) != 400:  # 413 included: the whole body, no field
        return None
    if isinstance(exc, ContextLengthExceededError):
        return _body_path("max_tokens", endpoint, body)
    if isinstance(exc, PromptTooLongError):
        return "messages" if endpoint == "chat" else "prompt"
    lead = _leading_path(str(exc).removeprefix("invalid request: ").split("; ")[0])
    if lead is None:
        return None
    if lead[0].removeprefix("sampling.").split(".")[0] == "logit_bias":  # pydantic's path goes on into its keys
        return "logit_bias"
    return _body_path(lead[0], endpoint, body)


def error_message(exc: BaseException, endpoint: str | None = None, body: dict | None = None) -> str:
    """The message of ``exc`` for an HTTP caller: :func:`deployments.grpc_status.details_for`,
    with every clause of a 400 that starts with a core request path renamed to the body's field
    (``invalid request: sampling.temperature: ...`` -> ``invalid request: temperature: ...``,
    ``prompt_token_ids: id -2 ...`` -> ``prompt: id -2 ...``, a logit_bias key pydantic could not
    read -> ``logit_bias key 'abc': ...``), so the message names what the caller sent, as
    :func:`error_param` does. Other statuses' messages are returned as they are."""
    text = details_for(exc)
    if http_status_for(exc) != 400:
        return text
    prefix = "invalid request: " if text.startswith("invalid request: ") else ""
    clauses = text[len(prefix):].split("; ")
    for i, clause in enumerate(clauses):
        lead = _leading_path(clause)
        if lead is None:
            continue
        path, rest = lead
        if endpoint == "chat" and path.split(".")[0] in ("prompt", "prompt_token_ids"):
            continue  # the prompt rendered from the messages: "prompt is 98 tokens but ..." reads right
        key = re.fullmatch(r"sampling\.logit_bias\.(.*)\.\[key\]", path)
        named = f"logit_bias key {key.group(1)!r}" if key else _body_path(path, endpoint, body)
        if named is not None:
            clauses[i] = named + rest
    return prefix + "; ".join(clauses)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "error"), "param": param, "code": code}}


def error_response(exc: BaseException, endpoint: str | None = None, body: dict | None = None):
    """A JSONResponse in OpenAI's error shape (``param`` from :func:`error_param`), with
    ``Retry-After`` on 429 and 503."""
    from fastapi.responses import JSONResponse

    status = http_status_for(exc)
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if status == 429 and retry is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry)))
    elif status == 503:
        headers["Retry-After"] = "1"
    return JSONResponse(error_body(status, error_message(exc, endpoint, body), error_code(exc),
                                   error_param(exc, endpoint, body)),
                        status_code=status, headers=headers)
