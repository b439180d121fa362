"""The error contract: specdec errors -> gRPC status codes, set on the context at the edge.

Ray Serve turns an exception raised from a gRPC deployment method into ``INTERNAL`` with a stack
trace, whatever code was set on the context. So a gRPC method never lets an exception out: it
catches at the edge, sets code and details on the ``grpc_context`` and returns an empty response
(or ends its stream). :func:`abort_with` is that one step; :data:`STATUS_BY_ERROR` is the one
table of codes.

    async def Generate(self, request, grpc_context=None):
        try:
            return await self._generate(request)
        except Exception as e:
            return abort_with(grpc_context, e, pb.GenerateResponse)

Server-streaming methods are different (checked on Ray 2.60): Serve ships the context to the
proxy *with each yielded message*, so a generator that sets a code and returns without
yielding ends with OK. Instead, :func:`abort_stream` sets the code and raises
:class:`StreamAborted`; Ray 2.60's replica wraps an exception raised after a code was set on the
context into ``gRPCStatusError`` carrying that code and details, so the client gets the code
(not INTERNAL) and no further message.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import grpc

from specdec import errors

logger = logging.getLogger(__name__)

#: Error class -> status code. Looked up along the exception's MRO, so the most specific entry
#: wins (PromptTooLongError is an InvalidRequestError -> INVALID_ARGUMENT).
STATUS_BY_ERROR: dict[type[BaseException], grpc.StatusCode] = {
    errors.InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.AuthenticationError: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    errors.ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.GenerationCancelledError: grpc.StatusCode.CANCELLED,
    errors.ModelNotFoundError: grpc.StatusCode.NOT_FOUND,
    errors.ModelNotReadyError: grpc.StatusCode.UNAVAILABLE,
    errors.ModelLoadError: grpc.StatusCode.UNAVAILABLE,
    errors.ModelCompatibilityError: grpc.StatusCode.FAILED_PRECONDITION,
    TimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
}

#: Trailing-metadata key carrying ``ResourceExhaustedError.retry_after_s`` (seconds, decimal).
RETRY_AFTER_KEY = "retry-after-s"

R = TypeVar("R")


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code of ``exc``: the first class of its MRO in the table, else INTERNAL."""
    for cls in type(exc).__mro__:
        code = STATUS_BY_ERROR.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def details_for(exc: BaseException) -> str:
    """The client-facing message: the error's own text for specdec errors, a generic one else.

    Unexpected exceptions are logged with their stack trace here and not sent to the client.
    """
    if status_for(exc) is grpc.StatusCode.INTERNAL:
        logger.exception("internal error", exc_info=exc)
        return f"internal error ({type(exc).__name__}); see the server log"
    return str(exc) or type(exc).__name__


def abort_with(grpc_context: Any, exc: BaseException, response_type: type[R] | None = None) -> R | None:
    """Set ``exc``'s status code and message on ``grpc_context`` and return an empty response.

    Args:
        grpc_context: Ray Serve's ``RayServegRPCContext`` (or any object with ``set_code``,
            ``set_details`` and optionally ``set_trailing_metadata``); None when called through a
            handle, in which case the exception is re-raised for the caller.
        exc: the error.
        response_type: the method's response message class; its empty instance is returned
            (None for a streaming method, which then just stops yielding).

    Returns:
        ``response_type()`` or None.

    Raises:
        the original ``exc`` when ``grpc_context`` is None.
    """
    if grpc_context is None:
        raise exc
    grpc_context.set_code(status_for(exc))
    grpc_context.set_details(details_for(exc))
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None and hasattr(grpc_context, "set_trailing_metadata"):
        # a list: Ray Serve's context appends it to its own request-id pairs (list + tuple raised)
        grpc_context.set_trailing_metadata([(RETRY_AFTER_KEY, f"{retry:.3f}")])
    return response_type() if response_type is not None else None


class StreamAborted(Exception):
    """Raised out of a streaming gRPC method after :func:`abort_stream` set the status."""


def abort_stream(grpc_context: Any, exc: BaseException) -> None:
    """End a server-streaming method with ``exc``'s status: set it on the context and raise.

    Raises:
        StreamAborted: always (from ``exc``); the original ``exc`` when ``grpc_context`` is None.
    """
    abort_with(grpc_context, exc)
    raise StreamAborted(details_for(exc)) from exc
