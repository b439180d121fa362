"""TenancyGate on tiny models and simulated tenants, in process (no Ray).

- adaptive K per tenant: a draft that always agrees (draft == target) climbs to the top of the
  range; an unrelated draft drops to K = 0, probes cheaply, and comes back when its traffic
  changes; neither moves the other's K;
- output stays exactly the target's (transformers' greedy generate) whatever K is picked;
- UNAUTHENTICATED / INVALID_ARGUMENT / RESOURCE_EXHAUSTED with their exact messages through
  the gate and the gRPC status table, other tenants still served afterwards;
- fair admission, stats of the caller's own tenant only, open mode, metrics.

K decisions use a frozen Leviathan cost model (verify 1, draft 0.1 per token): tiny drafts cost
as much as the tiny target, so measured costs would say speculation never pays.
"""

from __future__ import annotations

import asyncio

import pytest

from deployments.controller_client import ControllerClient
from deployments.grpc_status import RETRY_AFTER_KEY, abort_with, status_for
from deployments.metrics import SpecDecMetrics
from deployments.tenancy import TenancyGate, authorization_from_metadata, tenant_stats_to_proto
from specdec.control.adaptive import run_timed
from specdec.control.controller import k_schedule
from specdec.engine.engine import SpeculativeEngine
from specdec.errors import AuthenticationError, InvalidRequestError, ResourceExhaustedError
from specdec.request import GenerationRequest
from specdec.control.tenants import hash_api_key
from specdec.testing.sim import frozen_cost_model_factory
from specdec.types import DraftBlock
from tests.conftest import target_greedy
from tests.deployments.grpc_context import RecordingContext

KEYS = {"agree": "sk-agree-key", "disagree": "sk-disagree-key", "small": "sk-small-key", "other": "sk-other-key"}

TENANTS_YAML = f"""
tenants:
  - id: agree
    api_key_hashes: [{hash_api_key(KEYS["agree"])}]
    speculation: {{k_min: 0, k_max: 6}}
  - id: disagree
    api_key_hashes: [{hash_api_key(KEYS["disagree"])}]
    speculation: {{k_min: 0, k_max: 6}}
  - id: small
    api_key_hashes: [{hash_api_key(KEYS["small"])}]
    limits: {{max_concurrent_requests: 1, tokens_per_minute: 100, max_tokens: 64, max_prompt_tokens: 32}}
    speculation: {{allowed_proposers: [draft], k_min: 0, k_max: 3}}
  - id: other
    api_key_hashes: [{hash_api_key(KEYS["other"])}]
"""

PROMPTS = ["def add(a, b):", "for i in range(10):", "class Point:", '{"name": "specdec",', "SELECT id, name FROM"]
CONTROLLER = {"cost_model_factory": frozen_cost_model_factory, "probe_every_requests": 4}


