"""Cleanup that a second cancellation cannot cut short.

When a gRPC call ends early, Serve can cancel a replica's task more than once (the proxy's
cancellation and the router's ``stream.cancel()`` race). A ``finally`` block that awaits is
then interrupted at its first ``await`` and the rest of it never runs: a draft cache stays
listed, a rate lease is never returned. :func:`finish_despite_cancellation` runs the cleanup as
its own task, waits for it through any number of cancellations, and only then lets the
cancellation through.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

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
