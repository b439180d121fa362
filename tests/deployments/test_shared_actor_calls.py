"""Calls to the shared controller actor under Serve's cancellations (real Ray, one local
cluster for the module; no Serve, no models).

The hang these pin down (a full-suite run, ``test_serve_http.py``): a client disconnected
mid-stream; Serve cancelled the router replica's request recursively, and with it the request's
lease release (``SharedTenantState.complete``) a few ms after it was submitted, before it had
reached the actor. The actor executed a replica's calls in submission order, so it waited for
the missing call (Ray waits 30 s) and the next request's three admissions (``n = 3``) waited
behind it: the client timed out at 30 s, the draft replica never saw the request.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from deployments.aio import finish_despite_cancellation
from deployments.controller_actor import SharedTenantState
from deployments.controller_client import ControllerClient, get_or_create_actor

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.serve

POLICY = {"k_min": 0, "k_max": 0, "adaptive": False, "fixed_k": 0}


@pytest.fixture(scope="module")
def remote():
    """A local Ray cluster; the remote classes and function the tests use (defined here, so
    that Ray ships them by value: workers cannot import a test module)."""

    class Busy(SharedTenantState):
        """The shared state with one more call, which occupies the actor's only thread."""

        def hold(self, seconds: float) -> None:
            time.sleep(seconds)

    def ready_after(seconds: float) -> None:
        time.sleep(seconds)

    class Signal:
        """``wait()`` answers ``value`` once ``send(value)`` was called."""

        def __init__(self):
            self.event = asyncio.Event()
            self.value = None

        async def wait(self):
            await self.event.wait()
            return self.value

        async def send(self, value=None) -> None:
            self.value = value
            self.event.set()

    class RouterLike:
        """An async actor like a router replica: admits, then ends the admission in a cleanup
        awaited through :func:`finish_despite_cancellation` (as ``TenancyGate.complete`` is)."""

        def __init__(self, actor):
            self.client = ControllerClient(actor=actor)
            self.entered = 0

        def calls_entered(self) -> int:
            """How many ``admit``/``sync`` calls have started running (their actor call is
            submitted right after): a test cancels only once its call got this far."""
            return self.entered

        async def request(self, stats: list) -> None:
            got = await self.client.admit("alpha", {}, 10, "none", POLICY, 0)
            # the release's stats argument is still being computed: the call is submitted but
            # has not reached the actor (where Serve's cancel caught it in the failed run)
            await finish_despite_cancellation(
                self.client.complete(got["lease"], "alpha", "none", stats[0], None, 4, 0, 4))

        async def admit(self) -> dict:
            self.entered += 1
            return await self.client.admit("alpha", {}, 10, "none", POLICY, 0)

        async def sync(self, replica: list) -> dict:
            # the replica's id is still being computed: submitted, not yet at the actor
            self.entered += 1
            return await self.client.sync_batch_acceptance(replica[0], {"segments": []})

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield SimpleNamespace(
            busy=ray.remote(Busy).options(num_cpus=0, max_concurrency=1, allow_out_of_order_execution=True),
            ready_after=ray.remote(num_cpus=0)(ready_after),
            router=ray.remote(num_cpus=0)(RouterLike),
            signal=ray.remote(num_cpus=0)(Signal),
        )
    finally:
        ray.shutdown()


def wait_until_entered(router, calls: int = 1) -> None:
    """Wait (up to 60 s) until the router-like actor runs ``calls`` calls: cancelled before
    that, Ray drops the queued call and the behaviour under test never happens (a cold worker
    can take seconds to start on a loaded 2-core machine)."""
    end = time.monotonic() + 60
    while ray.get(router.calls_entered.remote()) < calls and time.monotonic() < end:
        time.sleep(0.05)
    assert ray.get(router.calls_entered.remote()) == calls


