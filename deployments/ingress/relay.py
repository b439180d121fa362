"""Relaying a generation's stream from the Draft deployment to the client, and resuming it on
another draft replica when the one running it dies (:func:`relay`); what the router holds to
resume from (:class:`RelayProgress`). The router is not in the per-token path: the draft replica
runs the loop and talks to the target itself."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable

from deployments.ray_errors import is_replica_death
from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.errors import DeadlineExceededError, ModelNotReadyError

log = logging.getLogger(__name__)

#: How many times one generation is resumed after its draft replica died.
MAX_RESUMES = 3
#: Seconds a draft stream is read after its final chunk (:func:`_drain`) before it is cancelled:
#: the replica's cleanup then waits for at most one CloseSession (VERIFY_TIMEOUT_S, 300 s).
DRAIN_TIMEOUT_S = 600.0
#: The message of a generation cut because its server shuts down (UNAVAILABLE, HTTP 503).
SHUTTING_DOWN = "the server is shutting down; retry once it is back (or on another replica)"


def remaining(deadline_unix_s: float) -> float | None:
    """Seconds until ``deadline_unix_s`` (at least 0), or None without a deadline (0)."""
    return max(0.0, deadline_unix_s - time.time()) if deadline_unix_s else None


class RelayProgress:
    """What the router holds of a generation it relays, to resume it on another draft replica.

    The ids and characters the client received, and the checkpoint the draft replica reported
    with the last chunk (``DraftChunkTrailer``: the tokens that step committed but the chunk held
    back, and the step count). Together they end where a speculation step ended, the only place
    a seeded sampled generation can resume from and continue as it would have (each step's
    random streams are keyed by the position the step starts from).
    """

    def __init__(self) -> None:
        self.sent_ids: list[int] = []
        self.sent_chars = 0
        self.trailer = xpb.DraftChunkTrailer()

    def see(self, raw: bytes) -> pb.GenerateStreamChunk:
        """Record one chunk's bytes from the draft replica; return the chunk for the client.

        The trailer (fields unknown to GenerateStreamChunk) is read and dropped; a chunk without
        one (the last, or from an older draft replica) leaves nothing held.
        """
        chunk = pb.GenerateStreamChunk.FromString(raw)
        chunk.DiscardUnknownFields()
        self.trailer = xpb.DraftChunkTrailer.FromString(raw)
        self.trailer.DiscardUnknownFields()
        self.sent_ids.extend(chunk.token_ids)
        self.sent_chars += len(chunk.text)
        return chunk

    def fill(self, job: xpb.DraftJob) -> None:
        """Set ``job``'s resume fields to continue after what was relayed (nothing at first)."""
        for name in ("resume_token_ids", "resume_held_token_ids", "resume_held_logprobs", "resume_held_top_logprobs"):
            job.ClearField(name)
        job.resume_token_ids.extend(self.sent_ids)
        job.resume_text_chars = self.sent_chars
        job.resume_held_token_ids.extend(self.trailer.held_token_ids)
        job.resume_held_logprobs.extend(self.trailer.held_logprobs)
        job.resume_held_top_logprobs.extend(self.trailer.held_top_logprobs)
        job.resume_steps = self.trailer.steps


def _retrieve(task: asyncio.Future) -> None:
    """Mark ``task``'s exception retrieved (a done-callback: no error of a task nobody awaits any
    more is logged as never retrieved)."""
    if not task.cancelled():
        task.exception()


