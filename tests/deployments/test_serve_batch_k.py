"""K under load served with two draft replicas: their acceptance counts are pooled in the shared
controller actor (a real Ray actor, real Serve replicas). Tiny models, target TP=1, one Ray +
Serve + application for the module (2 CPUs)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from deployments.config import Scaling
from protos.specdec.v1 import specdec_pb2 as pb
from protos.specdec.v1 import specdec_pb2_grpc as pb_grpc
from tests.conftest import load_tiny, target_greedy
from tests.deployments.serving import APP, KEYS, serve_tiny_app, wait_running

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.serve

#: tenant beta: adaptive K (K under load on the draft replicas)
BETA = (("application", APP), ("authorization", f"Bearer {KEYS['beta']}"))


def test_two_draft_replicas_pool_acceptance_in_the_controller_actor(models):
    """6 adaptive requests, 3 at a time (tenant beta allows 4 in flight), over two draft replicas: greedy outputs equal the target
    alone; every draft replica that ran a generation reported to the controller actor when it
    ended, and the actor's pool holds exactly the tenant's speculation steps of all requests."""
    from ray import serve

    from deployments.controller_actor import ACTOR_NAMESPACE, actor_name

    with serve_tiny_app(models, target_tp=1, draft=Scaling(min_replicas=2, max_replicas=2, max_ongoing_requests=4),
                        draft_num_cpus=0.1, batch_k_sync_s=0.5) as cfg:
        wait_running(serve, APP, timeout_s=240)
        channel = grpc.insecure_channel(f"localhost:{cfg.grpc_port}")
        stub = pb_grpc.SpecDecStub(channel)
        prompts = [[5 + i, 17, 42, 9 + i, 100] for i in range(6)]

        def call(ids):
            req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), max_tokens=12,
                                     speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4))
            return stub.Generate(req, metadata=BETA, timeout=120)

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(call, prompts))
        channel.close()
        target = load_tiny(models[0])
        for ids, g in zip(prompts, got):
            assert list(g.token_ids) == target_greedy(target, ids, 12)
        spec_steps = sum(sum(n for k, n in g.stats.k_counts.items() if k > 0) for g in got)
        assert spec_steps > 0
        actor = ray.get_actor(actor_name(cfg.app_name, cfg.model_pair()), namespace=ACTOR_NAMESPACE)  # the application's
        end = time.time() + 60  # the last exchanges run in the background after the responses
        while True:
            pooled = ray.get(actor.sync_batch_acceptance.remote("test-reader", {"segments": []}))
            steps = {(t, p): c["raw_steps"] for t, p, c in pooled["keys"]}
            if steps.get(("beta", "draft"), 0) >= spec_steps or time.time() > end:
                break
            time.sleep(0.2)
        assert steps == {("beta", "draft"): spec_steps}
        replicas = set(ray.get(actor.batch_k_replicas.remote()))
        assert 1 <= len(replicas - {"test-reader"}) <= 2
