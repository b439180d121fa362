"""A TP=1 target worker computes on the device it holds (issue 11: it used to load on the CPU).

Without Ray and without a GPU: the worker at TP=1 needs no process group, and the accelerator
is the virtual one of :mod:`specdec.testing.devices` (CUDA's device rules on the CPU). The real
GPU check is ``test_served_tp1_on_one_gpu`` in ``tests/test_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from deployments import convert, tp_worker
from deployments.tp_worker import TPWorker, worker_device
from protos.specdec.v1 import exchange_pb2 as xpb
from specdec.request import SamplingParams
from specdec.testing.devices import VIRTUAL_ACCELERATOR, DeviceAudit
from specdec.types import DraftBlock

PROMPT = [5, 17, 42, 9, 100, 7, 23]


def test_worker_device_is_the_gpu_it_holds():
    assert worker_device(0) == torch.device("cpu")
    if torch.cuda.is_available():
        assert worker_device(1) == torch.device("cuda", 0)
    else:  # holding a GPU without CUDA is an error, not a silent CPU run
        with pytest.raises(RuntimeError, match=r"was given num_gpus=1 but CUDA is not available"):
            worker_device(1)


def test_tp1_worker_on_the_cpu(tiny_model_folder):
    worker = TPWorker(0, 1)
    info = worker.setup(str(tiny_model_folder), "127.0.0.1", 0, num_gpus=0)
    assert (info["device"], info["backend"], info["world_size"]) == ("cpu", None, 1)


def test_tp1_worker_verifies_on_the_device_it_holds(tiny_model_folder, monkeypatch):
    """Given a GPU, the TP=1 worker loads the target onto it, and a block from the wire is verified
    there under CUDA's device rules (greedy and sampled)."""
    monkeypatch.setattr(tp_worker, "worker_device", lambda num_gpus: VIRTUAL_ACCELERATOR if num_gpus else torch.device("cpu"))
    moved = []
    real_to = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **kw: (moved.append(a or kw), real_to(self, *a, **kw))[1])
    worker = TPWorker(0, 1)
    info = worker.setup(str(tiny_model_folder), "127.0.0.1", 0, num_gpus=1)
    assert moved and moved[-1] == (VIRTUAL_ACCELERATOR,)  # the model went to the worker's device
    with DeviceAudit() as audit:
        audit.track(worker.loaded.model)
        for i, sampling in enumerate([SamplingParams(), SamplingParams(temperature=0.9, seed=2)]):
            block = DraftBlock(token_ids=torch.tensor([42, 9]))
            open_ = convert.session_open_to_proto(PROMPT, sampling, 5, True)
            msg = convert.draft_block_to_proto(block, f"s{i}", len(PROMPT), open=open_)
            reply = xpb.VerificationResult.FromString(worker.verify(msg.SerializeToString()))
            assert reply.status == xpb.VERIFY_STATUS_OK and len(reply.token_ids) == reply.accepted + 1
            assert len(reply.logprobs) == len(reply.token_ids)
        logits = worker.forward(PROMPT)
    assert audit.violations == [] and audit.model_calls == 3
    assert logits.shape == (len(PROMPT), 320)


def test_tp1_worker_runs_plain_steps_through_lean_decode(tiny_model_folder, monkeypatch):
    """At TP = 1 a shape-invariant target's plain K = 0 steps take the lean decode forward
    (specdec.models.lean_decode), and the worker's greedy tokens are transformers' generate's on the
    same weights; a float32 target (not shape-invariant) keeps transformers' forward."""
    from specdec.models import lean_decode
    from tests.conftest import target_greedy

    plain = TPWorker(0, 1).setup(str(tiny_model_folder), "127.0.0.1", 0)  # float32
    assert plain["lean_decode"] is False and plain["attention"] == "transformers"
    worker = TPWorker(0, 1)
    info = worker.setup(str(tiny_model_folder), "127.0.0.1", 0, dtype="bfloat16")
    assert info["lean_decode"] is True
    assert info["attention"] == "row"  # a CPU: one call per query row (SEQUENCE_ATTENTION "auto")
    lean_calls = []
    real = lean_decode.decode_one
    monkeypatch.setattr(lean_decode, "decode_one", lambda *a: lean_calls.append(1) or real(*a))
    open_ = convert.session_open_to_proto(PROMPT, SamplingParams(), 0, False)
    position, tokens = len(PROMPT), []
    for step in range(10):
        msg = convert.draft_block_to_proto(DraftBlock.empty(), "s", position, open=open_ if step == 0 else None)
        reply = xpb.VerificationResult.FromString(worker.verify(msg.SerializeToString()))
        assert reply.status == xpb.VERIFY_STATUS_OK and reply.accepted == 0 and len(reply.token_ids) == 1
        tokens += list(reply.token_ids)
        position = reply.committed_len
    assert len(lean_calls) == 9  # every step after the prompt's prefill
    assert tokens == target_greedy(worker.loaded, PROMPT, 10)
