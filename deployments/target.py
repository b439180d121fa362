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

from deployments.config import AppConfig
from protos.specdec.v1 import exchange_pb2 as xpb

log = logging.getLogger(__name__)


class Target:
    """One target replica: TP workers + session fan-out."""

    def __init__(self, cfg: AppConfig):
        import ray

        from deployments.config import torch_threads
        from deployments.tp_worker import start_tp_workers
        from specdec.models.loader import resolve_folder

        self.cfg = cfg
        pg = ray.util.get_current_placement_group()
        self.workers, infos = start_tp_workers(
            resolve_folder(cfg.target_model), cfg.target_tp, pg, first_bundle=1,
            num_gpus=cfg.target_gpus_per_worker, threads=torch_threads(cfg.cpu_threads, share=cfg.target_tp),
        )
        self.infos = infos
        log.info("target TP workers ready: %s", infos)

    async def _all(self, method: str, *args):
        outs = await asyncio.gather(*[getattr(w, method).remote(*args) for w in self.workers])
        return outs[0]

    async def Verify(self, candidate_block: bytes) -> bytes:
        """Verify one serialized CandidateBlock; a serialized VerificationResult."""
        return await self._all("verify", candidate_block)

    async def CloseSession(self, request: bytes) -> bytes:
        """Free a session on every rank; a serialized CloseSessionResponse."""
        sid = xpb.CloseSessionRequest.FromString(request).session_id
        existed = await self._all("close_session", sid)
        return xpb.CloseSessionResponse(existed=bool(existed)).SerializeToString()

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
        """Serve health check: fails the replica when a TP worker died."""
        import ray

        await asyncio.gather(*[w.num_sessions.remote() for w in self.workers])

    def __del__(self):
        try:
            import ray

            for w in getattr(self, "workers", []):
                ray.kill(w)
        except Exception:
            pass
