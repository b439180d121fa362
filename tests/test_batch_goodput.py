"""K under load against measurement: the batch cost model on int4-like and flat verify costs, and
the goodput guard that forces K = 0 when speculating measures slower than plain decoding."""

from __future__ import annotations

import pytest

from specdec.control.batch_k import BatchCostModel, BatchKController, BatchKSessions, GoodputGuard
from specdec.control.objective import expected_tokens_per_step
from specdec.types import BatchShape


def _controller(verify, draft) -> BatchKController:
    """A controller that measured batched forwards of 8 rows at 8..400 positions (K = 0, 1, 2, 4
    and a prompt prefill) and batched draft forwards of 4 and 8 rows; code accepted 4 of 4 drafts
    on 30 steps, creative 1 of 4."""
    c = BatchKController(budget=128)
    for rows, positions in [(8, 8), (8, 16), (8, 24), (8, 40), (8, 400)]:
        c.observe_tick(rows, positions, verify(positions), [(r, draft(r)) for r in (4, 8)])
    for _ in range(30):
        c.observe_row("code", "draft", 4, 4)
        c.observe_row("creative", "draft", 4, 1)
    return c


def test_int4_like_linear_verify_cost_picks_k0_under_load():
    """int4 on the 2-core CPU: a batched verify costs about 75 ms per position (3.2 s for 8 rows x
    5 positions, docs/bench/batching/int4), the draft 26 ms per row: at 8 rows K = 0 is the best
    batch, whatever the tenants' acceptance."""
    c = _controller(lambda p: 0.05 + 0.075 * p, lambda r: 0.08 + 0.026 * r)
    d = c.decide({("code", "draft"): 4, ("creative", "draft"): 4})
    assert d.ks == {"code": 0, "creative": 0}
    assert d.step_s == pytest.approx(0.05 + 0.075 * 8)  # one verify of 8 positions, no draft
    assert d.tokens_per_s == pytest.approx(8 / 0.65)
    # K = 1 for both, what the model predicts: 8 rows drafting once, 16 positions verified
    a_code, a_cre = c.estimator.alpha(("code", "draft")), c.estimator.alpha(("creative", "draft"))
    k1 = 4 * (expected_tokens_per_step(a_code, 1) + expected_tokens_per_step(a_cre, 1)) / (
        (0.08 + 0.026 * 8) + (0.05 + 0.075 * 16))
    assert k1 < d.tokens_per_s


def test_flat_verify_cost_and_high_acceptance_pick_k_above_0():
    """bfloat16 / GPU-like: a batched verify costs about the same for 8 or 400 positions: the code
    tenant speculates at its K maximum, the creative tenant less."""
    c = _controller(lambda p: 0.30 + 0.001 * p, lambda r: 0.03 + 0.001 * r)
    d = c.decide({("code", "draft"): 4, ("creative", "draft"): 4})
    assert d.ks == {"code": 8, "creative": 3}
    # 3 draft forwards of 8 rows, 5 of 4 rows; 4 x 9 + 4 x 4 = 52 positions interpolated 40..400
    assert d.step_s == pytest.approx(3 * 0.038 + 5 * 0.034 + 0.34 + (0.70 - 0.34) * 12 / 360)
    assert d.positions == 52 and d.rows == 8


class _CurveWithPrefills(BatchCostModel):
    """The batch cost model before prefill forwards were kept off its verify curve (and before a
    thin count below every well-measured count kept its own price: capped on the line, floored on
    the line through the origin from the least well-measured count)."""

    def observe_verify(self, rows: int, positions: int, seconds: float, *, prefill: bool = False,
                       context: float | None = None) -> None:
        super().observe_verify(rows, positions, seconds)  # context-blind, as it was

    def _least_well_measured(self) -> float:
        return float("-inf")

    def _well_measured_floor(self, positions: int) -> float:
        pts = [(p, t) for p, t, _ in self._well_measured()]
        below = [t for p, t in pts if p <= positions]
        if below or not pts:
            return max(below, default=0.0)
        p_lo, t_lo = min(pts)
        return t_lo * positions / p_lo


