"""finish_despite_cancellation: cleanup survives repeated cancellation of its caller."""

from __future__ import annotations

import asyncio

import pytest

from deployments.aio import finish_despite_cancellation


def test_cleanup_runs_to_its_end_through_two_cancellations():
    done: list[str] = []

    async def cleanup():
        await asyncio.sleep(0.2)
        done.append("cleaned")
        return 7

    async def worker():
        try:
            await asyncio.sleep(10)
        finally:
            await finish_despite_cancellation(cleanup())
            done.append("after")

    async def main():
        task = asyncio.create_task(worker())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert done == ["cleaned"]  # the cleanup ended; the cancellation went on past it


def test_returns_and_raises_like_the_awaitable_when_not_cancelled():
    async def ok():
        return 3

    async def bad():
        raise ValueError("boom")

    assert asyncio.run(finish_despite_cancellation(ok())) == 3
    with pytest.raises(ValueError, match="boom"):
        asyncio.run(finish_despite_cancellation(bad()))