def test_a_call_cancelled_before_reaching_the_shared_actor_does_not_hold_up_the_next(remote):
    actor = get_or_create_actor(app_name="test-shared-actor-gap", pair={"target_model": "t", "draft_model": "d"})
    expected = SharedTenantState().tenant_stats("alpha")
    assert ray.get(actor.tenant_stats.remote("alpha"), timeout=60) == expected
    dep = remote.ready_after.remote(60)
    never_sent = actor.tenant_stats.remote(dep)  # waits for its argument in this process
    time.sleep(0.3)
    ray.cancel(never_sent)
    t0 = time.monotonic()
    # in submission order the actor waited 30 s for the cancelled call, then failed this one
    assert ray.get(actor.tenant_stats.remote("alpha"), timeout=10) == expected
    assert time.monotonic() - t0 < 10
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(never_sent, timeout=10)
    ray.cancel(dep, force=True)
    ray.kill(actor)


def test_the_lease_release_outlives_the_cancellation_of_its_request(remote):
    shared = remote.busy.remote()
    router = remote.router.remote(shared)
    signal = remote.signal.remote()
    ref = router.request.remote([signal.wait.remote()])  # in a list: not awaited before the call
    end = time.monotonic() + 30
    while ray.get(shared.active_leases.remote()) != 1 and time.monotonic() < end:
        time.sleep(0.05)
    assert ray.get(shared.active_leases.remote()) == 1
    time.sleep(0.3)  # the release is submitted, waiting for its argument
    ray.cancel(ref)  # as Serve cancels a disconnected request: recursively
    time.sleep(0.3)
    signal.send.remote()  # now the release can be sent
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=30)
    end = time.monotonic() + 30
    while ray.get(shared.active_leases.remote()) and time.monotonic() < end:
        time.sleep(0.1)
    assert ray.get(shared.active_leases.remote()) == 0  # released, not left to expire
    assert ray.get(shared.tenant_stats.remote("alpha"))["usage"]["prompt_tokens"] == 4
    for actor in (router, signal, shared):
        ray.kill(actor)


def test_an_unanswering_shared_actor_is_replaced_by_the_fallback_within_the_bound(remote):
    shared = remote.busy.remote()
    assert ray.get(shared.active_leases.remote()) == 0
    busy = shared.hold.remote(6.0)
    client = ControllerClient(actor=shared, call_timeout_s=0.5)

    async def admit_complete_and_wait():
        t0 = time.monotonic()
        got = await client.admit("alpha", {}, 10, "none", POLICY, 0)
        waited = time.monotonic() - t0
        held = client._fallback is not None and client._fallback.holds_lease(got["lease"])
        await client.complete(got["lease"], "alpha", "none", None, None, 4, 0, 4)
        await busy
        # the admit that timed out ran once the actor was free; its lease is released at once
        end = time.monotonic() + 30
        while await shared.active_leases.remote() and time.monotonic() < end:
            await asyncio.sleep(0.1)
        return waited, held, client._fallback.active_leases(), await shared.active_leases.remote()

    waited, held_by_fallback, left_on_fallback, left_on_actor = asyncio.run(admit_complete_and_wait())
    assert 0.5 <= waited < 5.0  # the bound, not the 6 s the actor was busy
    assert held_by_fallback and left_on_fallback == 0
    assert left_on_actor == 0
    # the late admit counted the request on the actor too (the fallback counted it as well)
    assert ray.get(shared.tenant_stats.remote("alpha"))["usage"]["requests"] == 1
    ray.kill(shared)


def test_an_admit_cancelled_with_its_request_leaves_no_lease(remote):
    """The client disconnected while its admission waited on the busy actor: the admit still
    runs there (Ray does not take back a call the actor queued); its lease is released at once,
    not held for the request's timeout."""
    shared = remote.busy.remote()
    router = remote.router.remote(shared)
    assert ray.get(shared.active_leases.remote()) == 0
    ray.get(router.calls_entered.remote(), timeout=60)  # started: the hold below times the admit
    busy = shared.hold.remote(3.0)
    ref = router.admit.remote()
    wait_until_entered(router)
    time.sleep(0.3)  # the admit is queued at the busy actor
    ray.cancel(ref)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=30)
    ray.get(busy)
    end = time.monotonic() + 30
    while ray.get(shared.active_leases.remote()) and time.monotonic() < end:
        time.sleep(0.1)
    assert ray.get(shared.active_leases.remote()) == 0
    assert ray.get(shared.tenant_stats.remote("alpha"))["usage"]["requests"] == 1  # it did run
    for actor in (router, shared):
        ray.kill(actor)