def _simulate(extrapolation: str, verify, draft, prefill: list[BatchShape], rounds: int = 30):
    """Served K under load without the guard: 4 code sessions (accept every draft) and 4
    creative ones (accept 1 per step) step once per round on one draft replica. Round 0 is
    every session's first step, verified by the prompts' prefill forwards ``prefill`` (4
    sessions each); after it every round is one batched verify of 8 rows costing
    ``verify(positions)`` s and the batched draft forwards ``draft(rows)`` s of the drafting
    sessions (measured 4- and 8-row draft forwards known beforehand). Returns the (code,
    creative) K per round and the tokens/s of rounds 1.. under those true costs. ``"trend"`` is
    the controller before proportional extrapolation, which also decided on the priors before a
    decode forward was measured (``measure_first=False``) and put prefill forwards on the verify
    curve (``observe_verify(..., prefill=False)``)."""
    cost = (_CurveWithPrefills if extrapolation == "trend" else BatchCostModel)(
        max_positions=512, verify_extrapolation=extrapolation)
    c = BatchKController(budget=128, cost=cost, measure_first=extrapolation != "trend")
    for r in (4, 8):
        c.observe_tick(0, 0, 0.0, [(r, draft(r))])
    live = BatchKSessions(c)
    keys = [("code", i) for i in range(4)] + [("creative", i) for i in range(4)]
    for key in keys:
        live.join(key, key[0], "draft", k_range=(0, 8))
    sched = {key: live.schedule(key[0], 8) for key in keys}
    ks_seen, tokens, seconds = [], 0, 0.0
    for rnd in range(rounds):
        ks = [sched[key]() for key in keys]
        if rnd == 0:
            shapes, drafts = [prefill[0]] * 4 + [prefill[1]] * 4, []
        else:
            p = sum(k + 1 for k in ks)
            shapes = [BatchShape(rnd + 2, 8, p, verify(p))] * 8
            drafts = [(n, draft(n)) for n in (sum(1 for k in ks if k > j) for j in range(max(ks)))]
            seconds += shapes[0].seconds + sum(s for _, s in drafts)
        for i, (key, k) in enumerate(zip(keys, ks)):
            accepted = k if key[0] == "code" else min(k, 1)
            tokens += accepted + 1 if rnd else 0
            live.observe_step(key, k, accepted, shapes[i], drafts if i == 0 else ())
        ks_seen.append((ks[0], ks[-1]))
    return ks_seen, tokens / seconds, c


#: the first forwards the served int4 run measured: prompts' prefill chunks, 57 positions
#: (1 row) in 5.52 s and 64 positions (5 rows) in 3.11 s (docs/bench/batching/int4/served-tenants-guard.md)
SERVED_PREFILLS = [BatchShape(1, 1, 57, 5.52), BatchShape(2, 5, 64, 3.11)]


def test_batch_cost_model_below_prefill_forwards_is_proportional_not_flat():
    """Only the two prefill forwards measured: the old extrapolation (least-squares slope, here
    negative, clamped at 0) predicted a decode forward of 8 positions (K = 0 for 8 rows) and
    one of 40 (K = 4) both at 5.52 s, and 72 (K = 8) at 3.11 s; the new one goes through the
    origin below (5.52 · p / 57) and from the dearest measured forward above."""
    old, new = BatchCostModel(verify_extrapolation="trend"), BatchCostModel()
    for m in (old, new):
        for s in SERVED_PREFILLS:
            m.observe_verify(s.rows, s.positions, s.seconds)
    assert [old.verify_s(8, p) for p in (8, 16, 40, 72)] == pytest.approx([5.52, 5.52, 5.52, 3.11])
    assert [new.verify_s(8, p) for p in (8, 16, 40, 72)] == pytest.approx(
        [5.52 * 8 / 57, 5.52 * 16 / 57, 5.52 * 40 / 57, 5.52])
    assert new.verify_s(5, 64) == pytest.approx(3.11) and new.verify_s(1, 60) == pytest.approx(5.52 - 2.41 * 3 / 7)
    with pytest.raises(ValueError, match="extrapolation"):
        BatchCostModel(verify_extrapolation="flat")


