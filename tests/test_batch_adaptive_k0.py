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
