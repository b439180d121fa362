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
        the generator cancels the draft's stream (both caches freed). Once the final chunk
        was yielded nothing is raised: an error while the draft's stream ends (the deadline,
        ``stop``, the replica's death) ends the relay as the stream's end would.
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
            if not finished:
                raise ModelNotReadyError("the draft replica ended the stream without a final chunk")
            return
        except Exception as e:
            if finished:  # the final chunk was relayed: the generation is complete, whatever ends its stream
                log.debug("%s: the draft's stream ended with %s after its final chunk", job.session_id, type(e).__name__)
                return
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
            if not finished:
                try:
                    stream.cancel()
                except Exception:
                    pass