def test_int4_like_costs_from_prefill_forwards_choose_k0_without_the_guard():
    """int4-like true costs (verify 0.05 + 0.075 s per position, draft 0.08 + 0.026 s per row),
    the served run's two prefill forwards first, no goodput guard: the old model (prefill
    forwards on its verify curve, extrapolated on the trend) speculates from round 1 on (K = 8
    for code, 6 for creative from round 2: the 64-position forward it keeps running is predicted
    at the prefill's 3.11 s, the K = 0 forward at 5.52 s, and never measured) at 6.3 tok/s; the
    new one keeps the prefills off its verify curve, holds K = 0 until a decode forward is
    measured (round 1), tries K = 1 once (round 2, one step per session: no acceptance evidence
    yet, so the decision's optimistic acceptance, the upper confidence bound 0.79, is what K = 1
    needs; before that optimism a probe of each tenant ran the same round) and then holds
    K = 0: 0.99x the best batch under the true costs (8 tokens per 0.65 s)."""
    def verify(p):
        return 0.05 + 0.075 * p

    def draft(r):
        return 0.08 + 0.026 * r

    ks_old, tps_old, _ = _simulate("trend", verify, draft, SERVED_PREFILLS)
    ks_new, tps_new, c = _simulate("monotone", verify, draft, SERVED_PREFILLS)
    assert ks_old[1:3] == [(7, 7), (8, 6)] and ks_old[3:] == [(8, 6)] * 27
    assert tps_old == pytest.approx(6.32, abs=0.01)
    assert ks_new == [(0, 0), (0, 0), (1, 1)] + [(0, 0)] * 27 and c.probes == 0 and c.probe_step_count == 0
    assert round(tps_new / (8 / verify(8)), 3) == 0.988
    # the true best: no (code K, creative K) beats K = 0 for both
    for kc in range(0, 9):
        for kr in range(0, 9):
            p = 4 * (kc + 1) + 4 * (kr + 1)
            t = verify(p) + sum(draft(4 * (kc > j) + 4 * (kr > j)) for j in range(max(kc, kr)))
            assert 4 * (kc + 1) + 4 * (min(kr, 1) + 1) <= 8 / verify(8) * t + 1e-9


def test_flat_costs_from_a_prefill_forward_speculate_after_one_k0_round():
    """GPU-like flat true costs (verify 0.30 + 0.001 s per position): after prefill forwards of
    400 and 380 positions (off the verify curve) round 1 runs at K = 0 and measures an
    8-position forward; from round 2 on the controller speculates (no probe needed) and
    settles where the old model settled: code at K = 8, creative at K = 3 (K = 2 before the
    decisions priced a tenant at the upper confidence bound of its acceptance, about 0.5 + one
    sd of its evidence for creative, which puts K = 3 a hair above K = 2 on the flat curve;
    under the true costs the two differ by about 1 % of the batch's tokens/s)."""
    prefills = [BatchShape(1, 1, 400, 0.70), BatchShape(2, 2, 380, 0.68)]
    ks_old, _, _ = _simulate("trend", lambda p: 0.30 + 0.001 * p, lambda r: 0.03 + 0.001 * r, prefills)
    ks_new, _, c = _simulate("monotone", lambda p: 0.30 + 0.001 * p, lambda r: 0.03 + 0.001 * r, prefills)
    assert ks_new[:4] == [(0, 0), (0, 0), (2, 2), (8, 4)] and c.probes == 0
    assert ks_new[-8:] == ks_old[-8:] == [(8, 3)] * 8


def _run(guard: GoodputGuard, spec_rate: float, plain_rate: float, steps: int,
         plain_bound: float | None = None) -> str:
    """Drive ``guard``: each step is plain (1 token per ``1 / plain_rate`` s) while it forces K = 0,
    spec (2 tokens per ``2 / spec_rate`` s) otherwise; returns 'P'/'s' per step: whether K = 0 is
    forced after recording it (the spec step that starts an exploration or a veto shows 'P').
    ``plain_bound``: passed with every step (the most plain decoding could reach)."""
    out = []
    for _ in range(steps):
        if guard.forced:
            guard.record("plain", 1, 1.0 / plain_rate, plain_bound=plain_bound)
        else:
            guard.record("spec", 2, 2.0 / spec_rate, plain_bound=plain_bound)
        out.append("P" if guard.forced else "s")
    return "".join(out)


#: the guard's first exploration after its first ``min_steps`` spec steps (as the served guard
#: did before ``first_explore``): the tests of its veto and back-off mechanics start from it
EARLY = 12


