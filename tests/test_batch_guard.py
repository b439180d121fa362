"""Goodput guards of the in-process batch scheduler (specdec/engine/batch_adaptive.py: TenantGuards)."""

from __future__ import annotations

import pytest

from specdec.control.goodput_guard import GoodputGuard
from specdec.engine.batch_adaptive import TenantGuards


class _Controller:
    """The two calls TenantGuards makes of a BatchKController: k_for and step_k."""

    def __init__(self, ks: dict[str, int]):
        self.ks = ks
        self.step_calls = 0

    def k_for(self, tenant):
        return self.ks.get(tenant)

    def step_k(self, tenant, cap):
        self.step_calls += 1
        return min(cap, self.ks.get(tenant, cap))


def test_guard_vetoes_a_tenant_whose_speculation_measures_slower_than_plain_decoding():
    ctl = _Controller({"code": 0})
    guards = TenantGuards(GoodputGuard(min_steps=2, explore_every=2, first_explore=2, hold=3))
    k_of_code = guards.k(ctl, "code", 4)
    # first steps (they prefilled the target) count in no guard
    guards.record_tick(ctl, [(1, "code", 0, 0), (2, "code", 0, 0)], 1.0)
    assert guards.guards["code"].steps("plain") == 0
    # plain decoding: 2 rows x 1 token per 1 s tick = 2 tokens/s of the batch
    guards.record_tick(ctl, [(1, "code", 0, 0), (2, "code", 0, 0)], 1.0)
    assert guards.guards["code"].steps("plain") == 2
    assert guards.guards["code"].goodput("plain") == pytest.approx(2.0)
    # a probe's step (K > 0 while the decision holds code at K = 0) counts in no guard
    guards.record_tick(ctl, [(1, "code", 2, 2), (2, "code", 2, 2)], 1.0)
    assert guards.guards["code"].steps("spec") == 0 and guards.guards["code"].steps("plain") == 2
    # the model moves code to K = 2; every draft rejected and the tick takes 2 s: 1 token/s
    ctl.ks["code"] = 2
    assert k_of_code() == 2 and not guards.forced("code")
    guards.record_tick(ctl, [(1, "code", 2, 0), (2, "code", 2, 0)], 2.0)
    g = guards.guards["code"]
    assert g.steps("spec") == 2 and g.goodput("spec") == pytest.approx(1.0)
    assert g.vetoes == 1 and guards.forced("code")
    calls = ctl.step_calls
    assert k_of_code() == 0 and ctl.step_calls == calls  # held at K = 0 without asking the model
    # the hold runs out after 3 recorded steps, then the model's K runs again (a recheck)
    guards.record_tick(ctl, [(1, "code", 0, 0), (2, "code", 0, 0)], 1.0)
    assert guards.forced("code")
    guards.record_tick(ctl, [(1, "code", 0, 0)], 1.0)
    assert not guards.forced("code") and k_of_code() == 2
    assert guards.snapshot()["code"]["vetoes"] == 1


def test_guard_keeps_speculation_that_measures_faster():
    ctl = _Controller({"code": 0})
    guards = TenantGuards(GoodputGuard(min_steps=2, explore_every=100, hold=3))  # no exploration due
    for _ in range(2):
        guards.record_tick(ctl, [(1, "code", 0, 0), (2, "code", 0, 0)], 1.0)
    ctl.ks["code"] = 2
    for _ in range(3):
        guards.record_tick(ctl, [(1, "code", 2, 2), (2, "code", 2, 2)], 1.2)  # 3 tokens a row: 5 tokens/s
    assert guards.guards["code"].vetoes == 0 and not guards.forced("code")
    assert guards.guards["code"].goodput("spec") == pytest.approx(5.0)


def test_scheduler_with_guard_keeps_outputs_and_records_adaptive_rows(tiny_target, tiny_draft_close):
    """BatchScheduler(guard=...): adaptive requests give the outputs of fixed K = 0 (greedy), and
    every tenant with adaptive rows has a guard that recorded their steps after the first."""
    from specdec.control.batch_k import BatchKController
    from specdec.engine.batch import BatchScheduler
    from specdec.engine.engine import SpeculativeEngine
    from specdec.request import GenerationRequest

    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    prompts = [("code", [5, 9, 13, 17, 21]), ("creative", [7, 3, 11, 2]), ("code", [30, 31, 32])]

    def run(adaptive: bool):
        ctl = BatchKController(budget=64) if adaptive else None
        sched = BatchScheduler(engine, max_batch_positions=64, controller=ctl,
                               guard=GoodputGuard(min_steps=2, explore_every=2, first_explore=2, hold=4)
                               if adaptive else None)
        hs = [sched.submit(GenerationRequest(prompt_token_ids=p, max_tokens=12,
                                             speculation={"proposer": "draft", "k": 0 if not adaptive else 3}),
                           tenant=t, adaptive=adaptive) for t, p in prompts]
        sched.run_until_idle()
        return [h.result().token_ids for h in hs], sched

    plain, _ = run(False)
    adaptive, sched = run(True)
    assert adaptive == plain
    assert sorted(sched.guards.guards) == ["code", "creative"]
    ticks = sum(1 for t in sched.trace if t.answered)
    recorded = {t: g.steps("spec") + g.steps("plain") for t, g in sched.guards.guards.items()}
    assert all(0 < n <= 3 * ticks for n in recorded.values())