def test_a_draft_replicas_report_outlives_the_cancellation_of_the_request_that_sent_it(remote):
    """K under load: the exchange a draft replica starts after a step is not cancelled with
    that step's generation (cancelled, a report the actor merged anyway was restored and sent
    again, its steps counted twice; one not merged was delayed)."""
    shared = remote.busy.remote()
    router = remote.router.remote(shared)
    signal = remote.signal.remote()
    assert ray.get(shared.batch_k_replicas.remote()) == {}
    ref = router.sync.remote([signal.wait.remote()])
    wait_until_entered(router)
    time.sleep(0.3)  # the report is submitted, waiting for its argument
    ray.cancel(ref)
    time.sleep(0.3)
    ray.get(signal.send.remote("draft-replica-1"))
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=30)
    end = time.monotonic() + 30
    while not ray.get(shared.batch_k_replicas.remote()) and time.monotonic() < end:
        time.sleep(0.1)
    assert list(ray.get(shared.batch_k_replicas.remote())) == ["draft-replica-1"]
    for actor in (router, signal, shared):
        ray.kill(actor)


def test_two_applications_get_two_actors_and_share_no_acceptance_or_usage(remote):
    """One shared actor per Serve application: the router gate and the draft replica's client of
    application A reach A's actor (and its snapshot key), B's reach B's; A's pooled acceptance
    and usage are not B's (they once shared one actor for the whole cluster)."""
    import json

    from ray.experimental import internal_kv

    from deployments.config import AppConfig
    from deployments.controller_actor import ACTOR_NAMESPACE, actor_name, snapshot_key
    from deployments.metrics import SpecDecMetrics
    from deployments.tenancy import TenancyGate

    cfg_a = AppConfig(app_name="test-app-a")
    cfg_b = AppConfig(app_name="test-app-b", draft_dtype="int4")  # another pair too
    gate_a = TenancyGate.from_config(cfg_a, metrics=SpecDecMetrics(backend=None))
    gate_b = TenancyGate.from_config(cfg_b, metrics=SpecDecMetrics(backend=None))
    draft_a, draft_b = ControllerClient.for_app(cfg_a), ControllerClient.for_app(cfg_b)  # as Draft builds them
    assert all(c.is_shared for c in (gate_a.controller, gate_b.controller, draft_a, draft_b))
    report = {"segments": [{"steps": [["default", "draft", 4, 4, 30]], "cap": None}]}

    async def main():
        pooled_a = await draft_a.sync_batch_acceptance("replica-a", report)
        from_gate_a = await gate_a.controller.sync_batch_acceptance("reader-a", {"segments": []})
        pooled_b = await draft_b.sync_batch_acceptance("replica-b", {"segments": []})
        adm = await gate_a.controller.admit("default", {}, 10, "none", POLICY, 0)
        await gate_a.controller.complete(adm["lease"], "default", "none", None, None, 10, 0, 10)
        usage = [(await g.controller.tenant_stats("default"))["usage"]["requests"] for g in (gate_a, gate_b)]
        return pooled_a, from_gate_a, pooled_b, usage

    pooled_a, from_gate_a, pooled_b, usage = asyncio.run(main())
    assert [k[:2] for k in pooled_a["keys"]] == [["default", "draft"]] and from_gate_a == pooled_a
    assert pooled_b["keys"] == []  # B's draft replicas see none of A's steps
    assert usage == [1, 0]
    actors = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == ACTOR_NAMESPACE}
    assert {actor_name(c.app_name, c.model_pair()) for c in (cfg_a, cfg_b)} <= actors
    handles = [ray.get_actor(actor_name(c.app_name, c.model_pair()), namespace=ACTOR_NAMESPACE) for c in (cfg_a, cfg_b)]
    assert ray.get(handles[0].batch_k_replicas.remote()).keys() == {"replica-a", "reader-a"}
    assert ray.get(handles[1].batch_k_replicas.remote()).keys() == {"replica-b"}
    # each saves to its own key, recording its own model pair
    for cfg, h in zip((cfg_a, cfg_b), handles):
        assert ray.get(h.snapshot.remote(True))
        saved = json.loads(internal_kv._internal_kv_get(snapshot_key(cfg.app_name, cfg.model_pair()),
                                                        namespace=ACTOR_NAMESPACE))
        assert saved["pair"] == cfg.model_pair()
        assert ("batch_acceptance" in saved) and bool(saved["batch_acceptance"]["keys"]) == (cfg is cfg_a)
        ray.kill(h)


