"""K under load: the batch cost model and the per-tenant K that maximises the batch's tokens/s."""

from __future__ import annotations

import time

import pytest

from specdec.engine.batch import BatchScheduler
from specdec.control.batch_k import BatchCostModel, BatchKController, TenantLoad, choose_batch_ks
from specdec.control.objective import expected_tokens_per_step
from specdec.engine.engine import SpeculativeEngine
from specdec.request import GenerationRequest
from specdec.testing.sim import BeattyDrafts


def _cost(per_position: float, base: float = 1.0, draft: float = 0.05) -> BatchCostModel:
    """A measured cost model: verify = base + per_position * (P - 1); draft forward = draft s."""
    c = BatchCostModel(max_positions=256)
    for p in (1, 8, 64, 128):
        c.observe_verify(1, p, base + per_position * (p - 1))
    for rows in (1, 8):
        c.observe_draft(rows, draft)
    return c


def test_cost_model_terms():
    c = _cost(0.1)
    assert c.verify_s(1, 8) == pytest.approx(1.7)
    assert c.verify_s(1, 36) == pytest.approx(1.0 + 0.1 * 35)  # interpolated between 8 and 64
    c.observe_verify(4, 8, 1.7 + 3 * 0.02)  # 20 ms per extra row
    assert c.verify_s(4, 8) > c.verify_s(1, 8)  # rows cost something beyond their positions
    # step: two drafting sessions at K=3 and K=1, one plain: 3 draft forwards + verify of 4+2+1
    assert c.step_s([3, 1, 0], [True, True, False]) == pytest.approx(3 * 0.05 + c.verify_s(3, 7))
    with pytest.raises(ValueError, match="rows <= positions"):
        c.observe_verify(3, 2, 1.0)


def test_one_contended_forward_at_a_thinly_measured_count_does_not_price_it_for_good():
    """Served trace (w8a8 pair, one client, acceptance 0.98): 1 and 2 positions measured over
    hundreds of forwards at 0.128 / 0.14 s, 3 positions once at 0.204 s (the first K = 2 step).
    Priced at 0.204, K = 2 never paid again and the client held K = 1; a thin count is priced at
    most on the line of the well-measured ones, and its own measurements decide once it has 3."""
    c = BatchCostModel(max_positions=64)
    for _ in range(60):
        c.observe_verify(1, 1, 0.128)
    for _ in range(100):
        c.observe_verify(1, 2, 0.14)
    c.observe_verify(1, 3, 0.204)
    for _ in range(50):
        c.observe_draft(1, 0.07)
    assert c.verify_s(1, 3) == pytest.approx(0.128 + 2 * 0.012)  # the line through 1 and 2 positions
    assert c.verify_s(1, 2) == pytest.approx(0.14) and c.verify_s(3, 3) == pytest.approx(0.152)
    d = choose_batch_ks({"default": TenantLoad(sessions=1, alpha=0.98)}, c, budget=64)
    assert d.ks["default"] == 2  # priced at 0.204 it was K = 1
    c_old = BatchCostModel(max_positions=64)
    c_old.verify = c.verify
    c_old.draft = c.draft
    c_old.THIN_SAMPLES = 1  # every measured count trusted: the model before
    assert c_old.verify_s(1, 3) == pytest.approx(0.204)
    assert choose_batch_ks({"default": TenantLoad(sessions=1, alpha=0.98)}, c_old, budget=64).ks["default"] == 1
    c.observe_verify(1, 3, 0.204)
    c.observe_verify(1, 3, 0.204)  # 3 samples: measured often enough to stand for itself
    assert c.verify_s(1, 3) == pytest.approx(0.204)


def test_a_thin_count_below_every_well_measured_count_keeps_its_own_price():
    """The int4 main job with one contended forward (tests/test_batch_one_client.py): 3 and 4
    positions measured 3-4 times at 0.256 / 0.289 s, 5 positions 3 times (0.25 and two slowed
    to 2.14 s: once measured 3 times a count's point is the median of its recent forwards,
    2.14), 1 position once at 0.19 s. The line through the well-measured counts (slope 0.94 s
    per position) crosses zero below 3 positions; a count below every well-measured one is not
    capped on it (nor, as before, on the line through the origin at 0.256 / 3 s): it costs what
    it measured, and K = 3 (6.8 tokens/s at α 0.95) beats K = 0 (1 / 0.19 = 5.3)."""
    c = BatchCostModel()
    c.observe_verify(1, 1, 0.19)
    for _ in range(3):
        c.observe_verify(1, 3, 0.256)
    for _ in range(4):
        c.observe_verify(1, 4, 0.289)
    for s in (0.25, 2.14, 2.14):
        c.observe_verify(1, 5, s)
    c.observe_draft(1, 0.085)
    line = c._well_measured_line()
    assert line == pytest.approx((-2.9336, 0.942)) and line[0] + line[1] < 0
    assert c.verify_s(1, 1) == pytest.approx(0.19)
    assert c.verify_s(1, 2) == pytest.approx((0.19 + 0.256) / 2)  # never measured: interpolated, no cap
    d = choose_batch_ks({"default": TenantLoad(sessions=1, alpha=0.95, k_max=4)}, c, budget=64)
    assert d.ks == {"default": 3}
    assert d.tokens_per_s == pytest.approx(expected_tokens_per_step(0.95, 3) / (3 * 0.085 + 0.289))