def _record_tick_per_row(guards: TenantGuards, controller, rows, seconds) -> None:
    """TenantGuards.record_tick before quiet guards were recorded in one call (main a6e13f6): one
    GoodputGuard.record per adaptive row and tenant, in tenant order: the reference."""
    if not rows or not seconds > 0:
        return
    n = len(rows)
    for _, tenant, _, _ in rows:
        if tenant not in guards.guards:
            guards.guards[tenant] = guards.template.fresh()
    names = sorted(guards.guards)
    exploring = sum(1 for g in guards.guards.values() if g.exploring)
    for rid, tenant, k, accepted in rows:
        first = rid not in guards._stepped
        guards._stepped.add(rid)
        if first or (k > 0 and (guards.forced(tenant) or controller.k_for(tenant) == 0)):
            continue
        for t in names:
            g = guards.guards[t]
            regime = "plain" if g.forced or not (controller.k_for(t) or 0) > 0 else "spec"
            was = g.exploring
            g.record(regime, (accepted + 1) * n, seconds, may_explore=exploring - was == 0)
            exploring += g.exploring - was


def test_quiet_guards_recorded_in_one_call_keep_every_guard_state_bit_for_bit():
    """record_tick records the steps of guards that stay quiet through a tick (plain decoding, or a
    forcing with more steps left than the tick's rows) in one GoodputGuard.record_quiet call: every
    guard's whole state after every tick equals the per-row reference's, over 60 random runs of 150
    ticks (tenants switching K or unknown to the decision, probes, explorations, vetoes, ragged rows,
    ticks of as many rows as a forcing has left +-1, outlier seconds; random guard settings)."""
    import random

    for seed in range(60):
        rng = random.Random(seed)
        tenants = [f"t{i}" for i in range(rng.choice((2, 5, 12)))]
        min_steps = rng.choice((1, 2, 4, 12))
        template = GoodputGuard(min_steps=min_steps, explore_every=min_steps * rng.choice((1, 3, 6)),
                                hold=rng.choice((1, 3, 9, 96)), outlier_clip=rng.choice((1.3, 2.0, float("inf"))),
                                decay=rng.choice((0.9, 0.97, 1.0)), compare_on_explore_end=rng.random() < 0.5,
                                skip_margin=rng.choice((None, 0.25)), first_explore=min_steps * rng.choice((1, 2)))
        fast, ref = TenantGuards(template), TenantGuards(template)
        ks = {t: rng.choice((0, 0, 2, 4)) for t in tenants}
        ctl = _Controller(ks)
        rid = 0
        live: list[tuple[int, str]] = []
        events = 0
        for tick in range(150):
            if rng.random() < 0.1:
                t = rng.choice(tenants)
                ks[t] = rng.choice((0, 1, 4))
            if rng.random() < 0.03:  # a tenant the last decision did not see (k_for None)
                ks.pop(rng.choice(tenants), None)
            left = [g._forced_left for g in fast.guards.values() if g._forced_left > 1]
            want = rng.choice(left) + rng.choice((-1, 0, 1)) if left and rng.random() < 0.3 else rng.choice((1, 4, 16, 40))
            while len(live) < want:  # now and then as many rows as a forcing has steps left, +-1
                live.append((rid, rng.choice(tenants)))
                rid += 1
            if rng.random() < 0.2:
                live = live[rng.randrange(1, 4):]
            live = live[:max(1, want)]
            rows = []
            for r, t in live:
                k = ks.get(t, 0) if rng.random() > 0.05 else rng.choice((1, 4))  # now and then a probe's K
                rows.append((r, t, k, rng.randrange(0, k + 1)))
            seconds = rng.choice((0.1, 0.1, 0.12, 0.5, 3.0))
            fast.record_tick(ctl, rows, seconds)
            _record_tick_per_row(ref, ctl, rows, seconds)
            assert sorted(fast.guards) == sorted(ref.guards)
            for t in fast.guards:
                assert vars(fast.guards[t]) == vars(ref.guards[t]), (seed, tick, t)
            events += sum(g.forced for g in fast.guards.values())
        assert fast._stepped == ref._stepped
    assert events > 0


def test_record_quiet_refuses_steps_that_are_not_quiet():
    g = GoodputGuard(min_steps=2, explore_every=2, first_explore=2, hold=3)
    assert g.quiet_for("plain", 5) and not g.quiet_for("spec", 1)
    with pytest.raises(ValueError, match="not quiet"):
        g.record_quiet("spec", [2.0], 0.1)
    with pytest.raises(ValueError, match="tokens >= 1"):
        g.record_quiet("plain", [0.0], 0.1)
    with pytest.raises(ValueError, match="tokens >= 1"):
        g.record_quiet("plain", [float("nan")], 0.1)
    for _ in range(2):
        g.record("spec", 4.0, 0.1)
    assert g.exploring and g._forced_left == 2  # an exploration of 2 steps started
    assert g.quiet_for("plain", 1) and not g.quiet_for("plain", 2)
    g.record_quiet("plain", [3.0], 0.1)
    assert g._forced_left == 1 and g.exploring
