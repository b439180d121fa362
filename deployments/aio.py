"""Cleanup that a second cancellation cannot cut short.

When a gRPC call ends early, Serve can cancel a replica's task more than once (the proxy's
cancellation and the router's ``stream.cancel()`` race). A ``finally`` block that awaits is
then interrupted at its first ``await`` and the rest of it never runs: a draft cache stays
listed, a rate lease is never returned. :func:`finish_despite_cancellation` runs the cleanup as
its own task, waits for it through any number of cancellations, and only then lets the
cancellation through. Ray cancels the request's task recursively as well (the actor calls made
from it); :func:`outside_request` submits a call that must outlive that.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")


async def finish_despite_cancellation(aw: Awaitable[T]) -> T:
    """Await ``aw`` to its end even if the calling task is cancelled meanwhile.

    Returns:
        what ``aw`` returns.

    Raises:
        asyncio.CancelledError: the caller was cancelled while waiting (raised after ``aw`` ended).
        Exception: whatever ``aw`` raised.
    """
    task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the cleanup itself was cancelled (loop shutting down)
                raise
            cancelled = True
    if cancelled:
        task.result()  # surface the cleanup's own error first, if any
        raise asyncio.CancelledError()
    return task.result()


def outside_request(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in an empty :mod:`contextvars` context, so that the Ray calls it submits
    are not children of the Serve request being handled.

    When Serve cancels a request (the client disconnected, the caller cancelled a stream) it
    cancels the replica's Ray task *recursively*: every actor call submitted from the request's
    context (Ray keeps the current task in a context variable of the event loop) is cancelled
    too, even one awaited through :func:`finish_despite_cancellation`. A cleanup call (a rate
    lease's release) or a replica-wide background job (a batched-forward loop, an exchange
    with the shared controller actor) must not be: submit it through this function (or start
    its task with ``context=contextvars.Context()``). Tests:
    ``tests/deployments/test_shared_actor_calls.py``.
    """
    return contextvars.Context().run(fn, *args)