def _lone_client_model(one_position_s: float, two_positions_s: float | None = None) -> BatchCostModel:
    """A lone client's K = 4 forwards (5 positions, 0.125 s) and eight clients' K = 0 forwards (8
    positions at 8 rows, 0.17 s) measured often, its 1-position forward once (and 2 positions once)."""
    c = BatchCostModel(max_positions=512)
    if two_positions_s is not None:
        c.observe_verify(1, 2, two_positions_s)
    for _ in range(6):
        c.observe_verify(1, 5, 0.125)
    for _ in range(20):
        c.observe_verify(8, 8, 0.17)
    for _ in range(10):
        c.observe_draft(1, 0.035)
    c.observe_verify(1, 1, one_position_s)
    return c


def test_a_lone_clients_k0_forward_is_not_priced_on_the_line_of_other_shapes():
    """In process on the 2-core Zen 3 (w7a8 pair, docs/bench/batching/inprocess-s20-bg2/): the
    controller had measured a lone client's K = 4 forwards (5 positions) and eight clients' K = 0
    forwards (8 positions at 8 rows) often, its K = 0 forward (1 position) once. On the line
    through the well-measured counts that forward cost 0.065 s where it measured 0.077 s, K = 0
    looked faster than K = 4 with the draft's 0.21 s catch-up spread over 32 tokens, and once at
    K = 0 the growing catch-up held the client there for all 32 steps (0.80x fixed K = 4). A
    count below every well-measured count keeps its own price."""
    c = _lone_client_model(0.077, two_positions_s=0.11)
    line = c._well_measured_line()
    assert line == pytest.approx((0.05, 0.015))  # through (5, 0.125) x 6 and (8, 0.17) x 20
    assert c.verify_s(1, 1) == pytest.approx(0.077) and c.verify_s(1, 2) == pytest.approx(0.11)
    assert c.verify_s(1, 3) == pytest.approx(0.115)  # never measured: interpolated between 2 and 5
    c.observe_verify(1, 6, 0.5)  # a thin count above the least well-measured one: capped on the line
    assert c.verify_s(1, 6) == pytest.approx(0.05 + 0.015 * 6)
    load = {"code": TenantLoad(sessions=1, alpha=0.9, k_max=4, catchup_s=0.21, tokens_left=32)}
    d = choose_batch_ks(load, c, budget=128)
    steps = 32 / expected_tokens_per_step(0.9, 4)
    assert d.ks == {"code": 4}
    assert d.tokens_per_s == pytest.approx(expected_tokens_per_step(0.9, 4) / (4 * 0.035 + 0.125 + 0.21 / steps))
    # priced on the line (the model before), K = 0 won at 1 / 0.065 tokens/s
    at_line = choose_batch_ks(load, _lone_client_model(line[0] + line[1], two_positions_s=0.11), budget=128)
    assert at_line.ks == {"code": 0} and at_line.tokens_per_s == pytest.approx(1 / 0.065)


def test_a_contended_small_count_costs_no_more_than_the_least_well_measured_one():
    """Below every well-measured count a thin count keeps its own price, but no more than the
    least well-measured count's (the curve never decreases): the 1-position forward measured once
    at 0.40 s in a contended moment (it costs 0.077 s) is priced 0.125 s, the 5 positions measured
    six times, and so are the never-measured 2 to 4 between it and them. At α 0.2 K = 0 (8 tokens/s
    at that price) beats K = 1 (7.5), runs, and measures what it costs; priced at 0.40 s it never
    ran in process, where no goodput guard explores K = 0 by default (K = 4 was chosen)."""
    c = _lone_client_model(0.40)
    assert c.verify_s(1, 1) == pytest.approx(0.125) and c.verify_s(1, 3) == pytest.approx(0.125)
    d = choose_batch_ks({"code": TenantLoad(sessions=1, alpha=0.2, k_max=4)}, c, budget=128)
    assert d.ks == {"code": 0} and d.tokens_per_s == pytest.approx(1 / 0.125)
    c_old = BatchCostModel(max_positions=512)  # the 0.40 s forward at its own price: K = 0 never chosen
    c_old.verify, c_old.draft = c.verify, c.draft
    c_old.THIN_SAMPLES = 1
    assert c_old.verify_s(1, 1) == pytest.approx(0.40)
    assert choose_batch_ks({"code": TenantLoad(sessions=1, alpha=0.2, k_max=4)}, c_old, budget=128).ks == {"code": 4}
    for _ in range(3):  # K = 0 runs: its own forwards take over the price (median of the recent ones)
        c.observe_verify(1, 1, 0.077)
    assert c.verify_s(1, 1) < 0.125
    for _ in range(20):
        c.observe_verify(1, 1, 0.077)
    assert c.verify_s(1, 1) == pytest.approx(0.077, rel=0.01)


def test_expensive_positions_drop_the_low_acceptance_tenant_to_k0():
    """Verify cost steep in positions: speculation by the creative tenant (α 0.3) costs the
    batch more than it gains, the code tenant (α 0.95) keeps speculating."""
    cost = _cost(0.05)
    loads = {"code": TenantLoad(sessions=4, alpha=0.95), "creative": TenantLoad(sessions=4, alpha=0.3)}
    d = choose_batch_ks(loads, cost, budget=128)
    assert d.ks["creative"] == 0 and d.ks["code"] >= 2
    # the choice is the best over the grid (brute force check)
    def tps(kc, kr):
        per = [kc] * 4 + [kr] * 4
        tokens = 4 * expected_tokens_per_step(0.95, kc) + 4 * expected_tokens_per_step(0.3, kr)
        return tokens / cost.step_s(per, [True] * 8)
    best = max((tps(a, b), a, b) for a in range(9) for b in range(9))
    assert (d.ks["code"], d.ks["creative"]) == best[1:]
    assert d.tokens_per_s == pytest.approx(best[0])


