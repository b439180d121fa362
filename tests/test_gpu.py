"""The GPU path on a real CUDA device: the demo pair in process and served at TP=1 on one GPU.

Marked ``gpu``: skipped (with the reason) only where CUDA is absent (``tests/conftest.py``);
``scripts/gpu-check.sh`` runs them on a GPU machine. Without a GPU the same code paths are
checked under CUDA's device rules on the CPU by ``tests/test_devices.py``.

Exactness is against the target alone on the same GPU (transformers' own ``generate``), as on
the CPU; a seeded sampled request is reproducible on the GPU because every random draw is made
on the CPU generator (:mod:`specdec.engine.sampling`).
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.demo]

MESSAGES = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
NEW_TOKENS = 48


def _target_alone(target, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of the target alone on its own device (transformers' ``generate``)."""
    out = target.model.generate(
        torch.tensor([prompt], device=target.device), max_new_tokens=n, do_sample=False,
        eos_token_id=target.eos_token_ids, pad_token_id=target.tokenizer.pad_token_id,
    )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def cuda_pair():
    from specdec.models.loader import load_pair
    from specdec.models.spec import ModelPairSpec

    target, draft = load_pair(ModelPairSpec.demo(), device="cuda")
    assert target.device.type == "cuda" and draft.device.type == "cuda"
    return target, draft


def _request(**kw):
    from specdec.request import GenerationRequest

    return GenerationRequest.model_validate({"messages": MESSAGES, "max_tokens": NEW_TOKENS, **kw})


@pytest.mark.parametrize("k", [1, 4, 8])
def test_demo_pair_greedy_on_cuda_is_the_target_alone(cuda_pair, k):
    from specdec.engine.engine import SpeculativeEngine

    target, draft = cuda_pair
    engine = SpeculativeEngine(target, draft)
    req = _request(speculation={"proposer": "draft", "k": k})
    result = engine.generate(req)
    assert result.stats.proposed > 0 and result.stats.accepted > 0
    assert result.token_ids == _target_alone(target, engine.encode(req), NEW_TOKENS)


def test_seeded_sampled_request_on_cuda_gives_the_same_output_twice(cuda_pair):
    from specdec.engine.engine import SpeculativeEngine

    target, draft = cuda_pair
    engine = SpeculativeEngine(target, draft)
    req = _request(sampling={"temperature": 0.8, "top_p": 0.95, "seed": 7}, speculation={"proposer": "draft", "k": 4})
    first, second = engine.generate(req), engine.generate(req)
    assert first.stats.proposed > 0
    assert first.token_ids == second.token_ids and first.text == second.text
    other = engine.generate(_request(sampling={"temperature": 0.8, "top_p": 0.95, "seed": 8},
                                     speculation={"proposer": "draft", "k": 4}))
    assert other.token_ids != first.token_ids  # the seed matters


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.mark.serve
def test_served_tp1_on_one_gpu(cuda_pair):
    """Router -> Draft -> Target with one TP worker, draft and target sharing the one GPU."""
    import grpc
    import ray
    from ray import serve
    from ray.serve.api import _run
    from ray.serve.config import HTTPOptions, gRPCOptions

    from deployments.app import build_app
    from deployments.client import SpecDecClient
    from deployments.config import HEALTH_SERVICER, SPECDEC_SERVICER, AppConfig

    target, _ = cuda_pair
    cfg = AppConfig(target_tp=1, target_gpus_per_worker=0.5, draft_num_gpus=0.5, grpc_port=_free_port(),
                    http_port=_free_port(), cpu_threads=2, ready_timeout_s=60.0)
    ray.init(address="local", num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options=HTTPOptions(port=cfg.http_port),
                    grpc_options=gRPCOptions(port=cfg.grpc_port, grpc_servicer_functions=[SPECDEC_SERVICER, HEALTH_SERVICER]))
        _run(build_app(cfg), _blocking=False, name=cfg.app_name, route_prefix=f"/{cfg.app_name}")
        end = time.time() + 900
        info = None
        while time.time() < end:
            try:
                info = serve.get_deployment_handle("Target", app_name=cfg.app_name).Info.remote().result(timeout_s=30)
                break
            except Exception:
                time.sleep(2)
        assert info is not None and [i["device"] for i in info] == ["cuda:0"], info
        with SpecDecClient(f"localhost:{cfg.grpc_port}", application=cfg.app_name) as client:
            served = client.generate(messages=MESSAGES, max_tokens=NEW_TOKENS, proposer="draft", max_k=4, timeout=600)
            from specdec.engine.engine import encode_prompt

            prompt = encode_prompt(target.tokenizer, _request(), target.emittable_vocab)
            assert served.token_ids == _target_alone(target, prompt, NEW_TOKENS)
            sampled = [client.generate(messages=MESSAGES, max_tokens=32, temperature=0.8, seed=3, proposer="draft",
                                       max_k=4, timeout=600).token_ids for _ in range(2)]
            assert sampled[0] == sampled[1]
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
