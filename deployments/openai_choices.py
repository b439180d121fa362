"""Running an OpenAI request's ``n`` choices on the Router: each admitted as its own generation
(:meth:`deployments.router.Router.generate_stream`), run to the end and joined (unary,
:func:`run_unary`) or merged into server-sent events as their chunks come (:func:`sse_events`).
A choice that fails before its first chunk fails the request with its status; the others are
cancelled and their caches freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator, Mapping

from deployments.aio import finish_despite_cancellation
from deployments.openai_errors import error_body, error_code, error_message, error_param, http_status_for
from deployments.openai_requests import OpenAIRequest
from deployments.openai_responses import (
    SSE_DONE,
    TextOffsets,
    TokenText,
    chunk_envelope,
    pooled_stats,
    sse,
    stream_chunk,
    usage_dict,
)
from protos.specdec.v1 import specdec_pb2 as pb




async def _close(gen: Any) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        await finish_despite_cancellation(aclose())


def _own_serve_request_id() -> None:
    """Give the Serve handle calls of the current task (one choice) their own internal request id.

    Serve's request router indexes the calls that wait for a replica by the internal id of the
    request that makes them (Ray 2.60: ``RequestRouter._pending_requests_by_id``, keyed by
    ``RequestMetadata.internal_request_id``); the n choices of one HTTP request share their
    request's id, and when they wait together one of them can be left waiting for a replica
    forever (seen: n = 3 hung, one choice never reaching the draft replica). Only the context of
    this task changes (asyncio copies it per task); in process (no Serve request) nothing does.
    A client's disconnect still stops every choice: the request's task closes them.
    """
    try:
        from ray.serve import context as serve_context
        from ray.serve._private.utils import generate_request_id
    except ImportError:  # pragma: no cover - Serve is a dependency of deployments/
        return
    ctx = serve_context._serve_request_context.get()
    if ctx is None or not ctx._internal_request_id:
        return
    serve_context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=generate_request_id()))


class DrainedChoice:
    """One choice's generation, read from the start by its own task into a queue.

    With ``n > 1`` every choice holds a router admission slot while it runs. Had a choice waited
    to be read (for the other choices' first chunks, or for the client), it would keep its slot
    while choices still queued for a slot wait on it: with fewer free slots than ``n`` the
    request never started. Drained, each choice runs to its end and frees its slot whatever the
    others and the client do; the chunks wait in memory (at most ``max_tokens`` per choice).

    Iterating gives the chunks, then the generation's error if it failed; :meth:`aclose`
    cancels the generation (its admission is ended, both caches freed).
    """

    _END = object()

    def __init__(self, gen: Any):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.ensure_future(self._drain(gen))

    async def _drain(self, gen: Any) -> None:
        _own_serve_request_id()
        try:
            async for c in gen:
                self.queue.put_nowait(c)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the reader
            self.queue.put_nowait(e)
        else:
            self.queue.put_nowait(self._END)
        finally:
            await _close(gen)

    def __aiter__(self) -> "DrainedChoice":
        return self

    async def __anext__(self) -> Any:
        item = await self.queue.get()
        if item is self._END:
            self.queue.put_nowait(item)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        self.task.cancel()
        await finish_despite_cancellation(asyncio.gather(self.task, return_exceptions=True))


def _refuse_n_over_the_tenants_concurrency(router: Any, n: int, metadata: Mapping[str, str]) -> None:
    """Each choice is admitted as one request: ``n`` above the caller's tenant limit
    ``max_concurrent_requests`` can never run, so the request is invalid (HTTP 400
    ``invalid_request_error``, ``param`` ``n``; counted as INVALID_ARGUMENT), not a rate limit
    (429, which OpenAI's clients retry although no retry can succeed). gRPC has no ``n``.

    Raises:
        AuthenticationError: no, malformed or unknown key.
        InvalidRequestError: ``n`` above the tenant's ``max_concurrent_requests``.
    """
    from specdec.errors import InvalidRequestError

    gate = getattr(router, "gate", None)
    if gate is None:
        return
    tenant = gate.authenticate_caller(metadata)
    most = tenant.limits.max_concurrent_requests
    if n > most:
        e = InvalidRequestError(
            f"n={n} choices run as {n} concurrent requests but tenant {tenant.id!r} may run at most {most} at once "
            f"(limits.max_concurrent_requests); lower n to at most {most}")
        e.param = "n"
        gate._refused(tenant.id, "unknown", e)
        raise e


async def start_choices(router: Any, req: OpenAIRequest, metadata: Mapping[str, str]) -> list[tuple[Any, Any]]:
    """Start the n generations and wait for each one's first chunk, so that every error found
    before generating (validation, tenancy, loading) is raised here, before any byte is sent.
    With ``n > 1`` each generation is a :class:`DrainedChoice` (no choice waits on another).

    Returns:
        ``[(first_chunk, stream), ...]`` per choice.

    Raises:
        the first choice's error (the others are cancelled and their admissions ended).
    """
    if req.n > 1:
        _refuse_n_over_the_tenants_concurrency(router, req.n, metadata)
    gens = [router.generate_stream(req.choice_data(i), metadata, req.default_max_tokens) for i in range(req.n)]
    if req.n > 1:
        gens = [DrainedChoice(g) for g in gens]
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
    offsets = [TextOffsets(text) for _ in started]
    firsts = [True] * len(started)
    finals: list = [None] * len(started)
    stream = merged(started)
    try:
        async for i, c in stream:
            yield sse(stream_chunk(req, i, c, text, offsets[i], firsts[i]))
            firsts[i] = False
            if c.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finals[i] = c
        if req.include_usage:
            last = chunk_envelope(req, [])
            last["usage"] = usage_dict(finals)
            last["speculation_stats"] = pooled_stats([f.stats for f in finals])
            yield sse(last)
    except Exception as e:  # after the first byte the status is sent: report in the stream
        from deployments.ray_errors import unwrap

        e = unwrap(e)
        yield sse(error_body(http_status_for(e), error_message(e, req.endpoint), error_code(e), error_param(e, req.endpoint)))
    finally:
        await _close(stream)
    yield SSE_DONE
