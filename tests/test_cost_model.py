"""CostModel: priors, EWMA, interpolation and extrapolation of the verify curve."""

import pytest

from specdec.control.cost_model import CostModel, Ewma


def test_priors_and_step_time_terms():
    cm = CostModel()
    assert cm.verify_s(1) == pytest.approx(0.05)
    assert cm.verify_s(5) == pytest.approx(0.05 * 1.2)
    assert cm.step_time(0) == pytest.approx(0.05)
    assert cm.step_terms(4) == pytest.approx(
        {"draft_s": 0.02, "verify_s": 0.06, "round_trip_s": 0.0, "total_s": 0.08})


def test_leviathan_constant_cost():
    cm = CostModel(prior_verify_s=1.0, prior_verify_slope=0.0, prior_draft_s_per_token=0.2)
    assert [cm.step_time(k) for k in range(4)] == pytest.approx([1.0, 1.2, 1.4, 1.6])


def test_ewma_running_mean_then_fixed_weight():
    e = Ewma(0.25)
    for x in (1.0, 2.0, 3.0, 4.0):
        e.update(x)
    assert e.value == pytest.approx(2.5)  # running mean for the first 1/0.25 = 4
    e.update(10.0)
    assert e.value == pytest.approx(2.5 + 0.25 * 7.5)


def test_draft_and_round_trip_measurements():
    cm = CostModel()
    cm.observe_draft(4, 0.8)
    cm.observe_draft(0, 5.0)  # ignored
    cm.observe_round_trip(0.01)
    assert cm.draft_s_per_token == pytest.approx(0.2)
    assert cm.round_trip_s == pytest.approx(0.01)
    cm.observe_verify(1, 0.1)
    assert cm.step_time(0) == pytest.approx(0.1)  # no draft, no round trip at K=0
    cm.observe_verify(3, 0.3)
    assert cm.step_time(2) == pytest.approx(2 * 0.2 + 0.3 + 0.01)


MEASURED = {1: 0.37, 2: 0.70, 3: 1.02, 4: 0.68, 5: 0.71, 9: 0.99}  # K -> verify s (positions K+1)


def test_measured_values_used_as_is_not_monotonic():
    cm = CostModel()
    for k, t in MEASURED.items():
        cm.observe_verify(k + 1, t)
    for k, t in MEASURED.items():
        assert cm.verify_s(k + 1) == pytest.approx(t)
    assert cm.verify_s(5) < cm.verify_s(4)  # K=4 really was cheaper than K=3
    # interpolation between 6 and 10 positions
    assert cm.verify_s(8) == pytest.approx(0.71 + (0.99 - 0.71) * 2 / 4)


def test_extrapolation_is_sane():
    cm = CostModel()
    for k, t in MEASURED.items():
        cm.observe_verify(k + 1, t)
    # above: least-squares slope over the measured points, never decreasing
    assert cm.verify_s(12) > cm.verify_s(10)
    # below (1 position: plain decoding): positive and not above the 2-position cost
    assert 0 < cm.verify_s(1) <= 0.37
    cm2 = CostModel()
    cm2.observe_verify(3, 0.3)
    cm2.observe_verify(4, 0.2)  # negative slope -> flat outside
    assert cm2.verify_s(8) == pytest.approx(0.2)
    assert cm2.verify_s(1) == pytest.approx(0.3)


def test_single_point_scales_prior_shape():
    cm = CostModel(prior_verify_s=1.0, prior_verify_slope=0.5)
    cm.observe_verify(3, 4.0)  # prior(3) = 2.0 -> scale 2
    assert cm.verify_s(1) == pytest.approx(2.0)
    assert cm.verify_s(5) == pytest.approx(6.0)


def test_bad_observations_raise():
    cm = CostModel()
    with pytest.raises(ValueError):
        cm.observe_verify(0, 0.1)
    with pytest.raises(ValueError):
        cm.observe_verify(2, -1.0)
    with pytest.raises(ValueError):
        cm.observe_draft(2, float("nan"))


def test_step_costs_leave_out_the_draft_catch_up_after_k0_steps():
    """A drafting step right after K = 0 steps counts its verify, not its draft seconds (the
    draft's first forward then also feeds the tokens decoded at K = 0); later drafting steps,
    and the first step's prefill, as before."""
    from specdec.control.adaptive import StepCostRecorder
    from specdec.types import SpeculationStats

    stats = SpeculationStats()
    rec = StepCostRecorder(stats)
    steps = [  # (k, accepted, draft_s, verify_s)
        (2, 2, 5.0, 9.0),   # first step: prompt prefill of both models, left out
        (2, 1, 0.2, 0.3),   # counted: 0.2 s for 2 drafted tokens
        (0, 0, 0.0, 0.1),
        (0, 0, 0.0, 0.1),
        (3, 3, 1.5, 0.4),   # after K = 0: catch-up of 2 tokens in the draft forward, draft left out
        (3, 2, 0.3, 0.4),   # counted
        (1, 1, 0.1, 0.2),   # counted
    ]
    for k, acc, d, v in steps:
        stats.record_step(k, acc, d, v)
        rec.after_step()
    costs = rec.costs.as_dict()
    assert costs["skipped_steps"] == 1
    assert costs["drafted"] == 2 + 3 + 1
    assert costs["draft_s"] == pytest.approx(0.2 + 0.3 + 0.1)
    assert {p: (round(s, 9), n) for p, (s, n) in costs["verify_s_by_positions"].items()} == {
        1: (0.2, 2), 2: (0.2, 1), 3: (0.3, 1), 4: (0.8, 2)}
    # session 12: the same drafting steps by block length, and the first step's draft apart
    assert costs["draft_s_by_drafted"] == {1: [pytest.approx(0.1), 1], 2: [pytest.approx(0.2), 1],
                                           3: [pytest.approx(0.3), 1]}
    assert costs["first_draft_s"] == 5.0 and costs["first_drafted"] == 2


