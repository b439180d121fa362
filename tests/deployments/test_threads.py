"""Threads of the model processes come from the CPUs Ray assigned them, never from the host's
core count (inside a pod ``os.cpu_count()`` is the node's), and the draft replica runs its
steps on an executor sized to the requests it may run at once."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from deployments.config import AppConfig, Scaling
from deployments.config import torch_threads
from deployments.draft import Draft
from deployments.target import rank_threads


@pytest.fixture()
def many_host_cores(monkeypatch):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    yield


def test_torch_threads_are_the_assigned_whole_cpus(many_host_cores):
    assert [torch_threads(0, cpus) for cpus in (0.25, 0.5, 1.0, 2.0, 3.5, 16.0)] == [1, 1, 1, 2, 3, 16]
    assert torch_threads(0, None) == 1  # nothing assigned (a num_cpus=0 actor): one thread
    assert torch_threads(6, 0.25) == 6  # cpu_threads in the config wins


def test_tp_rank_threads_come_from_its_placement_group_bundle(many_host_cores):
    cpu = AppConfig(target_tp=2, target_cpus_per_worker=0.5)
    assert rank_threads(cpu) == 1
    gpu = AppConfig(target_tp=2, target_cpus_per_worker=4, target_gpus_per_worker=1)
    assert rank_threads(gpu) == 4
    # the bundle Ray actually reserved wins over the config (a Serve config may override it)
    assert rank_threads(gpu, [{"CPU": 1}, {"CPU": 3, "GPU": 1}, {"CPU": 3, "GPU": 1}]) == 3
    assert rank_threads(AppConfig(cpu_threads=2, target_cpus_per_worker=8)) == 2


def test_draft_replica_threads_and_step_executor(many_host_cores, tiny_model_folder, monkeypatch):
    from specdec.engine.decoder import Generation

    from tests.deployments.test_draft import PROMPT, Wire, _collect, _job
    from tests.conftest import load_tiny

    before = torch.get_num_threads()
    cfg = AppConfig(target_model=str(tiny_model_folder), draft_model=str(tiny_model_folder), cpu_threads=0,
                    draft_num_cpus=2, draft=Scaling(max_ongoing_requests=3))
    wire = Wire(load_tiny(tiny_model_folder))
    names = []
    plan = Generation.plan  # every step plans first (batched or not), in the thread that steps

    def spy(self):
        names.append(threading.current_thread().name)
        return plan(self)

    monkeypatch.setattr(Generation, "plan", spy)
    try:
        rep = Draft(cfg, send_factory=lambda key: wire.send)
        assert torch.get_num_threads() == 2  # draft_num_cpus outside Ray, not the 64 host cores
        assert rep.step_executor._max_workers == 3
        asyncio.run(_collect(rep.Generate(_job(PROMPT, max_tokens=5).SerializeToString())))
    finally:
        torch.set_num_threads(before)
    assert names and all(n.startswith("specdec-step") for n in names)


def test_local_cpu_preset_threads(many_host_cores):
    """local-cpu: one target rank of two threads; the draft, which runs while it waits, two."""
    from deployments.config import PRESETS

    cfg = PRESETS["local-cpu.yaml"]
    assert cfg.target_tp == 1 and rank_threads(cfg, cfg.target_bundles()) == 2
    assert torch_threads(cfg.draft_cpu_threads or cfg.cpu_threads, cfg.draft_num_cpus) == 2


def test_model_processes_sleep_idle_openmp_threads(many_host_cores):
    """The draft replica's process starts with idle OpenMP threads sleeping (OMP_WAIT_POLICY=PASSIVE)
    after a bounded spin (GOMP_SPINCOUNT = AppConfig.omp_spin_count, 0: none) and its thread count
    as every thread's OpenMP team size; the TP ranks get the same from start_tp_workers
    (tests/deployments/test_tp_worker.py)."""
    from deployments.config import OMP_SPIN_COUNT, PRESETS, AppConfig, model_process_env

    assert OMP_SPIN_COUNT == 0
    # GOMP_SPINCOUNT set also at 0: one in the environment that started Ray would override PASSIVE's zero
    assert model_process_env(0) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    assert model_process_env(3) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "OMP_NUM_THREADS": "3"}
    assert model_process_env(3, 30000) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000", "OMP_NUM_THREADS": "3"}
    assert model_process_env(0, 500) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "500"}
    with pytest.raises(ValueError, match="threads and spin_count must be >= 0, got 0, -1"):
        model_process_env(0, -1)
    opts = PRESETS["local-cpu.yaml"].deployment_options()
    assert opts["Draft"]["ray_actor_options"]["runtime_env"] == {
        "env_vars": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "OMP_NUM_THREADS": "2"}}
    spin = PRESETS["local-cpu.yaml"].model_copy(update={"omp_spin_count": 30000}).deployment_options()
    assert spin["Draft"]["ray_actor_options"]["runtime_env"] == {
        "env_vars": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000", "OMP_NUM_THREADS": "2"}}
    for bad in (-5, True, 1.5, "30000"):  # strict: a YAML `true` or a quoted number is no spin count
        with pytest.raises(ValueError, match="omp_spin_count"):
            AppConfig.model_validate({**PRESETS["local-cpu.yaml"].model_dump(), "omp_spin_count": bad})
    assert "runtime_env" not in opts["Router"]["ray_actor_options"]  # no model there
