"""The batch cost model prices a verify forward at the batch's context: a forward's seconds grow
with the tokens its rows hold in the target's KV cache, so a shape last measured over long
contexts is not priced there at the start of the next, short-context group
(:class:`specdec.control.batch_cost.BatchCostModel`, "Context"). Synthetic forwards with a known
cost; the scheduler's and the served replica's feed on tiny models and fakes."""

from __future__ import annotations

import pytest

from specdec.control.batch_cost import CONTEXT_MIN_SD, CONTEXT_QUERY_SHARE, RECENT_FORWARDS
from specdec.control.batch_k import BatchCostModel, BatchKController, BatchKSessions
from specdec.engine.batch import BatchScheduler
from specdec.engine.engine import SpeculativeEngine
from specdec.request import GenerationRequest
from specdec.types import BatchShape

#: seconds a cached token adds per row and per query position (in process, w8a8 pair, 2-core
#: Zen 4: ~8e-6 and ~4e-6, docs/bench/batching/context-s26/)
ROW_S, QUERY_S = 8e-6, 4e-6
#: 8 rows: a verify forward of p positions at context 0 (s)
BASE = {8: 0.114, 16: 0.160, 24: 0.200, 40: 0.330}


def _true(p: int, context: float) -> float:
    return BASE[p] + (ROW_S * 8 + QUERY_S * p) * context


def _seconds(p: int, context: float, i: int = 0) -> float:
    """The synthetic forward's seconds (8 rows), with a deterministic +-2 % wobble."""
    return _true(p, context) * (1 + 0.02 * ((i * 7) % 5 - 2) / 2)


def _two_groups(cost: BatchCostModel, *, context: bool = True) -> None:
    """A group of 8 sessions at K = 4 over contexts 40-120, then one at K = 0 over 40-168 (128 tokens)."""
    for i in range(20):
        c = 40 + 4 * i
        cost.observe_verify(8, 40, _seconds(40, c, i), context=c if context else None)
    for i in range(128):
        c = 40 + i
        cost.observe_verify(8, 8, _seconds(8, c, i), context=c if context else None)


def test_a_shape_measured_over_long_contexts_is_priced_at_the_next_groups_short_ones():
    """Session 25's quiet run: after a 128-token group at K = 0 the 8 x 1 forward was priced at its
    long contexts' cost where the next group's short contexts run it ~10 % cheaper, and K = 4 came
    out ahead. With the contexts both rates are found (the two shapes differ in positions per
    row) and both shapes are priced at the batch's context."""
    blind, aware = BatchCostModel(), BatchCostModel()
    _two_groups(blind, context=False)
    _two_groups(aware)
    # +-2 % of the 40-position forward's 0.33 s is 2-3x what 80 tokens of context add to it
    assert aware.context_row_s == pytest.approx(ROW_S, rel=0.2)
    assert aware.context_query_s == pytest.approx(QUERY_S, rel=0.4)
    assert blind.context_row_s == blind.context_query_s == 0.0
    aware.set_context(40)
    assert aware.verify_s(8, 8) == pytest.approx(_true(8, 40), rel=0.01)  # 0.1178 s
    assert aware.verify_s(8, 40) == pytest.approx(_true(40, 40), rel=0.01)  # 0.3390 s
    # context-blind: the median of the last 9 forwards, at contexts 160-168
    assert blind.verify_s(8, 8) == pytest.approx(_true(8, 164), rel=0.01)  # 0.1297 s
    aware.set_context(250)
    assert aware.verify_s(8, 8) == pytest.approx(_true(8, 250), rel=0.01)
    assert aware.verify_s(8, 40) == pytest.approx(_true(40, 250), rel=0.02)
    snap = aware.snapshot()
    assert snap["context"] == 250 and snap["context_row_s"] == aware.context_row_s


