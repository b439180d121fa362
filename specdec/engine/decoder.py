"""The speculation loop of one request: propose → verify → commit, with stop conditions.

Synchronous and free of I/O. The target side is anything with ``verify(block) -> VerifyResult``,
``committed_len`` and ``close()``: the in-process :class:`specdec.engine.verifier.TargetSession`, or a
serving layer's stand-in that sends the block to a remote target replica.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Protocol

from specdec.engine.proposers.base import ProposerSession
from specdec.engine.stopping import OutputAssembler
from specdec.types import (
    Checkpoint,
    DraftBlock,
    FinishReason,
    GenerationChunk,
    GenerationResult,
    SpeculationStats,
    Usage,
    VerifyResult,
)


class TargetLike(Protocol):
    """What the loop needs of the target side."""

    @property
    def committed_len(self) -> int: ...

    def verify(self, block: DraftBlock) -> VerifyResult: ...

    def close(self) -> None: ...


def speculation_length(k: int, committed_len: int, max_total_len: int, generated: int, max_tokens: int) -> int:
    """The K actually used for a step: the wanted ``k`` shrunk to the room that is left.

    A step with K drafts feeds the target positions up to ``committed_len + K - 1`` and emits up
    to K + 1 tokens, so K is capped to keep the sequence within ``max_total_len`` tokens and the
    completion within ``max_tokens`` (tokens).

    Returns:
        K in ``0..k``.
    """
    room_context = max_total_len - committed_len - 1
    room_tokens = max_tokens - generated - 1
    return max(0, min(k, room_context, room_tokens))


class Generation:
    """One request's decoding loop.

    Args:
        target: the target session (or a remote stand-in), already holding the prompt.
        proposer: the proposer session, or None for plain decoding.
        assembler: output and stop conditions of the request.
        prompt_len: prompt length in tokens.
        max_total_len: context limit in tokens (prompt + completion) of the target.
        k: the largest K per step, or a callable returning it before each step (an adaptive
            controller); it is then shrunk by :func:`speculation_length`.
        clock: seconds counter (injected for tests).
        seed: the request's seed (recorded in :meth:`checkpoint`; the sessions already hold
            the seeds derived from it).
        steps_done: steps run before this loop started (a resumed generation), for
            :meth:`checkpoint` and :attr:`steps`.
    """

    def __init__(
        self,
        *,
        target: TargetLike,
        proposer: ProposerSession | None,
        assembler: OutputAssembler,
        prompt_len: int,
        max_total_len: int,
        k: int | Callable[[], int],
        clock: Callable[[], float] = time.perf_counter,
        seed: int = 0,
        steps_done: int = 0,
    ):
        self.target = target
        self.seed = seed
        self.steps_done = steps_done
        self.proposer = proposer
        self.assembler = assembler
        self.prompt_len = prompt_len
        self.max_total_len = max_total_len
        self._k = k
        self._clock = clock
        self.stats = SpeculationStats()
        self._started = clock()
        self._ended: float | None = None
        self._closed = False

    @property
    def finished(self) -> bool:
        return self.assembler.finished

    @property
    def steps(self) -> int:
        """Speculation steps run so far, those before a resume included."""
        return self.steps_done + self.stats.steps

    def checkpoint(self) -> Checkpoint:
        """Where this generation stands: always the end of a step (see :class:`Checkpoint`).

        ``open_generation(..., resume=checkpoint)`` (or ``SpeculativeEngine.start``) continues
        it, elsewhere or later, token for token as this one would have gone on.

        Raises:
            RuntimeError: the generation has finished (nothing is left to continue).
        """
        if self.finished:
            raise RuntimeError("a finished generation has no checkpoint")
        a = self.assembler
        if self.prompt_len + len(a.token_ids) != self.target.committed_len:  # pragma: no cover - a bug
            raise RuntimeError(f"output holds {len(a.token_ids)} tokens after a {self.prompt_len}-token prompt, "
                               f"the target committed {self.target.committed_len}")
        return Checkpoint(
            token_ids=list(a.token_ids),
            logprobs=list(a.logprobs) if a.want_logprobs else None,
            top_logprobs=list(a.top_logprobs) if a.want_top else None,  # rows are never changed once added
            steps=self.steps,
            seed=self.seed,
            sent_ids=a.sent_ids,
            sent_text_chars=a.sent_text_chars,
        )

    def _wanted_k(self) -> int:
        if self.proposer is None:
            return 0
        return int(self._k()) if callable(self._k) else int(self._k)

    def step(self) -> GenerationChunk | None:
        """Run one speculation step; return what may be streamed now (or None)."""
        if self.finished:
            return self.assembler.take_chunk()
        k = self.plan()
        if k is None:
            return self._done_chunk()
        t0 = self._clock()
        block = self.proposer.propose(k) if (self.proposer is not None and k > 0) else DraftBlock.empty()
        t1 = self._clock()
        result = self.target.verify(block)
        t2 = self._clock()
        return self.apply(block, result, t1 - t0, t2 - t1)

    def plan(self) -> int | None:
        """The K of the next step, or None when the generation ends before it (context full).

        The first half of :meth:`step`; a batch scheduler calls it, drafts and verifies many
        generations' blocks together, and hands each result to :meth:`apply`.
        """
        if self.finished:
            return None
        committed = self.target.committed_len
        if committed >= self.max_total_len:
            self.assembler.finish(FinishReason.CONTEXT_LENGTH)
            return None
        return speculation_length(
            self._wanted_k(), committed, self.max_total_len, len(self.assembler.token_ids), self.assembler.max_tokens
        )

    def apply(self, block: DraftBlock, result: VerifyResult, draft_s: float, verify_s: float) -> GenerationChunk | None:
        """Record a verified step (the second half of :meth:`step`); return what may be streamed.

        Args:
            block: the step's candidate block (K drafts).
            result: its verification (the target session has already committed it).
            draft_s, verify_s: seconds spent drafting and verifying (in a batch: the batch's).
        """
        self.stats.record_step(block.k, result.accepted, draft_s, verify_s)
        if self.proposer is not None:
            self.proposer.commit(result.token_ids)
        self.assembler.add(result.token_ids, result.logprobs, result.top_logprobs)
        if not self.finished and self.target.committed_len >= self.max_total_len:
            self.assembler.finish(FinishReason.CONTEXT_LENGTH)
        if self.finished:
            return self._done_chunk()
        return self.assembler.take_chunk()

    def finish_chunk(self) -> GenerationChunk | None:
        """After :meth:`plan` returned None: close the sessions and return the last chunk."""
        return self._done_chunk()

    def _done_chunk(self) -> GenerationChunk | None:
        if self._ended is None:
            self._ended = self._clock()
        self.close()
        return self.assembler.take_chunk()

    def cancel(self) -> None:
        """Stop generating (finish reason CANCELLED) and free both sessions' caches."""
        self.assembler.finish(FinishReason.CANCELLED)
        self._done_chunk()

    def __iter__(self) -> Iterator[GenerationChunk]:
        """Stream chunks until finished; the last chunk carries the finish reason."""
        try:
            while True:
                chunk = self.step()
                if chunk is not None:
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
        finally:
            self.close()

    def run(self) -> GenerationResult:
        """Decode to the end and return the whole result."""
        for _ in self:
            pass
        return self.result()

    def result(self) -> GenerationResult:
        """The finished generation (text, ids, finish reason, usage, speculation stats)."""
        a = self.assembler
        if a.finish_reason is None:
            raise RuntimeError("generation has not finished")
        end = self._ended if self._ended is not None else self._clock()
        return GenerationResult(
            text=a.text,
            token_ids=list(a.token_ids),
            finish_reason=a.finish_reason,
            usage=Usage(prompt_tokens=self.prompt_len, completion_tokens=len(a.token_ids)),
            stats=self.stats,
            logprobs=list(a.logprobs) if a.want_logprobs else None,
            top_logprobs=[list(t) for t in a.top_logprobs] if a.want_top else None,
            elapsed_s=end - self._started,
        )

    def close(self) -> None:
        """Free the sessions' caches. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.target.close()
        if self.proposer is not None:
            self.proposer.close()