def test_goodput_guard_vetoes_speculation_that_measures_slower():
    """Speculation measures 2/3 of plain decoding's tokens per second: after 12 spec steps K = 0
    is explored for 12 steps, then vetoed for 96 steps; the recheck's 12 spec steps lose again,
    so the next hold is twice as long (192)."""
    g = GoodputGuard(first_explore=EARLY)
    seq = _run(g, spec_rate=2 / 3, plain_rate=1.0, steps=300)
    assert seq == "s" * 11 + "P" * 12 + "s" + "P" * 96 + "s" * 12 + "P" * 168
    assert g.vetoes == 2 and g.explorations == 1 and g.forced
    assert g.snapshot() == {"goodput_spec": pytest.approx(2 / 3), "goodput_plain": pytest.approx(1.0),
                            "steps_spec": 12, "steps_plain": 12 + 96 + 167, "forced": "veto",
                            "forced_left": 192 - 167, "vetoes": 2, "explorations": 1, "skipped": 0,
                            "resized": 0, "explore_spacing": 64}


def test_goodput_guard_keeps_speculation_that_measures_faster():
    """Speculation measures 1.5x plain decoding: K = 0 is explored for 12 steps after the first
    12 spec steps, then after 64 spec steps, and each exploration that confirms speculation
    doubles the spacing up to 8 x 64: 5 explorations in 1200 steps (60 steps at K = 0), where a
    fixed spacing (``explore_backoff=1``, the guard before) explored 16 times (192 steps)."""
    g = GoodputGuard(first_explore=EARLY)
    seq = _run(g, spec_rate=1.5, plain_rate=1.0, steps=1200)
    spaced = "".join("s" * n + "P" * 12 for n in (64, 128, 256, 512))
    assert seq == "s" * 11 + "P" * 12 + spaced + "s" * 169
    assert g.vetoes == 0 and g.explorations == 5 and g.snapshot()["explore_spacing"] == 512
    fixed = GoodputGuard(explore_backoff=1, first_explore=EARLY)
    seq = _run(fixed, spec_rate=1.5, plain_rate=1.0, steps=1200)
    assert seq == "s" * 11 + "P" * 12 + ("s" * 64 + "P" * 12) * 15 + "s" * 37 and fixed.explorations == 16
    with pytest.raises(ValueError, match="regime"):
        g.record("fast", 1, 1.0)
    with pytest.raises(ValueError, match="tokens >= 1"):
        g.record("spec", 0, 1.0)
    with pytest.raises(ValueError, match="explore_every >= min_steps"):
        GoodputGuard(min_steps=10, explore_every=5)
    with pytest.raises(ValueError, match="explore_backoff >= 1"):
        GoodputGuard(explore_backoff=0)


def test_goodput_guard_first_exploration_waits_for_64_spec_steps():
    """The served guard (defaults) explores K = 0 first after 64 spec steps, not after its first
    12: a fresh server's first request (one client, 128 tokens, about 30 steps at K = 4) ran a
    third of its steps at K = 0 for an exploration no comparison had asked for yet. Speculation
    that measures slower is still vetoed: after 64 + 12 steps. Speculation that pays: the
    next exploration 64 spec steps later, then the spacing doubles as before (128, ...)."""
    g = GoodputGuard()
    assert g.first_explore == 64
    assert _run(g, spec_rate=2 / 3, plain_rate=1.0, steps=200) == "s" * 63 + "P" * 12 + "s" + "P" * 96 + "s" * 12 + "P" * 16
    assert g.vetoes == 2 and g.explorations == 1
    g = GoodputGuard()
    assert _run(g, spec_rate=1.5, plain_rate=1.0, steps=500) == (
        "s" * 63 + "P" * 12 + "s" * 64 + "P" * 12 + "s" * 128 + "P" * 12 + "s" * 209)
    assert g.explorations == 3 and g.vetoes == 0
    early = GoodputGuard(first_explore=12)
    assert _run(early, spec_rate=1.5, plain_rate=1.0, steps=40) == "s" * 11 + "P" * 12 + "s" * 17
    with pytest.raises(ValueError, match="first_explore >= min_steps"):
        GoodputGuard(first_explore=4)