def md(tenant: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {KEYS[tenant]}")]


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    p.write_text(TENANTS_YAML)
    return p


class ShiftedSession:
    """Proposes the target's own greedy tokens + 1: never agrees."""

    def __init__(self, inner, vocab):
        self.inner, self.vocab = inner, vocab

    def propose(self, k):
        b = self.inner.propose(k)
        return DraftBlock(token_ids=(b.token_ids + 1) % self.vocab)

    def commit(self, token_ids):
        self.inner.commit(token_ids)

    def close(self):
        self.inner.close()


class ShiftedProposer:
    def __init__(self, inner, vocab):
        self.inner, self.vocab = inner, vocab

    def open_session(self, *a, **kw):
        return ShiftedSession(self.inner.open_session(*a, **kw), self.vocab)


@pytest.fixture(scope="module")
def engines(tiny_target, tiny_draft_far, tiny_draft_close):
    wrong = SpeculativeEngine(tiny_target, tiny_target)
    wrong.draft_proposer = ShiftedProposer(wrong.draft_proposer, tiny_target.emittable_vocab)
    return {
        "equal": SpeculativeEngine(tiny_target, tiny_target),  # the draft always agrees
        "wrong": wrong,  # always proposes a token the target does not pick
        "far": SpeculativeEngine(tiny_target, tiny_draft_far),  # unrelated weights: rarely agrees
        "close": SpeculativeEngine(tiny_target, tiny_draft_close),
    }


def make_gate(tenants_file, clock=None, **kw) -> TenancyGate:
    ctl = ControllerClient.local(CONTROLLER, clock=clock) if clock else ControllerClient.local(CONTROLLER)
    return TenancyGate(tenants_file, ctl, SpecDecMetrics(backend=None), **kw)


def engine_k(adm):
    """The loop's K for an admission, as the draft replica builds it from the router's job."""
    return k_schedule(adm.chosen_k, adm.decision.get("probe_steps") if adm.decision.get("probe") else None)


async def serve_one(gate, engine, tenant, prompt, max_tokens=24, k=6):
    req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, speculation={"proposer": "draft", "k": k})
    adm = await gate.admit(md(tenant), req)
    try:
        timed = run_timed(engine.start(adm.request, k=engine_k(adm)))
    except BaseException as e:
        await gate.complete(adm, e)
        raise
    await gate.complete(adm, timed)
    return adm, timed


def k_of(gate, tenant):
    return gate.controller.state.current_k(tenant, "draft")


# ---------------------------------------------------------------- adaptive K per tenant


def test_agreeing_tenant_climbs_disagreeing_drops_then_returns(tenants_file, engines, tiny_target):
    gate = make_gate(tenants_file)

    async def main():
        agree_ks, dis = [], []
        for i in range(12):
            p = PROMPTS[i % len(PROMPTS)]
            a, ta = await serve_one(gate, engines["equal"], "agree", p)
            agree_ks.append(a.chosen_k)
            d, td = await serve_one(gate, engines["wrong"], "disagree", p)
            dis.append(d)
            ids = engines["equal"].encode(GenerationRequest(prompt=p))
            want = target_greedy(tiny_target, ids, 24)
            assert ta.result.token_ids == want and td.result.token_ids == want  # exact whatever K
        assert agree_ks[-6:] == [6] * 6 and k_of(gate, "agree") == 6
        assert k_of(gate, "disagree") == 0
        assert all(d.chosen_k == 0 for d in dis[-6:] if not d.decision["probe"])
        probes = [d for d in dis if d.decision["probe"]]
        assert probes and all(d.decision["probe_steps"] == 4 for d in probes)
        # the disagreeing tenant's traffic turns predictable (its draft now agrees): back up
        back = None
        for i in range(12):
            p = PROMPTS[i % len(PROMPTS)]
            a, _ = await serve_one(gate, engines["equal"], "agree", p)
            assert a.chosen_k == 6  # never moved by the other tenant
            d, _ = await serve_one(gate, engines["equal"], "disagree", p)
            if back is None and not d.decision["probe"] and d.chosen_k > 0:
                back = i
        assert back is not None and back <= 8
        assert k_of(gate, "disagree") >= 4
        stats = await gate.tenant_stats(md("disagree"))
        assert stats["tenant_id"] == "disagree" and stats["proposers"]["draft"]["probes"] >= 1

    asyncio.run(main())


