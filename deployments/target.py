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

    def _start_workers(self, cfg: AppConfig) -> list:
        """Start the TP ranks in this replica's placement group; sets :attr:`infos`."""
        import ray

        from deployments.tp_worker import start_tp_workers
        from specdec.models.loader import resolve_folder

        pg = ray.util.get_current_placement_group()
        workers, infos = start_tp_workers(
            resolve_folder(cfg.target_model), cfg.target_tp, pg, first_bundle=1,
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
        """Verify one serialized CandidateBlock; a serialized VerificationResult."""
        self.activity.touch(xpb.CandidateBlock.FromString(candidate_block).session_id)
        return await self._all("verify", candidate_block)

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
        sessions (:meth:`sweep_idle`)."""
        await asyncio.gather(*[w.num_sessions.remote() for w in self.workers])
        try:
            await self.sweep_idle()
        except Exception:  # a failed sweep is retried at the next check; the ranks answered
            log.exception("idle-session sweep failed")

    def __del__(self):
        try:
            import ray

            for w in getattr(self, "workers", []):
                ray.kill(w)
        except Exception:
            pass
