"""The shared controller state survives a restart: snapshot to a store, restore on start."""

from __future__ import annotations

import random

import pytest

from deployments.controller_actor import SharedTenantState
from specdec.types import SpeculationStats

POLICY = {"k_min": 0, "k_max": 6, "adaptive": True, "fixed_k": None}


class DictStore:
    def __init__(self):
        self.blob = None
        self.saves = 0

    def load(self):
        return self.blob

    def save(self, blob):
        self.blob = blob
        self.saves += 1


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _traffic(call, tenant: str, alpha: float, n: int, rng, tick=None) -> None:
    """n requests of 8 steps at the decided K, each draft token accepted with probability alpha.

    ``call(method, *args)`` reaches the shared state (in process, or the Ray actor)."""
    for _ in range(n):
        adm = call("admit", tenant, {}, 10, "draft", POLICY, 6)
        k = adm["decision"]["k"]
        st = SpeculationStats()
        for _ in range(8):
            a = 0
            while a < k and rng.random() < alpha:
                a += 1
            st.record_step(k, a, 0.01 * k, 0.1 + 0.01 * k)
        call("complete", adm["lease"], tenant, "draft", st.as_dict(), None, 10, 8 + st.accepted)
        if tick is not None:
            tick()


def _local(state: SharedTenantState):
    return lambda method, *args: getattr(state, method)(*args)


def test_learned_state_and_usage_survive_a_restart():
    store, clock, rng = DictStore(), Clock(), random.Random(3)
    first = SharedTenantState(store=store, clock=clock, snapshot_every_s=5.0)
    assert not first.was_restored()
    def tick():
        clock.t += 1.0

    _traffic(_local(first), "code", 0.95, 20, rng, tick)
    _traffic(_local(first), "chat", 0.05, 20, rng, tick)
    assert 1 < store.saves < 40  # throttled to one save per 5 s of 1 s requests (+ the first)
    first.snapshot(force=True)
    k_code, k_chat = first.current_k("code", "draft"), first.current_k("chat", "draft")
    assert k_code >= 4 and k_chat == 0

    second = SharedTenantState(store=store, clock=Clock())  # a new process: another clock
    assert second.was_restored()
    assert (second.current_k("code", "draft"), second.current_k("chat", "draft")) == (k_code, k_chat)
    for tenant in ("code", "chat"):
        a1 = first.controller.estimator.alpha((tenant, "draft"))
        assert second.controller.estimator.alpha((tenant, "draft")) == pytest.approx(a1)
        assert second.tenant_stats(tenant)["usage"] == first.tenant_stats(tenant)["usage"]
    assert second.controller.cost_model("draft").snapshot() == first.controller.cost_model("draft").snapshot()
    # the restored controller keeps deciding from what it knew: code stays high at once
    assert second.decide("code", "draft", POLICY, 6)["k"] == k_code


@pytest.mark.parametrize("blob", [b"not a pickle", None])
def test_bad_or_missing_snapshot_starts_fresh(blob):
    store = DictStore()
    store.blob = blob
    state = SharedTenantState(store=store)
    assert not state.was_restored() and state.current_k("code", "draft") is None


def test_snapshot_of_another_version_is_ignored():
    import pickle

    store = DictStore()
    store.blob = pickle.dumps({"controller": pickle.dumps({"version": 999}), "usage": {"x": {}}})
    state = SharedTenantState(store=store)
    assert not state.was_restored() and state.usage == {}


def _trained_store():
    store, clock = DictStore(), Clock()
    state = SharedTenantState(store=store, clock=clock)
    _traffic(_local(state), "code", 0.95, 20, random.Random(3))
    state.snapshot(force=True)
    return store, state


def test_snapshot_is_versioned_plain_json():
    import json

    store, state = _trained_store()
    data = json.loads(store.blob)  # plain data: no pickled objects
    assert data["format"] == "specdec-controller-snapshot" and data["controller"]["version"] == 2
    assert data["usage"] == {"code": {"requests": 20, "prompt_tokens": 200, "completion_tokens": state.usage["code"]["completion_tokens"]}}
    (entry,) = data["controller"]["k_state"]
    assert (entry["tenant"], entry["proposer"], entry["current_k"]) == ("code", "draft", state.current_k("code", "draft"))
    assert [k[:2] for k in data["controller"]["acceptance"]["keys"]] == [["code", "draft"]]