def test_one_shape_alone_fits_one_rate_split_by_the_query_share():
    """Forwards of one shape cannot tell a row's cost from a query position's: one rate over
    rows + CONTEXT_QUERY_SHARE x positions (0.5: what the Zen 4 measured, so exact here)."""
    cost = BatchCostModel()
    for i in range(64):
        cost.observe_verify(8, 8, _seconds(8, 40 + 2 * i, i), context=40 + 2 * i)
    assert CONTEXT_QUERY_SHARE == 0.5
    assert cost.context_row_s == pytest.approx(ROW_S, rel=0.05)
    assert cost.context_query_s == pytest.approx(QUERY_S, rel=0.05)


def test_one_preempted_forward_does_not_bend_the_rates():
    """A forward 5x its cost (another process ran) in the fitted window: the robust refit leaves it
    out. Fitted with it, the rate would be 1.12x the true one (the test's 5 % bound would fail)."""
    cost = BatchCostModel()
    for i in range(64):
        c = 40 + 2 * i
        cost.observe_verify(8, 8, 5 * _seconds(8, c) if i == 40 else _seconds(8, c), context=c)
    assert cost.context_row_s == pytest.approx(ROW_S, rel=0.05)
    pts = [(40 + 2 * i, 5 * _seconds(8, 40 + 2 * i) if i == 40 else _seconds(8, 40 + 2 * i)) for i in range(16, 64)]
    mc, mt = sum(c for c, _ in pts) / len(pts), sum(t for _, t in pts) / len(pts)
    plain = sum((c - mc) * (t - mt) for c, t in pts) / sum((c - mc) ** 2 for c, _ in pts)  # per cached token, 8 rows
    assert plain / (8 * ROW_S + 8 * QUERY_S) == pytest.approx(1.12, abs=0.01)


def test_one_client_is_priced_on_the_curve_at_its_context():
    """One row (a lone client, served or in process) is priced from the curve's points, not from a
    shape's window: they are kept at context 0 and shifted on every refit. A client at K = 1 and
    K = 4 over contexts 40-295: K = 4's 5-position forward and the plain 1-position one, at a short
    and at a long context, and the optimistic prices of a probe, all at the context's cost."""

    def one(p, c):
        return 0.045 + 0.004 * p + (ROW_S + QUERY_S * p) * c

    cost = BatchCostModel()
    for i in range(0, 256, 2):
        cost.observe_verify(1, 2, one(2, 40 + i), context=40 + i)
        cost.observe_verify(1, 5, one(5, 41 + i), context=41 + i)
        if i % 32 == 0:
            cost.observe_verify(1, 1, one(1, 40 + i), context=40 + i)
    assert cost.context_row_s == pytest.approx(ROW_S, rel=0.02)
    assert cost.context_query_s == pytest.approx(QUERY_S, rel=0.02)
    for c in (40, 300):
        cost.set_context(c)
        assert cost.verify_s(1, 5) == pytest.approx(one(5, c), rel=0.02)
        assert cost.verify_s(1, 2) == pytest.approx(one(2, c), rel=0.02)
        assert cost.measured_verify_s(1) == pytest.approx(one(1, c), rel=0.03)
        assert cost.optimistic().step_s([4], [False]) == pytest.approx(one(5, c), rel=0.02)


def test_contexts_within_a_narrow_range_leave_the_prices_context_blind():
    """Forwards whose contexts spread less than CONTEXT_MIN_SD tokens (a sd of ~9 here) fit no rates:
    every price is the context-blind model's."""
    blind, aware = BatchCostModel(), BatchCostModel()
    for i in range(40):
        c = 100 + i % 32
        for cost, ctx in ((blind, None), (aware, c)):
            cost.observe_verify(8, 8, _seconds(8, c, i), context=ctx)
            cost.observe_verify(8, 16, _seconds(16, c, i), context=ctx)
    assert (sum((i % 32 - 15.5) ** 2 for i in range(32)) / 32) ** 0.5 < CONTEXT_MIN_SD
    assert aware.context_row_s == aware.context_query_s == 0.0
    aware.set_context(500)
    for p in (8, 16, 24, 40):
        assert aware.verify_s(8, p) == blind.verify_s(8, p)