def test_goodput_guard_compares_regimes_at_the_same_batch_size():
    """Plain steps measured at 8 sessions (the batch's 8 tokens per 0.3 s step, 26.7 tokens/s)
    are no yardstick for a lone client's speculation (3 tokens per 0.34 s, 8.8 tokens/s, where
    its plain decoding gives 1 per 0.15 s): the first step at one session drops them (a batch
    1.5x smaller or larger is another comparison), so no veto; plain decoding is measured afresh
    by an exploration that waits 64 spec steps, as a fresh guard's first. Before: vetoed after 12
    spec steps (served: the lone client held at K = 0 for the rest of its request)."""
    def drive(g, regime, n, steps, sessions):
        for _ in range(steps):
            if regime == "plain":
                g.record("plain", 1 * n, 0.3 if n > 1 else 0.15, sessions=n)
            else:
                g.record("spec", 3 * n, 0.34, sessions=n)

    g = GoodputGuard()
    drive(g, "spec", 1, 12, 1)  # a lone client speculated first (its spec measured at 1 session)
    g._forced_left, g._forced_why = 0, None
    drive(g, "plain", 8, 40, 8)  # then 8 clients at K = 0
    assert g.mean_sessions("plain") == pytest.approx(8.0) and g.steps("plain") == 40
    assert g.steps("spec") == 0 and g.resized == 1  # spec measured at 1 session dropped by the batch of 8
    seq = []
    for _ in range(80):  # one client again, speculating
        if g.forced:
            g.record("plain", 1, 0.15, sessions=1)
        else:
            g.record("spec", 3, 0.34, sessions=1)
        seq.append("P" if g.forced else "s")
    assert g.vetoes == 0 and g.resized == 2 and g.explorations == 1
    assert "".join(seq) == "s" * 63 + "P" * 12 + "s" * 5  # the exploration at one session, then spec stands
    assert g.goodput("plain") == pytest.approx(1 / 0.15) and g.goodput("spec") == pytest.approx(3 / 0.34)
    assert g.mean_sessions("plain") == pytest.approx(1.0)

    # without sessions (the guard before): the 8-session plain steps veto the lone client's speculation
    old = GoodputGuard()
    for _ in range(40):
        old.record("plain", 8, 0.3)
    for _ in range(12):
        old.record("spec", 3, 0.34)
    assert old.vetoes == 1 and old.forced

    # a veto's hold ends when the batch size changes: it was a verdict on another batch
    v = GoodputGuard(first_explore=12)
    assert _run(v, spec_rate=2 / 3, plain_rate=1.0, steps=30)[-1] == "P" and v.vetoes == 1
    v2 = GoodputGuard(first_explore=12)
    for _ in range(30):
        if v2.forced:
            v2.record("plain", 2, 1.0, sessions=2)
        else:
            v2.record("spec", 2 * 2, 3.0, sessions=2)
    assert v2.vetoes == 1 and v2.forced
    v2.record("plain", 1, 1.0, sessions=1)  # 2 -> 1 sessions: both regimes dropped, the hold ends
    assert not v2.forced and v2.steps("plain") == 1 and v2.steps("spec") == 0 and v2.resized == 1
    with pytest.raises(ValueError, match="sessions must be >= 1"):
        v2.record("spec", 1, 1.0, sessions=0)
    with pytest.raises(ValueError, match="resize_ratio must be > 1"):
        GoodputGuard(resize_ratio=1.0)
    assert GoodputGuard(resize_ratio=3.0).fresh().resize_ratio == 3.0


def test_goodput_guard_skips_explorations_that_plain_decoding_cannot_win():
    """With ``plain_bound`` (the most tokens/s plain decoding could reach by the target's measured
    forwards) below speculation's measured goodput, no exploration runs: speculation at 1.5x
    with plain bounded at 1.2 runs all 500 steps at K > 0 (the first exploration, due after 64
    spec steps, is skipped, and again every 64). Without the bound, or with a bound it does
    not beat (1.6, or unknown), the same explorations as before: 36 steps at K = 0. Speculation
    slower than plain (2/3) never beats a bound above it: explored and vetoed as before."""
    g = GoodputGuard()
    assert _run(g, spec_rate=1.5, plain_rate=1.0, steps=500, plain_bound=1.2) == "s" * 500
    assert g.explorations == 0 and g.skipped == 7 and g.vetoes == 0
    before = "s" * 63 + "P" * 12 + "s" * 64 + "P" * 12 + "s" * 128 + "P" * 12 + "s" * 209
    for bound in (None, 1.6):
        g = GoodputGuard()
        assert _run(g, spec_rate=1.5, plain_rate=1.0, steps=500, plain_bound=bound) == before
        assert g.explorations == 3 and g.skipped == 0
    g = GoodputGuard()
    assert _run(g, spec_rate=2 / 3, plain_rate=1.0, steps=200, plain_bound=1.0) == (
        "s" * 63 + "P" * 12 + "s" + "P" * 96 + "s" * 12 + "P" * 16)
    assert g.vetoes == 2 and g.skipped == 0


