"""The Target replica frees sessions nobody used for ``target_session_idle_timeout_s`` (a
consistent-hash remap, a failed CloseSession or a failed resume would otherwise hold their KV
caches forever), on every TP rank alike, and counts them in a metric. Tiny target, fake
clock, the TP ranks as in-process tables behind Ray-like handles (no Ray)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deployments import convert
from deployments.config import AppConfig
from deployments.metrics import SpecDecMetrics
from deployments.target import Target
from deployments.target_sessions import TargetSessionTable
from protos.specdec.v1 import exchange_pb2 as xpb
from specdec.request import SamplingParams
from specdec.types import DraftBlock
from specdec.engine.verifier import TargetVerifier


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.fn(*args))
        return fut


class Rank:
    """One TP rank as the Target replica sees it (``handle.method.remote(...)``, awaitable)."""

    def __init__(self, target):
        self.table = TargetSessionTable(TargetVerifier(target))
        self.verify = _Method(lambda b: self.table.handle(xpb.CandidateBlock.FromString(b)).SerializeToString())
        self.close_session = _Method(self.table.close)
        self.session_ids = _Method(lambda: sorted(self.table.sessions))
        self.num_sessions = _Method(lambda: len(self.table))
        # the batched path (target_batching, the default): TPWorker's own method over this table
        from deployments.tp_worker import TPWorker

        worker = TPWorker(0, 1)
        worker.table = self.table
        self.verify_batch = _Method(worker.verify_batch)
        self.prefix_cache_stats = _Method(worker.prefix_cache_stats)


def _open_block(sid: str, prompt: list[int]) -> bytes:
    """A K = 0 block that (re)opens session ``sid`` after ``prompt``."""
    opening = convert.session_open_to_proto(prompt, SamplingParams(), 0, False)
    return convert.draft_block_to_proto(DraftBlock(token_ids=torch.tensor([], dtype=torch.long)), sid,
                                        len(prompt), opening).SerializeToString()


def test_idle_sessions_are_swept_on_every_rank_and_counted(tiny_target):
    clock = Clock()
    metrics = SpecDecMetrics(backend=None)
    ranks = [Rank(tiny_target), Rank(tiny_target)]
    cfg = AppConfig(target_model="unused", target_session_idle_timeout_s=60)
    target = Target(cfg, workers=ranks, clock=clock, metrics=metrics)

    async def main():
        for sid in ("a", "b", "c"):
            reply = xpb.VerificationResult.FromString(await target.Verify(_open_block(sid, [5, 6, 7])))
            assert reply.status == xpb.VERIFY_STATUS_OK
        clock.t += 50
        await target.Verify(_open_block("b", [5, 6, 7, 8]))  # b is used again
        await target.CloseSession(xpb.CloseSessionRequest(session_id="c").SerializeToString())
        clock.t += 20  # a: idle 70 s (over 60), b: 20 s, c: closed by its owner
        await target.check_health()  # Serve calls it periodically: the sweep runs there
        return await target.Sessions()

    held = asyncio.run(main())
    assert held == ["b"]
    assert [sorted(r.table.sessions) for r in ranks] == [["b"], ["b"]]
    assert metrics.value("specdec_target_sessions_swept") == 1
    assert metrics.value("specdec_target_sessions") == 1


def test_idle_timeout_is_validated():
    with pytest.raises(ValueError, match="target_session_idle_timeout_s\n  Input should be greater than 0"):
        AppConfig(target_session_idle_timeout_s=0)
    assert AppConfig().target_session_idle_timeout_s == 600


def test_target_starts_its_workers_through_ray_start_path(monkeypatch, tiny_target, tmp_path):
    """The replica's own start path (TP workers in its placement group) sets the rank infos
    that ``Info`` returns; exercised with ``start_tp_workers`` replaced (no Ray cluster) and an
    empty cache (the folder is not built: ``resolve_folder`` is asked, here since torch is loaded)."""
    import types

    import deployments.tp_worker as tp
    import specdec.models.loader as loader

    ranks = [Rank(tiny_target)]
    fake_ray = types.SimpleNamespace(util=types.SimpleNamespace(get_current_placement_group=lambda: None))
    monkeypatch.setitem(__import__("sys").modules, "ray", fake_ray)
    monkeypatch.setattr(loader, "resolve_folder", lambda spec, fmt: f"/models/target-{fmt}")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    seen = {}

    def start(path, tp_size, pg, first_bundle, num_gpus, threads, dtype, prefix_cache_entries, omp_spin_count):
        seen.update(path=path, tp_size=tp_size, threads=threads, dtype=dtype, prefix_cache_entries=prefix_cache_entries,
                    omp_spin_count=omp_spin_count)
        return ranks, [{"rank": 0, "device": "cpu"}]

    monkeypatch.setattr(tp, "start_tp_workers", start)
    target = Target(AppConfig(target_model="demo:target", target_tp=1, target_cpus_per_worker=2,
                              target_dtype="int8", prefix_cache_entries=5, omp_spin_count=700),
                    metrics=SpecDecMetrics(backend=None))
    assert seen == {"path": "/models/target-int8", "tp_size": 1, "threads": 2, "dtype": "int8",
                    "prefix_cache_entries": 5, "omp_spin_count": 700}
    assert target.workers is ranks
    assert asyncio.run(target.Info()) == [{"rank": 0, "device": "cpu"}]


def test_dropping_a_replica_with_in_process_ranks_starts_no_ray():
    """Garbage-collecting a Target whose ranks are in-process objects must not start a local Ray
    (``ray.kill`` auto-initialises Ray): a later test's ``ray.init`` then failed with "called
    ray.init twice" and every served test of the suite errored."""
    import gc

    import ray

    from deployments.config import AppConfig
    from deployments.metrics import SpecDecMetrics
    from deployments.target import Target

    assert not ray.is_initialized(), "precondition: an earlier test left Ray running"
    replica = Target(AppConfig(target_model="unused"), workers=[object(), object()],
                     metrics=SpecDecMetrics(backend=None))
    del replica
    gc.collect()
    assert not ray.is_initialized()
