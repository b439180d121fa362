"""The demo pair served end to end (local-cpu preset: target TP=1 + draft + router).

Greedy output over the real gRPC port equals the target alone (transformers ``generate``) for a
code-writing chat prompt. Short (16 new tokens) to keep CI time down. The reference is computed
first and its model freed before serving, so at most one copy of the target is in memory at a time
besides the served shards.
"""

from __future__ import annotations

import gc

import pytest

from tests.conftest import target_greedy
from tests.deployments.serving import free_port

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.serve, pytest.mark.demo]

MESSAGES = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
NEW_TOKENS = 16


def test_served_demo_pair_equals_target_alone(demo_pair_folders):
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from deployments.app import build_app
    from deployments.client import SpecDecClient
    from deployments.config import HEALTH_SERVICER, PRESETS, SPECDEC_SERVICER, AppConfig
    from specdec.engine.engine import encode_prompt
    from specdec.models.loader import load_model
    from specdec.models.spec import DemoModelSpec
    from specdec.request import parse_request

    target = load_model(DemoModelSpec(role="target"))
    prompt = encode_prompt(target.tokenizer, parse_request({"messages": MESSAGES}), target.emittable_vocab)
    expected = target_greedy(target, prompt, NEW_TOKENS)
    del target
    gc.collect()

    cfg = AppConfig.model_validate({**PRESETS["local-cpu.yaml"].model_dump(), "grpc_port": free_port(),
                                    "http_port": free_port()})
    assert cfg.target_tp == 1 and cfg.target_model == "demo:target" and cfg.draft_model == "demo:draft"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options=HTTPOptions(port=cfg.http_port),
                    grpc_options=gRPCOptions(port=cfg.grpc_port, grpc_servicer_functions=[SPECDEC_SERVICER, HEALTH_SERVICER]))
        serve.run(build_app(cfg), name=cfg.app_name, route_prefix=f"/{cfg.app_name}")
        with SpecDecClient(f"localhost:{cfg.grpc_port}", application=cfg.app_name) as client:
            res = client.generate(messages=MESSAGES, max_tokens=NEW_TOKENS, timeout=600)
        print(f"served: {res.text!r}; acceptance {res.stats.acceptance_rate}, wire {res.wire}")
        assert res.token_ids == expected[: len(res.token_ids)]
        assert len(res.token_ids) == NEW_TOKENS
        assert res.stats.proposed > 0 and res.wire.bytes_per_step > 0
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
