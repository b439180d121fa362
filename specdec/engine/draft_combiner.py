"""Batched drafting for a serving replica whose generations are stepped by separate threads.

:class:`DraftCombiner` combines the draft-model forwards of the sessions that ask to draft at
about the same time into one batched forward per draft position; the in-process counterpart that
steps every generation itself is :class:`specdec.engine.batch.BatchScheduler`.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Any, Callable

from specdec.engine.decoder import Generation
from specdec.engine.proposers.draft_model import DECODE_TAIL, DraftModelSession
from specdec.types import DraftBlock, GenerationChunk

class _Waiting:
    __slots__ = ("session", "k", "block", "error")

    def __init__(self, session: DraftModelSession, k: int):
        self.session, self.k = session, k
        self.block: DraftBlock | None = None
        self.error: BaseException | None = None


class DraftCombiner:
    """Batches the drafting of generations that are stepped by separate threads.

    A serving replica steps each generation in its own thread (its verify is a remote call that
    waits). :meth:`step` is :meth:`specdec.engine.decoder.Generation.step` with the drafting combined:
    the draft-model sessions that ask to draft while another batch is drafting (or within
    ``window_s`` of the first) draft together, one batched forward per draft position
    (:meth:`specdec.engine.proposers.draft_model.DraftModelProposer.propose_batch`). Prompt lookup and
    plain decoding need no forward and run in the caller's thread.

    Args:
        batched: False drafts every session alone (the unbatched path), in its caller's thread;
            its draft forwards are timed all the same (:meth:`take_timings`).
        window_s: seconds the first caller waits for others before drafting.
        clock: seconds clock.
        max_prefill: chunked draft prefill: uncached prompt positions fed per batch round (a
            session whose prompt is longer is prefilled in chunks over several rounds, waiting
            in the queue, while the others get their blocks every round); None: no bound.
            Batched only: unbatched, a session feeds its whole prompt in its first forward.
        k_control: a :class:`specdec.control.batch_k.BatchKSessions`: after every step it
            learns the step's K and acceptance, the target forward that verified it, batched or
            alone (``VerifyResult.batch``), and the draft forwards run since (batched, or one
            row each unbatched).
        linger_s: the batch fill of drafting: after the window, the first caller also waits for
            the sessions that drafted before and are still out (verifying, or on their way
            back), as long as one of them comes back within ``linger_s`` of the last arrival
            (the replies of one batched target forward reach their threads a few ms apart), at
            most ``max_linger_s`` in all; 0: the window alone. Sessions that finished, or that
            no longer draft with a draft model, are not waited for.
        max_linger_s: seconds, the longest such wait of one drafting batch.
        peers: how many generations the replica steps now (a callable; None: unknown). With at
            most one, the first caller drafts at once: no window, nobody to wait for (one client
            alone waited ``window_s`` on every step).
    """

    def __init__(self, batched: bool = True, window_s: float = 0.002, clock: Callable[[], float] = time.perf_counter,
                 max_prefill: int | None = None, k_control: Any = None, linger_s: float = 0.02,
                 max_linger_s: float = 0.25, peers: Callable[[], int] | None = None):
        if max_prefill is not None and max_prefill < 1:
            raise ValueError(f"max_prefill must be >= 1, got {max_prefill}")
        self.batched = batched
        self.window_s = window_s
        self.linger_s = linger_s
        self.max_linger_s = max_linger_s
        self.peers = peers
        #: draft-model sessions that drafted and are not back yet (weak: a dropped one leaves)
        self._out: weakref.WeakSet = weakref.WeakSet()
        #: seconds each drafting batch waited for sessions still out (most recent 1000)
        self.lingered: collections.deque = collections.deque(maxlen=1000)
        self.max_prefill = max_prefill
        self._clock = clock
        #: ``(rows, positions)`` of every draft forward (most recent 1000; rows 1 unbatched)
        self.trace: collections.deque = collections.deque(maxlen=1000)
        #: ``(rows, wall seconds)`` of draft decode forwards (batched, or one row each unbatched)
        #: not yet taken by :meth:`take_timings` (:meth:`_record`: no prefill or catch-up forwards)
        self._timings: collections.deque = collections.deque(maxlen=1000)
        self.k_control = k_control
        self._cv = threading.Condition()
        self._queue: list[_Waiting] = []
        self._busy = False
        #: sizes of the draft batches run (for tests and statistics)
        self.batch_sizes: list[int] = []
        #: unbatched draftings running now, each with whether another overlapped it (a list of
        #: one bool, shared with the caller); guarded by ``_cv``
        self._unbatched_running: list[list[bool]] = []

    def propose(self, session: Any, k: int) -> DraftBlock:
        """Draft up to ``k`` tokens for ``session``, batched with concurrent callers (blocking)."""
        if session is None or k <= 0:
            return DraftBlock.empty()
        if not isinstance(session, DraftModelSession):
            return session.propose(k)  # prompt lookup: no forward to time
        if not self.batched:
            return self._draft_unbatched(session, k)
        me = _Waiting(session, k)
        with self._cv:
            self._out.discard(session)
            self._queue.append(me)
            self._cv.notify_all()
            while me.block is None and me.error is None:
                if self._busy:
                    self._cv.wait()
                    continue
                self._busy = True
                self._cv.release()
                try:
                    if self.window_s > 0 and (self.peers is None or self.peers() > 1):
                        time.sleep(self.window_s)
                    with self._cv:
                        self._linger()
                        batch, self._queue = self._queue, []
                    self._run(batch)
                finally:
                    self._cv.acquire()
                    self._busy = False
                    self._cv.notify_all()
            self._out.add(session)
        if me.error is not None:
            raise me.error
        return me.block

    def _linger(self) -> None:
        """(Holding the lock.) Wait for sessions still out while they keep coming back (see
        ``linger_s``)."""
        if self.linger_s <= 0 or not self._out:
            return
        t0 = self._clock()
        last, n = t0, len(self._queue)
        while self._out:
            now = self._clock()
            until = min(last + self.linger_s, t0 + self.max_linger_s)
            if now >= until:
                break
            self._cv.wait(until - now)
            if len(self._queue) != n:
                last, n = self._clock(), len(self._queue)
        self.lingered.append(self._clock() - t0)

    def leave(self, session: Any) -> None:
        """``session`` drafts no more (its generation ended): drafting batches stop waiting for it."""
        if not isinstance(session, DraftModelSession):
            return
        with self._cv:
            self._out.discard(session)
            self._cv.notify_all()

    def _run(self, batch: list[_Waiting]) -> None:
        self.batch_sizes.append(len(batch))
        groups: dict[int, list[_Waiting]] = {}
        for w in batch:
            groups.setdefault(id(w.session._proposer), []).append(w)
        later: list[_Waiting] = []
        for rows in groups.values():
            try:
                blocks = self._draft(rows)
            except Exception as e:
                if len(rows) == 1:
                    rows[0].error = e
                    continue
                blocks = self._draft_alone(rows)
            except BaseException as e:  # an interrupt, not one session's failure: all alike
                for w in rows:
                    w.error = e
                continue
            for w, block in zip(rows, blocks):
                if w.error is not None:
                    continue
                if block is None:
                    later.append(w)  # its prompt is being prefilled in chunks: next round
                else:
                    w.block = block
        if later:
            with self._cv:
                self._queue = later + self._queue

    def _draft(self, rows: list[_Waiting]) -> list[DraftBlock | None]:
        """One batched drafting of ``rows`` (sessions of one proposer); records its forwards.

        Raises:
            whatever :meth:`DraftModelProposer.propose_batch` raises (the batch as a whole).
        """
        timings: list[tuple[int, float]] = []
        trace: list[tuple[int, int]] = []
        try:
            return rows[0].session._proposer.propose_batch(
                [w.session for w in rows], [w.k for w in rows], timings,
                **({} if self.max_prefill is None else {"max_prefill": self.max_prefill}), trace=trace)
        finally:
            self._record(timings, trace)

    def _record(self, timings: list[tuple[int, float]], trace: list[tuple[int, int]]) -> None:
        """Keep one drafting call's forwards: all in :attr:`trace`; in the timings the cost model
        takes (:meth:`take_timings`) only the decode forwards, at most :data:`DECODE_TAIL`
        positions a row (as the in-process scheduler's :func:`specdec.engine.batch_draft.draft_tick`):
        a forward that also fed a prompt's prefill or a catch-up after K = 0 steps costs far more
        than a draft position, and the timings are pooled, so whichever session's step takes them
        next would record it as its own draft forward (a 900-token prompt's 8.6 ms prefill
        forward among 1-ms decode forwards)."""
        with self._cv:
            self.trace.extend(trace)
            self._timings.extend(t for t, (rows, positions) in zip(timings, trace)
                                 if positions <= DECODE_TAIL * rows)

    def _draft_unbatched(self, session: DraftModelSession, k: int) -> DraftBlock:
        """The unbatched path: ``session`` drafts alone in the caller's thread, exactly as
        ``session.propose(k)`` (:meth:`DraftModelProposer.propose_batch` of one row and no
        ``max_prefill`` drives the same :meth:`DraftModelSession.drafting` through
        :func:`specdec.kv_cache.feed_many` of one item, which is :meth:`CachedSequence.feed`:
        the same tokens fed, the same logits), and its draft forwards are recorded as the batched
        path's are: ``(1, wall seconds of the forward)`` each for :meth:`take_timings` (so the
        K-under-load cost model prices a draft forward from measurements, not from its prior),
        ``(1, positions fed)`` each in :attr:`trace`. Not in :attr:`batch_sizes` (no batch).

        Only a drafting that no other unbatched drafting overlapped is timed: unbatched sessions
        draft concurrently in their own threads, sharing the device, so each forward's wall
        seconds under contention are several forwards' (8 sessions on 2 CPU cores: 0.20 s for a
        0.036-s forward), and taken as a draft forward's price they held every tenant at K = 0,
        also a lone client after the load had gone (session 29's served run).

        Raises:
            whatever ``session.propose(k)`` raises.
        """
        timings: list[tuple[int, float]] = []
        trace: list[tuple[int, int]] = []
        overlapped = [False]
        with self._cv:
            if self._unbatched_running:
                overlapped[0] = True
                for other in self._unbatched_running:
                    other[0] = True
            self._unbatched_running.append(overlapped)
        try:
            return session._proposer.propose_batch([session], [k], timings, trace=trace)[0]
        finally:
            with self._cv:
                self._unbatched_running.remove(overlapped)
            self._record([] if overlapped[0] else timings, trace)  # the trace keeps every forward

    def _draft_alone(self, rows: list[_Waiting]) -> list[DraftBlock | None]:
        """After a batched drafting of ``rows`` raised: each session drafts alone, so the one
        that fails (a closed session, a bad token, a failing logit processor) gets its own error
        (``_Waiting.error``, its block None) and the others their blocks, exactly as alone (the
        draw of a drafted token depends only on the session's seed and position, and a forward
        that failed part-way is cut out of every cache first: :meth:`CachedSequence.realign`)."""
        blocks: list[DraftBlock | None] = []
        for w in rows:
            try:
                w.session.seq.realign()
                blocks.append(self._draft([w])[0])
            except Exception as e:
                w.error = e
                blocks.append(None)
        return blocks

    def take_timings(self) -> list[tuple[int, float]]:
        """``(rows, wall seconds)`` of the draft decode forwards (no prefill or catch-up:
        :meth:`_record`) run since the last call, by any session (batched; or one row each on the
        unbatched path); each is returned once (thread-safe)."""
        with self._cv:
            out = list(self._timings)
            self._timings.clear()
        return out

    def step(self, gen: Generation) -> GenerationChunk | None:
        """One speculation step of ``gen`` (as ``gen.step()``), its drafting batched."""
        if gen.finished:
            self.leave(gen.proposer)
            return gen.assembler.take_chunk()
        k = gen.plan()
        if k is None:
            self.leave(gen.proposer)
            return gen.finish_chunk()
        if k <= 0 and gen.proposer is not None:
            self.leave(gen.proposer)  # a step without drafting: not waited for meanwhile
        t0 = self._clock()
        block = self.propose(gen.proposer, k)
        t1 = self._clock()
        result = gen.target.verify(block)
        t2 = self._clock()
        if self.k_control is not None:
            self.k_control.observe_step(gen, block.k, result.accepted, result.batch, self.take_timings(),
                                        draft_s=t1 - t0, verify_s=t2 - t1)
        chunk = gen.apply(block, result, t1 - t0, t2 - t1)
        if gen.finished:
            self.leave(gen.proposer)
        return chunk