def test_greedy_identity_under_adaptive_k(tenants_file, engines, tiny_target):
    """A close draft: K moves between requests (and probes use a K schedule); every output equals
    transformers' greedy generate of the target alone."""
    gate = make_gate(tenants_file)

    async def main():
        ks = set()
        for i in range(10):
            p = PROMPTS[i % len(PROMPTS)] + " " * (i // 5)
            adm, t = await serve_one(gate, engines["close" if i % 3 else "far"], "other", p, max_tokens=20, k=8)
            ks.add(adm.chosen_k)
            want = target_greedy(tiny_target, engines["close"].encode(GenerationRequest(prompt=p)), 20)
            assert t.result.token_ids == want, (i, adm.chosen_k)
        assert len(ks) >= 2  # the controller did change K

    asyncio.run(main())


# ---------------------------------------------------------------- auth, policy, limits


def req(**kw):
    kw.setdefault("prompt_token_ids", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    kw.setdefault("max_tokens", 8)
    return GenerationRequest(**kw)


def grpc_of(exc):
    ctx = RecordingContext()
    abort_with(ctx, exc)
    return ctx


def test_unauthenticated_messages_and_others_still_served(tenants_file, engines):
    gate = make_gate(tenants_file)

    async def main():
        cases = [
            (None, "missing API key: send 'authorization: Bearer <key>' (gRPC metadata or HTTP header)"),
            ([("authorization", "Basic abc")], "malformed authorization: expected 'Bearer <key>'"),
            ([("authorization", "Bearer sk-nope")], "unknown API key"),
        ]
        for metadata, msg in cases:
            with pytest.raises(AuthenticationError) as ei:
                await gate.admit(metadata, req())
            ctx = grpc_of(ei.value)
            assert ctx.code.name == "UNAUTHENTICATED" and ctx.details == msg
            with pytest.raises(AuthenticationError):
                await gate.tenant_stats(metadata)
        assert gate.metrics.value("specdec_requests", tenant="unknown", status="UNAUTHENTICATED") == 3
        _, t = await serve_one(gate, engines["equal"], "other", "def add(a, b):", max_tokens=6)
        assert t.tokens == 6

    asyncio.run(main())


def test_invalid_argument_messages_and_clipping(tenants_file):
    gate = make_gate(tenants_file)

    async def main():
        cases = [
            (req(max_tokens=65), "max_tokens=65 exceeds the limit of tenant 'small', 64 (limits.max_tokens)"),
            (req(prompt_token_ids=list(range(5, 38))),
             "prompt is 33 tokens but tenant 'small' allows at most 32 (limits.max_prompt_tokens)"),
            (req(speculation={"proposer": "ngram"}),
             "speculation.proposer: 'ngram' is not allowed for tenant 'small'; allowed: ['draft', 'none']"),
        ]
        for r, msg in cases:
            with pytest.raises(InvalidRequestError) as ei:
                await gate.admit(md("small"), r)
            ctx = grpc_of(ei.value)
            assert ctx.code.name == "INVALID_ARGUMENT" and ctx.details == msg
        assert gate.metrics.value("specdec_requests", tenant="small", status="INVALID_ARGUMENT") == 3
        adm = await gate.admit(md("small"), req(speculation={"proposer": "draft", "k": 9}))
        assert adm.clipped == ("k=9 clipped to the tenant's k_max=3",)
        assert adm.decision["k_max"] == 3 and adm.request.speculation.k == adm.chosen_k <= 3
        await gate.complete(adm, None)

    asyncio.run(main())


def test_seeded_sampled_requests_are_not_adapted(tenants_file):
    """A seeded sampled request runs at a K the controller does not move (its output depends
    on K); unseeded sampled and greedy requests are adapted."""
    gate = make_gate(tenants_file)

    async def main():
        out = {}
        for name, sampling in [("seeded", {"temperature": 0.8, "seed": 7}), ("unseeded", {"temperature": 0.8}),
                               ("greedy", {"temperature": 0.0, "seed": 7})]:
            adm = await gate.admit(md("agree"), req(sampling=sampling, speculation={"proposer": "draft", "k": 5}))
            out[name] = (adm.decision["reason"], adm.chosen_k)
            await gate.complete(adm, None)
        return out

    out = asyncio.run(main())
    assert out["seeded"] == ("fixed", 5)
    assert out["unseeded"][0] != "fixed" and out["greedy"][0] != "fixed"


def test_resource_exhausted_messages_retry_after_and_recovery(tenants_file, engines):
    clock = FakeClock()
    gate = make_gate(tenants_file, clock=clock)

    async def main():
        first = await gate.admit(md("small"), req(max_tokens=60))  # 10 + 60 of 100 tokens/min
        with pytest.raises(ResourceExhaustedError) as ei:
            await gate.admit(md("small"), req())
        ctx = grpc_of(ei.value)
        assert ctx.code.name == "RESOURCE_EXHAUSTED"
        assert ctx.details == ("tenant 'small' already has 1 requests in flight (limit max_concurrent_requests); "
                               "retry when one finishes")
        assert ctx.trailing == ((RETRY_AFTER_KEY, "1.000"),)
        # others are still served while 'small' is limited
        _, t = await serve_one(gate, engines["equal"], "other", "class Point:", max_tokens=5)
        assert t.tokens == 5
        await gate.complete(first, None)  # nothing generated: 60 of 70 tokens refunded
        second = await gate.admit(md("small"), req(max_tokens=60))
        await gate.complete(second, None)  # charged 10 again
        third = await gate.admit(md("small"), req(max_tokens=8, ignore_eos=True))
        await gate.complete(third, engines["equal"].generate(third.request))  # charged 10 + 8
        with pytest.raises(ResourceExhaustedError) as ei:
            await gate.admit(md("small"), req(max_tokens=60))  # needs 70; 100 - 10 - 10 - 18 = 62 left
        e = ei.value
        assert e.limit == "tokens_per_minute" and e.retry_after_s == pytest.approx(4.8)
        ctx = grpc_of(e)
        assert ctx.details == ("tenant 'small' is over its limit of 100 tokens per minute (limit tokens_per_minute): "
                               "request needs 70, 62 available; retry after 4.800 s")
        assert ctx.trailing == ((RETRY_AFTER_KEY, "4.800"),)
        _, t = await serve_one(gate, engines["equal"], "other", "class Point:", max_tokens=5)  # still served
        assert t.tokens == 5
        clock.t += 60.0  # the bucket refills
        adm = await gate.admit(md("small"), req(max_tokens=60))
        await gate.complete(adm, None)
        assert gate.metrics.value("specdec_requests", tenant="small", status="RESOURCE_EXHAUSTED") == 2
        assert gate.controller.state.active_leases() == 0

    asyncio.run(main())


def test_fair_admission_queue_limit_and_burst_does_not_starve(tenants_file):
    gate = make_gate(tenants_file, capacity=1, max_queue_per_tenant=2)

    async def main():
        holder = await gate.admit(md("other"), req())
        order = []

        async def one(tenant):
            adm = await gate.admit(md(tenant), req())
            order.append(tenant)
            await asyncio.sleep(0)
            await gate.complete(adm, None)

        burst = [asyncio.create_task(one("other")) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(ResourceExhaustedError) as ei:
            await gate.admit(md("other"), req())
        assert ei.value.limit == "max_queued_requests"
        assert str(ei.value) == ("tenant 'other' already has 2 requests queued (limit max_queued_requests=2); "
                                 "retry shortly")
        late = asyncio.create_task(one("agree"))
        await asyncio.sleep(0.01)
        await gate.complete(holder, None)
        await asyncio.gather(*burst, late)
        assert order[0] == "agree"  # the other tenant's single request is not behind the burst
        assert gate.admission.running == 0

    asyncio.run(main())


# ---------------------------------------------------------------- stats, open mode, metadata


def test_tenant_stats_are_the_callers_own(tenants_file, engines):
    gate = make_gate(tenants_file)

    async def main():
        await serve_one(gate, engines["equal"], "agree", "def add(a, b):", max_tokens=10)
        await serve_one(gate, engines["wrong"], "disagree", "def add(a, b):", max_tokens=10)
        sa = await gate.tenant_stats(md("agree"))
        sd = await gate.tenant_stats(md("disagree"))
        assert sa["tenant_id"] == "agree" and sd["tenant_id"] == "disagree"
        assert sa["usage"]["requests"] == 1 and sa["usage"]["completion_tokens"] == 10
        assert sa["proposers"]["draft"]["acceptance"]["tenant"] == "agree"
        assert sa["proposers"]["draft"]["acceptance"]["alpha"] > sd["proposers"]["draft"]["acceptance"]["alpha"]
        msg = tenant_stats_to_proto(sa)
        assert msg.tenant_id == "agree" and msg.proposer == 1 and msg.usage.completion_tokens == 10
        assert msg.HasField("acceptance_rate") and msg.HasField("predicted_speedup")
        assert msg.current_k == sa["proposers"]["draft"]["current_k"]
        assert msg.cost.draft_per_token_s > 0 and msg.stats.proposed > 0  # frozen costs: no verify points
        from deployments.tenancy import proposer_name

        assert proposer_name(msg.proposer) == "draft" and proposer_name(0) is None
        assert tenant_stats_to_proto(sa, proposer_name(2)).current_k == 0  # never used ngram
        fresh = await gate.tenant_stats(md("other"))
        assert fresh["proposers"] == {} and tenant_stats_to_proto(fresh).current_k == 0

    asyncio.run(main())


def test_open_mode_default_tenant(engines, tiny_target):
    gate = TenancyGate(None, ControllerClient.local(CONTROLLER), SpecDecMetrics(backend=None))
    assert gate.open_mode

    async def main():
        for metadata in (None, [("authorization", "Bearer anything")]):
            r = GenerationRequest(prompt="def add(a, b):", max_tokens=12, speculation={"k": 16})
            adm = await gate.admit(metadata, r)
            assert adm.tenant_id == "default" and adm.decision["k_max"] == 16
            t = run_timed(engines["equal"].start(adm.request, k=engine_k(adm)))
            await gate.complete(adm, t)
        st = await gate.tenant_stats(None)
        assert st["tenant_id"] == "default" and st["usage"]["requests"] == 2
        assert gate.metrics.value("specdec_requests", tenant="default", status="OK") == 2

    asyncio.run(main())


def test_authorization_from_metadata_shapes():
    class Item:
        def __init__(self, k, v):
            self.key, self.value = k, v

    class Ctx:
        def invocation_metadata(self):
            return [Item("x-other", "1"), Item("Authorization", "Bearer a")]

    assert authorization_from_metadata(Ctx()) == "Bearer a"
    assert authorization_from_metadata({"authorization": b"Bearer b"}) == "Bearer b"
    assert authorization_from_metadata([("AUTHORIZATION", "Bearer c")]) == "Bearer c"
    assert authorization_from_metadata([]) is None and authorization_from_metadata(None) is None


def test_metrics_record_request_and_status_names(engines):
    m = SpecDecMetrics(backend=None)
    res = engines["equal"].start(GenerationRequest(prompt="def add(a, b):", max_tokens=9, speculation={"k": 3})).run()
    decision = {"k": 3, "predicted_speedup": 2.0, "alpha": 0.9, "baseline_step_time_s": 0.1}
    m.record_request("t", "draft", "OK", res, 0.05, decision, inter_token_s=0.01, prompt_tokens=7, queue_s=0.0)
    assert m.value("specdec_requests", tenant="t", status="OK") == 1
    assert m.value("specdec_generated_tokens", tenant="t") == 9
    assert m.value("specdec_prompt_tokens", tenant="t") == 7
    assert m.value("specdec_proposed_tokens", tenant="t", proposer="draft") == res.stats.proposed
    assert m.value("specdec_accepted_tokens_by_position", tenant="t", proposer="draft", position="0") == \
        res.stats.accepted_per_position[0]
    assert m.value("specdec_chosen_k", tenant="t", proposer="draft") == 3
    assert m.value("specdec_acceptance_rate", tenant="t", proposer="draft") == 0.9
    assert m.value("specdec_measured_speedup", tenant="t", proposer="draft") > 0
    assert m.count("specdec_speculation_k", tenant="t") == res.stats.steps
    assert m.count("specdec_ttft_seconds", tenant="t") == 1
    assert status_for(ResourceExhaustedError("x", limit="y")).name == "RESOURCE_EXHAUSTED"


def test_metrics_on_ray_api_without_a_cluster():
    m = SpecDecMetrics()  # ray.serve.metrics objects; recording without Ray is a no-op export
    m.record_request("t", "draft", "OK")
    assert m.value("specdec_requests", tenant="t", status="OK") == 1


# ---------------------------------------------------------------- two router replicas (Ray)


#: the application name and model pair of the Ray tests' shared actor
RAY_APP = "test-tenancy"
RAY_PAIR = {"target_model": "t", "draft_model": "d"}


@pytest.fixture
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        from deployments.controller_actor import ACTOR_NAMESPACE, actor_name

        try:
            ray.kill(ray.get_actor(actor_name(RAY_APP, RAY_PAIR), namespace=ACTOR_NAMESPACE))
        except ValueError:
            pass
        ray.shutdown()


@pytest.mark.serve
def test_two_router_replicas_share_k_and_limits(ray_local, tenants_file, engines):
    """Two gates (two router replicas of one application) on its named controller actor: the
    same K per tenant, and a tenant's concurrency limit holds across them."""
    from deployments.controller_actor import ACTOR_NAMESPACE, actor_name

    g1 = TenancyGate(tenants_file, ControllerClient.shared(CONTROLLER, app_name=RAY_APP, pair=RAY_PAIR),
                     SpecDecMetrics(backend=None))
    g2 = TenancyGate(tenants_file,
                     ControllerClient.shared({"probe_every_requests": 99}, app_name=RAY_APP, pair=RAY_PAIR),
                     SpecDecMetrics(backend=None))
    assert g1.controller.is_shared and g2.controller.is_shared

    async def main():
        for i in range(6):
            gate = (g1, g2)[i % 2]
            await serve_one(gate, engines["equal"], "agree", PROMPTS[i % 5], max_tokens=16)
            await serve_one(gate, engines["wrong"], "disagree", PROMPTS[i % 5], max_tokens=16)
        for t, want in (("agree", 6), ("disagree", 0)):
            k1 = await g1.controller.current_k(t, "draft")
            k2 = await g2.controller.current_k(t, "draft")
            assert k1 == k2 == want
        a1 = await g1.admit(md("agree"), req(speculation={"k": 8}))
        a2 = await g2.admit(md("agree"), req(speculation={"k": 8}))
        assert a1.chosen_k == a2.chosen_k == 6
        await g1.complete(a1, None)
        await g2.complete(a2, None)
        s1, s2 = await g1.tenant_stats(md("agree")), await g2.tenant_stats(md("agree"))
        assert s1["usage"] == s2["usage"] and s1["usage"]["requests"] == 8
        # limits are shared: 'small' may have one request in flight, whichever replica
        held = await g1.admit(md("small"), req())
        with pytest.raises(ResourceExhaustedError) as ei:
            await g2.admit(md("small"), req())
        assert ei.value.limit == "max_concurrent_requests"
        await g1.complete(held, None)
        again = await g2.admit(md("small"), req())
        await g2.complete(again, None)

    asyncio.run(main())
    actor = ray_local.get_actor(actor_name(RAY_APP, RAY_PAIR), namespace=ACTOR_NAMESPACE)
    assert ray_local.get(actor.active_leases.remote()) == 0


def test_dashboard_reads_only_metrics_we_define():
    """Every ray_specdec_* series in the Grafana dashboard is one deployments.metrics defines."""
    import json
    import re
    from pathlib import Path

    from deployments.metrics import METRICS

    exported = set()
    for name, (kind, *_rest) in METRICS.items():
        exported.add("ray_" + name + ("_total" if kind == "counter" else ""))
    dash = json.loads((Path(__file__).parents[2] / "k8s" / "grafana" / "specdec-dashboard.json").read_text())
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for p in dash["panels"] for t in p["targets"]
            for m in re.findall(r"\bray_specdec_[a-z_]+", t["expr"])}
    assert used <= exported, used - exported
    assert {"ray_specdec_predicted_speedup", "ray_specdec_measured_speedup",
            "ray_specdec_accepted_tokens_by_position_total"} <= used
