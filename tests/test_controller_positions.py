"""K controller, session 15: clustered acceptance (a per-position model that keeps the first draft
position apart from the run), a running request's own acceptance weighed against a capped
history, and blocks cut by the room left in a request not read as early stops (issue 9: the
in-process adaptive arm held K = 3 on code-prime at 32 tokens where K = 8 / 12 with early stop
ran 1.64x / 1.67x the target alone)."""

import pytest

from benchmarks import inprocess_adaptive as ia
from specdec.control.acceptance import AcceptanceEstimator, reached_from_counts, shrunk_position_alphas
from specdec.control.adaptive import StepCostRecorder
from specdec.control.controller import KController
from specdec.control.cost_model import CostModel
from specdec.types import SpeculationStats

POLICY = {"k_min": 0, "k_max": 8, "adaptive": True, "fixed_k": None}
KEY = ("code", "draft")


def leviathan(c):
    """step_time(k) = 1 + c·k (Leviathan et al.'s constant-cost model)."""
    return CostModel(prior_verify_s=1.0, prior_verify_slope=0.0, prior_draft_s_per_token=c)


def exact_estimator() -> AcceptanceEstimator:
    return AcceptanceEstimator(half_life_steps=None, prior_weight=0.0, global_prior_weight=0.0,
                               prior_half_life_steps=None)


def bursty(est: AcceptanceEstimator) -> None:
    """6 steps at K = 3: 4 accepted whole, 2 rejected at the first position (a hard stretch).
    α̂ = 12 / (12 + 2) = 6/7; per position accepted [4, 4, 4], reached [6, 4, 4]."""
    for _ in range(4):
        est.record(KEY, 3, 3)
    for _ in range(2):
        est.record(KEY, 3, 0)


# ---------------------------------------------------------------- the formula

def test_shrunk_position_alphas_exact():
    # run = (6 + 5 + 4·0.8) / (6 + 6 + 4) = 14.2 / 16; α_0 = (6 + 3.2) / 12
    run = 14.2 / 16
    got = shrunk_position_alphas([6, 6, 5], [8, 6, 6], 0.8, 5, 4.0)
    assert got == pytest.approx([9.2 / 12, (6 + 4 * run) / 10, (5 + 4 * run) / 10, run, run], abs=1e-12)
    assert shrunk_position_alphas([], [], 0.7, 3, 4.0) == pytest.approx([0.7, 0.7, 0.7], abs=1e-12)
    assert shrunk_position_alphas([6], [8], 0.8, 0, 4.0) == []


def test_iid_acceptance_gives_alpha_everywhere():
    """With i.i.d. acceptance every position's rate is α, so the model adds nothing."""
    assert shrunk_position_alphas([8, 4, 2], [10, 5, 2.5], 0.8, 4, 4.0) == pytest.approx([0.8] * 4, abs=1e-12)


def test_shrunk_position_alphas_errors():
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\], got 1.5"):
        shrunk_position_alphas([1], [1], 1.5, 2, 4.0)
    with pytest.raises(ValueError, match="need n >= 0 and prior_trials > 0, got n=2, prior_trials=0"):
        shrunk_position_alphas([1], [1], 0.5, 2, 0)
    with pytest.raises(ValueError, match=r"position 1: need 0 <= accepted <= reached, got 3.0 > 2.0"):
        shrunk_position_alphas([3, 3], [4, 2], 0.5, 2, 4.0)
    with pytest.raises(ValueError, match=r"scale must be in \[0, 1\], got 2"):
        exact_estimator().shrunk_position_alphas(KEY, 2, 4.0, scale=2)
    with pytest.raises(ValueError, match="position_prior_trials must be > 0 or None, got 0"):
        KController(position_prior_trials=0)
    with pytest.raises(ValueError, match="retune_memory_trials must be >= 0 or None, got -1"):
        KController(retune_memory_trials=-1)


def test_reached_from_counts():
    assert reached_from_counts([3, 2, 1], [4, 3, 3]) == [4, 3, 2]
    assert reached_from_counts([], []) == []


# ---------------------------------------------------------------- decisions

def test_clustered_acceptance_picks_a_longer_k_than_iid():
    """The same counts: i.i.d. α̂ = 6/7 gives K = 3; the per-position model (first position 0.743,
    the run 0.952) gives K = 7 with step_time(k) = 1 + 0.35 k."""
    iid = KController(exact_estimator(), lambda p: leviathan(0.35), position_min_reached=None)
    bursty(iid.estimator)
    d = iid.decide(*KEY, POLICY, 8)
    assert (d.k, d.alpha, d.position_alphas) == (3, pytest.approx(6 / 7, abs=1e-12), ())

    ctl = KController(exact_estimator(), lambda p: leviathan(0.35), position_prior_trials=4.0)
    bursty(ctl.estimator)
    d = ctl.decide(*KEY, POLICY, 8)
    a = 6 / 7
    run = (8 + 4 * a) / (8 + 4)
    first = (4 + 4 * a) / (6 + 4)
    later = (4 + 4 * run) / (4 + 4)
    pos = [first, later, later, run, run, run, run, run]
    assert d.position_alphas == pytest.approx(pos, abs=1e-12)
    assert (d.k, d.best_k, d.reason) == (7, 7, "initial")
    prod, e = 1.0, 1.0
    for x in pos[:7]:
        prod *= x
        e += prod
    assert d.expected_tokens == pytest.approx(e, abs=1e-12)
    assert d.predicted_speedup == pytest.approx(e / (1 + 0.35 * 7), abs=1e-12)
    # explainable: the decision as plain data carries the per-position rates it used
    assert d.as_dict()["position_alphas"] == pytest.approx(pos, abs=1e-12)


