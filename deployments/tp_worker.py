"""Tensor-parallel target workers: one Ray actor per rank, transformers' own TP over gloo/nccl.

Each :class:`TPWorker` holds one TP shard of the target, loaded with
``from_pretrained(..., distributed_config=DistributedConfig(tp_size=n))`` after this module has
initialised ``torch.distributed`` itself (explicit rank, world size, ``tcp://`` rendezvous on
rank 0's node, timeout), so transformers reuses the process group instead of reading torchrun's
environment. With the model's ``_tp_plan`` the LM head is ``colwise_gather_output``: every rank
ends a forward pass with the *full* logits, bit-identical on all ranks, so every rank can run the
same (deterministic, identically seeded) verifier and keep its own KV-cache shard in lockstep.
Rank 0's answer is the one returned. See ``deployments/NOTES-tp.md`` for what was checked.

The owner (the target replica, or a test) calls every method on *all* ranks at once
(:func:`call_all`): a collective op on one rank alone blocks until the gloo timeout.

Continuous batching: :meth:`TPWorker.verify_batch` admits the blocks that arrived and verifies
all waiting blocks in one batched forward (every rank the same). Health probes run in their own
concurrency group ("health"), never behind a forward.

Known limits: HF-folder models only (GGUF specs must be converted to a folder first);
``tp_size`` must divide the attention and KV heads.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import TYPE_CHECKING, Any, Sequence


if TYPE_CHECKING:
    import torch

# torch and the model code are imported inside the methods, in the rank's own process: the target
# replica that starts the ranks (deployments.target) imports this module and holds no model
# (tests/deployments/test_lean_imports.py)

#: Seconds a rank waits in ``init_process_group`` and in any collective before failing.
DIST_TIMEOUT_S = 120


def free_port() -> int:
    """A TCP port free on this host right now (for the rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def worker_device(num_gpus: float) -> torch.device:
    """The device a model process (a TP worker, a draft replica) computes on: its GPU when Ray gave
    it one, else the CPU.

    Ray shows an actor only the GPUs it was assigned (``CUDA_VISIBLE_DEVICES``), so a worker
    holding a GPU sees it as ``cuda:0``. A worker asked to hold a GPU on a machine where CUDA is
    not available fails here rather than silently running on the CPU.

    Raises:
        RuntimeError: ``num_gpus > 0`` but CUDA is not available in this process.
    """
    import torch

    if num_gpus <= 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"this process was given num_gpus={num_gpus} but CUDA is not available "
                           f"(torch {torch.__version__}; is the CUDA build of torch installed?)")
    return torch.device("cuda", 0)


