"""The GPU path without a GPU: every tensor that meets another in the engine is on one device.

The models run on the *virtual accelerator* ``cpu:0`` of :mod:`specdec.testing.devices`: the CPU
under a name the engine must pass on explicitly, checked by :class:`DeviceAudit` with CUDA's rules
(the same mistakes fail there as on a GPU: a CPU block compared with device logits, ``p - q``
across devices, ``torch.multinomial`` with a CPU generator on a device tensor). Outputs must be
identical to running on the plain CPU: a seeded request's draws do not depend on the device.
The real GPU checks are the ``gpu``-marked tests in ``tests/test_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from deployments import convert
from deployments.target_sessions import TargetSessionTable
from protos.specdec.v1 import exchange_pb2 as xpb
from specdec.engine.engine import SpeculativeEngine
from specdec.request import GenerationRequest, SamplingParams, SpeculationParams
from specdec.testing.devices import VIRTUAL_ACCELERATOR, DeviceAudit, DeviceMismatch
from specdec.engine.verifier import TargetVerifier
from tests.conftest import target_greedy

PROMPT = [5, 17, 42, 9, 100, 7, 23]


def _run_audited(target, draft, request):
    with DeviceAudit() as audit:
        audit.track(target.model)
        audit.track(draft.model)
        assert target.device == draft.device == VIRTUAL_ACCELERATOR
        result = SpeculativeEngine(target, draft).generate(request)
    assert audit.violations == []
    return result, audit


def test_audit_catches_what_cuda_refuses():
    """The audit is not vacuous: the three mistakes of issue 11 raise under it."""
    with DeviceAudit():
        logits = torch.zeros(3, 8, device=VIRTUAL_ACCELERATOR)
        block = torch.tensor([1, 2], dtype=torch.long)  # from the wire: host
        with pytest.raises(DeviceMismatch):
            _ = logits.argmax(dim=-1)[:2] == block
        with pytest.raises(DeviceMismatch):
            _ = logits[0] - torch.zeros(8)
        with pytest.raises(DeviceMismatch):
            torch.multinomial(logits[0].softmax(-1), 1, generator=torch.Generator())
        # what the engine does instead is fine
        _ = logits.argmax(dim=-1)[:2] == block.to(logits.device)
        torch.multinomial(logits[0].softmax(-1).cpu(), 1, generator=torch.Generator())
        assert logits.device == VIRTUAL_ACCELERATOR


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_greedy_on_the_accelerator_is_the_target_alone(tiny_target, tiny_draft_close, proposer):
    req = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=24, ignore_eos=True,
                            speculation=SpeculationParams(proposer=proposer, k=3))
    result, audit = _run_audited(tiny_target, tiny_draft_close, req)
    assert audit.model_calls >= 9  # target steps and draft forwards were all audited
    assert result.token_ids == target_greedy(tiny_target, PROMPT, 24)


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.9, seed=11),
    SamplingParams(temperature=0.7, top_k=1, seed=3),  # fewer than M ids with non-zero probability
    SamplingParams(temperature=1.0, top_p=0.8, seed=5),
])
def test_seeded_sampling_on_the_accelerator_equals_the_cpu(tiny_target, tiny_draft_close, sampling):
    req = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=20, ignore_eos=True, logprobs=True, sampling=sampling,
                            speculation=SpeculationParams(proposer="draft", k=4))
    on_accel, audit = _run_audited(tiny_target, tiny_draft_close, req)
    on_cpu = SpeculativeEngine(tiny_target, tiny_draft_close).generate(req)
    assert audit.model_calls > 0
    assert on_accel.token_ids == on_cpu.token_ids
    assert on_accel.stats.accepted == on_cpu.stats.accepted
    assert on_accel.logprobs == pytest.approx(on_cpu.logprobs, abs=1e-6)


def test_sampling_processors_on_the_accelerator(tiny_target, tiny_draft_close):
    """Penalties, logit bias, min-p, min_tokens and top logprobs keep their tensors on the device."""
    sampling = SamplingParams(temperature=0.8, seed=4, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5,
                              frequency_penalty=0.2, logit_bias={7: 2.0, 9: -5.0})
    req = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=12, min_tokens=6, logprobs=True, top_logprobs=3,
                            sampling=sampling, speculation=SpeculationParams(proposer="draft", k=3))
    on_accel, audit = _run_audited(tiny_target, tiny_draft_close, req)
    on_cpu = SpeculativeEngine(tiny_target, tiny_draft_close).generate(req)
    assert audit.model_calls > 0 and on_accel.token_ids == on_cpu.token_ids


def test_served_target_table_on_the_accelerator(tiny_target, tiny_draft_close):
    """The target replica's path: a block from the wire (CPU) verified by a model on the device."""
    target = tiny_target
    table = TargetSessionTable(TargetVerifier(target))
    sampling = SamplingParams(temperature=0.8, seed=1)
    draft = SpeculativeEngine(tiny_target, tiny_draft_close).draft_proposer.open_session(PROMPT, sampling, seed=9)
    block = draft.propose(3)
    msg = convert.draft_block_to_proto(block, "s", len(PROMPT), open=convert.session_open_to_proto(PROMPT, sampling, 4, False))
    with DeviceAudit() as audit:
        audit.track(target.model)
        reply = table.handle(msg)  # opens the session (and its cache) on the accelerator, then verifies
    assert audit.violations == [] and audit.model_calls == 1
    assert reply.status == xpb.VERIFY_STATUS_OK and len(reply.token_ids) == reply.accepted + 1