def test_draft_block_first_forward_dearer_than_later_ones():
    """``draft_block_s(d) = first + (d - 1) · later``: with one measured length split by
    ``prior_draft_first_ratio``; with several, the least-squares line through them beyond, the
    neighbours in between; until a block was measured by length, d x the per-token EWMA."""
    cm = CostModel(prior_draft_s_per_token=0.005)
    assert cm.draft_block_s(0) == 0.0 and cm.draft_block_s(4) == pytest.approx(0.020)
    cm.observe_draft(10, 0.31)  # the per-token EWMA (served path): d x 31 ms
    assert cm.draft_block_s(8) == pytest.approx(0.248)
    cm.observe_draft_block(2, 0.062)  # one length: later = 0.062 / (1.5 + 1), first = 1.5 x later
    assert cm.draft_block_s(2) == pytest.approx(0.062)
    assert cm.draft_block_s(1) == pytest.approx(0.0372)
    assert cm.draft_block_s(4) == pytest.approx(0.0248 * 4.5)
    assert cm.step_time(4) == pytest.approx(0.0248 * 4.5 + cm.verify_s(5))
    cm.observe_draft_block(4, 0.106)  # two lengths: later 22 ms, first 40 ms
    assert cm.draft_block_s(3) == pytest.approx(0.084)
    assert cm.draft_block_s(8) == pytest.approx(0.106 + 4 * 0.022)
    assert cm.draft_block_s(1) == pytest.approx(0.040)
    assert cm.step_terms(8)["draft_s"] == pytest.approx(0.194)
    with pytest.raises(ValueError):
        cm.observe_draft_block(0, 0.1)
    with pytest.raises(ValueError):
        CostModel(prior_draft_first_ratio=0.5)


def test_draft_prefill_spread_over_the_request():
    """request_speedup = tokens · step_time(0) / (tokens / E[N] · step_s + draft_prefill_s);
    the steady state without a measured prefill or a length."""
    cm = CostModel()
    cm.observe_verify(1, 0.08)
    assert cm.draft_prefill_s == 0.0
    assert cm.request_speedup(3.0, 0.2, 32) == pytest.approx(3.0 * 0.08 / 0.2)
    cm.observe_draft_prefill(0.36)
    assert cm.request_speedup(3.0, 0.2, 32) == pytest.approx(32 * 0.08 / (32 / 3.0 * 0.2 + 0.36))
    assert cm.request_speedup(3.0, 0.2, None) == pytest.approx(1.2)
    data = cm.export_observations()
    assert data["draft_prefill"] == [1, 0.36] and data["draft_blocks"] == {}
    cm.observe_draft_block(3, 0.09)
    back = CostModel()
    back.import_observations(cm.export_observations())
    assert back.draft_block_s(3) == 0.09 and back.draft_prefill_s == 0.36
    old = {k: v for k, v in cm.export_observations().items() if k not in ("draft_blocks", "draft_prefill")}
    back.import_observations(old)  # written before session 12: no blocks, no prefill
    assert back.draft_prefill_s == 0.0 and back.draft_block_s(3) == pytest.approx(3 * back.draft_s_per_token)


def test_frozen_cost_model_ignores_every_kind_of_observation():
    """FrozenCostModel keeps its priors whatever is observed: every ``observe_*`` of CostModel is
    a no-op there (a new measurement kind left out made tiny-model tests price drafts from their
    wall time: tests/deployments/test_tenancy.py held an always-rejected tenant at K = 6)."""
    from specdec.control.cost_model import CostModel
    from specdec.testing.sim import FrozenCostModel

    frozen = FrozenCostModel(verify_s=1.0, draft_s_per_token=0.1)
    before = [frozen.step_time(k) for k in range(7)]
    for name in dir(CostModel):
        if name.startswith("observe_"):
            fn = getattr(frozen, name)
            args = [3, 0.001][: fn.__code__.co_argcount - 1]
            for _ in range(20):
                fn(*args)
    assert [frozen.step_time(k) for k in range(7)] == before == [1.0 + 0.1 * k for k in range(7)]
