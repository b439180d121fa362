"""Rate leases of the shared tenant state: ids that never collide (across a controller restart
and the router's local fallback), release only by the tenant that holds the lease, and a TTL
that follows the request's own timeout."""

from __future__ import annotations

import asyncio

from deployments.controller_actor import LEASE_GRACE_S, SharedTenantState
from deployments.controller_client import ControllerClient

POLICY = {"k_min": 0, "k_max": 4, "adaptive": True, "fixed_k": None}
LIMITS = {"max_concurrent_requests": 2, "tokens_per_minute": 1000}


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _tokens(state: SharedTenantState, tenant: str) -> float:
    return state.limiter._buckets[tenant].level


def test_lease_of_a_previous_incarnation_releases_nothing_here():
    """A restarted controller (or the router's local fallback) must not release another
    request's lease when a request admitted before the restart completes."""
    clock = Clock()
    old = SharedTenantState(clock=clock)
    lease_a = old.admit("a", LIMITS, 100, "draft", POLICY, 4)["lease"]
    new = SharedTenantState(clock=clock)  # the actor restarted: leases are not saved
    lease_b = new.admit("b", LIMITS, 300, "draft", POLICY, 4)["lease"]
    assert lease_a != lease_b
    assert (new.limiter.active("b"), _tokens(new, "b")) == (1, 700.0)
    # tenant a's request ends on the new incarnation: b's lease stays, b is refunded nothing
    new.complete(lease_a, "a", "draft", used_tokens=10)
    assert (new.limiter.active("b"), _tokens(new, "b"), new.active_leases()) == (1, 700.0, 1)
    new.complete(lease_b, "b", "draft", used_tokens=120)
    assert (new.limiter.active("b"), _tokens(new, "b"), new.active_leases()) == (0, 880.0, 0)


def test_release_checks_the_tenant():
    clock = Clock()
    state = SharedTenantState(clock=clock)
    lease_b = state.admit("b", LIMITS, 300, "draft", POLICY, 4)["lease"]
    state.complete(lease_b, "a", "draft", used_tokens=0)  # wrong tenant: refused, nothing refunded
    assert (state.limiter.active("b"), _tokens(state, "b"), state.active_leases()) == (1, 700.0, 1)
    assert "a" not in state.usage and "a" not in state.limiter._buckets
    state.complete(lease_b, "b", "draft", used_tokens=50)
    assert (state.limiter.active("b"), _tokens(state, "b"), state.active_leases()) == (0, 950.0, 0)


def test_lease_ids_unique_across_fallback_and_shared_state():
    """The client's local fallback and the shared state hand out distinct ids; completing a
    fallback lease through the client releases it in the fallback, not in the shared state."""
    shared = SharedTenantState()
    client = ControllerClient(local=shared)
    fallback = SharedTenantState()
    ids = {shared.admit("t", {}, 1, "draft", POLICY, 4)["lease"] for _ in range(50)}
    ids |= {fallback.admit("t", {}, 1, "draft", POLICY, 4)["lease"] for _ in range(50)}
    assert len(ids) == 100
    client._fallback = fallback
    lease = fallback.admit("u", {"max_concurrent_requests": 1}, 1, "draft", POLICY, 4)["lease"]
    asyncio.run(client.complete(lease, "u", "draft"))
    assert fallback.limiter.active("u") == 0 and fallback.active_leases() == 50


def test_lease_ttl_follows_the_request_timeout():
    clock = Clock()
    state = SharedTenantState(clock=clock, lease_ttl_s=300.0)
    long = state.admit("a", LIMITS, 10, "draft", POLICY, 4, 900.0)["lease"]
    clock.t += 400.0  # past the default TTL, within the request's own timeout
    state.admit("a", LIMITS, 10, "draft", POLICY, 4, 10.0)
    assert state.limiter.active("a") == 2 and long in state._leases
    clock.t += 900.0 - 400.0 + LEASE_GRACE_S + 1.0  # past its timeout and the grace
    state._expire()
    assert state.limiter.active("a") == 0 and state.active_leases() == 0
    # without a timeout the default TTL applies
    state.admit("a", LIMITS, 10, "draft", POLICY, 4)
    clock.t += 300.0 + 1.0
    state._expire()
    assert state.limiter.active("a") == 0
