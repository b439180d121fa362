"""``benchmarks.adaptive_k``'s adaptive arm runs its steps as ``specdec bench --adaptive`` does:
under the tenant's in-request goodput guard (:meth:`KController.guarded_k`,
:mod:`specdec.control.step_guard`), on a tiny pair built from a config."""

from __future__ import annotations

import pytest

from specdec.engine.engine import SpeculativeEngine


def test_adaptive_arm_runs_every_step_under_the_tenants_goodput_guard(tiny_target, tiny_draft_close):
    """The adaptive arm's controller is the one the in-process bench builds (with a step guard); every
    request it speculates in, a fresh key's whole-request probe included (``probe_steps`` None:
    ``fresh_key_whole_probe``), asks the guard before each step (``step_ks``: one K per step, none
    below 0 or above the request's cap of 8: the in-request retune may raise the decided K), feeds
    it (the tenant's guard holds the measured steps) and gives the K = 0 arm's tokens (greedy)."""
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
    spec = [r for r in rows if r["k"] > 0 and (not r["probe"] or r["probe_steps"] is None)]
    assert spec, [(r["k"], r["reason"]) for r in rows]
    assert rows[0]["reason"] == "probe: fresh key" and rows[0]["probe_steps"] is None
    for r in spec:
        assert len(r["step_ks"]) == r["steps"] and 0 <= min(r["step_ks"]) and max(r["step_ks"]) <= 8
    guard = controller.guard_stats("code", "draft")
    assert guard is not None and guard["steps_spec"] + guard["steps_plain"] > 0, guard


def test_calibrate_with_blocks_measures_every_k(tiny_target, tiny_draft_close):
    """``calibrate(..., blocks=True)`` (what the in-process bench's controllers start from,
    ``benchmarks.inprocess_adaptive.calibrated_costs``): every positions count 1..5 observed 3
    times (so the one-position verify makes a plain bound) and every block length 1..4 too."""
    from benchmarks.inprocess_adaptive import calibrated_costs, new_controller
    from specdec.control.adaptive import calibrate

    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    ctl = new_controller()
    snap = calibrate(engine, ctl, max_k=4, repeats=3, blocks=True)
    assert snap["verify_observations"] == {1: 3, 2: 3, 3: 3, 4: 3, 5: 3}
    assert snap["draft_block_observations"] == {1: 3, 2: 3, 3: 3, 4: 3}
    assert ctl.plain_bound("draft") == pytest.approx(1 / snap["verify_s"][1])
    old = calibrate(engine, new_controller(), max_k=2, repeats=3)
    assert old["verify_observations"] == {1: 1, 2: 1, 3: 1} and old["draft_block_observations"] == {}
    costs = calibrated_costs(engine)
    assert sorted(int(p) for p in costs["verify"]) == list(range(1, 10))
    assert sorted(int(d) for d in costs["draft_blocks"]) == list(range(1, 9))
