"""In-request goodput guard (specdec/control/step_guard.py): exact K sequences on a deterministic
cost/acceptance simulation, the controller's per-tenant guards, outputs equal to the target alone."""

from __future__ import annotations

import pytest

from specdec.control.acceptance import AcceptanceEstimator
from specdec.control.controller import KController
from specdec.control.goodput_guard import GoodputGuard
from specdec.control.step_guard import GuardedK, in_request_guard
from specdec.testing.sim import BeattyDrafts, FrozenCostModel, simulate_request

POLICY = {"k_min": 0, "k_max": 8, "adaptive": True, "fixed_k": None}


def verify_s(positions: int) -> float:
    """A CPU-like verify curve: 1 s for one position, +10 % per extra position."""
    return 1.0 + 0.1 * (positions - 1)


def run(k, guard, alpha, tokens=32, draft_s=0.3, drafts=None):
    gk = GuardedK(k, guard)
    ks, stats = simulate_request(gk, drafts or BeattyDrafts(alpha), tokens, verify_s=verify_s,
                                 draft_s_per_token=draft_s, on_start=gk.attach)
    return "".join(map(str, ks)), stats


def test_low_acceptance_tenant_is_held_at_k0_after_one_exploration_and_stays_there():
    # alpha 0.3 at K = 2: 1.39 tokens per 1.8 s step = 0.77 tokens/s against plain 1.0 tokens/s
    guard = in_request_guard()
    ks, _ = run(2, guard, 0.3)
    # step 1 (prefill, not counted), 4 spec steps, 4 explored plain steps: compared as the
    # exploration ends -> veto, plain for the rest of the request
    assert ks == "22222" + "0" * 26
    assert guard.vetoes == 1 and guard.explorations == 1 and guard.snapshot()["forced"] == "veto"
    assert guard.goodput("spec") == pytest.approx(0.6978185, rel=1e-6)
    assert guard.goodput("plain") == pytest.approx(1.0)
    # the tenant's next request: held at K = 0 from its first step
    ks2, stats2 = run(2, guard, 0.3)
    assert ks2 == "0" * 32 and stats2.proposed == 0


def test_high_acceptance_tenant_keeps_speculating():
    # alpha 0.9 at K = 2: 2.71 tokens per 1.8 s step = 1.5 tokens/s against plain 1.0
    guard = in_request_guard()
    ks, _ = run(2, guard, 0.9)
    assert ks == "22222" + "0000" + "222220"  # one exploration, confirmed; last step: 1 token left
    assert guard.vetoes == 0 and guard.explorations == 1
    ks2, _ = run(2, guard, 0.9)
    assert ks2 == "222222222222"  # next exploration due after 16 spec steps: none in this request
    assert guard.vetoes == 0


def test_known_plain_bound_skips_an_exploration_speculation_already_beats():
    guard = in_request_guard()
    gk = GuardedK(2, guard, plain_bound=lambda: 1.05)  # plain decoding at most 1.05 tokens/s
    ks, _ = simulate_request(gk, BeattyDrafts(0.9), 32, verify_s=verify_s, draft_s_per_token=0.3,
                             on_start=gk.attach)
    assert ks == [2] * 12 and guard.explorations == 0 and guard.skipped == 2  # after spec steps 4 and 8


def test_probe_steps_pass_through_unmeasured():
    guard = in_request_guard()
    gk = GuardedK(2, guard, measure=False)
    ks, _ = simulate_request(gk, BeattyDrafts(0.3), 16, verify_s=verify_s, draft_s_per_token=0.3,
                             on_start=gk.attach)
    assert set(ks[:-1]) == {2} and guard.steps("spec") == 0 and guard.steps("plain") == 0


def test_compare_on_explore_end_vetoes_without_another_speculating_step():
    def feed(g):
        for _ in range(2):
            g.record("spec", 1.0, 2.0)  # 0.5 tokens/s; after 2 spec steps an exploration starts
        assert g.exploring
        for _ in range(2):
            g.record("plain", 1.0, 1.0)  # 1 token/s
        return g.forced

    now = GoodputGuard(min_steps=2, explore_every=2, first_explore=2, hold=5, compare_on_explore_end=True)
    later = GoodputGuard(min_steps=2, explore_every=2, first_explore=2, hold=5)
    assert feed(now) is True and now.vetoes == 1 and now.snapshot()["forced"] == "veto"
    assert feed(later) is False and later.vetoes == 0  # waits for the next spec step
    later.record("spec", 1.0, 2.0)
    assert later.vetoes == 1 and later.forced
    assert now.fresh().compare_on_explore_end is True


