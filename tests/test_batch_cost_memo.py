"""What BatchCostModel derives for pricing is kept until its state changes (class docstring, "Pricing
many shapes"): every price equals the one computed afresh, after every kind of observation."""

from __future__ import annotations

import random
import types

from specdec.control.batch_cost import BatchCostModel


def _afresh(cost: BatchCostModel) -> BatchCostModel:
    """``cost`` with nothing kept: every derived value and every curve's sorted points recomputed
    on each call (the pricing before session 28)."""
    cost._memo = lambda key, make: make()
    for curve in (cost.verify, cost._served_curve, cost.draft):
        curve.verify_points = types.MethodType(
            lambda self: sorted((p, e.value) for p, e in self._verify.items() if e.value is not None), curve)
    return cost


def _prices(cost: BatchCostModel, rows_max: int, positions_max: int) -> list:
    out = []
    for rows in (1, 2, rows_max // 2, rows_max):
        for positions in range(rows, min(positions_max, rows * 6) + 1, max(1, rows // 2)):
            out.append(cost.verify_s(rows, positions))
            out.append(cost.verify_s(rows, positions, optimistic=True))
        out.append(cost.draft_s(rows))
    out += [cost.catchup_s(t) for t in (0, 1, 9, 40)]
    out.append(cost.shape_s(rows_max, rows_max * 2, [rows_max, rows_max // 2], cost.prices()))
    return out


def test_prices_equal_prices_computed_afresh_after_every_observation():
    """30 random runs of 120 events (verify forwards of 1-24 rows and their positions, with and
    without context, prefill, calibration; draft forwards; catch-ups; new pricing contexts; context
    refits): after each, ~150 prices of the kept model equal bit for bit those of a twin fed the same
    events that keeps nothing."""
    checked = refits = 0
    for seed in range(30):
        rng = random.Random(seed)
        rows_max = rng.choice((4, 8, 24))
        kept, fresh = BatchCostModel(max_positions=256), _afresh(BatchCostModel(max_positions=256))
        for _ in range(120):
            ev = rng.random()
            for cost in (kept, fresh):
                r = random.Random(hash((seed, ev)))
                if ev < 0.6:
                    rows = r.choice((rows_max, max(1, rows_max // 2), r.randint(1, rows_max)))
                    positions = rows * r.choice((1, 2, 5, r.randint(1, 6)))
                    context = r.choice((None, r.uniform(0, 400)))
                    kind = r.random()
                    seconds = 0.02 + 0.001 * positions + 0.004 * rows + r.uniform(0, 0.01)
                    cost.observe_verify(rows, positions, seconds + 2e-5 * rows * (context or 0.0),
                                        prefill=kind < 0.05, calibration=0.05 <= kind < 0.1 and rows == 1,
                                        context=context)
                elif ev < 0.8:
                    cost.observe_draft(r.randint(1, rows_max), r.uniform(0.003, 0.03))
                elif ev < 0.85:
                    cost.observe_catchup(r.randint(1, 50), r.uniform(0, 0.5))
                else:
                    cost.set_context(r.uniform(0, 500))
            got, want = _prices(kept, rows_max, 256), _prices(fresh, rows_max, 256)
            assert got == want, seed
            checked += len(got)
        assert kept.version == fresh.version
        refits += kept.context_row_s > 0
    assert refits >= 10  # context refits re-expressed the points in most runs
    assert checked > 100_000


def test_a_catch_up_priced_beside_a_verify_forward_of_zero_seconds_does_not_divide_by_zero():
    """A forward measured at 0 s (or clamped there by a context refit): the catch-up of a tenant
    behind by 9 tokens is priced with the priors' draft/verify ratio, not a ZeroDivisionError in
    the decision (session 28's review)."""
    from specdec.control.batch_k import BatchKController

    ctl = BatchKController(64)
    ctl.observe_tick(1, 1, 0.0)
    d = ctl.decide({("a", "draft"): 1}, behind={"a": 9})
    assert set(d.ks) == {"a"}  # decided (a 0-s verify makes speculation look free: any K)
    cost = BatchCostModel()
    cost.observe_verify(1, 1, 0.0)
    cost.observe_verify(1, 2, 0.02)
    # the curve's price of 5 positions (extrapolated from 0 and 0.02 s) times the priors' ratio
    assert cost.catchup_s(5) == cost.verify.verify_s(5) * cost._prior_ratio > 0