def test_flat_verify_cost_lets_both_tenants_speculate():
    cost = _cost(0.0005, draft=0.005)
    d = choose_batch_ks({"code": TenantLoad(4, 0.95), "creative": TenantLoad(4, 0.6)}, cost, budget=128)
    assert d.ks["code"] >= 4 and d.ks["creative"] >= 1


def test_fair_share_of_the_positions_budget():
    """Budget 16, equal weights, 4 sessions each: at most 8 positions per tenant, so K <= 1."""
    cost = _cost(0.0, draft=0.0)
    d = choose_batch_ks({"a": TenantLoad(4, 0.99), "b": TenantLoad(4, 0.99)}, cost, budget=16)
    assert d.ks == {"a": 1, "b": 1} and d.positions == 16
    # weight 3:1 -> a may use 12 positions (K = 2), b 4 (K = 0)
    d = choose_batch_ks({"a": TenantLoad(4, 0.99, weight=3), "b": TenantLoad(4, 0.99, weight=1)}, cost, budget=16)
    assert d.ks == {"a": 2, "b": 0} and d.by_tenant_share == {"a": 12, "b": 4}
    # a pinned K and a K range are respected
    d = choose_batch_ks({"a": TenantLoad(1, 0.99, fixed_k=3), "b": TenantLoad(1, 0.99, k_min=1, k_max=2)}, cost, 64)
    assert d.ks == {"a": 3, "b": 2}


def test_scheduler_with_controller_adapts_and_outputs_stay_exact(tiny_target, tiny_draft_close, tiny_draft_far):
    """Adaptive requests under the batch controller: greedy outputs equal the requests alone,
    the controller learns α per tenant and reports K per tenant and the batch shape."""
    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    prompts = [[5, 17, 42, 9, 100, 7, 23][: 2 + i] for i in range(6)]
    reqs = [GenerationRequest(prompt_token_ids=p, max_tokens=24, ignore_eos=True,
                              speculation={"proposer": "draft", "k": 6}) for p in prompts]
    alone = [engine.generate(r).token_ids for r in reqs]
    ctl = BatchKController(budget=64, weights={"code": 1, "creative": 1})
    sched = BatchScheduler(engine, max_batch_positions=64, controller=ctl)
    hs = [sched.submit(r, tenant=["code", "creative"][i % 2], adaptive=True) for i, r in enumerate(reqs)]
    sched.run_until_idle()
    assert [h.result().token_ids for h in hs] == alone
    stats = ctl.stats()
    assert set(stats["k_by_tenant"]) == {"code", "creative"}
    assert all(0 <= k <= 8 for k in stats["k_by_tenant"].values())
    assert stats["mean_rows_per_forward"] > 1
    # α̂ is learned from the tenants' speculative steps (a tenant held at K = 0 teaches nothing)
    spec_tenants = {t for h, t in zip(hs, ["code", "creative"] * 3) if h.result().stats.proposed}
    assert set(stats["alpha"]) == {f"{t}/draft" for t in spec_tenants}
    # every step's K was at most the tenant's decision at that time and the request's cap
    assert all(max(h.result().stats.k_counts) <= 6 for h in hs)
    with pytest.raises(ValueError, match="needs a scheduler with a controller"):
        BatchScheduler(engine).submit(reqs[0], adaptive=True)


def test_batch_k_sessions_served_controller():
    """The served K-under-load controller (draft replica): sessions join and leave, steps report
    K, acceptance and the batched forward that verified them; K per tenant is the whole-batch
    optimum of choose_batch_ks over the sessions held, each forward is measured once, and a
    probe runs its first steps at the request's ceiling."""

    from specdec.control.batch_k import BatchKSessions
    from specdec.types import BatchShape

    cost = _cost(0.05)
    live = BatchKSessions(BatchKController(budget=128, cost=cost))
    for i in range(4):
        live.join(("code", i), "code", "draft", k_range=(0, 8))
        live.join(("creative", i), "creative", "draft", k_range=(0, 8))
    live.join("pinned", "creative", "draft", adaptive=False, k_range=(3, 3))  # its own K = 3
    shape = BatchShape(forward=7, rows=8, positions=40, seconds=cost.verify_s(8, 40))
    n_before = len(live.controller.batches)
    for step in range(40):
        for i in range(4):
            live.observe_step(("code", i), 4, 4, shape)  # every draft accepted
            live.observe_step(("creative", i), 4, 1 if step % 2 else 0, shape)
    assert len(live.controller.batches) == n_before + 1  # 320 reports of one forward: measured once
    k_code, k_creative = live.k_for("code", 8), live.k_for("creative", 8)
    est = live.controller.estimator
    # the pinned session counts in the batch at its own K and takes no share from the others
    pinned = TenantLoad(1, est.alpha(("creative", "draft")), weight=1e-9, k_min=3, k_max=3, fixed_k=3)
    expected = choose_batch_ks({"code": TenantLoad(4, est.alpha(("code", "draft"))),
                                "creative": TenantLoad(4, est.alpha(("creative", "draft"))), "pinned": pinned},
                               live.controller.cost, budget=128)
    assert (k_code, k_creative) == (expected.ks["code"], expected.ks["creative"])
    assert live.controller.last.rows == 9 and live.controller.last.positions == expected.positions
    assert set(live.controller.k_by_tenant) == {"code", "creative"}  # the pinned load is not a tenant's K
    assert k_creative == 0 and k_code >= 2
    assert live.k_for("code", 1) == 1  # never above the request's ceiling
    stats = live.tenant_stats("code")
    assert stats == {"k_under_load": k_code, "k_model": k_code, "decided_at": live.controller.k_decided_at["code"],
                     "guard": None, "rows_per_step": 8.0, "positions_per_step": 40.0, "steps": 160, "sessions": 4}
    assert live.controller.k_decided_at["code"] == pytest.approx(time.time(), abs=60)
    assert live.tenant_stats("creative")["sessions"] == 5
    # a probe of the per-request controller: the ceiling for its first two steps, then the
    # tenant's K under load; held at K = 0, after 32 steps at K = 0 a probe of 4 consecutive
    # steps runs at the K the batch optimum gives the tenant if its acceptance were 0.9
    kp = live.controller.probe_k("creative", 6)
    assert kp == choose_batch_ks({"code": TenantLoad(4, est.alpha(("code", "draft"))),
                                  "creative": TenantLoad(4, 0.9, k_max=6), "pinned": pinned},
                                 live.controller.cost, budget=128).ks["creative"] == 4
    k = live.schedule("creative", 6, probe_steps=2)
    ks = [k() for _ in range(64)]
    assert ks == [6, 6] + [0] * 32 + [kp] * 4 + [0] * 26 and live.probes == 1
    k2 = live.schedule("creative", 6)  # the count is the tenant's, over its generations; a probe
    # that found nothing doubles the interval: the next one after 64 held steps
    ks2 = [k2() for _ in range(40)]
    assert ks2 == [0] * (64 - 26) + [kp] * 2 and live.probes == 2
    # the code tenant leaves: the creative tenant alone decides again (its steps no longer slow
    # anyone else's), and K under load follows the new batch
    for i in range(4):
        live.leave(("code", i))
    decisions = live.decisions
    live.k_for("creative", 8)
    assert live.decisions == decisions + 1 and "code" not in live.controller.last.ks
    live.leave("missing")  # idempotent
    with pytest.raises(ValueError, match="weight must be > 0"):
        live.join("x", "t", "draft", weight=0)


