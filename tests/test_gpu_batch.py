"""Continuous batching on a real CUDA device, with tiny models (no demo pair needed).

Marked ``gpu``: skipped (with the reason) where CUDA is absent (``tests/conftest.py``);
``scripts/gpu-check.sh`` runs them. The CPU suite checks the same paths under CUDA's device rules
(``tests/test_devices.py``, ``tests/test_batch.py::test_batched_path_on_the_accelerator_equals_alone``);
here the kernels are the GPU's own, so what the rules cannot see is checked too: that a row's
result does not depend on the batch it was verified in when the GPU's kernels pick their
blocking by shape (float32 without, bfloat16 with the shape-invariant forward of
:mod:`specdec.engine.invariant`).
"""

from __future__ import annotations

import pytest
import torch

from specdec.engine.batch import BatchScheduler
from specdec.engine.engine import SpeculativeEngine
from specdec.testing.tiny import build_tiny_model
from specdec.types import FinishReason
from tests.conftest import load_tiny
from tests.test_batch import _requests

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cuda_pair(request, tmp_path_factory):
    """The tiny 1024-position pair of tests/test_batch.py, on the GPU in one weight format."""
    d = tmp_path_factory.mktemp(f"gpupair-{request.param}")
    target = load_tiny(build_tiny_model(d / "t", seed=0, max_positions=1024), device="cuda",
                       weight_format=request.param)
    draft = load_tiny(build_tiny_model(d / "d", seed=1, base=target.model, noise=0.03, max_positions=1024),
                      device="cuda", weight_format=request.param)
    assert target.device.type == "cuda" and draft.device.type == "cuda"
    return target, draft


def test_batched_rows_on_cuda_equal_each_request_alone(cuda_pair):
    """Prompts 1..500 tokens, K 0/1/4/8, draft/ngram/none, greedy and seeded sampled, two tenants."""
    engine = SpeculativeEngine(*cuda_pair)
    alone = [engine.generate(req).token_ids for req, _ in _requests()]
    sched = BatchScheduler(engine, max_batch_positions=64)
    handles = [sched.submit(req, tenant=tenant) for req, tenant in _requests()]
    sched.run_until_idle()
    assert [h.result().token_ids for h in handles] == alone
    assert all(h.result().finish_reason is FinishReason.MAX_TOKENS for h in handles)
    assert max(len(t.answered) for t in sched.trace) >= 5  # rows really shared forwards


def test_greedy_speculation_on_cuda_is_the_target_decoding_alone(cuda_pair):
    """Greedy rows with K = 1, 4, 8 equal the target decoding alone (K = 0) on the same GPU."""
    engine = SpeculativeEngine(*cuda_pair)
    reqs = [(r, t) for r, t in _requests() if r.sampling.temperature == 0.0]
    for req, _ in reqs:
        plain = engine.generate(req.model_copy(update={"speculation": req.speculation.model_copy(
            update={"k": 0, "proposer": "none"})})).token_ids
        for k in (1, 4, 8):
            spec = engine.generate(req.model_copy(update={"speculation": req.speculation.model_copy(
                update={"k": k, "proposer": "draft"})}))
            assert spec.token_ids == plain, (len(req.prompt_token_ids), k)


def test_seeded_sampled_rows_on_cuda_are_reproducible_and_seed_dependent(cuda_pair):
    engine = SpeculativeEngine(*cuda_pair)
    req = next(r for r, _ in _requests() if r.sampling.temperature > 0)
    first, second = engine.generate(req), engine.generate(req)
    assert first.stats.proposed > 0 and first.token_ids == second.token_ids
    other = engine.generate(req.model_copy(update={"sampling": req.sampling.model_copy(update={"seed": 12345})}))
    assert other.token_ids != first.token_ids


def test_cuda_memory_is_freed_when_sessions_end(cuda_pair):
    """A cancelled or finished session's caches leave the GPU (allocated bytes back to the start)."""
    engine = SpeculativeEngine(*cuda_pair)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    sched = BatchScheduler(engine, max_batch_positions=64)
    handles = [sched.submit(req, tenant=t) for req, t in _requests()]
    sched.step()
    sched.step()
    handles[4].cancel()  # the 500-token prompt
    sched.run_until_idle()
    assert handles[4].result().finish_reason is FinishReason.CANCELLED
    del handles, sched
    import gc

    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