def _history(est: AcceptanceEstimator, steps: int = 20) -> None:
    """The tenant's history: 20 steps at K = 3, each rejected at the third position
    (α̂ = 40 / 60 = 2/3 without prior)."""
    for _ in range(steps):
        est.record(KEY, 3, 2)


def test_request_own_acceptance_steers_its_remaining_steps_with_a_capped_history():
    """History α̂ 2/3 (60 trials); the running request accepted 4 whole blocks of 3. Weighed
    against the whole history: α = (40 + 12) / (60 + 12) = 0.722, K stays 3. Against 16 trials
    of it: α = (16·2/3 + 12) / (16 + 12) = 0.810, K = 5 (1 + 0.15 k step time)."""
    stats = SpeculationStats()
    for _ in range(4):
        stats.record_step(3, 3, 0.0, 0.0)
    # (memory, K kept, best K at that α): at 0.722 K = 4 is best by 0.03 % (< the 3 % switch margin)
    for memory, k, best, alpha in ((None, 3, 4, 52 / 72), (16.0, 5, 5, (16 * 2 / 3 + 12) / 28)):
        ctl = KController(exact_estimator(), lambda p: leviathan(0.15), position_min_reached=None,
                          retune_memory_trials=memory)
        _history(ctl.estimator)
        d = ctl.decide(*KEY, POLICY, 8)
        assert d.k == 3
        assert ctl.in_request_k(*KEY, d, stats, 3) == k
        cands = {c.k: c for c in ctl._candidates(*KEY, alpha, (), 3, 8, None)}
        assert max(cands.values(), key=lambda c: c.speedup).k == best


def test_in_request_positions_use_the_scaled_history_and_the_request():
    """With both settings, the per-position rates in_request_k uses are the history's counts
    scaled to 16 trials plus the request's own (checked through the estimator helper)."""
    ctl = KController(exact_estimator(), lambda p: leviathan(0.2), position_prior_trials=4.0,
                      retune_memory_trials=16.0)
    _history(ctl.estimator)
    scale = 16 / 60
    req_acc, req_reached = [4, 4, 4], [4, 4, 4]
    alpha = (40 * scale + 12) / (60 * scale + 12)
    got = ctl.estimator.shrunk_position_alphas(KEY, 4, 4.0, req_acc, req_reached, alpha=alpha, scale=scale)
    acc = [20 * scale + 4, 20 * scale + 4, 0 * scale + 4]
    reached = [20 * scale + 4, 20 * scale + 4, 20 * scale + 4]
    assert got == pytest.approx(shrunk_position_alphas(acc, reached, alpha, 4, 4.0), abs=1e-12)


# ---------------------------------------------------------------- blocks cut by the room left

def test_recorder_marks_blocks_cut_to_the_room_left():
    """max_tokens 12: step 1 drafts 4, accepts 4 (5 tokens); step 2 drafts 4, accepts 1 (2 tokens,
    7 generated); step 3 drafts 4 = 12 - 7 - 1 (cut to the room)."""
    st = SpeculationStats()
    rec = StepCostRecorder(st, max_tokens=12)
    for k, a in ((4, 4), (4, 1), (4, 4)):
        st.record_step(k, a, 0.1, 0.2)
        rec.after_step()
    assert rec.costs.room_blocks == {4: 1}
    assert rec.costs.as_dict()["room_limited_blocks"] == {4: 1}
    plain = StepCostRecorder(SpeculationStats())
    assert plain.max_tokens is None and plain.costs.as_dict()["room_limited_blocks"] == {}


def test_room_limited_blocks_are_censored_not_stops():
    ctl = KController(exact_estimator(), lambda p: leviathan(0.2), learn_early_stop=True)
    ctl.record_stops(KEY, {3: 8, 1: 1}, 3)
    # position 1: 1 stop in 9 blocks; 2: 8 blocks went on; 3: never reached, the pooled 1 / 17
    assert ctl.stop_hazards(*KEY, 3) == pytest.approx([1 / 9, 0.0, 1 / 17], abs=1e-12)
    ctl2 = KController(exact_estimator(), lambda p: leviathan(0.2), learn_early_stop=True)
    ctl2.record_stops(KEY, {3: 8, 1: 1}, 3, censored={1: 1})
    assert ctl2.stop_hazards(*KEY, 3) == [0.0, 0.0, 0.0]