def test_one_row_forwards_are_each_measured_whatever_their_number():
    """A forward of one row answers one step alone, so its every report is a forward of its own:
    two target replicas (or a restarted one) number their forwards from 1 alike, and the
    deduplication by (forward, rows, positions) that a batched forward's many reports need
    dropped the second replica's forward 1 as a copy of the first's (served unbatched, every
    forward is one row). Forwards of several rows are still measured once however many rows
    report them."""
    from specdec.control.batch_k import BatchKSessions
    from specdec.types import BatchShape

    live = BatchKSessions(BatchKController(budget=128, cost=_cost(0.05)))
    ticks = []
    observe_tick = live.controller.observe_tick
    live.controller.observe_tick = lambda rows, positions, s, d=(), **kw: (ticks.append((rows, positions, s)),
                                                                          observe_tick(rows, positions, s, d, **kw))
    for i in range(3):
        live.join(i, "code", "draft", k_range=(0, 4))
    replica_a, replica_b = BatchShape(forward=1, rows=1, positions=5, seconds=0.10), \
        BatchShape(forward=1, rows=1, positions=5, seconds=0.12)
    live.observe_step(0, 4, 4, replica_a)
    live.observe_step(1, 4, 4, replica_b)
    live.observe_step(0, 4, 4, replica_a)  # that replica's next forward, restarted: number 1 again
    both = BatchShape(forward=2, rows=2, positions=10, seconds=0.2)
    live.observe_step(1, 4, 4, both)
    live.observe_step(2, 4, 4, both)  # the same two-row forward's second row
    assert ticks == [(1, 5, 0.10), (1, 5, 0.12), (1, 5, 0.10), (2, 10, 0.2)]


def test_batch_k_sessions_leave_out_draft_catch_up_forwards():
    """The draft forwards reported with a generation's first drafting step, or its first after a
    K = 0 step, also fed the prompt / the tokens decoded at K = 0: they are not measured as
    draft forwards; those of the following drafting steps are."""
    from specdec.control.batch_k import BatchKSessions

    live = BatchKSessions(BatchKController(budget=64))
    live.join("g", "t", "draft", k_range=(0, 8))
    live.observe_step("g", 2, 2, None, [(1, 5.0), (1, 0.03)])  # first step: prompt prefill in it
    assert live.controller.cost.draft.snapshot()["verify_s"] == {}
    live.observe_step("g", 2, 1, None, [(1, 0.03), (1, 0.03)])
    live.observe_step("g", 0, 0, None, [])
    live.observe_step("g", 0, 0, None, [])
    live.observe_step("g", 3, 3, None, [(1, 0.9), (1, 0.03), (1, 0.03)])  # catch-up of 2 tokens
    assert live.controller.cost.draft.snapshot()["verify_observations"] == {1: 2}
    assert live.controller.cost.draft_s(1) == pytest.approx(0.03)
    live.observe_step("g", 3, 2, None, [(1, 0.05)])
    assert live.controller.cost.draft.snapshot()["verify_observations"] == {1: 3}


def _run_two_tenants(ctl: BatchKController, ticks: int, truth: dict) -> list[tuple[str, int, bool]]:
    """``ticks`` ticks of 4 code + 4 creative sessions (cap 8): decide, each session's step K
    from ``step_k``, its accepted count from ``truth``. Returns (tenant, K, probe?) per step."""
    log = []
    for _ in range(ticks):
        ctl.decide({("code", "draft"): 4, ("creative", "draft"): 4})
        for t in ("code", "creative"):
            for _ in range(4):
                k = ctl.step_k(t, 8)
                probe = ctl.k_for(t) == 0 and k > 0
                ctl.observe_row(t, "draft", k, truth[t].accepted(k))
                log.append((t, k, probe))
    return log


