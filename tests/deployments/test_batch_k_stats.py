"""GetTenantStats' K under load with several draft replicas: every replica's view kept by the
shared controller state, merged with the answering replica's own, one defined K (the most
recent decision's, its replica named). Plain data, no models."""

from __future__ import annotations

import pytest

from deployments.batch_k_stats import fill_batch_load, merge_views
from deployments.controller_actor import SharedTenantState
from protos.specdec.v1 import specdec_pb2 as pb


def _view(k, decided_at, steps, rows, positions, *, k_model=None, forced=False, sessions=2):
    return {"k_under_load": k, "k_model": k if k_model is None else k_model, "decided_at": decided_at,
            "guard_forced": forced, "rows_per_step": rows, "positions_per_step": positions, "steps": steps,
            "sessions": sessions}


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_shared_state_keeps_each_replicas_view_and_drops_stale_ones():
    clock = Clock()
    state = SharedTenantState(clock=clock, batch_view_ttl_s=60.0)
    state.sync_batch_acceptance("a", {"segments": [], "tenants": {"code": _view(3, 1000.0, 40, 6.0, 20.0)}})
    clock.t = 110.0
    state.sync_batch_acceptance("b", {"segments": [], "tenants": {
        "code": _view(0, 1005.0, 10, 2.0, 2.0, k_model=2, forced=True), "creative": _view(1, 1004.0, 5, 1.0, 2.0)}})
    clock.t = 115.0
    views = state.tenant_stats("code")["batch_replicas"]
    assert views == [dict(_view(0, 1005.0, 10, 2.0, 2.0, k_model=2, forced=True), replica="b", reported_s_ago=5.0),
                     dict(_view(3, 1000.0, 40, 6.0, 20.0), replica="a", reported_s_ago=15.0)]
    assert [v["replica"] for v in state.tenant_stats("creative")["batch_replicas"]] == ["b"]
    assert state.tenant_stats("other")["batch_replicas"] == []
    clock.t = 165.0  # a reported 65 s ago: past the 60 s TTL
    assert [v["replica"] for v in state.batch_k_views("code")] == ["b"]
    # a malformed view is refused before anything is merged
    with pytest.raises(ValueError, match="steps"):
        state.sync_batch_acceptance("c", {"segments": [{"steps": [["code", "draft", 2, 1, 1]]}],
                                          "tenants": {"code": dict(_view(1, 1.0, 1, 1.0, 1.0), steps=-1)}})
    assert state.batch_acceptance.raw_steps(("code", "draft")) == 0 and "c" not in state.batch_views


def test_tenant_stats_report_every_replica_and_the_most_recent_decision_named():
    """Replica a decided K = 3 at t = 1000 and b K = 0 (its guard vetoes the model's K = 2) at
    t = 1005, as reported; a answers the call itself with a newer view (K = 4 decided at
    t = 1010): K under load is a's 4, named; b's view is listed too; steps summed, means
    weighted by steps."""
    reported = [dict(_view(0, 1005.0, 10, 2.0, 2.0, k_model=2, forced=True), replica="b", reported_s_ago=5.0),
                dict(_view(3, 1000.0, 40, 6.0, 20.0), replica="a", reported_s_ago=15.0)]
    answered = dict(_view(4, 1010.0, 30, 4.0, 20.0), replica="a")
    views = merge_views(reported, answered)
    assert [v["replica"] for v in views] == ["a", "b"] and views[0]["k_under_load"] == 4
    msg = pb.GetTenantStatsResponse()
    fill_batch_load(msg.batch, views, now=1012.0)
    b = msg.batch
    assert (b.k_under_load, b.k_under_load_replica, b.tenant_steps) == (4, "a", 40)
    assert b.tenant_rows_per_step == pytest.approx((4.0 * 30 + 2.0 * 10) / 40)
    assert b.tenant_positions_per_step == pytest.approx((20.0 * 30 + 2.0 * 10) / 40)
    a_msg, b_msg = b.replicas
    assert (a_msg.replica, a_msg.k_under_load, a_msg.k_model, a_msg.guard_forced, a_msg.tenant_steps) == (
        "a", 4, 4, False, 30)
    assert a_msg.decided_s_ago == pytest.approx(2.0) and a_msg.reported_s_ago == 0.0
    assert (b_msg.replica, b_msg.k_under_load, b_msg.k_model, b_msg.guard_forced, b_msg.sessions) == (
        "b", 0, 2, True, 2)
    assert b_msg.decided_s_ago == pytest.approx(7.0) and b_msg.reported_s_ago == pytest.approx(5.0)
    # without the answer (replica unreachable) the reported views decide: b's is the newest
    msg = pb.GetTenantStatsResponse()
    fill_batch_load(msg.batch, merge_views(reported, None), now=1012.0)
    assert (msg.batch.k_under_load, msg.batch.k_under_load_replica, msg.batch.tenant_steps) == (0, "b", 50)
    # no decision anywhere yet: K under load unset, the replicas still listed
    msg = pb.GetTenantStatsResponse()
    fill_batch_load(msg.batch, [dict(_view(None, None, 0, 0.0, 0.0), replica="a")], now=1.0)
    assert not msg.batch.HasField("k_under_load") and msg.batch.k_under_load_replica == ""
    assert len(msg.batch.replicas) == 1 and not msg.batch.replicas[0].HasField("k_under_load")
