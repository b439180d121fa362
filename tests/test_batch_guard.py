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