def test_snapshot_written_before_a_field_existed_is_restored_with_defaults():
    """An upgrade adds fields: an older snapshot lacks them; they take their defaults and
    deciding works."""
    import json

    store, state = _trained_store()
    data = json.loads(store.blob)
    entry = data["controller"]["k_state"][0]
    del entry["switches"], entry["probes"]
    counts = data["controller"]["acceptance"]["keys"][0][2]
    del counts["proposed_per_position"], counts["raw_steps"]
    store.blob = json.dumps(data).encode()
    fresh = SharedTenantState(store=store, clock=Clock())
    assert fresh.was_restored()
    assert fresh.tenant_stats("code")["proposers"]["draft"]["switches"] == 0
    snap = fresh.controller.estimator.snapshot(("code", "draft"))
    assert snap.raw_steps == 0 and snap.proposed_per_position == ()
    assert snap.accepted == pytest.approx(state.controller.estimator.snapshot(("code", "draft")).accepted)
    assert fresh.decide("code", "draft", POLICY, 6)["k"] == state.current_k("code", "draft")


def test_pickled_snapshot_of_live_objects_is_ignored_with_a_log_line(caplog):
    """The old format pickled live objects: after an upgrade that adds a field, it unpickled
    into objects without it and every decision raised. Now any unreadable snapshot is ignored."""
    import pickle

    from specdec.control.acceptance import AcceptanceEstimator
    from specdec.control.controller import KController

    old = KController()
    counts = old.estimator._new_key(("code", "draft"))
    del counts.proposed_per_position  # a _Counts pickled before this field existed
    legacy = {"version": 1, "estimator": old.estimator, "costs": {}, "state": {}}
    store = DictStore()
    store.blob = pickle.dumps({"controller": pickle.dumps(legacy), "usage": {"code": {"requests": 3}}})
    with caplog.at_level("WARNING", logger="deployments.controller_actor"):
        state = SharedTenantState(store=store)
    assert not state.was_restored() and state.usage == {}
    msgs = [r.getMessage() for r in caplog.records if r.name == "deployments.controller_actor"]
    assert len(msgs) == 1 and msgs[0].startswith("controller snapshot unreadable (") and msgs[0].endswith("); starting fresh")
    assert isinstance(state.controller.estimator, AcceptanceEstimator)
    assert state.decide("code", "draft", POLICY, 6)["reason"] == "initial"
    assert state.admit("code", {}, 10, "draft", POLICY, 6)["decision"]["k"] >= 0


@pytest.mark.parametrize("mutate", [
    lambda d: d["controller"].update(version=3),
    lambda d: d["controller"]["k_state"][0].update(current_k="four"),
    lambda d: d["controller"]["acceptance"]["keys"][0][2].update(accepted=-1.0),
    lambda d: d["controller"]["costs"]["draft"]["verify"].update({"99": [1, 0.5]}),
    lambda d: d.pop("usage"),
])
def test_snapshot_of_another_version_or_shape_is_ignored_whole(mutate, caplog):
    import json

    store, _ = _trained_store()
    data = json.loads(store.blob)
    mutate(data)
    store.blob = json.dumps(data).encode()
    with caplog.at_level("WARNING", logger="deployments.controller_actor"):
        state = SharedTenantState(store=store)
    assert not state.was_restored() and state.usage == {} and state.current_k("code", "draft") is None
    assert state.controller.estimator.keys() == [] and state.controller._costs == {}
    assert any(r.getMessage().startswith("controller snapshot unreadable (") for r in caplog.records)


