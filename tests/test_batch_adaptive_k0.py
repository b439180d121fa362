"""An adaptive batch whose controller decides K = 0 runs exactly the forwards of a fixed K = 0 batch.

Session 10 measured the adaptive arm of ``benchmarks.batching_goal`` (8 clients, K = 0 decided on
every step) at 0.83-0.90x the fixed K = 0 arm's tokens/s, its 8-row forwards 0.096 s against
0.076 s. Counted here: the same target forwards (same packed shapes, same kept logits), no draft
forward, the same tokens; what the adaptive path adds per tick is the controller's decision and
the guards' bookkeeping (``other_s`` of the benchmark, ~1-3 ms a tick against an 80 ms forward).
Measured in adjacent pairs (docs/bench/batching/inprocess-s11/k0-pairs-32tok-loaded.log) the two
arms' 8-row forwards showed no systematic difference; session 10's order had run the adaptive arm
right after the 8-client K = 4 arm (:func:`benchmarks.batching_goal.arm_order` pairs them now).
"""

from __future__ import annotations

from collections import Counter

from specdec.control.batch_k import BatchKController
from specdec.control.goodput_guard import GoodputGuard
from specdec.engine.batch import BatchScheduler
from specdec.engine.engine import SpeculativeEngine
from specdec.request import GenerationRequest

PROMPTS = [[5, 9, 13, 17, 21], [7, 3, 11, 2], [30, 31, 32], [40, 41, 5, 6, 7, 8]]


def _held_at_k0() -> BatchKController:
    """A controller whose measured costs make every K > 0 a loss even at acceptance 0.9 (a draft
    forward 100x a verify forward), so it decides K = 0 and never probes."""
    ctl = BatchKController(budget=64, k_ranges={"code": (0, 3), "creative": (0, 3)})
    for rows in (1, 2, 4):
        for positions in range(rows, 4 * rows + 1):
            ctl.cost.observe_verify(rows, positions, 0.01)
        ctl.cost.observe_draft(rows, 1.0)
    return ctl