def test_goodput_guard_backed_off_still_vetoes_speculation_turning_slower_at_once():
    """Speculation pays 1.5x for 500 steps (explorations spaced 64, 128, 256), then measures half
    plain decoding's speed: every spec step is compared with the last exploration's plain, so
    the 15th slow spec step vetoes (its decayed goodput below plain's; the 11th without the
    outlier clip, which counts each slow step at no more than twice the mean step until the mean
    has risen), and the veto sets the exploration spacing back to 64."""
    g = GoodputGuard(first_explore=EARLY)
    before = _run(g, spec_rate=1.5, plain_rate=1.0, steps=500)
    assert before == "s" * 11 + "P" * 12 + "".join("s" * n + "P" * 12 for n in (64, 128)) + "s" * 256 + "P" * 5
    assert g.snapshot()["explore_spacing"] == 256  # doubled once the exploration in progress confirms
    after = _run(g, spec_rate=0.5, plain_rate=1.0, steps=120)
    assert after == "P" * 7 + "s" * 14 + "P" * 96 + "s" * 3
    assert g.vetoes == 1 and g.explorations == 4 and g.snapshot()["explore_spacing"] == 64


def _one_slow_step(guard: GoodputGuard, slow_at: int, factor: float, steps: int = 200) -> str:
    """Like :func:`_run` at spec 1.3x plain, but spec step ``slow_at`` (counted from 1) takes
    ``factor`` times as long (another process's burst on the shared CPU)."""
    out, n = [], 0
    for _ in range(steps):
        if guard.forced:
            guard.record("plain", 1, 1.0)
        else:
            n += 1
            guard.record("spec", 2, 2 / 1.3 * (factor if n == slow_at else 1.0))
        out.append("P" if guard.forced else "s")
    return "".join(out)


def test_goodput_guard_one_contended_step_does_not_veto():
    """Speculation pays 1.3x; its 14th step (3 after the first exploration) takes 5x as long.
    Counted in full it drags speculation's goodput below plain's: a veto, 96 steps at K = 0.
    Clipped at twice the mean spec step: no veto, explorations as without the slow step."""
    clipped, full = GoodputGuard(first_explore=EARLY), GoodputGuard(outlier_clip=float("inf"), first_explore=EARLY)
    assert _one_slow_step(clipped, 14, 5.0) == "s" * 11 + "P" * 12 + "s" * 64 + "P" * 12 + "s" * 101
    assert clipped.vetoes == 0
    assert _one_slow_step(full, 14, 5.0) == "s" * 11 + "P" * 12 + "s" * 2 + "P" * 96 + "s" * 62 + "P" * 12 + "s" * 5
    assert full.vetoes == 1
    with pytest.raises(ValueError, match="outlier_clip >= 1"):
        GoodputGuard(outlier_clip=0.5)


def test_batch_k_sessions_guard_overrules_the_model_when_measured_slower():
    """Served: the model (flat verify costs) has both tenants speculate, but the steps' wall times
    say K > 0 is slower (1.0 s per 2-token K = 4 step against 0.25 s per K = 0 step): the guard
    explores K = 0, then forces it (every adaptive step's K is 0), and the first step of a
    generation (its prefill) is not measured."""
    c = _controller(lambda p: 0.30 + 0.001 * p, lambda r: 0.03 + 0.001 * r)
    live = BatchKSessions(c, guard=GoodputGuard(min_steps=4, explore_every=8, hold=20, first_explore=4))
    for i in range(4):
        live.join(("code", i), "code", "draft", k_range=(0, 4))
    sched = {i: live.schedule("code", 4) for i in range(4)}
    ks = []
    for rnd in range(12):
        for i in range(4):
            k = sched[i]()
            ks.append(k)
            live.observe_step(("code", i), k, 1 if k else 0, None, draft_s=0.5 if k else 0.0,
                              verify_s=0.5 if k else 0.25)
    # round 0: each generation's first step (prefill), not measured; round 1: 4 spec steps, then
    # K = 0 explored for 4 steps (round 2); the next spec step compares 2 tokens / 1 s against
    # 1 token / 0.25 s and vetoes: K = 0 forced for 20 steps
    assert ks[:8] == [4] * 8
    assert ks[8:12] == [0] * 4 and ks[12] == 4
    assert ks[13:33] == [0] * 20
    guard = live.guards["code"]
    g = guard.snapshot()
    assert guard.vetoes >= 1 and guard.explorations == 1
    assert g["goodput_plain"] == pytest.approx(4 * 1 / 0.25)  # 4 sessions x 1 token per 0.25 s
    assert g["goodput_spec"] == pytest.approx(4 * 2 / 1.0)
    assert live.stats()["guards"] == {"code": g}
    assert live.tenant_stats("code")["k_under_load"] == 0 and live.tenant_stats("code")["k_model"] == 4