def test_one_application_redeployed_with_another_pair_gets_another_actor(remote):
    """The same application name with another model pair (a redeploy with other models, old and
    new replicas side by side during a rolling update): the new pair's router and draft replicas
    reach another actor, which pools none of the old pair's acceptance and keeps its own
    snapshot key; the old pair's clients keep reaching the old actor. Before, the new pair
    attached to the live actor of the old one (its pair argument ignored) and inherited its
    acceptance, cost models and K."""
    import json

    from ray.experimental import internal_kv

    from deployments.config import AppConfig
    from deployments.controller_actor import ACTOR_NAMESPACE, actor_name, snapshot_key

    old_cfg = AppConfig(app_name="test-app-redeploy")
    new_cfg = AppConfig(app_name="test-app-redeploy", draft_model="demo:target", draft_dtype="int4")
    assert old_cfg.model_pair() != new_cfg.model_pair()
    names = [actor_name(c.app_name, c.model_pair()) for c in (old_cfg, new_cfg)]
    assert names[0] != names[1]
    report = {"segments": [{"steps": [["default", "draft", 4, 4, 30]], "cap": None}]}
    try:
        old_draft, new_draft = ControllerClient.for_app(old_cfg), ControllerClient.for_app(new_cfg)
        old_router = ControllerClient.for_app(old_cfg)  # another replica of the old pair
        assert old_draft.is_shared and new_draft.is_shared

        async def main():
            pooled_old = await old_draft.sync_batch_acceptance("old-replica", report)
            pooled_new = await new_draft.sync_batch_acceptance("new-replica", {"segments": []})
            seen_by_old = await old_router.sync_batch_acceptance("old-reader", {"segments": []})
            return pooled_old, pooled_new, seen_by_old

        pooled_old, pooled_new, seen_by_old = asyncio.run(main())
        assert [k[:2] for k in pooled_old["keys"]] == [["default", "draft"]] and seen_by_old == pooled_old
        assert pooled_new["keys"] == []  # the new pair learns afresh
        handles = [ray.get_actor(n, namespace=ACTOR_NAMESPACE) for n in names]
        assert ray.get(handles[0].batch_k_replicas.remote()).keys() == {"old-replica", "old-reader"}
        assert ray.get(handles[1].batch_k_replicas.remote()).keys() == {"new-replica"}
        for cfg, h in zip((old_cfg, new_cfg), handles):
            assert ray.get(h.snapshot.remote(True))
            saved = json.loads(internal_kv._internal_kv_get(snapshot_key(cfg.app_name, cfg.model_pair()),
                                                            namespace=ACTOR_NAMESPACE))
            assert saved["pair"] == cfg.model_pair()  # each labelled with its own pair
            assert bool(saved["batch_acceptance"]["keys"]) == (cfg is old_cfg)
    finally:
        for n in names:
            try:
                ray.kill(ray.get_actor(n, namespace=ACTOR_NAMESPACE))
            except ValueError:
                pass
