"""The Target deployment: owns its tensor-parallel worker actors and verifies candidate blocks.

Plain class (decorated in :mod:`deployments.app`). The replica runs in bundle 0 of its own
placement group (``AppConfig.target_bundles()``, STRICT_PACK); it starts one
:class:`deployments.tp_worker.TPWorker` per TP rank in bundles 1..n, and fans every call out to
all ranks, returning rank 0's answer. It holds no model itself.

Interface (serialized protos in and out, never pickled core objects; the method names match
``specdec.v1.Verifier``): ``Verify(CandidateBlock bytes) -> VerificationResult bytes`` and
``CloseSession(CloseSessionRequest bytes) -> CloseSessionResponse bytes``; plus ``Ready()``,
``Sessions()`` (session ids held) and ``Info()`` (each rank's device and setup facts), for tests
and debugging; ``PrefixCacheStats()`` (automatic prefix caching on the ranks,
:mod:`deployments.prefix_caching`). Called through a
Serve handle with ``.options(session_id=...)`` so ConsistentHashRouter keeps a session on one
replica.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import itertools
import logging
import os
import statistics
import time

from deployments.config import AppConfig, torch_threads
from protos.specdec.v1 import exchange_pb2 as xpb

log = logging.getLogger(__name__)


def rank_threads(cfg: AppConfig, bundle_specs: list[dict] | None = None) -> int:
    """Torch threads of one TP rank: ``cfg.cpu_threads``, else the CPUs of its placement-group
    bundle (``bundle_specs[1]``, what Ray reserved for rank 0; all ranks' bundles are alike),
    else ``cfg.target_cpus_per_worker``; whole CPUs, at least 1."""
    cpus = cfg.target_cpus_per_worker
    if bundle_specs is not None and len(bundle_specs) > 1:
        cpus = bundle_specs[1].get("CPU", cpus)
    return torch_threads(cfg.cpu_threads, cpus)


class BatchFill:
    """When a target replica's batched forward should start: the *batch fill* policy.

    Sessions stepped by a draft replica come back to the target once per step: answered, they
    draft (a batched draft forward per draft position), then send their next block. Blocks that
    miss the gathering window (``window_s``) wait a whole forward, and the sessions then settle
    into groups that alternate between drafting and verifying, each forward half full (measured
    served, int4 demo pair, 8 clients: 2.3 sessions per forward against 4.7 in process). So while
    blocks wait, the forward is also held for the sessions this replica answered and expects
    back: each is expected for ``slack`` times its own gap (seconds from answering it to its
    next block; the mean of its last gap and the one before, halved each step) plus the window
    after its answer (``max_wait_s`` before its first gap is known), and the hold ends when every
    expected session's block is in, when their expectations run out, or at the latest
    ``max_wait_s`` after it began (the replica was free and blocks waited). A closed session is
    no longer expected; a session that keeps coming back late is waited for at most
    ``slack`` times its own pace. Outputs do not depend on it (each row is decided exactly as alone); only
    which blocks share a forward does.

    The same idea as the in-process :class:`specdec.engine.batch.BatchScheduler`, which steps all
    its sessions in lockstep (draft all, verify all); here the scheduler learns, from the
    arrivals, which sessions are drafting.

    Args:
        max_wait_s: seconds, the longest hold of one forward (0: no hold).
        window_s: the gathering window (``AppConfig.batch_window_s``), added to each expectation.
        clock: monotonic seconds.
        slack: expectation length in median gaps.
    """

    def __init__(self, max_wait_s: float, window_s: float = 0.0, clock=time.monotonic, slack: float = 2.0):
        self.max_wait_s = float(max_wait_s)
        self.window_s = float(window_s)
        self.clock = clock
        self.slack = slack
        #: session id -> when it was answered (its next block is expected)
        self.expected: dict[str, float] = {}
        #: session id -> its gap estimate, seconds (exponential mean, weight 1/2)
        self.gaps: dict[str, float] = {}
        self._gaps: collections.deque = collections.deque(maxlen=64)
        self._event = asyncio.Event()

    def gap(self) -> float | None:
        """Median seconds from answering a session to its next block, over the replica's last
        64 gaps (None before any); for statistics."""
        return statistics.median(self._gaps) if self._gaps else None

    def answered(self, session_id: str) -> None:
        self.expected[session_id] = self.clock()

    def arrived(self, session_id: str) -> None:
        """A block of ``session_id`` arrived (records its gap when it was expected)."""
        t = self.expected.pop(session_id, None)
        if t is not None:
            gap = self.clock() - t
            self._gaps.append(gap)
            old = self.gaps.get(session_id)
            self.gaps[session_id] = gap if old is None else (old + gap) / 2
        self._event.set()

    def closed(self, session_id: str) -> None:
        self.gaps.pop(session_id, None)
        if self.expected.pop(session_id, None) is not None:
            self._event.set()

    def _until(self, session_id: str) -> float:
        g = self.gaps.get(session_id)
        return self.expected[session_id] + self.window_s + (self.max_wait_s if g is None else self.slack * g)

    def missing(self) -> list[str]:
        """Sessions expected back now (answered, no block since, expectation not run out)."""
        now = self.clock()
        return [sid for sid in self.expected if self._until(sid) > now]

    async def wait(self) -> float:
        """Hold the forward until no expected session is missing (bounded, see the class);
        returns the seconds held."""
        if self.max_wait_s <= 0:
            return 0.0
        t0 = self.clock()
        while True:
            now = self.clock()
            if not self.missing():
                return now - t0
            until = min(t0 + self.max_wait_s, max(self._until(sid) for sid in self.expected))
            if now >= until:
                return now - t0
            self._event.clear()
            try:
                await asyncio.wait_for(self._event.wait(), until - now)
            except asyncio.TimeoutError:
                pass


class Target:
    """One target replica: TP workers + session fan-out + the idle-session sweep.

    Args:
        cfg: the application config.
        workers: the TP rank handles (tests inject in-process ones); None: start them with Ray
            in this replica's placement group.
        clock: monotonic seconds for session idleness (tests inject one).
        metrics: :class:`deployments.metrics.SpecDecMetrics` (default: Ray's metrics API).
    """

    def __init__(self, cfg: AppConfig, workers: list | None = None, clock=time.monotonic, metrics=None):
        from deployments.metrics import SpecDecMetrics
        from deployments.target_sessions import SessionActivity

        self.cfg = cfg
        #: each TP rank's setup facts (empty for injected workers)
        self.infos: list[dict] = []
        if workers is None:
            workers = self._start_workers(cfg)
        self.workers = workers
        self.activity = SessionActivity(cfg.target_session_idle_timeout_s, clock)
        self.metrics = metrics if metrics is not None else SpecDecMetrics()
        self._sweeping = False
        # continuous batching: blocks waiting for the next batched forward (see _batch_loop)
        self._tickets = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._queue: list[tuple[int, bytes]] = []
        self._in_flight: set[int] = set()
        self._kick = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._sweep_task: asyncio.Task | None = None  # a sweep started by a health check while busy
        #: (rows verified, positions fed) per batched forward (most recent 1000), for BatchStats
        self._rows: collections.deque = collections.deque(maxlen=1000)
        # filling the batch (batch_fill_wait_s): the sessions answered and expected back
        self._fill = BatchFill(cfg.batch_fill_wait_s, cfg.batch_window_s)
        self._ticket_sid: dict[int, str] = {}
        #: per batched forward (most recent 1000): (blocks new in it, seconds held for the fill,
        #: sessions still expected when it started)
        self._fills: collections.deque = collections.deque(maxlen=1000)
        self._trace = os.environ.get("SPECDEC_TARGET_BATCH_TRACE") or None
        from deployments.config import freeze_startup_objects_in_actor

        freeze_startup_objects_in_actor()  # constructed: what it imported out of full collections (served)

    def _start_workers(self, cfg: AppConfig) -> list:
        """Start the TP ranks in this replica's placement group; sets :attr:`infos`."""
        import ray

        from deployments.target_info import target_folder
        from deployments.tp_worker import start_tp_workers

        pg = ray.util.get_current_placement_group()
        folder, fmt = target_folder(cfg)  # without torch: this replica holds no model
        workers, infos = start_tp_workers(
            folder, cfg.target_tp, pg, first_bundle=1,
            dtype=fmt,
            num_gpus=cfg.target_gpus_per_worker,
            threads=rank_threads(cfg, pg.bundle_specs if pg is not None else None),
            prefix_cache_entries=cfg.prefix_cache_entries,
            omp_spin_count=cfg.omp_spin_count,
        )
        self.infos = infos
        log.info("target TP workers ready: %s", infos)
        return workers

    async def _all(self, method: str, *args):
        outs = await asyncio.gather(*[getattr(w, method).remote(*args) for w in self.workers])
        return outs[0]

    async def Verify(self, candidate_block: bytes) -> bytes:
        """Verify one serialized CandidateBlock; a serialized VerificationResult.

        With ``target_batching`` (default) the block joins the next batched forward of this
        replica (:meth:`_batch_loop`); otherwise it is verified alone (batch size 1).

        A block dropped unverified while it waited for a batched forward (its session was
        closed: the generation was cancelled; or a newer block of the session replaced it) is
        answered ``VERIFY_STATUS_CANCELLED``, not raised: a cancellation is no failed call
        (Serve logs every exception a replica method raises as ``Request failed`` at ERROR).

        Raises:
            InvalidRequestError: a malformed block or ``open``.
        """
        sid = xpb.CandidateBlock.FromString(candidate_block).session_id
        self.activity.touch(sid)
        if not self.cfg.target_batching:
            return await self._all("verify", candidate_block)
        fut = asyncio.get_running_loop().create_future()
        ticket = next(self._tickets)
        self._waiting[ticket] = fut
        self._ticket_sid[ticket] = sid
        self._queue.append((ticket, candidate_block))
        self._fill.arrived(sid)
        self._kick.set()
        if self._loop_task is None or self._loop_task.done():
            # outside this request's context: Serve cancels a request's Ray calls recursively
            # (deployments.aio.outside_request), and the loop's calls to the TP ranks verify every
            # session's blocks, not only this request's (its cancellation must not reach them)
            self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop(), context=contextvars.Context())
        return await fut

    async def _batch_loop(self) -> None:
        """Gather the blocks that arrive within ``batch_window_s`` and verify them in one forward
        (no window when every session held here already has its block waiting).

        Then, while blocks wait, hold the forward for the sessions answered and expected back
        (:class:`BatchFill`, at most ``batch_fill_wait_s``), so sessions that drafted at
        different times share forwards instead of alternating between half-full ones.
        One forward at a time (every TP rank runs it); blocks arriving meanwhile join the next.
        A prefill chunked over several forwards keeps the loop going until it is answered.
        """
        from specdec.errors import GenerationCancelledError, InvalidBlockError, InvalidRequestError

        errors = {"InvalidRequestError": InvalidRequestError, "InvalidBlockError": InvalidBlockError,
                  "PromptTooLongError": InvalidRequestError, "GenerationCancelledError": GenerationCancelledError}
        cancelled = xpb.VerificationResult(status=xpb.VERIFY_STATUS_CANCELLED).SerializeToString()
        while True:
            await self._kick.wait()
            if self.cfg.batch_window_s > 0 and not self._all_known_queued():
                await asyncio.sleep(self.cfg.batch_window_s)
            expected = self._fill.missing()
            held = await self._fill.wait() if self._queue or self._in_flight else 0.0
            self._kick.clear()
            new, self._queue = self._queue, []
            self._in_flight.update(t for t, _ in new)
            self._fills.append((len(new), held, len(expected)))
            t_fwd = time.monotonic()
            try:
                out = await self._all("verify_batch", new, self.cfg.max_batch_positions)
                answers = out["answers"]
                if out["positions"]:
                    self._rows.append((out["rows"], out["positions"]))
                    self.metrics.observe("specdec_batch_rows", out["rows"])
                    self.metrics.observe("specdec_batch_positions", out["positions"])
            except Exception as e:  # the forward failed: its sessions are closed on every rank
                for t in list(self._in_flight):
                    self._ticket_sid.pop(t, None)
                    fut = self._waiting.pop(t, None)
                    if fut is not None and not fut.done():
                        fut.set_exception(e)
                self._in_flight.clear()
                answers = []
            if self._trace and answers:
                self._write_trace(len(new), held, expected, answers, time.monotonic() - t_fwd)
            for ticket, raw, kind, message in answers:
                self._in_flight.discard(ticket)
                sid = self._ticket_sid.pop(ticket, None)
                fut = self._waiting.pop(ticket, None)
                if fut is None or fut.done():  # the caller went away
                    continue
                if raw is not None:
                    fut.set_result(raw)
                    if sid is not None:
                        self._fill.answered(sid)  # its next block is expected after its drafting
                elif kind == "GenerationCancelledError":  # dropped unverified: a status, not an error
                    fut.set_result(cancelled)
                else:
                    fut.set_exception(errors.get(kind, RuntimeError)(message))
            if self._in_flight or self._queue:
                self._kick.set()

    def _all_known_queued(self) -> bool:
        """Whether every session this replica holds already has a block waiting: then no block
        the gathering window could wait for is expected (one client alone: its every step
        waited ``batch_window_s`` for nobody; a new session's first block, a prompt prefill,
        joins the next forward)."""
        queued = {self._ticket_sid.get(t) for t, _ in self._queue}
        return all(sid in queued for sid in self.activity.sessions())

    def _write_trace(self, new: int, held: float, expected: list[str], answers: list, forward_s: float) -> None:
        """One JSON line per batched forward to ``$SPECDEC_TARGET_BATCH_TRACE`` (benchmarks)."""
        import json

        try:
            with open(self._trace, "a") as f:
                f.write(json.dumps({"t": time.time(), "new": new, "held_s": round(held, 4),
                                    "expected_at_start": len(expected), "answered": len(answers),
                                    "rows": self._rows[-1][0] if self._rows else 0,
                                    "forward_s": round(forward_s, 4), "sessions": len(self.activity),
                                    "gap_s": self._fill.gap()}) + "\n")
        except OSError:
            log.exception("batch trace")

    async def BatchStats(self) -> dict:
        """Rows (sessions verified) and positions per batched forward, over the last 1000 forwards;
        and the batch fill: ``mean_new_blocks`` (blocks that joined each forward),
        ``mean_held_s`` (seconds each forward was held for expected sessions), ``gap_s`` (the
        median seconds from answering a session to its next block, the fill's estimate)."""
        rows = [r for r, _ in self._rows]
        pos = [p for _, p in self._rows]
        n = len(rows)
        fills = list(self._fills)
        nf = len(fills)
        return {"forwards": n, "max_rows": max(rows, default=0), "mean_rows": sum(rows) / n if n else 0.0,
                "mean_positions": sum(pos) / n if n else 0.0, "max_positions": max(pos, default=0),
                "mean_new_blocks": sum(f[0] for f in fills) / nf if nf else 0.0,
                "mean_held_s": sum(f[1] for f in fills) / nf if nf else 0.0, "gap_s": self._fill.gap()}

    async def PrefixCacheStats(self) -> dict:
        """The target's prefix cache (``AppConfig.prefix_cache_entries``), rank 0's (every rank
        holds the same): ``{"enabled", "entries", "held", "hits", "shared_positions"}``
        (:func:`deployments.prefix_caching.prefix_stats`). Asked in the ranks' "health" group, so
        it never waits behind a forward; also brings the ``specdec_prefix_cache_*`` counters up
        to date (as every health check does)."""
        w = self.workers[0]
        method = w.prefix_cache_stats
        stats = await (method.options(concurrency_group="health") if hasattr(method, "options") else method).remote()
        self.metrics.record_prefix_cache("target", stats)
        return stats

    async def CloseSession(self, request: bytes) -> bytes:
        """Free a session on every rank; a serialized CloseSessionResponse."""
        sid = xpb.CloseSessionRequest.FromString(request).session_id
        self.activity.forget(sid)
        self._fill.closed(sid)
        existed = await self._all("close_session", sid)
        return xpb.CloseSessionResponse(existed=bool(existed)).SerializeToString()

    async def sweep_idle(self) -> list[str]:
        """Free, on every rank, the sessions unused for ``target_session_idle_timeout_s``.

        Returns:
            the ids freed. Counted in ``specdec_target_sessions_swept``; the sessions still held
            are set in ``specdec_target_sessions``.
        """
        if self._sweeping:  # one sweep at a time (health checks may overlap a slow one)
            return []
        self._sweeping = True
        swept = []
        try:
            for sid in self.activity.idle():
                self.activity.forget(sid)
                self._fill.closed(sid)
                if await self._all("close_session", sid):
                    swept.append(sid)
            if swept:
                log.warning("freed %d target session(s) idle for over %.0f s: %s", len(swept),
                            self.activity.idle_timeout_s, ", ".join(swept[:5]) + (" ..." if len(swept) > 5 else ""))
                self.metrics.inc("specdec_target_sessions_swept", len(swept))
            self.metrics.set("specdec_target_sessions", len(self.activity))
        finally:
            self._sweeping = False
        return swept

    async def Ready(self) -> bool:
        """True: the replica exists only once all TP ranks loaded their shards."""
        return True

    async def Info(self) -> list[dict]:
        """Each TP rank's setup facts (rank, backend, device, load seconds); for tests and debugging."""
        return list(self.infos)

    async def Sessions(self) -> list[str]:
        """Ids of the sessions held by this replica (rank 0's table; all ranks hold the same)."""
        return await self.workers[0].session_ids.remote()

    async def check_health(self) -> None:
        """Serve health check (periodic): fails the replica when a TP worker died; sweeps idle
        sessions (:meth:`sweep_idle`); updates the prefix cache counters (:meth:`PrefixCacheStats`).

        The probe runs in the workers' "health" concurrency group, so a loaded replica (a long
        prefill or verify in progress) answers at once; while blocks wait for a forward the
        sweep (which queues behind the forwards) runs in the background instead of being awaited.
        """
        probes = []
        for w in self.workers:
            method = w.num_sessions
            probes.append((method.options(concurrency_group="health") if hasattr(method, "options") else method).remote())
        await asyncio.gather(*probes)
        try:
            await self.PrefixCacheStats()
        except Exception:  # statistics never fail a health check
            log.exception("prefix cache statistics")
        if self._in_flight or self._queue:
            if not self._sweeping:  # held (a task nobody references may be collected), outside the call's context
                self._sweep_task = asyncio.get_running_loop().create_task(self._sweep_logged(),
                                                                          context=contextvars.Context())
            return
        await self._sweep_logged()

    async def _sweep_logged(self) -> None:
        try:
            await self.sweep_idle()
        except Exception:  # a failed sweep is retried at the next check; the ranks answered
            log.exception("idle-session sweep failed")

    def __del__(self):
        try:
            import ray

            if not ray.is_initialized():  # ray.kill would start a local Ray just to fail
                return
            for w in getattr(self, "workers", []):
                if isinstance(w, ray.actor.ActorHandle):
                    ray.kill(w)
        except Exception:
            pass