def test_probes_of_a_tenant_held_at_k0_bring_it_back_and_cost_little():
    """Verify cost steep in positions (speculation by the creative tenant pays from α ≈ 0.6).
    Creative's drafts agree 10 % of the time: it is held at K = 0 and its probes (4 consecutive
    steps at the K it would get at α = 0.9: at once, its evidence being under 8 trials, then
    after 64, 128, 128, ... held steps) take 32 of its 1000 steps (3.2 %). Then its drafts agree 95 % of the time: the next probe moves
    α̂ (the old counts weigh 8 trials) past the point where speculation pays, and it is back at
    K > 0 right after that probe, within 128 + 4 of its steps."""
    cost = _cost(0.05)
    assert choose_batch_ks({"code": TenantLoad(4, 0.98), "creative": TenantLoad(4, 0.5)}, cost, 128).ks["creative"] == 0
    assert choose_batch_ks({"code": TenantLoad(4, 0.98), "creative": TenantLoad(4, 0.6)}, cost, 128).ks["creative"] == 1
    ctl = BatchKController(128, cost=cost)
    truth = {"code": BeattyDrafts(0.98), "creative": BeattyDrafts(0.1)}
    low = [(k, p) for t, k, p in _run_two_tenants(ctl, 250, truth) if t == "creative"]
    kp = ctl.probe_k("creative", 8)
    assert kp == 4 and ctl.k_for("creative") == 0 and ctl.k_for("code") == 8
    probes = [i for i, (k, p) in enumerate(low) if p]
    assert len(low) == 1000 and len(probes) == 32 and ctl.probes == 8 and ctl.probe_step_count == 32
    # each probe at the K the tenant would get at α = 0.9 under the load then (the code tenant
    # priced at its optimistic acceptance, near 1 from its first steps on)
    assert [low[i][0] for i in probes] == [kp] * 32
    # after the prior's first steps, every step at K > 0 is a probe: speculation never pays
    first_held = next(i for i, (k, _) in enumerate(low) if k == 0)
    assert all(p for k, p in low[first_held:] if k > 0)
    # probes in runs of 4: at once when first held (its 8 steps at K = 3 and K = 1 left it under
    # 8 trials of evidence), then after 64 and 128 held steps
    starts = [i for i in probes if i - 1 not in probes]
    assert [b - a - 4 for a, b in zip(starts, starts[1:])] == [64, 128, 128, 128, 128, 128, 128]
    assert starts[0] == 8 and first_held == 12 and [k for k, _ in low[:8]] == [3] * 4 + [1] * 4
    assert ctl.estimator.alpha(("creative", "draft")) < 0.2

    truth["creative"] = BeattyDrafts(0.95)
    high = [(k, p) for t, k, p in _run_two_tenants(ctl, 60, truth) if t == "creative"]
    back = next(i for i, (k, p) in enumerate(high) if k > 0 and not p)
    assert back <= 128 + 4 and [p for _, p in high[back - 4:back]] == [True] * 4  # right after one probe
    assert ctl.k_for("creative") >= 4 and ctl.estimator.alpha(("creative", "draft")) > 0.9
    # back at K > 0: the interval is the short one again for the next time it is held
    assert ctl._probe["creative"].interval == 32


def test_no_probe_when_speculation_cannot_pay_even_at_high_acceptance():
    """A verify so steep that the batch optimum keeps the tenant at K = 0 even at α = 0.9:
    probing would only cost, so none runs."""
    ctl = BatchKController(128, cost=_cost(1.0))
    truth = {"code": BeattyDrafts(0.98), "creative": BeattyDrafts(0.1)}
    log = _run_two_tenants(ctl, 100, truth)
    assert ctl.probe_k("creative", 8) == 0 and ctl.probes == 0
    assert not any(p for _, _, p in log)
    with pytest.raises(ValueError, match="probe_steps >= 1"):
        BatchKController(128, probe_steps=0)


