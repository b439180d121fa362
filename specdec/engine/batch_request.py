"""What a batch scheduler hands out and records: a request's handle and one tick's record.

Part of :mod:`specdec.engine.batch` (re-exported there): :class:`BatchedRequest` is what
:meth:`specdec.engine.batch.BatchScheduler.submit` returns (cancel, wait, result, stream);
:class:`TickRecord` is what one tick did (tests, benchmarks and the cost model read it).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Iterator

from specdec.engine.decoder import Generation
from specdec.types import DraftBlock, GenerationChunk, GenerationResult


@dataclass
class TickRecord:
    """What one tick did (for tests and the cost model).

    Attributes:
        rows: request ids offered to the target forward, in budget order.
        answered: request ids whose block was decided in it.
        positions: positions the rows' next forwards need (uncached tail + K each).
        positions_fed: positions the target forward fed (≤ the budget unless one row alone);
            unbatched, the sum over the rows' separate forwards.
        draft_s, verify_s: seconds spent drafting and in the target forward.
        context: mean tokens in the target's KV cache per row the forward fed, before it (the keys
            each of its query positions attends to besides its row's own; batched only, else None).
    """

    rows: list[int]
    answered: list[int]
    positions: int
    positions_fed: int
    draft_s: float
    verify_s: float
    context: float | None = None


@dataclass
class BatchedRequest:
    """A request running under a :class:`BatchScheduler`; its chunks arrive in :attr:`chunks`.

    Attributes:
        id: scheduler-wide request id (submission order).
        tenant: the tenant it counts against.
        generation: its decoding loop.
    """

    id: int
    tenant: str
    generation: Generation
    proposer: str = "none"
    #: K from the scheduler's controller (``submit(..., adaptive=True)``)
    adaptive: bool = False
    chunks: "queue.Queue[GenerationChunk | BaseException | None]" = field(default_factory=queue.Queue)
    error: BaseException | None = None
    block: DraftBlock | None = None
    #: tick its current block was drafted in (rows whose block waited longest go first)
    block_tick: int = 0
    draft_s: float = 0.0
    _cancel: bool = False
    _done: threading.Event = field(default_factory=threading.Event)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Ask the scheduler to stop this generation at the next tick boundary (thread-safe).

        Its caches are freed then; the other rows of the batch are not disturbed.
        """
        self._cancel = True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the generation ended; whether it did within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def result(self) -> GenerationResult:
        """The finished generation.

        Raises:
            the error that ended it (e.g. :class:`specdec.errors.InvalidRequestError`), or
            RuntimeError when it has not ended.
        """
        if self.error is not None:
            raise self.error
        if not self.done:
            raise RuntimeError("the generation has not finished")
        return self.generation.result()

    def stream(self, timeout: float | None = None) -> Iterator[GenerationChunk]:
        """Yield the chunks as the scheduler produces them (needs a running scheduler thread)."""
        while True:
            item = self.chunks.get(timeout=timeout)
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
