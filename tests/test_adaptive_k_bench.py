"""``benchmarks.adaptive_k``'s adaptive arm runs its steps as ``specdec bench --adaptive`` does:
under the tenant's in-request goodput guard (:meth:`KController.guarded_k`,
:mod:`specdec.control.step_guard`), on a tiny pair built from a config."""

from __future__ import annotations

from specdec.engine.engine import SpeculativeEngine


def test_adaptive_arm_runs_every_step_under_the_tenants_goodput_guard(tiny_target, tiny_draft_close):
    """The adaptive arm's controller is the one the in-process bench builds (with a step guard); every
    request it speculates in asks the guard before each step (``step_ks``: one K per step, none above
    the decision), feeds it (the tenant's guard holds the measured steps) and gives the K = 0 arm's
    tokens (greedy)."""
    from benchmarks.adaptive_k import Arm, new_controller

    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    controller = new_controller()
    assert controller.step_guard is not None
    adaptive, plain = Arm("adaptive", None, controller), Arm("K=0", 0)
    rows = []
    for content in ("Write a function.", "Write another function.", "And a third one."):
        a, p = adaptive.run(engine, "code", content, 24), plain.run(engine, "code", content, 24)
        assert a["token_ids"] == p["token_ids"] and len(a["token_ids"]) == 24
        assert p["step_ks"] is None  # a fixed arm is not guarded
        rows.append(a)
    spec = [r for r in rows if r["k"] > 0 and not r["probe"]]
    assert spec, [(r["k"], r["reason"]) for r in rows]
    for r in spec:
        assert len(r["step_ks"]) == r["steps"] and max(r["step_ks"]) <= r["k"]
    guard = controller.guard_stats("code", "draft")
    assert guard is not None and guard["steps_spec"] + guard["steps_plain"] > 0, guard
