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


def test_cuda_attention_mode_is_the_probes_decision(cuda_pair):
    """bfloat16 (shape-invariant): each model's attention is one call per sequence exactly when the
    load-time probe on this GPU finds it bitwise equal to one call per row
    (:func:`specdec.engine.invariant.probe_sequence_attention`); float32 (not invariant): per row.
    The batched and greedy tests here then check the exactness of the mode chosen."""
    from specdec.engine.invariant import attention_mode, probe_sequence_attention

    for loaded in cuda_pair:
        model = loaded.model
        if not loaded.invariant:
            assert attention_mode(model) == "row"
            continue
        cfg = model.config
        probed = probe_sequence_attention(cfg.num_attention_heads, cfg.num_key_value_heads,
                                          cfg.hidden_size // cfg.num_attention_heads, torch.bfloat16, "cuda",
                                          scaling=model.model.layers[0].self_attn.scaling)
        assert attention_mode(model) == ("sequence" if probed else "row")
        assert model.model.layers[0].self_attn._specdec_attention == attention_mode(model)
        print(f"attention on {torch.cuda.get_device_name()}, bfloat16: one call per {attention_mode(model)}")


def test_batched_rows_on_cuda_equal_each_request_alone(cuda_pair):
    """Prompts 1..500 tokens, K 0/1/4/8, draft/ngram/none, greedy and seeded sampled, two tenants
    (bfloat16: in the attention mode the probe chose, test_cuda_attention_mode_is_the_probes_decision)."""
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