@pytest.mark.serve
def test_restarted_controller_actor_resumes_from_its_snapshot():
    """The named actor is killed (Ray restarts it: max_restarts=-1); the new incarnation loads
    the snapshot from Ray's GCS key-value store and holds the same K per tenant."""
    ray = pytest.importorskip("ray")
    import time

    from deployments.controller_client import get_or_create_actor

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        actor = get_or_create_actor({"probe_every_requests": 1000}, app_name="test-restart",
                                    pair={"target_model": "t", "draft_model": "d"})
        rng = random.Random(5)

        def call(method, *args):
            return ray.get(getattr(actor, method).remote(*args))

        for tenant, alpha in (("code", 0.95), ("chat", 0.05)):
            _traffic(call, tenant, alpha, 20, rng)
        assert ray.get(actor.snapshot.remote(True))
        before = [ray.get(actor.current_k.remote(t, "draft")) for t in ("code", "chat")]
        assert before[0] >= 4 and before[1] == 0
        assert not ray.get(actor.was_restored.remote())
        ray.kill(actor, no_restart=False)
        # calls right after the kill may still reach the old incarnation (False): wait for the new one
        deadline = time.time() + 60
        restored = False
        while not restored and time.time() < deadline:
            try:
                restored = ray.get(actor.was_restored.remote(), timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            if not restored:
                time.sleep(0.5)
        assert restored
        assert [ray.get(actor.current_k.remote(t, "draft")) for t in ("code", "chat")] == before
        ray.kill(actor)
    finally:
        ray.shutdown()


def test_draft_replicas_acceptance_pool_survives_a_restart_and_rejects_bad_reports():
    """The pool of the draft replicas' acceptance counts (K under load) is in the snapshot; a
    malformed report is refused whole with ValueError."""
    store = DictStore()
    first = SharedTenantState(store=store, clock=Clock())
    report = {"segments": [{"steps": [["code", "draft", 4, 4, 30], ["code", "draft", 4, 1, 10]], "cap": None}]}
    pooled = first.sync_batch_acceptance("replica-a", report)
    assert first.batch_replicas == {"replica-a": 100.0}
    (entry,) = pooled["keys"]
    assert entry[:2] == ["code", "draft"] and entry[2]["raw_steps"] == 40
    assert entry[2]["accepted"] == pytest.approx(first.batch_acceptance.snapshot(("code", "draft")).accepted)
    first.snapshot(force=True)
    second = SharedTenantState(store=store, clock=Clock())
    assert second.was_restored()
    assert second.batch_acceptance.export_counts() == first.batch_acceptance.export_counts()
    with pytest.raises(ValueError, match="accepted <= K"):
        second.sync_batch_acceptance("replica-b", {"segments": [{"steps": [["code", "draft", 2, 5, 1]]}]})
    assert second.batch_acceptance.export_counts() == first.batch_acceptance.export_counts()
    assert "replica-b" not in second.batch_replicas


def test_tenant_stats_after_one_rejected_pooled_step_of_a_second_tenant_is_not_zero():
    """GetTenantStats reported acceptance 0.0 for a tenant whose single pooled step was rejected
    after another tenant's single rejected step (the pool's global estimate had no prior, so the
    second tenant's prior was all rejections). The served pool's global estimate now carries
    GLOBAL_PRIOR_WEIGHT pseudo-trials at 0.5; a snapshot restore keeps that setting."""
    from deployments.ingress.tenant_stats import tenant_stats_to_proto

    store = DictStore()
    state = SharedTenantState(store=store, clock=Clock())
    state.sync_batch_acceptance("r1", {"segments": [{"steps": [["a", "draft", 4, 0, 1]], "cap": None}]})
    f = 0.5 ** (1 / 200)  # a key's step-based decay over its one step
    first = tenant_stats_to_proto(state.tenant_stats("a"))
    # the empty pool's 0.5 as prior: 10 + 10 pseudo-trials, faded (half-life 20 steps) and decayed
    pa = 10 * 0.5 ** (1 / 20) * f
    assert first.acceptance_rate == pytest.approx(pa / (2 * pa + 1))
    state.sync_batch_acceptance("r1", {"segments": [{"steps": [["b", "draft", 4, 0, 1]], "cap": None}]})
    second = tenant_stats_to_proto(state.tenant_stats("b"))
    g = 10 / 21  # the global: one rejection + 20 pseudo-trials at 0.5 (without them: 0, and so was b's α̂)
    pa, pr = 20 * g * 0.5 ** (1 / 20) * f, 20 * (1 - g) * 0.5 ** (1 / 20) * f
    assert second.HasField("acceptance_rate") and second.acceptance_rate == pytest.approx(pa / (pa + pr + 1))
    assert second.stats.steps == 1 and second.stats.rejected_steps == 1 and second.stats.accepted == 0
    state.snapshot(force=True)
    restored = SharedTenantState(store=store, clock=Clock())
    assert restored.was_restored() and restored.batch_acceptance.global_prior_weight == 20.0
    assert tenant_stats_to_proto(restored.tenant_stats("b")).acceptance_rate == second.acceptance_rate
    assert restored.controller.estimator.global_prior_weight == 20.0


def test_tenant_stats_of_a_tenant_only_at_k0_leave_acceptance_unset():
    """A batch-adaptive tenant whose steps all ran at K = 0 (the draft replicas pooled none of
    its steps; the per-request controller recorded 5 steps at K = 0) measured no acceptance:
    GetTenantStats' optional acceptance_rate stays unset (unknown), where it reported the
    prior's 0.5 as the tenant's. Once a K > 0 step is pooled it is set."""
    from deployments.ingress.tenant_stats import tenant_stats_to_proto
    from specdec.types import SpeculationStats

    state = SharedTenantState(store=DictStore(), clock=Clock())
    state.decide("c", "draft", {})
    st = SpeculationStats()
    for _ in range(5):
        st.record_step(0, 0, 0.0, 0.1)
    state.record("c", "draft", st.as_dict())
    stats = state.tenant_stats("c")
    assert stats["proposers"]["draft"]["acceptance"]["evidence"] == 0.0
    assert stats["proposers"]["draft"]["acceptance"]["alpha"] == 0.5
    msg = tenant_stats_to_proto(stats)
    assert not msg.HasField("acceptance_rate") and msg.stats.steps == 0 and msg.stats.proposed == 0
    state.sync_batch_acceptance("r1", {"segments": [{"steps": [["c", "draft", 2, 2, 1]], "cap": None}]})
    msg = tenant_stats_to_proto(state.tenant_stats("c"))
    assert msg.HasField("acceptance_rate") and msg.stats.accepted == 2


def test_one_actor_name_and_snapshot_key_per_application_and_pair():
    from deployments.controller_actor import actor_name, pair_hash, snapshot_key

    pair = {"target_model": "t", "draft_model": "d"}
    h = pair_hash(pair)
    assert len(h) == 12 and int(h, 16) >= 0
    assert h == pair_hash(dict(reversed(list(pair.items()))))  # canonical: key order no matter
    assert actor_name("specdec", pair) == f"specdec-k-controller:specdec:{h}"
    assert actor_name("specdec-batched", pair) != actor_name("specdec-unbatched", pair)
    assert actor_name("specdec", pair) != actor_name("specdec", dict(pair, draft_model="d2"))
    assert snapshot_key("specdec", pair) == f"specdec-k-controller:specdec:{h}/snapshot"
    assert snapshot_key("a", pair) != snapshot_key("b", pair)
    assert snapshot_key("a", pair) != snapshot_key("a", dict(pair, target_format="w8a8"))
    # the keys of earlier versions are not this version's (an upgrade starts afresh)
    assert "specdec-k-controller/snapshot" != snapshot_key("specdec", pair) != "specdec-k-controller:specdec/snapshot"
    for bad in ("", None):
        with pytest.raises(ValueError, match="application's name"):
            actor_name(bad, pair)
    with pytest.raises(ValueError, match="model pair"):
        actor_name("specdec", None)


def test_model_pair_names_models_and_formats_without_loading_them(monkeypatch):
    import json

    from deployments.config import AppConfig

    monkeypatch.delenv("SPECDEC_WEIGHT_FORMAT", raising=False)
    base = AppConfig().model_pair()
    assert base == {"target_model": "demo:target", "target_format": "default", "target_device": "cpu",
                    "draft_model": "demo:draft", "draft_format": "default", "draft_device": "cpu",
                    "draft_vocab_subset": None, "draft_vocab_table": None}
    assert json.loads(json.dumps(base)) == base
    assert AppConfig(app_name="other", grpc_port=9100).model_pair() == base  # the pair, not the application
    for other in (AppConfig(draft_dtype="int4"), AppConfig(draft_model="demo:target"), AppConfig(draft_num_gpus=0.5),
                  AppConfig(target_dtype="w8a8"), AppConfig(draft_vocab_subset=1000), AppConfig(draft_model=None)):
        assert other.model_pair() != base
    assert AppConfig(draft_model=None).model_pair()["draft_format"] is None


def test_router_and_draft_processes_of_one_config_reach_one_actor_whatever_their_environment(monkeypatch):
    """The pair, hence the actor's name, comes from the config alone: a router and a draft
    replica in processes (or pods) whose $SPECDEC_WEIGHT_FORMAT differs compute the same name (a
    default format is recorded as "default", not resolved); another target, draft or configured
    format is another actor. Ray-free: the names ControllerClient.for_app gives the actor."""
    from deployments.config import AppConfig
    from deployments.controller_actor import actor_name

    def name_in_a_process(env_format, **cfg):
        if env_format is None:
            monkeypatch.delenv("SPECDEC_WEIGHT_FORMAT", raising=False)
        else:
            monkeypatch.setenv("SPECDEC_WEIGHT_FORMAT", env_format)
        c = AppConfig(**cfg)  # each process builds its config from the same serialized fields
        return actor_name(c.app_name, c.model_pair())

    for cfg in ({}, {"draft_dtype": "int4"}, {"target_dtype": "w8a8", "draft_model": None}):
        router = name_in_a_process(None, **cfg)
        assert name_in_a_process("w8a8", **cfg) == name_in_a_process(" INT4 ", **cfg) == router
    names = {name_in_a_process(None, **cfg) for cfg in (
        {}, {"target_model": "demo:draft"}, {"draft_model": "demo:target"}, {"draft_dtype": "int4"},
        {"draft_dtype": "w8a8"}, {"target_dtype": "w8a8"}, {"draft_vocab_subset": 1000})}
    assert len(names) == 7
    assert name_in_a_process(None, app_name="other") != name_in_a_process(None)


def test_snapshot_of_another_model_pair_or_of_none_is_ignored(caplog):
    """A snapshot records its pair; a state of another pair starts fresh (log line), and so does
    one given a snapshot written before snapshots recorded their pair. Without a pair of its
    own a state restores any (unchecked)."""
    pair = {"target_model": "t", "target_format": "w8a8", "draft_model": "d", "draft_format": "int4"}
    other = dict(pair, draft_format="w8a8")
    store = DictStore()
    first = SharedTenantState(store=store, clock=Clock(), pair=pair)
    first.sync_batch_acceptance("r", {"segments": [{"steps": [["code", "draft", 4, 4, 30]], "cap": None}]})
    assert first.snapshot(force=True)
    import json

    assert json.loads(store.blob)["pair"] == pair
    with caplog.at_level("WARNING", logger="deployments.controller_actor"):
        fresh = SharedTenantState(store=store, clock=Clock(), pair=other)
    assert not fresh.was_restored() and fresh.batch_acceptance.export_counts()["keys"] == []
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "deployments.controller_actor"]
    assert "snapshot ignored" in msg and "'draft_format': 'int4'" in msg and "'draft_format': 'w8a8'" in msg
    same = SharedTenantState(store=store, clock=Clock(), pair=dict(reversed(list(pair.items()))))  # order: no matter
    assert same.was_restored()
    assert same.batch_acceptance.export_counts() == first.batch_acceptance.export_counts()
    assert SharedTenantState(store=store, clock=Clock()).was_restored()
    # written before snapshots recorded their pair: ignored by a state that has one
    old = DictStore()
    SharedTenantState(store=old, clock=Clock()).snapshot(force=True)
    assert "pair" not in json.loads(old.blob)
    caplog.clear()
    with caplog.at_level("WARNING", logger="deployments.controller_actor"):
        assert not SharedTenantState(store=old, clock=Clock(), pair=pair).was_restored()
    assert any("records no model pair" in r.getMessage() for r in caplog.records)
    assert SharedTenantState(store=old, clock=Clock()).was_restored()