def test_a_refit_keeps_a_window_priced_at_its_own_context_as_measured():
    """A shape measured at one context is priced there at what it measured, whatever rates were
    fitted before or after its forwards (windows are kept raw and re-expressed on each refit)."""
    cost = BatchCostModel()
    for i in range(RECENT_FORWARDS):
        cost.observe_verify(8, 24, 0.25, context=300)  # before any slope
    _two_groups(cost)
    assert cost.context_row_s > 0 and cost.context_query_s > 0
    cost.set_context(300)
    assert cost.verify_s(8, 24) == pytest.approx(0.25, abs=1e-9)


def test_bad_contexts_are_refused():
    cost = BatchCostModel()
    with pytest.raises(ValueError, match="context must be finite and >= 0, got -1"):
        cost.set_context(-1)
    with pytest.raises(ValueError, match="context must be finite and >= 0, got inf"):
        cost.observe_verify(8, 8, 0.1, context=float("inf"))


def test_the_scheduler_reports_each_forwards_mean_cached_tokens_and_prices_at_its_rows(tiny_target, tiny_draft_close):
    """Two sessions of 10- and 30-token prompts at K = 0: the first forward prefills both (0
    cached), the next feeds one position each over 10 + 30 cached tokens, then one more each; the
    decisions price at what the decode forwards attend to, the prompts before they are prefilled."""
    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    ctl = BatchKController(budget=64)
    priced_at = []
    decide = ctl.decide
    ctl.decide = lambda *a, **kw: (priced_at.append(kw.get("context")), decide(*a, **kw))[1]
    sched = BatchScheduler(engine, max_batch_positions=64, controller=ctl)
    for n in (10, 30):
        sched.submit(GenerationRequest(prompt_token_ids=list(range(3, 3 + n)), max_tokens=4, ignore_eos=True,
                                       speculation={"proposer": "draft", "k": 0}), tenant="code", adaptive=True)
    sched.run_until_idle()
    assert [(t.positions_fed, t.context) for t in sched.trace] == [(40, 0.0), (2, 20.0), (2, 21.0), (2, 22.0)]
    # each decision prices at the rows' committed tokens less the last one (fed with the next block):
    # before the prefill, the prompts the decode forwards will attend to, (9 + 29) / 2
    assert priced_at == [19.0, 20.0, 21.0, 22.0] and ctl.cost.context == 22.0


def test_the_served_sessions_price_at_their_mean_context_and_feed_the_targets():
    """Served, each session's KV cache holds its prompt (a resumed one's history) plus its steps'
    tokens, less the last one; the forward's context comes from the target (BatchShape.context)."""
    live = BatchKSessions(BatchKController(budget=64))
    live.join("a", "code", "draft", k_range=(0, 4), prompt_tokens=10, max_tokens=32)
    live.join("b", "code", "draft", k_range=(0, 4), prompt_tokens=0, context_tokens=30, max_tokens=32)
    live.k_for("code", 4)
    assert live.controller.cost.context == 19.0  # (9 + 29) / 2: the last token is fed with the next block
    live.observe_step("a", 2, 2, BatchShape(1, 2, 6, 0.1, 20.0))
    live.k_for("code", 4)
    assert live.controller.cost.context == 20.5  # (12 + 29) / 2
    assert list(live.controller.cost._context_samples) == [(2, 6)]
    with pytest.raises(ValueError, match="context_tokens >= 0"):
        live.join("c", "code", "draft", context_tokens=-1)


def test_a_forward_below_zero_at_context_0_is_kept_not_refused():
    """Rates fitted on slow forwards, then a fast one at a long context: at context 0 it is below 0
    s. It must not raise (served, the draft replica's step failed: HTTP 500 on a 200-token prompt of
    the tiny test model); the curve keeps 0 and the price at its context is what it measured."""
    cost = BatchCostModel()
    _two_groups(cost)
    assert cost.context_row_s > 0
    cost.observe_verify(8, 16, 0.001, context=2000.0)
    assert cost.verify._verify[16].value == 0.0
    for c in (2000.0, 40.0):  # its window's median is below 0 at context 0: no price is
        cost.set_context(c)
        assert cost.verify_s(8, 16) >= 0.0