def test_draft_replicas_pool_acceptance_and_keep_their_own_k():
    """Two draft replicas' batch controllers exchange acceptance counts through a pool
    (merge_report / merge_pooled, what the controller actor does every batch_k_sync_s): after an
    exchange both hold the pool's counts exactly, steps recorded during an exchange are replayed
    and sent next time, a probe's evidence cap reaches the pool; costs and K stay per replica
    (same α̂, different batches, different K)."""
    from specdec.control.acceptance import AcceptanceEstimator
    from specdec.control.batch_k import BatchKSessions, merge_report

    cost = _cost(0.05)
    a = BatchKSessions(BatchKController(budget=128, cost=cost))
    b = BatchKSessions(BatchKController(budget=128, cost=_cost(0.05)))
    pool = AcceptanceEstimator()
    for i in range(4):
        a.join(("code", i), "code", "draft")
        a.join(("creative", i), "creative", "draft")
    b.join("c0", "creative", "draft")
    for step in range(40):
        for i in range(4):
            a.observe_step(("code", i), 4, 4)
        b.observe_step("c0", 4, 1 if step % 2 else 0)

    def exchange(rep, between=None):
        report = rep.take_sync_report()
        merge_report(pool, report)
        if between:
            between()
        return rep.merge_pooled(pool.export_counts(), report)

    assert exchange(a) == [("code", "draft")]  # A has seen no creative step yet
    assert exchange(b) == [("code", "draft"), ("creative", "draft")]
    assert exchange(a) == [("code", "draft"), ("creative", "draft")]
    for key in (("code", "draft"), ("creative", "draft")):
        assert (a.controller.estimator.snapshot(key) == b.controller.estimator.snapshot(key)
                == pool.snapshot(key))
    assert pool.raw_steps(("code", "draft")) == 160 and pool.raw_steps(("creative", "draft")) == 40
    # same acceptance, different batches: A runs 4 code + 4 creative sessions, B one creative
    assert a.k_for("creative", 8) == 0 and b.k_for("creative", 8) > 0
    # costs stay per replica
    b.controller.cost.observe_verify(1, 2, 9.0)
    assert a.controller.cost.verify_s(1, 2) != b.controller.cost.verify_s(1, 2)

    # steps recorded during an exchange are replayed on the pool's counts and sent next time
    def more():
        for _ in range(3):
            a.observe_step(("code", 0), 2, 2)
    exchange(a, more)
    assert a.controller.estimator.raw_steps(("code", "draft")) == pool.raw_steps(("code", "draft")) + 3
    assert a.take_sync_report()["segments"] == [{"steps": [["code", "draft", 2, 2, 3]], "cap": None}]

    # a probe on B (creative held at K = 0 there after this load) caps the pool's evidence too
    b.join("c1", "creative", "draft")
    for i in range(2, 8):
        b.join(f"x{i}", "code", "draft")
    for _ in range(200):
        b.observe_step("c0", 4, 0)
    k = b.schedule("creative", 8)
    ks = [k() for _ in range(40)]
    assert ks[32] > 0 and b.probes == 1
    report = b.take_sync_report()
    assert report["segments"] == [{"steps": [["creative", "draft", 4, 0, 200]], "cap": ["creative", "draft", 8.0]},
                                  {"steps": [], "cap": None}]
    merge_report(pool, report)
    snap = pool.snapshot(("creative", "draft"))
    assert snap.accepted + snap.rejected_steps + snap.prior_accepted + snap.prior_rejected == pytest.approx(8.0)
    assert pool.alpha(("creative", "draft")) == b.controller.estimator.alpha(("creative", "draft"))

    # a pool that lost data (fewer steps than the replica had) is not taken for that key
    fresh = AcceptanceEstimator()
    report = a.take_sync_report()
    merge_report(fresh, report)
    before = a.controller.estimator.snapshot(("code", "draft"))
    assert a.merge_pooled(fresh.export_counts(), report) == []
    assert a.controller.estimator.snapshot(("code", "draft")) == before
    # undelivered: the steps go with the next report, before those recorded since
    a.observe_step(("code", 1), 3, 3)
    lost = a.take_sync_report()
    a.observe_step(("code", 1), 3, 2)
    a.restore_report(lost)
    assert a.take_sync_report()["segments"] == [
        {"steps": [["code", "draft", 3, 2, 1], ["code", "draft", 3, 3, 1]], "cap": None}]
    bad = pool.export_counts()
    for steps in ([["t", "draft", 2, 3, 1]], [[1, "draft", 2, 1, 1]]):
        with pytest.raises(ValueError, match="accepted <= K|strings"):
            merge_report(pool, {"segments": [{"steps": [["t", "draft", 2, 1, 1]]}, {"steps": steps}]})
    assert pool.export_counts() == bad  # checked before anything was added
    with pytest.raises(ValueError, match="more than 10 steps"):
        merge_report(pool, {"segments": [{"steps": [["t", "draft", 2, 1, 11]]}]}, max_steps=10)


def test_scheduler_measures_draft_forwards_without_prefill_or_catch_up(tiny_target, tiny_draft_close):
    """In process, as served: the batched draft forwards that also fed a prompt's prefill or the
    tokens decoded at K = 0 (more than 2 positions per row) are not measured as draft positions;
    the others are, one observation each."""
    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    ctl = BatchKController(budget=64)
    sched = BatchScheduler(engine, max_batch_positions=64, controller=ctl)
    for i in range(2):
        steps = iter([0, 0, 0, 0, 3, 3, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2])
        req = GenerationRequest(prompt_token_ids=[5, 17, 42, 9, 100][: 3 + i], max_tokens=24, ignore_eos=True,
                                speculation={"proposer": "draft", "k": 3})
        sched.add(engine.start(req, k=lambda it=steps: next(it, 2)), tenant="t", proposer="draft")
    sched.run_until_idle()
    clean = [(rows, pos) for rows, pos in sched.draft_trace if pos <= 2 * rows]
    dirty = [(rows, pos) for rows, pos in sched.draft_trace if pos > 2 * rows]
    assert dirty and clean  # the catch-up after the K = 0 steps (and the prompts) were fed
    measured = ctl.cost.draft.snapshot()["verify_observations"]
    assert sum(measured.values()) == len(clean)
    assert sorted(measured) == sorted({rows for rows, _ in clean})


