"""The Target deployment: owns its tensor-parallel worker actors and verifies candidate blocks.

Plain class (decorated in :mod:`deployments.app`). The replica runs in bundle 0 of its own
placement group (``AppConfig.target_bundles()``, STRICT_PACK); it starts one
:class:`deployments.tp_worker.TPWorker` per TP rank in bundles 1..n, and fans every call out to
all ranks, returning rank 0's answer. It holds no model itself.

Interface (serialized protos in and out, never pickled core objects; the method names match
``specdec.v1.Verifier``): ``Verify(CandidateBlock bytes) -> VerificationResult bytes`` and
``CloseSession(CloseSessionRequest bytes) -> CloseSessionResponse bytes``; plus ``Ready()``,
``Sessions()`` (session ids held) and ``Info()`` (each rank's device and setup facts), for tests
and debugging. Called through a
Serve handle with ``.options(session_id=...)`` so ConsistentHashRouter keeps a session on one
replica.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
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
        #: (rows verified, positions fed) per batched forward (most recent 1000), for BatchStats
        self._rows: collections.deque = collections.deque(maxlen=1000)

    def _start_workers(self, cfg: AppConfig) -> list:
        """Start the TP ranks in this replica's placement group; sets :attr:`infos`."""
        import ray

        from deployments.tp_worker import start_tp_workers
        from specdec.models.loader import resolve_folder

        pg = ray.util.get_current_placement_group()
        workers, infos = start_tp_workers(
            resolve_folder(cfg.target_model, cfg.target_format()), cfg.target_tp, pg, first_bundle=1,
            dtype=cfg.target_format(),
            num_gpus=cfg.target_gpus_per_worker,
            threads=rank_threads(cfg, pg.bundle_specs if pg is not None else None),
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

        Raises:
            InvalidRequestError: a malformed block or ``open``.
            GenerationCancelledError: its session was closed while the block waited.
        """
        self.activity.touch(xpb.CandidateBlock.FromString(candidate_block).session_id)
        if not self.cfg.target_batching:
            return await self._all("verify", candidate_block)
        fut = asyncio.get_running_loop().create_future()
        ticket = next(self._tickets)
        self._waiting[ticket] = fut
        self._queue.append((ticket, candidate_block))
        self._kick.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._batch_loop())
        return await fut

    async def _batch_loop(self) -> None:
        """Gather the blocks that arrive within ``batch_window_s`` and verify them in one forward.

        One forward at a time (every TP rank runs it); blocks arriving meanwhile join the next.
        A prefill chunked over several forwards keeps the loop going until it is answered.
        """
        from specdec.engine.verifier import InvalidBlockError
        from specdec.errors import GenerationCancelledError, InvalidRequestError

        errors = {"InvalidRequestError": InvalidRequestError, "InvalidBlockError": InvalidBlockError,
                  "PromptTooLongError": InvalidRequestError, "GenerationCancelledError": GenerationCancelledError}
        while True:
            await self._kick.wait()
            if self.cfg.batch_window_s > 0:
                await asyncio.sleep(self.cfg.batch_window_s)
            self._kick.clear()
            new, self._queue = self._queue, []
            self._in_flight.update(t for t, _ in new)
            try:
                out = await self._all("verify_batch", new, self.cfg.max_batch_positions)
                answers = out["answers"]
                if out["positions"]:
                    self._rows.append((out["rows"], out["positions"]))
                    self.metrics.observe("specdec_batch_rows", out["rows"])
                    self.metrics.observe("specdec_batch_positions", out["positions"])
            except Exception as e:  # the forward failed: its sessions are closed on every rank
                for t in list(self._in_flight):
                    fut = self._waiting.pop(t, None)
                    if fut is not None and not fut.done():
                        fut.set_exception(e)
                self._in_flight.clear()
                answers = []
            for ticket, raw, kind, message in answers:
                self._in_flight.discard(ticket)
                fut = self._waiting.pop(ticket, None)
                if fut is None or fut.done():  # the caller went away
                    continue
                if raw is not None:
                    fut.set_result(raw)
                else:
                    fut.set_exception(errors.get(kind, RuntimeError)(message))
            if self._in_flight or self._queue:
                self._kick.set()

    async def BatchStats(self) -> dict:
        """Rows (sessions verified) and positions per batched forward, over the last 1000 forwards."""
        rows = [r for r, _ in self._rows]
        pos = [p for _, p in self._rows]
        n = len(rows)
        return {"forwards": n, "max_rows": max(rows, default=0), "mean_rows": sum(rows) / n if n else 0.0,
                "mean_positions": sum(pos) / n if n else 0.0, "max_positions": max(pos, default=0)}

    async def CloseSession(self, request: bytes) -> bytes:
        """Free a session on every rank; a serialized CloseSessionResponse."""
        sid = xpb.CloseSessionRequest.FromString(request).session_id
        self.activity.forget(sid)
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
        sessions (:meth:`sweep_idle`).

        The probe runs in the workers' "health" concurrency group, so a loaded replica (a long
        prefill or verify in progress) answers at once; while blocks wait for a forward the
        sweep (which queues behind the forwards) runs in the background instead of being awaited.
        """
        probes = []
        for w in self.workers:
            method = w.num_sessions
            probes.append((method.options(concurrency_group="health") if hasattr(method, "options") else method).remote())
        await asyncio.gather(*probes)
        if self._in_flight or self._queue:
            if not self._sweeping:
                asyncio.create_task(self._sweep_logged())
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