def test_record_passes_room_limited_blocks_from_costs():
    ctl = KController(exact_estimator(), lambda p: leviathan(0.2), learn_early_stop=True)
    ctl.decide(*KEY, {"k_min": 3, "k_max": 3, "adaptive": False, "fixed_k": 3}, 3)
    stats = SpeculationStats()
    for k, a in ((3, 3),) * 8 + ((1, 1),):
        stats.record_step(k, a, 0.1, 0.2)
    costs = {"verify_s_by_positions": {}, "draft_s": 0.0, "drafted": 0, "room_limited_blocks": {1: 1}}
    ctl.record(*KEY, stats, costs)
    assert ctl.stop_hazards(*KEY, 3) == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------- where it is on

def test_defaults_off_served_and_on_in_the_bench():
    ctl = KController()
    assert (ctl.position_prior_trials, ctl.retune_memory_trials) == (None, None)
    bench = ia.new_controller()
    assert (bench.position_prior_trials, bench.retune_memory_trials) == (4.0, 16.0)
    assert (bench.learn_early_stop, bench.in_request_retune) == (True, True)


# ---------------------------------------------------------------- a fresh key starts where a predictable one would

def _fresh(c: float, flag: bool) -> KController:
    from specdec.control.step_guard import in_request_guard

    return KController(AcceptanceEstimator(), lambda p: leviathan(c), step_guard=in_request_guard(),
                       in_request_retune=True, fresh_key_whole_probe=flag)


def test_fresh_key_runs_its_first_request_at_the_probe_k_guarded_and_retuned():
    """Prior α 0.5 with step_time 1 + 0.35 k: K = 1 (1.11x). The probe's K (α 0.9): 4 (4.095 /
    2.4 = 1.706x against 1.704x at 5). With ``fresh_key_whole_probe`` the fresh key runs K = 4
    for the whole request, guarded and re-tuned; without, K = 1."""
    d = _fresh(0.35, False).decide(*KEY, POLICY, 8)
    assert (d.k, d.reason, d.probe, d.best_k) == (1, "initial", False, 1)
    ctl = _fresh(0.35, True)
    d = ctl.decide(*KEY, POLICY, 8)
    assert (d.k, d.reason, d.probe, d.probe_steps, d.best_k) == (4, "probe: fresh key", True, None, 1)
    # what the model predicts for K = 4 at the key's α̂ 0.5 (explainable: not the probe's α 0.9)
    assert d.predicted_speedup == pytest.approx(1.9375 / 2.4, abs=1e-12)
    assert ctl.current_k(*KEY) == 1  # the probe does not move the tenant's K
    g = ctl.guarded_k(*KEY, d)
    assert g.measure and g.retune is not None and g.guard is not None
    # 8 own steps later the key is no longer fresh: the model decides
    stats = SpeculationStats()
    for _ in range(8):
        stats.record_step(4, 4, 0.4, 1.0)
    ctl.record(*KEY, stats)
    d = ctl.decide(*KEY, POLICY, 8)
    assert not d.probe and d.reason in ("hold", "switch: gain")


def test_fresh_key_held_at_zero_probes_the_whole_request():
    """step_time 1 + k: K = 0 at the prior's α; the thin key's probe runs K = 1 (the best K >= 1
    at α 0.9) for the whole request with the flag, for 4 steps without."""
    d = _fresh(1.0, False).decide(*KEY, POLICY, 8)
    assert (d.k, d.reason, d.probe, d.probe_steps) == (1, "probe", True, 4)
    ctl = _fresh(1.0, True)
    d = ctl.decide(*KEY, POLICY, 8)
    assert (d.k, d.reason, d.probe, d.probe_steps) == (1, "probe", True, None)
    assert ctl.guarded_k(*KEY, d).measure


def test_fresh_key_whole_probe_needs_the_in_request_setting():
    assert not KController(fresh_key_whole_probe=True).fresh_key_whole_probe
    assert not KController(in_request_retune=True, fresh_key_whole_probe=True).fresh_key_whole_probe


def test_new_controller_starts_from_calibrated_costs():
    src = CostModel()
    for p, t in ((1, 0.177), (5, 0.19), (9, 0.237)):
        for _ in range(3):
            src.observe_verify(p, t)
    src.observe_draft_block(4, 0.265)
    ctl = ia.new_controller(src.export_observations())
    cm = ctl.cost_model("draft")
    assert (cm.verify_s(1), cm.verify_s(9), cm.draft_block_s(4)) == pytest.approx((0.177, 0.237, 0.265), abs=1e-12)
    assert ctl.plain_bound("draft") == pytest.approx(1 / 0.177, abs=1e-12)
    assert ia.new_controller().cost_model("draft").snapshot()["verify_observations"] == {}