def _run(engine, monkeypatch, *, adaptive: bool):
    calls: Counter = Counter()
    for name, model in (("target", engine.target.model), ("draft", engine.draft.model)):
        forward = model.forward

        def counting(*args, _forward=forward, _name=name, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            keep = kwargs.get("logits_to_keep")
            calls[(_name, tuple(ids.shape), tuple(keep.tolist()) if hasattr(keep, "tolist") else keep)] += 1
            return _forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", counting)
    ctl = _held_at_k0() if adaptive else None
    sched = BatchScheduler(engine, max_batch_positions=64, controller=ctl,
                           guard=GoodputGuard() if adaptive else None)
    hs = [sched.submit(GenerationRequest(prompt_token_ids=p, max_tokens=12,
                                         speculation={"proposer": "draft", "k": 3 if adaptive else 0}),
                       tenant=("code", "creative")[i % 2], adaptive=adaptive) for i, p in enumerate(PROMPTS)]
    sched.run_until_idle()
    monkeypatch.undo()
    return calls, [h.result() for h in hs], sched, ctl


def test_adaptive_batch_held_at_k0_runs_the_forwards_of_fixed_k0(tiny_target, tiny_draft_close, monkeypatch):
    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    fixed_calls, fixed, fixed_sched, _ = _run(engine, monkeypatch, adaptive=False)
    ad_calls, ad, ad_sched, ctl = _run(engine, monkeypatch, adaptive=True)
    assert [r.token_ids for r in ad] == [r.token_ids for r in fixed]
    assert all(set(r.stats.k_counts) == {0} for r in ad)  # decided K = 0 on every step, no probe
    assert ctl.probes == 0 and ctl.k_by_tenant == {"code": 0, "creative": 0}
    assert not any(name == "draft" for name, _, _ in ad_calls)  # the draft never ran
    assert ad_calls == fixed_calls  # the same target forwards: packed shapes and kept logits
    assert sum(fixed_calls.values()) == len(fixed_sched.trace) == len(ad_sched.trace)
    assert [(t.rows, t.positions_fed) for t in ad_sched.trace] == [(t.rows, t.positions_fed) for t in fixed_sched.trace]


def test_a_tenant_held_at_k0_prices_its_probe_once_per_decision_not_once_per_row(
        tiny_target, tiny_draft_close, monkeypatch):
    """Session 14: with no acceptance measured yet, a tenant held at K = 0 asked for a probe's K on
    every step of every row (:meth:`BatchKController.step_k`), and each ask was a whole batch
    optimum (:func:`choose_batch_ks`): at 8 rows 1.3 s of 3.2 s of a tiny-model run, and the
    adaptive arm's forwards measured slower too. The answer was then computed once per decision
    and tenant (the cost model does not change between a tick's rows); since session 27 a tenant
    whose probe did not pay asks again only after UNKNOWN_RECHECK decisions (or when a positions
    count was first measured, or its session count changed): one what-if per ask, never two asks
    of a tenant in one tick, and fewer asks than ticks. The K and the outputs are those of the
    fixed K = 0 arm."""
    from specdec.control import batch_controller

    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    optima: list[dict] = []
    asks: list[tuple[int, str]] = []  # (decision number, tenant) of every probe_k call
    choose, probe_k = batch_controller.choose_batch_ks, BatchKController.probe_k

    def counting_choose(loads, *args, **kwargs):
        optima.append({t: load.alpha for t, load in loads.items()})
        return choose(loads, *args, **kwargs)

    def counting_probe_k(self, tenant, cap):
        asks.append((sum(1 for o in optima if all(a != self.probe_alpha for a in o.values())), tenant))
        return probe_k(self, tenant, cap)

    fixed = _run(engine, monkeypatch, adaptive=False)[1]
    monkeypatch.setattr(batch_controller, "choose_batch_ks", counting_choose)
    monkeypatch.setattr(BatchKController, "probe_k", counting_probe_k)
    calls, ad, sched, ctl = _run(engine, monkeypatch, adaptive=True)  # undoes both patches at its end
    assert [r.token_ids for r in ad] == [r.token_ids for r in fixed]
    assert all(set(r.stats.k_counts) == {0} for r in ad) and ctl.probes == 0
    decisions = [o for o in optima if all(a != ctl.probe_alpha for a in o.values())]
    what_ifs = [o for o in optima if any(a == ctl.probe_alpha for a in o.values())]
    assert len(decisions) == len(sched.trace)  # one decision per tick
    assert len(asks) == len(set(asks))  # no tenant asked twice in one tick
    assert len(what_ifs) == len(asks)  # one what-if optimum per ask
    per_tenant = {t: [d for d, tt in asks if tt == t] for t in ("code", "creative")}
    assert all(0 < len(v) < len(decisions) for v in per_tenant.values()), (per_tenant, len(decisions))


def test_probe_k_answers_as_computed_afresh_after_a_cost_observation():
    """The remembered probe K follows the cost model: after a cost observation between two asks
    (no new decision), probe_k answers what the uncached what-if optimum gives with the new costs."""
    from specdec.control.batch_choice import TenantLoad, choose_batch_ks

    ctl = BatchKController(budget=64, k_ranges={"code": (0, 3)})
    for positions in range(1, 5):
        ctl.cost.observe_verify(1, positions, 0.01)
    ctl.cost.observe_draft(1, 1.0)  # a draft forward 100x a verify forward: no K > 0 pays
    ctl.decide({("code", "draft"): 1})
    assert ctl.probe_k("code", 3) == 0

    def afresh() -> int:
        load = ctl._loads["code"]
        what_if = {"code": TenantLoad(load.sessions, ctl.probe_alpha, load.weight, load.k_min, min(load.k_max, 3),
                                      load.drafted, load.fixed_k, load.catchup_s, load.tokens_left)}
        return choose_batch_ks(what_if, ctl.cost, ctl.budget, ctl.catchup_horizon).ks["code"]

    version, n = ctl.cost.version, 0
    while ctl.cost.draft_s(1) > 0.001:  # drafts become nearly free: a probe at α = 0.9 pays
        ctl.cost.observe_draft(1, 0.0001)
        n += 1
    assert 0 < n < 200 and ctl.cost.version == version + n
    assert afresh() == 3
    assert ctl.probe_k("code", 3) == 3