def test_goodput_guard_is_per_tenant_a_paying_tenant_keeps_its_k():
    """Two tenants, 4 sessions each, K range 0..2; the model (flat verify costs) has both at
    K = 2. True step wall time: 0.2 s, + 0.1 s while any code session speculates, + 0.3 s while
    any creative one does (costs the model does not see); code accepts both drafts (3 tokens
    per step), creative one of two (2 tokens). Batch tokens per second (8 steps per round):
    both at K = 2: 20 / 0.6 = 33.3; code only: 16 / 0.3 = 53.3; creative only: 12 / 0.5 = 24;
    none: 8 / 0.2 = 40. A guard shared by all tenants can only hold both at K = 0 (40); one
    guard per tenant, each comparing the batch with and without its tenant's speculation,
    vetoes creative and keeps code at K = 2 (53.3). Explorations do not overlap: code's first
    (round 2), then creative's (round 3), which vetoes creative; its rechecks (rounds 11, 24,
    49) lose again and double the hold (48, 96, 192 steps); code explores at rounds 2, 8, 17
    and 34 (each exploration confirming its speculation doubles the spacing: 32, 64, 128 of
    its guard's spec steps; 12 explorations at a fixed 32) and is never vetoed."""
    c = _controller(lambda p: 0.30 + 0.001 * p, lambda r: 0.03 + 0.001 * r)
    live = BatchKSessions(c, guard=GoodputGuard(min_steps=8, explore_every=32, hold=48, first_explore=8))
    keys = [("code", i) for i in range(4)] + [("creative", i) for i in range(4)]
    for key in keys:
        live.join(key, key[0], "draft", k_range=(0, 2))
    sched = {key: live.schedule(key[0], 2) for key in keys}
    rounds, tokens, seconds = [], 0, 0.0
    for rnd in range(60):
        ks = [sched[key]() for key in keys]
        assert ks == [ks[0]] * 4 + [ks[4]] * 4  # one K per tenant in a round
        wall = 0.2 + 0.1 * (ks[0] > 0) + 0.3 * (ks[4] > 0)
        for key, k in zip(keys, ks):
            accepted = k if key[0] == "code" else k // 2
            live.observe_step(key, k, accepted, None, draft_s=0.0, verify_s=wall)
            if rnd >= 12:
                tokens += accepted + 1
        seconds += wall if rnd >= 12 else 0.0
        rounds.append(f"{ks[0]}{ks[4]}")
    assert " ".join(rounds) == (
        "22 22 02 20 22 20 20 20 00 20 20 22 20 20 20 20 20 00 20 20 20 20 20 20 22 20 20 20 20 20 "
        "20 20 20 20 00 20 20 20 20 20 20 20 20 20 20 20 20 20 20 22 20 20 20 20 20 20 20 20 20 20")
    code, creative = live.guards["code"], live.guards["creative"]
    assert (code.vetoes, code.explorations, code.forced) == (0, 4, False)
    assert (creative.vetoes, creative.explorations, creative.snapshot()["forced"]) == (4, 1, "veto")
    assert creative.goodput("spec") == pytest.approx(20 / 0.6, rel=0.02)  # its recheck: both at K = 2
    stats = {t: live.tenant_stats(t) for t in ("code", "creative")}
    assert [(s["k_under_load"], s["k_model"]) for s in stats.values()] == [(2, 2), (0, 2)]
    # rounds 12..59: 44 at (2, 0), 2 code explorations at (0, 0), 2 creative rechecks at (2, 2)
    assert tokens / seconds == pytest.approx((44 * 16 + 2 * 8 + 2 * 20) / (44 * 0.3 + 2 * 0.2 + 2 * 0.6))
    # against 40 with both held at K = 0, 49.71 with code's explorations at a fixed spacing
    assert tokens / seconds == pytest.approx(51.35, abs=0.01)