class TPWorker:
    """One TP rank of the target. Plain class; run it as ``ray.remote(num_cpus=0)(TPWorker)``.

    Args:
        rank: this worker's rank, 0..world_size-1.
        world_size: the TP degree n.
    """

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.loaded = None
        self.table = None

    def address(self) -> tuple[str, int]:
        """Rendezvous address on this worker's node (asked of rank 0 only)."""
        try:
            import ray

            host = ray.util.get_node_ip_address()
        except Exception:  # outside Ray
            host = "127.0.0.1"
        return host, free_port()

    def setup(self, model_path: str, master_addr: str, master_port: int, dtype: str = "float32",
              threads: int = 0, num_gpus: float = 0, prefix_cache_entries: int = 0) -> dict:
        """Join the process group (when n > 1) and load this rank's shard. Call on all ranks at once.

        ``threads`` > 0 sets torch's CPU threads (Ray gives a ``num_cpus=0`` actor one thread).
        ``num_gpus`` is what Ray gave this worker: > 0 loads the shard onto its GPU
        (:func:`worker_device`), also at TP=1. ``prefix_cache_entries`` > 0: automatic prefix
        caching of the rank's model when its forward is shape-invariant
        (:func:`deployments.prefix_caching.serve_prefix_cache`; every rank alike).

        Returns:
            facts for logs and tests: rank, backend, device, load seconds, local q_proj shape,
            ``prefix_cache_entries`` (0: prefix caching off on this rank), ``gc_frozen`` (the
            objects alive after the load moved out of the cyclic collector's full collections in a
            Ray actor, :func:`deployments.config.freeze_startup_objects_in_actor`; None elsewhere).
        """
        import torch
        import torch.distributed as dist

        from specdec.engine.invariant import attention_mode
        from specdec.engine.verifier import TargetVerifier
        from specdec.models.fused import FusedLinear, FusedSlice

        from deployments.prefix_caching import serve_prefix_cache
        from deployments.target_sessions import TargetSessionTable
        from deployments.tp_load import load_tp_model

        t0 = time.perf_counter()
        if threads > 0:
            torch.set_num_threads(threads)
        backend = None
        if self.world_size > 1:
            # transformers binds the accelerator from LOCAL_RANK; Ray shows each actor only its
            # own GPU (cuda:0), so LOCAL_RANK is 0 in every worker.
            os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if not dist.is_initialized():
                dist.init_process_group(
                    backend,
                    init_method=f"tcp://{master_addr}:{master_port}",
                    rank=self.rank,
                    world_size=self.world_size,
                    timeout=datetime.timedelta(seconds=DIST_TIMEOUT_S),
                )
        device = worker_device(num_gpus)
        self.loaded = load_tp_model(model_path, self.rank, self.world_size, dtype, device)
        # TP = 1: the forwards (decode steps, blocks, chunks, packed batches) run specdec.models.lean_decode, as in
        # process (bitwise the same logits and cache); at TP > 1 the ranks' sharded layers keep
        # transformers' forward, whose tensor-parallel hooks lean decode would skip
        verifier = TargetVerifier(self.loaded, lean=self.world_size == 1)
        self.table = TargetSessionTable(verifier)
        prefix = serve_prefix_cache(self.loaded, prefix_cache_entries, "target", quiet=self.rank != 0)
        q = self.loaded.model.model.layers[0].self_attn.q_proj
        q = getattr(q, "inner", q)  # a TPLocalLinear (int8/int4/w8a8/invariant at TP > 1)
        if isinstance(q, FusedSlice):  # its columns of the fused q/k/v layer
            q_shape = (q.out_features, q.in_features)
        else:
            w = q.weight  # int8 layers: their int8 data (a meta tensor of its shape once w8a8 prepacked it)
            q_shape = tuple((w.to_local() if hasattr(w, "to_local") else w).shape)
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "backend": backend,
            "device": str(self.loaded.device),
            "load_s": time.perf_counter() - t0,
            "q_proj_local_shape": q_shape,
            "weight_format": self.loaded.weight_format,
            "quant_cache": self.loaded.quant_cache,
            "fused_groups": sum(isinstance(m, FusedLinear) for m in self.loaded.model.modules()),
            "torch_threads": torch.get_num_threads(),
            # what start_tp_workers put in the process env (deployments.config.model_process_env)
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "prefix_cache_entries": prefix.entries if prefix is not None else 0,
            "lean_decode": verifier.lean,
            # how attention computes rows: "row" / "sequence" (the shape-invariant forward; "sequence" only
            # where the load-time probe on this device proved one call per sequence bitwise equal to one per
            # row), "transformers" (a float32 forward, not made shape-invariant)
            "attention": attention_mode(self.loaded.model) if self.loaded.invariant else "transformers",
            # what start-up left alive, out of the cyclic collector's full collections from here on
            "gc_frozen": _freeze_in_actor(),
        }

    def forward(self, token_ids: Sequence[int], every_rank: bool = False) -> torch.Tensor | None:
        """Stateless forward over ``token_ids``: ``[T, V]`` float32 CPU logits on rank 0, None elsewhere.

        ``every_rank=True`` returns each rank's logits (to check they are identical).
        """
        import torch

        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.loaded.device)  # [1, T]
        with torch.no_grad():
            logits = self.loaded.model(ids, use_cache=False).logits[0].float().cpu()  # [T, V]
        return logits if (self.rank == 0 or every_rank) else None

    def session_state(self, session_id: str) -> tuple[int, int] | None:
        """``(committed_len, cached positions)`` of a session on this rank, or None."""
        s = self.table.sessions.get(session_id)
        return None if s is None else (s.committed_len, len(s.seq.cached))

    def verify(self, candidate_block: bytes) -> bytes | None:
        """Verify a serialized ``CandidateBlock``; serialized ``VerificationResult`` on rank 0.

        Errors (``InvalidRequestError``) are raised on every rank alike, so ranks stay in step.
        """
        from protos.specdec.v1 import exchange_pb2 as xpb

        reply = self.table.handle(xpb.CandidateBlock.FromString(candidate_block))
        return reply.SerializeToString() if self.rank == 0 else None

    def verify_batch(self, new: list[tuple[int, bytes]], max_positions: int | None) -> list | None:
        """Admit serialized ``CandidateBlock`` s and run one batched forward over all waiting blocks.

        Every rank admits the same blocks in the same order and runs the same forward, so the
        ranks' cache shards and waiting lists stay in lockstep.

        Args:
            new: ``(ticket, CandidateBlock bytes)`` arrived since the last call, in arrival order.
            max_positions: positions budget of the forward.

        Returns:
            on rank 0: ``{"answers": [...], "rows": r, "positions": p}`` with
            ``(ticket, VerificationResult bytes, None, None)`` or ``(ticket, None, error class
            name, message)`` for every ticket answered now (a status reply, a verified block, or
            an error: an invalid block or a dropped one), and the forward's verified rows and
            positions fed; None on the other ranks.
        """
        from protos.specdec.v1 import exchange_pb2 as xpb
        from specdec.errors import InvalidRequestError

        answers: list[tuple[int, object]] = []
        for ticket, raw in new:
            try:
                reply = self.table.admit(ticket, xpb.CandidateBlock.FromString(raw))
            except InvalidRequestError as e:
                answers.append((ticket, e))
                continue
            if reply is not None:
                answers.append((ticket, reply))
        self.table.verifier.last_positions = 0
        stepped = self.table.step(max_positions)
        answers.extend(stepped)
        if self.rank != 0:
            return None
        verified = sum(1 for _, res in stepped if isinstance(res, xpb.VerificationResult))
        out = []
        for ticket, res in answers:
            if isinstance(res, Exception):
                out.append((ticket, None, type(res).__name__, str(res)))
            else:
                out.append((ticket, res.SerializeToString(), None, None))
        return {"answers": out, "rows": verified, "positions": self.table.verifier.last_positions}

    def prefix_cache_stats(self) -> dict:
        """This rank's prefix cache (:func:`deployments.prefix_caching.prefix_stats`): every rank
        holds the same numbers (the ranks copy the same positions)."""
        from deployments.prefix_caching import prefix_stats

        return prefix_stats(self.table.verifier.target.model)

    def pending_count(self) -> int:
        """Blocks admitted and still waiting for a forward (a prefill in chunks)."""
        return len(self.table.pending)

    def close_session(self, session_id: str) -> bool:
        """Free a session's cache shard; whether it existed."""
        return self.table.close(session_id)

    def num_sessions(self) -> int:
        return len(self.table)

    def session_ids(self) -> list[str]:
        """Ids of the sessions whose cache shards this rank holds."""
        return sorted(self.table.sessions)

    def shutdown(self) -> None:
        """Free all sessions and leave the process group."""
        import torch.distributed as dist

        if self.table is not None:
            self.table.close_all()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_tp_workers(
    model_path: str,
    tp_size: int,
    placement_group=None,
    first_bundle: int = 1,
    num_gpus: float = 0,
    dtype: str = "float32",
    threads: int = 0,
    prefix_cache_entries: int = 0,
    omp_spin_count: int | None = None,
) -> tuple[list, list[dict]]:
    """Start ``tp_size`` TPWorker actors, one per bundle from ``first_bundle``, and set them up.

    Args:
        model_path: HF folder of the target.
        placement_group: the PG to place workers in (the Serve replica's own, from
            ``ray.util.get_current_placement_group()``); None schedules them freely.
        first_bundle: bundle index of rank 0 (bundle 0 holds the replica itself).
        num_gpus: GPUs per worker (0 on CPU).
        threads: torch CPU threads per worker (0 leaves Ray's default).
        prefix_cache_entries: ``AppConfig.prefix_cache_entries`` (0: no prefix caching).
        omp_spin_count: ``AppConfig.omp_spin_count`` (None: :data:`deployments.config.OMP_SPIN_COUNT`).

    Every worker process gets :func:`deployments.config.model_process_env` in its ``runtime_env``
    (OpenMP threads sleep when idle, after a short bounded spin, instead of spinning against the
    draft replica's; every thread's OpenMP team is ``threads`` wide).

    Returns:
        ``(actors, setup_infos)``, rank order.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from deployments.config import OMP_SPIN_COUNT, model_process_env

    # "health": a thread of its own, so a health probe never waits behind a forward
    actor_cls = ray.remote(concurrency_groups={"health": 1})(TPWorker)
    workers = []
    for rank in range(tp_size):
        opts: dict[str, Any] = {"num_cpus": 0, "num_gpus": num_gpus,
                                "runtime_env": {"env_vars": model_process_env(
                                    threads, OMP_SPIN_COUNT if omp_spin_count is None else omp_spin_count)}}
        if placement_group is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=first_bundle + rank
            )
        workers.append(actor_cls.options(**opts).remote(rank, tp_size))
    addr, port = ray.get(workers[0].address.remote())
    infos = ray.get([w.setup.remote(model_path, addr, port, dtype, threads, num_gpus, prefix_cache_entries)
                     for w in workers])
    return workers, infos


def call_all(workers: list, method: str, *args) -> Any:
    """Call ``method`` on every rank at once (Ray refs); return rank 0's result.

    Raises what rank 0 raised.
    """
    import ray

    refs = [getattr(w, method).remote(*args) for w in workers]
    return ray.get(refs)[0]


def _freeze_in_actor() -> int | None:
    """:func:`deployments.config.freeze_startup_objects_in_actor` (imported here, in the rank's process)."""
    from deployments.config import freeze_startup_objects_in_actor

    return freeze_startup_objects_in_actor()
