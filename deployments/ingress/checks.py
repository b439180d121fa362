"""The checks of a request before it is admitted, each one clear step of
:meth:`deployments.router.Router._prepare` or of its gRPC methods: the metadata (session id,
``application``, deadline), an undecodable body, the number of chat messages, and a text that
cannot fit the context however it tokenizes. Each raises the specdec error whose gRPC code and
HTTP status say what was wrong (:mod:`deployments.grpc_status`)."""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

from deployments.metadata import APPLICATION_KEY, MAX_SESSION_ID_CHARS, SESSION_KEY, TIMEOUT_KEY
from specdec.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
)
from specdec.request import GenerationRequest


class PromptTooManyCharactersError(PromptTooLongError):
    """A prompt refused before tokenizing: more characters than the context's positions can
    spell (INVALID_ARGUMENT; OpenAI code ``context_length_exceeded``, as a tokenized prompt over
    the context). ``prompt_tokens`` is None (not tokenized); ``limit`` is the context in positions."""

    def __init__(self, message: str, limit: int):
        InvalidRequestError.__init__(self, message)
        self.prompt_tokens = None
        self.limit = limit


def metadata_dict(grpc_context: Any) -> dict[str, str]:
    """The invocation metadata of a call as a dict (empty without a context)."""
    if grpc_context is None:
        return {}
    return {k: v for k, v in grpc_context.invocation_metadata()}


def check_session_id(metadata: Mapping[str, str]) -> None:
    """Refuse a session id longer than :data:`MAX_SESSION_ID_CHARS` (gRPC metadata
    ``session_id``, HTTP header ``x-session-id``).

    Raises:
        InvalidRequestError: naming both spellings of the key, the length and the limit.
    """
    sid = metadata.get(SESSION_KEY)
    if sid is not None and len(sid) > MAX_SESSION_ID_CHARS:
        raise InvalidRequestError(f"metadata {SESSION_KEY} (HTTP header x-session-id) is {len(sid)} characters; "
                                  f"at most {MAX_SESSION_ID_CHARS}")


def check_application(metadata: Mapping[str, str], app_name: str) -> None:
    """Refuse a gRPC call whose ``application`` metadata names another Serve application.

    Serve's gRPC proxy routes a call to the only application whatever name it carries
    (``ProxyRouter.get_handle_for_endpoint``: "or if there is only one endpoint"), so a client
    configured for another application would be answered by this one. No metadata is fine (the
    README: optional with one application).

    Raises:
        ModelNotFoundError: (NOT_FOUND) with Serve's own wording for an unknown application.
    """
    name = metadata.get(APPLICATION_KEY)
    if name is not None and name != app_name:
        raise ModelNotFoundError(f"Application '{name}' not found; this server serves the application '{app_name}'")

def refuse_undecodable(request: Any) -> None:
    """Raise InvalidRequestError for an :class:`deployments.servicer.UndecodableRequest`."""
    from deployments.servicer import UndecodableRequest

    if isinstance(request, UndecodableRequest):
        raise InvalidRequestError(request.describe())


def refuse_too_many_messages(data: Mapping[str, Any], limit: int) -> None:
    """Refuse a chat request with more than ``limit`` messages (``AppConfig.max_chat_messages``)
    before validating or templating them: the characters check counts only the messages'
    contents, and the template text each message adds (50,000 empty messages) would be
    tokenized first.

    Raises:
        InvalidRequestError: too many messages.
    """
    messages = data.get("messages")
    if isinstance(messages, (list, tuple)) and len(messages) > limit:
        raise InvalidRequestError(f"messages: {len(messages)} messages are more than this server's limit of "
                                  f"{limit} (max_chat_messages)")


def refuse_surely_too_long(req: GenerationRequest, max_positions: int, max_token_chars: int, target: str) -> None:
    """Refuse a text that cannot fit however it tokenizes, without tokenizing it (a 10 MB
    prompt takes seconds to tokenize).

    Args:
        req: the validated request.
        max_positions: the context of the served pair, in positions.
        max_token_chars: the longest vocabulary entry in characters (a text of n characters is
            at least n / this many tokens).
        target: the target's name, for the message.

    Raises:
        PromptTooManyCharactersError: more characters than ``max_positions`` tokens can spell.
    """
    if req.prompt is not None:
        chars = len(req.prompt)
    elif req.messages is not None:
        chars = sum(len(m.content) for m in req.messages)
    else:
        return
    most = max_positions * max_token_chars
    if chars > most:
        raise PromptTooManyCharactersError(
            f"prompt is {chars} characters: more than the {max_positions} positions of "
            f"the target '{target}' can hold (at most {most} characters)", max_positions
        )


def deadline_from_metadata(metadata: Mapping[str, str], request_timeout_s: float) -> float:
    """Unix time by which the request must end: the client's ``specdec-timeout-s`` seconds from
    now (gRPC metadata, or the HTTP header of the same name), capped by the server's
    ``request_timeout_s``; without it, ``request_timeout_s`` from now.

    Accepted: a number of seconds greater than 0 and finite (``0.5``, ``30``, ``1e3``); a value
    above ``request_timeout_s`` is capped to it. Refused, with one message naming the key and
    the range: 0, negatives, ``nan``, ``inf`` (and a number too large for a double, e.g.
    ``1e400``, which reads as ``inf``), an empty value and anything that is not a number. A 0 or
    negative was a 504 "deadline had passed" before: a caller's mistake, not a slow server.

    Raises:
        InvalidRequestError: (INVALID_ARGUMENT, HTTP 400) the value is outside that range.
    """
    raw = metadata.get(TIMEOUT_KEY)
    if raw is None:
        return time.time() + request_timeout_s
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds < math.inf):  # NaN fails both comparisons
        raise InvalidRequestError(
            f"{TIMEOUT_KEY} (gRPC metadata or HTTP header) must be a number of seconds greater than 0 and finite, "
            f"got {raw!r} (a value above this server's request_timeout_s of {request_timeout_s:g} s is capped to it)")
    return time.time() + min(request_timeout_s, seconds)


def with_default_max_tokens(data: Mapping[str, Any], tenant: Any, default: int | None) -> Mapping[str, Any]:
    """``data`` with ``max_tokens`` set when the caller left it out: ``default`` (the
    server's, :class:`GenerationRequest`'s, when None), at most the tenant's
    ``limits.max_tokens``. A default is the server's choice, so it never makes a request
    fail a tenant limit; a ``max_tokens`` the caller set over the limit still does."""
    if data.get("max_tokens") is not None:
        return data
    most = getattr(getattr(tenant, "limits", None), "max_tokens", None)
    value = GenerationRequest.model_fields["max_tokens"].default if default is None else default
    return {**data, "max_tokens": min(value, most) if isinstance(most, int) else value}
