"""A verify shape priced from old samples costs at most a count of more positions measured since
(:class:`specdec.control.batch_cost.BatchCostModel`, "Stale points"). Fake costs: the in-process
8-client arm of docs/bench/batching/inprocess-s21-trace/ (w8a8 pair, 2-core Zen 4, loaded)."""

from __future__ import annotations

import pytest

from specdec.control.batch_cost import STALE_FORWARDS
from specdec.control.batch_k import BatchCostModel, TenantLoad, choose_batch_ks

#: the six warm-up forwards of 8 sessions at K = 0 (8 rows, 8 positions), the first ones cold
WARM_UP = (0.3607, 0.3938, 0.626, 0.371, 0.4374, 0.3907)
#: the trace's tenants at the arm's start: code (acceptance ~1) and creative (0.64)
LOADS = {"code": TenantLoad(4, 0.997, k_max=4), "creative": TenantLoad(4, 0.64, k_max=4)}


class _Before(BatchCostModel):
    """The model before: no price capped for staleness, no samples replaced."""

    def _fresh_cap(self, rows, positions, optimistic=False):
        return float("inf")


def _arm_start(cls=BatchCostModel, fresh: int = STALE_FORWARDS + 1) -> BatchCostModel:
    """The warm-up's 8-position forwards, then ``fresh`` forwards of 8 rows at 10 and 12 positions
    (0.14 and 0.17 s, alternately: code at K = 1, creative at K = 1), drafts at 0.05 / 0.07 s."""
    c = cls(max_positions=128)
    for t in WARM_UP:
        c.observe_verify(8, 8, t)
    for rows, t in ((4, 0.05), (8, 0.07)):
        for _ in range(3):
            c.observe_draft(rows, t)
    for i in range(fresh):
        c.observe_verify(8, (10, 12)[i % 2], (0.14, 0.17)[i % 2])
    return c


def test_a_stale_k0_shape_costs_at_most_a_fresh_shape_of_more_positions():
    """The 8-position shape keeps its warm-up median (0.392 s) while it is fresh; once
    STALE_FORWARDS forwards have run since, it costs at most the fresh 10 positions' 0.14 s, and
    K = 0 is chosen (the code tenant at K = 1 priced 0.17 + 0.05 s for 12 tokens: 54.5 tokens/s
    against 57.1). Before, the code tenant left K = 0 and a lone low-acceptance tenant took K = 2."""
    c = _arm_start(fresh=STALE_FORWARDS)
    assert STALE_FORWARDS == 9
    assert c.verify_s(8, 8) == pytest.approx(0.39225)  # the median of the six, not yet stale
    assert choose_batch_ks(LOADS, c, 128).ks == {"code": 1, "creative": 0}
    c = _arm_start()
    assert (c.verify_s(8, 8), c.verify_s(8, 10), c.verify_s(8, 12)) == pytest.approx((0.14, 0.14, 0.17))
    d = choose_batch_ks(LOADS, c, 128)
    assert d.ks == {"code": 0, "creative": 0} and d.tokens_per_s == pytest.approx(8 / 0.14)
    assert choose_batch_ks({"t": TenantLoad(8, 0.64, k_max=4)}, c, 128).ks == {"t": 0}
    before = _arm_start(_Before)
    assert before.verify_s(8, 8) == pytest.approx(0.39225)
    assert choose_batch_ks(LOADS, before, 128).ks == {"code": 1, "creative": 0}
    assert choose_batch_ks({"t": TenantLoad(8, 0.64, k_max=4)}, before, 128).ks == {"t": 2}


def test_the_first_forward_of_a_stale_shape_replaces_its_samples():
    """Run again, the K = 0 shape's first forward (0.135 s) replaces its old window and curve
    point: a thin count then, priced on its curve point with no row term (the point was measured
    at these 8 rows: "Rows a point was measured at"), its own median after THIN_SAMPLES forwards.
    Fed to the old window, the median stayed 0.39 (0.371 after three new forwards) and the
    controller would leave K = 0 again as soon as the shape was fresh."""
    c, before = _arm_start(), _arm_start(_Before)
    for m in (c, before):
        m.observe_verify(8, 8, 0.135)
    assert c.verify_s(8, 8) == pytest.approx(0.135) and c._point_rows[8] == 8.0
    assert c.verify._verify[8].n == 1 and before.verify_s(8, 8) == pytest.approx(0.3907)
    for m in (c, before):
        m.observe_verify(8, 8, 0.135)
        m.observe_verify(8, 8, 0.135)
    assert c.verify_s(8, 8) == pytest.approx(0.135) and c.verify.verify_s(8) == pytest.approx(0.135)
    assert before.verify_s(8, 8) == pytest.approx(0.371)


def test_fresh_against_fresh_stays_as_measured():
    """Served w8a8 (tests/test_batch_cost_outliers.py): 4 positions at 0.138 s, 5 at 0.123, both
    run recently: 4 keeps its price. Only after STALE_FORWARDS forwards at 5 positions alone is 4
    priced at 5's (and its next forward replaces its samples with what it costs then)."""
    c = BatchCostModel(max_positions=64)
    for _ in range(3):
        c.observe_verify(1, 4, 0.138)
        c.observe_verify(1, 5, 0.123)
    assert c.verify_s(1, 4) == pytest.approx(0.138) and c.verify_s(1, 5) == pytest.approx(0.123)
    for _ in range(STALE_FORWARDS - 1):  # 4 was last run STALE_FORWARDS forwards ago: still fresh
        c.observe_verify(1, 5, 0.123)
    assert c.verify_s(1, 4) == pytest.approx(0.138)
    c.observe_verify(1, 5, 0.123)
    assert c.verify_s(1, 4) == pytest.approx(0.123)
    c.observe_verify(1, 4, 0.138)  # run so priced: its first forward replaces the old samples
    assert c.verify._verify[4].n == 1 and c.verify_s(1, 4) == pytest.approx(0.123)  # thin: below 5, the least
    c.observe_verify(1, 4, 0.138)
    c.observe_verify(1, 4, 0.138)
    assert c.verify_s(1, 4) == pytest.approx(0.138)  # measured again: its own price