class _Recording(BatchKController):
    """A batch controller that records what each decision was told (behind, tokens_left) and
    the catch-up it charged."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.told: list[tuple[dict, dict, float]] = []

    def decide(self, sessions, fixed=None, behind=None, tokens_left=None, context=None):
        d = super().decide(sessions, fixed, behind, tokens_left, context)
        self.told.append((dict(behind or {}), dict(tokens_left or {}), self._loads["t"].catchup_s))
        return d


def test_scheduler_charges_the_drafts_catch_up_as_served(tiny_target, tiny_draft_close):
    """In process, as served (BatchKSessions): each decision is told how many committed tokens
    the tenant's drafts have not fed (the prompts, 9 + 10, then one more per session and K = 0
    step; none after a drafting step; K = 0 steps after one leave the draft that far behind plus
    its uncached tail) and the tokens its sessions have left on average, and charges their
    catch-up; the batched draft forward that fed the 27 positions (prompts and the 4 tokens each
    decoded at K = 0) is measured as a catch-up, not as a draft position."""
    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    ctl = _Recording(budget=64)
    sched = BatchScheduler(engine, max_batch_positions=64, controller=ctl)
    prompt = [5, 17, 42, 9, 100, 7, 23, 11, 60, 3]
    for i in range(2):
        steps = iter([0, 0, 0, 0, 3, 3, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2])
        req = GenerationRequest(prompt_token_ids=prompt[: 9 + i], max_tokens=24, ignore_eos=True,
                                speculation={"proposer": "draft", "k": 3})
        sched.add(engine.start(req, k=lambda it=steps: next(it, 2)), tenant="t", proposer="draft")
    assert ctl.cost.snapshot()["catchup_s_per_token"] is None
    priced = ctl.cost.catchup_s(19)
    sched.run_until_idle()
    told = [(b["t"], left["t"]) for b, left, _ in ctl.told]
    assert told[:9] == [(19, 24.0), (21, 23.0), (23, 22.0), (25, 21.0), (27, 20.0), (0, 19.0), (0, 18.0),
                        (0, 17.0), (6, 16.0)]
    assert ctl.told[0][2] == pytest.approx(priced) and ctl.told[5][2] == 0.0
    assert sched.draft_trace[0] == (2, 27)
    assert ctl.cost.snapshot()["catchup_s_per_token"] is not None
    assert sum(ctl.cost.draft.snapshot()["verify_observations"].values()) == sum(
        1 for rows, pos in sched.draft_trace if pos <= 2 * rows)


def test_a_decision_prices_each_forward_once():
    """choose_batch_ks evaluates up to 17³ K combinations from the same few forwards: each draft
    forward (rows) and verify forward (rows, positions) is priced once per decision (memo in
    BatchCostModel.step_s); two tenants x 4 sessions at K 0..4 made 7000 draft_s calls per 100
    decisions before (0.9-1.3 ms a decision on the EPYC, every tick of an adaptive batch)."""
    cost = _cost(0.01, base=0.08, draft=0.03)
    calls = {"draft": 0, "verify": 0}
    draft_s, verify_s = cost.draft_s, cost.verify_s

    def counting_draft(rows):
        calls["draft"] += 1
        return draft_s(rows)

    def counting_verify(rows, positions, **kwargs):
        calls["verify"] += 1
        return verify_s(rows, positions, **kwargs)

    cost.draft_s, cost.verify_s = counting_draft, counting_verify
    loads = {t: TenantLoad(sessions=4, alpha=a, k_min=0, k_max=4) for t, a in (("code", 0.9), ("creative", 0.5))}
    d = choose_batch_ks(loads, cost, budget=128)
    # 25 combinations: verify forwards of 8 rows at 8 + 4·(K_code + K_creative) positions (9 distinct
    # sums), draft forwards of 4 or 8 rows
    assert calls == {"draft": 2, "verify": 9}
    cost.draft_s, cost.verify_s = draft_s, verify_s
    assert choose_batch_ks(loads, cost, budget=128) == d  # the same decision as unmemoised


def test_the_batch_statistics_keep_only_the_latest_forwards():
    """A long-running replica observes one verify forward per tick: the controller keeps the last
    RECENT_BATCHES (rows, positions) for its statistics, not every forward since start-up."""
    from specdec.control.batch_controller import RECENT_BATCHES

    c = BatchKController(budget=128, cost=_cost(0.05))
    for i in range(1000):
        c.observe_tick(1 + i % 8, 2 * (1 + i % 8), 0.1)
    assert RECENT_BATCHES == 50 and len(c.batches) == 50
    last = [(1 + i % 8, 2 * (1 + i % 8)) for i in range(950, 1000)]
    assert list(c.batches) == last
    s = c.stats()
    assert s["mean_rows_per_forward"] == sum(r for r, _ in last) / 50
    assert s["mean_positions_per_forward"] == sum(p for _, p in last) / 50


def test_draft_rows_above_the_measured_are_priced_at_the_drafts_catch_up_rate():
    """Session 11, 8 clients x 32 tokens (w8a8 target, int4 draft): warmed on one client, the
    controller had measured the draft at one row only (0.04 s) and priced 8 rows on the prior's 5 %
    per row (0.054 s) where they took ~0.13 s, chose K = 1 for both tenants at 8 clients and ran
    it at 0.86x K = 0. Above the most rows measured, each extra row now costs at least the
    measured catch-up seconds per token (here 1.2 s for 100 tokens): 0.04 + 7 x 0.012 = 0.124 s
    at 8 rows, and K = 0 pays best; below and at the measured rows nothing changes, and no price
    exceeds the most rows measured repeated (rows / R forwards of R rows)."""
    c = BatchCostModel(max_positions=512)
    for _ in range(3):
        c.observe_verify(8, 8, 0.150)  # K = 0 at 8 rows
        c.observe_verify(8, 12, 0.180)  # one tenant of 4 at K = 1
        c.observe_verify(8, 16, 0.206)  # K = 1 at 8 rows
        c.observe_verify(1, 5, 0.110)  # one client at K = 4
        c.observe_draft(1, 0.040)
    loads = {"code": TenantLoad(4, 0.9, k_max=4), "creative": TenantLoad(4, 0.6, k_max=4)}
    assert c.draft_s(8) == pytest.approx(0.040 * 1.35)  # no catch-up measured: the curve's trend
    assert choose_batch_ks(loads, c, 128).ks == {"code": 1, "creative": 1}  # what session 11 ran
    c.observe_catchup(100, 1.2)
    assert c.draft_s(1) == pytest.approx(0.040)
    assert c.draft_s(4) == pytest.approx(0.040 + 3 * 0.012)
    assert c.draft_s(8) == pytest.approx(0.040 + 7 * 0.012)
    d = choose_batch_ks(loads, c, 128)
    assert d.ks == {"code": 0, "creative": 0}
    assert d.tokens_per_s == pytest.approx(8 / 0.150)
    # measured rows are priced as measured, however dear the catch-ups
    for _ in range(3):
        c.observe_draft(8, 0.045)
    assert c.draft_s(8) == pytest.approx(0.045)
    assert choose_batch_ks(loads, c, 128).ks == {"code": 1, "creative": 1}
    # never dearer than the most rows measured, repeated: rows / R forwards of R rows
    c2 = BatchCostModel(max_positions=512)
    c2.observe_draft(2, 0.050)
    c2.observe_catchup(10, 1.0)  # 0.1 s per token (a served catch-up waits on other sessions too)
    assert c2.draft_s(8) == pytest.approx(0.050 * 8 / 2)
    assert c2.draft_s(3) == pytest.approx(min(0.050 + 0.1, 0.050 * 3 / 2))


def _s13_cost() -> BatchCostModel:
    """Session 13's warmed controller before the 8 clients x 128 tokens adaptive arm (w8a8 pair,
    2-core EPYC; docs/bench/batching/inprocess-s13-batch-main/k-trace.jsonl): one client's
    forwards, one 4-row forward dearer than the one-row 4-position ones (which teaches the row
    term ~0.004 s per row), the K = 0 8-row forward measured six times at 0.18-0.19 s, drafts."""
    c = BatchCostModel(max_positions=128)
    for p, t in ((1, 0.13), (4, 0.125), (5, 0.13)):
        for _ in range(3):
            c.observe_verify(1, p, t)
    c.observe_verify(4, 4, 0.198)
    for t in (0.187, 0.186, 0.19, 0.18, 0.193, 0.184):
        c.observe_verify(8, 8, t)
    for rows, t in ((1, 0.036), (4, 0.07)):
        for _ in range(3):
            c.observe_draft(rows, t)
    return c


def test_a_shape_measured_as_it_is_is_priced_at_its_own_median_not_the_curve_plus_the_row_term():
    """The curve's point at 8 positions was measured with 8 rows; curve + 7 x row_s priced the
    K = 0 forward 0.21 s here (0.229 s in the run) where it measured 0.18-0.19 s, and code at
    K = 4 (alpha 0.999) with creative at K = 1-2 (alpha 0.82) looked 1.1x K = 0: the controller
    ran it, 0.78x K = 0 measured (session 13); this model chose code K = 4, creative K = 1 before.
    Priced at its median, K = 0 wins; unmeasured or thin shapes keep the curve."""
    c = _s13_cost()
    # the row term, from the one 4-row forward against the one-row 4-position point; the 8-row
    # forwards teach it nothing, their count's point being measured at 8 rows (BatchCostModel,
    # "Rows a point was measured at")
    assert c._row_s == pytest.approx((0.198 - 0.125) / 3)
    assert c.verify_s(8, 8) == pytest.approx(0.1865)  # the median of its six forwards
    assert c.verify_s(1, 4) == c.verify.verify_s(4)  # one row: the curve, as before
    assert c._point_rows[4] == pytest.approx(1.75)  # 1, 1, 1 then 4 at weight 1/4
    assert c.verify_s(4, 4) == pytest.approx(c.verify.verify_s(4) + 2.25 * c._row_s)  # measured once: thin
    # never measured: extrapolated from the dearest point, the 8-row one at 8 positions, so no row term
    assert c.verify_s(8, 32) == pytest.approx(c.verify.verify_s(32))
    loads = {"code": TenantLoad(4, 0.9993, k_max=4), "creative": TenantLoad(4, 0.818, k_max=4)}
    assert choose_batch_ks(loads, c, budget=128).ks == {"code": 0, "creative": 0}


def test_a_count_priced_between_points_measured_at_its_rows_adds_no_row_term():
    """Points at 8 and 16 positions measured at 8 rows, a row term learned from a 4-row forward
    against a one-row point: an 8-row forward of 12 positions (never measured) is priced between
    the two (their rows), not 7 row terms above both (prices stay monotone in positions)."""
    c = BatchCostModel(max_positions=128)
    for _ in range(3):
        c.observe_verify(1, 4, 0.10)
    c.observe_verify(4, 4, 0.16)  # teaches the row term: (0.16 - 0.10) / 3 per row
    for t8, t16 in ((0.12, 0.16), (0.121, 0.161), (0.119, 0.159)):
        c.observe_verify(8, 8, t8)
        c.observe_verify(8, 16, t16)
    assert c._row_s == pytest.approx(0.02)
    assert c._point_rows[8] == c._point_rows[16] == 8.0
    assert c.verify_s(8, 12) == pytest.approx((0.12 + 0.16) / 2)
    assert c.verify_s(8, 8) < c.verify_s(8, 12) < c.verify_s(8, 16)
    assert c.verify_s(8, 20) == pytest.approx(c.verify.verify_s(20))  # above: the dearest point's 8 rows