def test_controller_keeps_one_guard_per_tenant_and_holds_only_the_losing_one():
    ctl = KController(estimator=AcceptanceEstimator(), cost_model_factory=lambda p: FrozenCostModel(),
                      step_guard=in_request_guard())
    seqs = {}
    for tenant, alpha in (("creative", 0.3), ("code", 0.9)):
        drafts = BeattyDrafts(alpha)
        for r in range(2):
            d = ctl.decide(tenant, "draft", POLICY, requested_k=8)
            gk = ctl.guarded_k(tenant, "draft", d)
            ks, stats = simulate_request(gk, drafts, 32, verify_s=verify_s, draft_s_per_token=0.3,
                                         on_start=gk.attach)
            seqs[(tenant, r)] = (d.k, d.probe, "".join(map(str, ks)))
    k0 = seqs[("creative", 0)][0]
    assert k0 >= 1 and not seqs[("creative", 0)][1]
    assert seqs[("creative", 0)][2].startswith(str(k0) * 5 + "0000")
    assert set(seqs[("creative", 0)][2][9:]) == {"0"}
    assert set(seqs[("creative", 1)][2]) == {"0"}  # held at K = 0 by the tenant's guard
    assert ctl.guard_stats("creative", "draft")["vetoes"] == 1
    assert ctl.guard_stats("code", "draft")["vetoes"] == 0
    assert "0" not in seqs[("code", 1)][2][:-1]  # code keeps speculating on its second request


def test_controller_without_step_guard_passes_the_decision_through():
    ctl = KController(cost_model_factory=lambda p: FrozenCostModel())
    d = ctl.decide("t", "draft", POLICY, requested_k=8)
    gk = ctl.guarded_k("t", "draft", d)
    ks, _ = simulate_request(gk, BeattyDrafts(0.0), 20, verify_s=verify_s, draft_s_per_token=0.3,
                             on_start=gk.attach)
    assert d.k >= 1 and set(ks[:-2]) == {d.k} and ks[-2:] == [1, 0] and ctl.guard_stats("t", "draft") is None


def test_guarded_generation_output_equals_the_target_alone(tiny_target, tiny_draft_close):
    from specdec.engine.engine import SpeculativeEngine
    from specdec.request import GenerationRequest
    from tests.conftest import target_greedy

    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    prompt = [5, 17, 42, 99, 7, 23]
    alone = target_greedy(tiny_target, prompt, 40)
    # an exploration after 2 drafting steps (steps, not seconds: deterministic), then K = 3 or 0
    guard = GoodputGuard(min_steps=2, explore_every=2, first_explore=2, hold=4, compare_on_explore_end=True)
    gk = GuardedK(3, guard)
    req = GenerationRequest(prompt_token_ids=prompt, max_tokens=40, speculation={"proposer": "draft", "k": 3})
    gen = engine.start(req, k=gk)
    gk.attach(gen.stats)
    out = gen.run()
    assert out.token_ids == alone[: len(out.token_ids)] and len(out.token_ids) == len(alone)
    assert gk.ks[:5] == [3, 3, 3, 0, 0] and guard.explorations >= 1
    # a guard holding K = 0 (vetoed): every step plain, output the same
    gk0 = GuardedK(3, guard)
    guard._forced_left, guard._forced_why = 1000, "veto"
    gen0 = engine.start(req, k=gk0)
    gk0.attach(gen0.stats)
    out0 = gen0.run()
    assert out0.token_ids == out.token_ids and out0.stats.proposed == 0 and set(gk0.ks) == {0}


def test_later_explorations_skipped_while_speculation_beats_the_measured_plain_steps_by_the_margin():
    """in_request_guard's skip_margin (0.25): after its first exploration measured plain decoding
    (1.0 tokens/s), a request whose speculation measures 1.5 tokens/s skips the explorations due
    later (counted as skipped, the spacing doubling); without the margin it explores again after
    16 spec steps. Speculation only 1.1x the plain steps still re-explores."""
    def long_run(guard, alpha, draft_s):
        return run(2, guard, alpha, tokens=128, draft_s=draft_s)

    with_margin = in_request_guard()
    ks, _ = long_run(with_margin, 0.9, 0.3)
    assert ks == "22222" + "0000" + "2" * 39 + "1"  # the first exploration only; last step: 2 tokens left
    assert with_margin.explorations == 1 and with_margin.skipped >= 1 and with_margin.vetoes == 0
    s = with_margin.snapshot()
    assert s["goodput_plain"] == pytest.approx(1.0) and s["goodput_spec"] > 1.25

    settings = dict(min_steps=4, explore_every=16, first_explore=4, hold=64, max_backoff=4, margin=0.0, decay=0.95,
                    explore_backoff=8, outlier_clip=2.0, compare_on_explore_end=True)
    without = GoodputGuard(**settings)
    ks0, _ = long_run(without, 0.9, 0.3)
    assert without.explorations == 2 and without.skipped == 0 and ks0.count("0000") == 2

    # alpha 0.7, draft 0.45 s per token: 2.19 tokens per 2.1 s = 1.04 tokens/s, within the margin
    thin = GoodputGuard(**settings, skip_margin=0.25)
    long_run(thin, 0.7, 0.45)
    assert thin.explorations >= 2 and thin.skipped == 0
    assert GoodputGuard(skip_margin=0.25).fresh().skip_margin == 0.25
    with pytest.raises(ValueError, match="skip_margin must be >= 0 or None"):
        GoodputGuard(skip_margin=-0.1)