async def _next_chunk(chunks: Any, timeout_s: float | None, stop: asyncio.Event | None) -> Any:
    """The next item of ``chunks`` (an async iterator), waiting at most ``timeout_s`` seconds
    (None: no limit) and not past ``stop`` being set (the router's shutdown cut).

    Raises:
        StopAsyncIteration: ``chunks`` ended.
        TimeoutError: ``timeout_s`` passed first (the request's deadline).
        ModelNotReadyError: ``stop`` was set first (or already), with :data:`SHUTTING_DOWN`.
    """
    if stop is None:
        return await asyncio.wait_for(chunks.__anext__(), timeout_s)
    if stop.is_set():
        raise ModelNotReadyError(SHUTTING_DOWN)
    nxt = asyncio.ensure_future(chunks.__anext__())
    # retrieved whatever happens here: cancelled twice (Serve may), this frame is left before
    # nxt ends, and nxt then ends with Serve's RequestCancelledError (the relay cancels the
    # stream): "Task exception was never retrieved" in the replica's log for a normal cancellation
    nxt.add_done_callback(_retrieve)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({nxt, stopped}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not nxt.done():
            nxt.cancel()
            await asyncio.wait({nxt})  # as wait_for does: the iterator is idle before anyone closes it
    if not nxt.cancelled():  # a chunk, the stream's end or its error came first
        return nxt.result()
    if stop.is_set():
        raise ModelNotReadyError(SHUTTING_DOWN)
    raise TimeoutError


async def relay(draft: Any, job: xpb.DraftJob, routing_key: str,
                on_resume: Callable[[], None] | None = None,
                stop: asyncio.Event | None = None) -> AsyncIterator[pb.GenerateStreamChunk]:
    """Stream ``job``'s chunks from the draft deployment, resuming after a replica death.

    Args:
        draft: the Draft deployment's handle.
        job: the generation; its resume fields are set here before each (re)try.
        routing_key: the session id the draft replica is chosen by (sticky).
        on_resume: called once per resume (the router counts them).
        stop: set when the server shuts down (:meth:`deployments.router.Router.Drain`): the
            generation ends at once, with ModelNotReadyError, and the draft's stream is cancelled.

    Yields:
        the chunks for the client, trailers dropped; the last carries the finish reason.

    Raises:
        DeadlineExceededError: the job's deadline passed (also inside a long step).
        ModelNotReadyError: the draft replica ended the stream without a final chunk, or
            ``stop`` was set (:data:`SHUTTING_DOWN`).
        the draft replica's error, or its death after :data:`MAX_RESUMES` resumes. Closing
        the generator before the final chunk cancels the draft's stream (both caches freed).

    The relay ends right after the final chunk (the one with the finish reason): nothing waits
    for the draft replica's stream to end, which comes only after the replica's cleanup (the
    step thread, ``CloseSession`` to the target). That rest of the stream is read to its end
    by a task of its own (:func:`_drain`), not cancelled: the draft's request ends as it
    would have (OK in Serve's logs and metrics, not CANCELLED), its cleanup untouched. So a
    unary consumer has its result at the final chunk, and a client cancelling after it is
    answered; an error of the draft's stream after it (its death included) changes nothing.
    """
    progress = RelayProgress()
    resumes = 0
    while True:
        progress.fill(job)
        stream = draft.options(session_id=routing_key, stream=True).Generate.remote(job.SerializeToString())
        finished = False
        try:
            chunks = stream.__aiter__()
            while True:
                try:  # the deadline is kept here too: a step (a long prefill, a loaded CPU) can
                    # outlast it, and the draft replica checks it only between steps
                    raw = await _next_chunk(chunks, remaining(job.deadline_unix_s), stop)
                except StopAsyncIteration:
                    break
                except (asyncio.TimeoutError, TimeoutError):
                    raise DeadlineExceededError("the request's deadline passed during generation") from None
                chunk = progress.see(raw)
                finished = chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                yield chunk
                if finished:  # the generation is complete: the rest of the stream is drained apart
                    return
            raise ModelNotReadyError("the draft replica ended the stream without a final chunk")
        except Exception as e:
            if not is_replica_death(e) or resumes >= MAX_RESUMES or (stop is not None and stop.is_set()):
                raise
            if job.deadline_unix_s and time.time() > job.deadline_unix_s:
                raise DeadlineExceededError("the request's deadline passed") from None
            resumes += 1
            if on_resume is not None:
                on_resume()
            log.warning("draft replica died during %s after %d tokens (%s); resuming (%d)",
                        job.session_id, len(progress.sent_ids), type(e).__name__, resumes)
            await asyncio.sleep(0.2 * resumes)
        finally:
            if finished:  # also when the consumer closed the relay at the final chunk
                _drain_later(stream, chunks, job)
            else:
                _cancel(stream)


#: The draft streams being read to their end after their final chunk (:func:`_drain`); held
#: here so that the garbage collector does not take a task nobody awaits.
_draining: set[asyncio.Task] = set()


def _drain_later(stream: Any, chunks: Any, job: xpb.DraftJob) -> None:
    """Read the rest of ``stream`` (a draft stream whose final chunk was relayed; ``chunks`` its
    iterator) in a task of its own (:func:`_drain`)."""
    try:
        task = asyncio.get_running_loop().create_task(_drain(stream, chunks, job))
    except RuntimeError:  # no event loop any more (the relay collected after it closed)
        _cancel(stream)
        return
    _draining.add(task)
    task.add_done_callback(_draining.discard)


async def _drain(stream: Any, chunks: Any, job: xpb.DraftJob) -> None:
    """Read the draft stream ``chunks`` to its end after its final chunk was relayed: the draft
    replica's request then ends normally, after its cleanup (step thread, ``CloseSession``).

    Nothing more is expected: a chunk is dropped, an error (not a replica death: that one is
    the replica's, nothing of the generation is lost) logged at INFO; the generation's outcome
    was decided at the final chunk. The stream is cancelled only when it outlasts
    :data:`DRAIN_TIMEOUT_S`, or when this task is cancelled (the event loop ends): the draft
    replica's cleanup runs to its end then too (:func:`deployments.aio.finish_despite_cancellation`).
    """
    extra = 0
    end = time.monotonic() + DRAIN_TIMEOUT_S
    try:
        while True:
            try:
                await _next_chunk(chunks, max(0.0, end - time.monotonic()), None)
            except StopAsyncIteration:
                break
            extra += 1
    except (asyncio.TimeoutError, TimeoutError):
        log.info("%s: the draft's stream did not end within %.0f s after its final chunk; cancelled",
                 job.session_id, DRAIN_TIMEOUT_S)
        _cancel(stream)
    except asyncio.CancelledError:
        _cancel(stream)
        raise
    except Exception as e:  # noqa: BLE001 - the generation was complete
        if is_replica_death(e):
            log.debug("%s: the draft replica died after the final chunk (%s)", job.session_id, type(e).__name__)
        else:
            log.info("%s: the draft's stream ended with %s after its final chunk: %s", job.session_id,
                     type(e).__name__, e)
    if extra:
        log.info("%s: the draft's stream sent %d chunk(s) after its final chunk; dropped", job.session_id, extra)


async def drained() -> None:
    """Wait until the draft streams being drained after their final chunk (:func:`_drain`) in
    this event loop have ended (tests: the draft replica's cleanup is then done)."""
    loop = asyncio.get_running_loop()
    while mine := [t for t in _draining if t.get_loop() is loop]:
        await asyncio.wait(mine)


def _cancel(stream: Any) -> None:
    """Cancel a draft stream (the replica frees both caches); a handle's error is ignored."""
    try:
        stream.cancel()
    except Exception:  # noqa: BLE001 - nothing to cancel any more
        pass
