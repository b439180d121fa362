"""K controller: Leviathan's optimum, simulated tenants, hysteresis, probing, policies."""

import math
import random

import pytest

from specdec.control.acceptance import AcceptanceEstimator
from specdec.control.controller import KController
from specdec.control.objective import (
    choose_k,
    evaluate_k,
    expected_tokens_per_step,
    expected_tokens_per_step_positional,
)
from specdec.control.cost_model import CostModel
from specdec.control.tenants import SpeculationPolicy
from specdec.types import SpeculationStats


class FakeClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def leviathan(c):
    return CostModel(prior_verify_s=1.0, prior_verify_slope=0.0, prior_draft_s_per_token=c)


# ---------------------------------------------------------------- formulas


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.5, 0) == 1.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1 - 1e-13, 3) == pytest.approx(4.0)
    assert expected_tokens_per_step_positional(0.5, 3, [0.9, 0.8]) == pytest.approx(1 + 0.9 + 0.72 + 0.36)
    assert expected_tokens_per_step_positional(0.7, 5) == pytest.approx(expected_tokens_per_step(0.7, 5))
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.2, 1)


@pytest.mark.parametrize(
    "c, alpha, k_star, speedup",
    [  # anchors.md §2.1, Leviathan et al. 2023 S(γ) table
        (0.2, 0.8, 4, 1.87),
        (0.05, 0.9, 13, 4.67),
        (0.10, 0.7, 4, 1.98),
        (0.20, 0.5, 1, 1.25),
        (0.40, 0.6, 1, 1.14),
        (0.40, 0.9, 4, 1.58),
        (0.05, 0.5, 3, 1.63),
    ],
)
def test_choose_k_matches_leviathan_table(c, alpha, k_star, speedup):
    k, s = choose_k(alpha, leviathan(c), 0, 16)
    assert k == k_star
    assert s == pytest.approx(speedup, abs=0.005)


def test_choose_k_zero_when_speculation_does_not_pay_and_respects_range():
    assert choose_k(0.0, leviathan(0.2), 0, 8) == (0, 1.0)
    k, s = choose_k(0.0, leviathan(0.2), 1, 8)  # K=0 not allowed
    assert k == 1 and s == pytest.approx(1 / 1.2)
    k, _ = choose_k(0.8, leviathan(0.2), 0, 2)
    assert k == 2


def test_measured_non_monotonic_verify_curve_can_favour_larger_k():
    cm = CostModel(prior_draft_s_per_token=0.0)
    for k, t in {0: 0.30, 1: 0.37, 2: 0.70, 3: 1.02, 4: 0.68}.items():
        cm.observe_verify(k + 1, t)
    cands = {c.k: c for c in evaluate_k(0.9, cm, 0, 4)}
    assert cands[4].speedup > cands[3].speedup
    assert choose_k(0.9, cm, 0, 4)[0] == 4


# ---------------------------------------------------------------- simulated tenants

DRAFT_S = 0.03


def true_verify(positions):  # CPU-like: 4 positions cost about 2x one
    return 0.1 * (1 + (positions - 1) / 3)


def run_request(ctl, tenant, policy, p_accept, rng, tokens=64, proposer="draft"):
    d = ctl.decide(tenant, proposer, policy)
    sched = d.k_schedule()  # a probe speculates for a few steps only
    st = SpeculationStats()
    emitted = 0
    while emitted < tokens:
        k = sched() if callable(sched) else sched
        a = 0
        while a < k and rng.random() < p_accept:
            a += 1
        st.record_step(k, a, k * DRAFT_S, true_verify(k + 1))
        emitted += a + 1
    ctl.record(tenant, proposer, st)
    return d


POLICY = SpeculationPolicy(k_min=0, k_max=6)


def test_agreeing_tenant_climbs_disagreeing_drops_then_returns_via_probes():
    rng = random.Random(1234)
    clock = FakeClock()
    ctl = KController(clock=clock)
    a_ks, b_decisions = [], []
    for _ in range(40):
        a_ks.append(run_request(ctl, "A", POLICY, 1.0, rng).k)
        b_decisions.append(run_request(ctl, "B", POLICY, 0.0, rng))
        clock.t += 0.5
    assert ctl.current_k("A", "draft") == 6  # top of A's range
    assert ctl.current_k("B", "draft") == 0
    assert a_ks[-10:] == [6] * 10
    reached = a_ks.index(6)
    assert [d.k for d in b_decisions[-5:]].count(0) >= 4
    probes = [d for d in b_decisions if d.probe]
    # probe K: the best K if B's acceptance were 0.9; only for the first probe_steps steps
    auto_k = choose_k(0.9, ctl.cost_model("draft"), 1, 6)[0]
    assert probes and all(d.k == auto_k and d.probe_steps == 4 for d in probes)

    # B's traffic becomes predictable: probes refresh alpha and B gets speculation back.
    back_at = None
    for i in range(200):
        a_ks.append(run_request(ctl, "A", POLICY, 1.0, rng).k)
        d = run_request(ctl, "B", POLICY, 1.0, rng)
        clock.t += 0.5
        if back_at is None and not d.probe and d.k > 0:
            back_at = i
    assert back_at is not None and back_at <= 40  # two or three probes
    assert ctl.current_k("B", "draft") == 6
    assert all(k == 6 for k in a_ks[reached:])  # A stays put; B never moved A


def test_tenants_do_not_share_k_or_counts():
    rng = random.Random(7)
    ctl = KController(clock=FakeClock())
    for _ in range(30):
        run_request(ctl, "A", POLICY, 0.0, rng)
    d_first = ctl.decide("B", "draft", POLICY)  # B is new: global prior only
    b_ks = [run_request(ctl, "B", POLICY, 0.95, rng).k for _ in range(100)]
    assert ctl.current_k("A", "draft") == 0
    assert b_ks[-10:] == [b_ks[-1]] * 10 and b_ks[-1] >= 4
    assert ctl.estimator.snapshot(("A", "draft")).accepted == 0
    # the global pool (only A so far) said speculation does not pay: B's held K starts at 0, and
    # having no evidence of its own, its first request is a (step-limited) probe
    assert d_first.best_k == 0 and d_first.probe and d_first.probe_steps == 4


def test_new_tenant_with_pessimistic_prior_probes_its_first_request():
    rng = random.Random(5)
    ctl = KController(estimator=AcceptanceEstimator(default_alpha=0.0), clock=FakeClock())
    ds = [run_request(ctl, "N", POLICY, 1.0, rng) for _ in range(3)]
    assert ds[0].probe and ds[0].reason == "probe"
    assert ds[1].k > 0 and not ds[1].probe  # its own evidence moved it off K = 0 at once


class StubEstimator:
    """Returns a scripted alpha; no per-position data."""

    def __init__(self, alphas):
        self.alphas = iter(alphas)

    def alpha(self, key):
        return next(self.alphas)

    def evidence(self, key):
        return 1.0  # pretend observed: no first-request probe

    def position_alphas(self, key, min_reached):
        return []


def boundary_alpha(c, k):
    """alpha at which K=k and K=k+1 give the same speedup under cost 1 + c*K."""
    lo, hi = 0.01, 0.99
    cm = leviathan(c)
    for _ in range(60):
        mid = (lo + hi) / 2
        ek, ek1 = expected_tokens_per_step(mid, k), expected_tokens_per_step(mid, k + 1)
        if ek / cm.step_time(k) > ek1 / cm.step_time(k + 1):
            lo = mid
        else:
            hi = mid
    return lo


def count_switches(ctl, n):
    ks = [ctl.decide("T", "draft", POLICY).k for _ in range(n)]
    return sum(1 for a, b in zip(ks, ks[1:]) if a != b), ks


def test_hysteresis_prevents_flapping_near_a_boundary():
    a0 = boundary_alpha(0.2, 2)  # between K=2 and K=3
    noise = random.Random(3)
    alphas = [a0 + noise.uniform(-0.01, 0.01) for _ in range(300)]
    steady = KController(StubEstimator(alphas), lambda p: leviathan(0.2), FakeClock())
    jumpy = KController(StubEstimator(alphas), lambda p: leviathan(0.2), FakeClock(),
                        switch_margin=0.0, switch_after=1)
    n_steady, ks = count_switches(steady, 300)
    n_jumpy, _ = count_switches(jumpy, 300)
    assert set(ks) <= {2, 3}
    assert n_steady <= 2
    assert n_jumpy > 50


def test_hysteresis_still_follows_a_real_change():
    alphas = [0.8] * 5 + [0.5] * 5
    ctl = KController(StubEstimator(alphas), lambda p: leviathan(0.2), FakeClock())
    ks = [ctl.decide("T", "draft", POLICY) for _ in range(10)]
    assert [d.k for d in ks] == [4] * 5 + [1] * 5
    assert ks[0].reason == "initial" and ks[5].reason == "switch: gain"


def test_small_persistent_gain_switches_after_consistent_decisions():
    a0 = boundary_alpha(0.2, 2)
    alphas = [a0 - 0.005] + [a0 + 0.005] * 20  # K=3 slightly (<3%) better from decision 2 on
    ctl = KController(StubEstimator(alphas), lambda p: leviathan(0.2), FakeClock(), switch_after=5)
    ds = [ctl.decide("T", "draft", POLICY) for _ in range(8)]
    assert [d.k for d in ds] == [2, 2, 2, 2, 2, 3, 3, 3]
    assert ds[5].reason == "switch: consistent"


def test_probe_after_interval_and_every_n_requests():
    clock = FakeClock()
    ctl = KController(StubEstimator([0.0] * 100), lambda p: leviathan(0.2), clock,
                      probe_every_requests=5, probe_interval_s=60.0, probe_k=2, probe_min_requests=1)
    ds = [ctl.decide("T", "draft", POLICY) for _ in range(10)]
    assert [d.k for d in ds] == [0, 0, 0, 0, 2, 0, 0, 0, 0, 2]
    assert ds[4].probe and ds[4].reason == "probe"
    assert ctl.current_k("T", "draft") == 0  # a probe does not move the held K
    clock.t += 61.0
    d = ctl.decide("T", "draft", POLICY)
    assert d.probe and d.k == 2


def test_policies_fixed_off_and_request_cap():
    ctl = KController(StubEstimator([0.8] * 100), lambda p: leviathan(0.2), FakeClock())
    fixed = {"k_min": 0, "k_max": 8, "adaptive": False, "fixed_k": 3}  # plain mapping works
    d = ctl.decide("T", "draft", fixed)
    assert (d.k, d.reason, d.best_k) == (3, "fixed", 4)
    d = ctl.decide("T", "none", POLICY)
    assert (d.k, d.reason, d.predicted_speedup) == (0, "speculation off", 1.0)
    d = ctl.decide("U", "draft", POLICY, requested_k=2)
    assert (d.k, d.k_max) == (2, 2)
    d = ctl.decide("U", "draft", POLICY, requested_k=1)  # range shrank under the held K
    assert (d.k, d.reason) == (1, "clipped to range")
    # k_min > 0: never K=0, so never a probe either
    ctl0 = KController(StubEstimator([0.0] * 50), lambda p: leviathan(0.2), FakeClock(), probe_every_requests=2)
    ks = [ctl0.decide("T", "draft", SpeculationPolicy(k_min=2, k_max=6)) for _ in range(6)]
    assert all(d.k == 2 and not d.probe for d in ks)


def test_decision_is_explainable():
    cm = CostModel(prior_verify_s=0.1, prior_verify_slope=0.1, prior_draft_s_per_token=0.02, prior_round_trip_s=0.005)
    ctl = KController(StubEstimator([0.75]), lambda p: cm, FakeClock())
    d = ctl.decide("T", "draft", POLICY)
    assert d.alpha == 0.75
    assert d.step_time_s == pytest.approx(d.draft_s + d.verify_s + d.round_trip_s)
    assert d.draft_s == pytest.approx(0.02 * d.k)
    assert d.baseline_step_time_s == pytest.approx(0.1)
    assert d.expected_tokens == pytest.approx(expected_tokens_per_step(0.75, d.k))
    assert d.predicted_speedup == pytest.approx(d.expected_tokens * 0.1 / d.step_time_s)
    assert [c.k for c in d.candidates] == list(range(0, 7))
    assert max(d.candidates, key=lambda c: c.speedup).k == d.k
    assert d.as_dict()["candidates"][0]["speedup"] == 1.0


def test_per_position_acceptance_used_when_measured():
    est = AcceptanceEstimator(half_life_steps=None, prior_weight=0.0)
    for _ in range(100):  # position 0 always accepted, position 1 never
        est.record(("T", "draft"), 2, 1)
    ctl = KController(est, lambda p: leviathan(0.1), FakeClock(), position_min_reached=50)
    d = ctl.decide("T", "draft", POLICY)
    assert d.position_alphas == (1.0, 0.0)
    assert d.k == 1  # i.i.d. alpha = 0.5 would pick K=2 at c=0.1
    assert choose_k(0.5, leviathan(0.1), 0, 6)[0] == 2


def test_record_feeds_costs_only_for_single_k_requests():
    ctl = KController(clock=FakeClock())
    st = SpeculationStats()
    for _ in range(4):
        st.record_step(3, 2, 0.3, 0.5)
    ctl.record("T", "draft", st.as_dict())  # dicts work (plain data over a Ray actor)
    cm = ctl.cost_model("draft")
    assert cm.draft_s_per_token == pytest.approx(0.1)
    assert cm.verify_s(4) == pytest.approx(0.5)
    mixed = SpeculationStats()
    mixed.record_step(1, 1, 0.1, 9.0)
    mixed.record_step(2, 0, 0.2, 9.0)
    ctl.record("T", "draft", mixed)
    assert cm.snapshot()["verify_s"] == {4: pytest.approx(0.5)}
    assert ctl.estimator.alpha(("T", "draft")) < 1.0


def test_tenant_stats_only_own():
    ctl = KController(clock=FakeClock())
    ctl.decide("A", "draft", POLICY)
    ctl.decide("B", "ngram", POLICY)
    sa = ctl.tenant_stats("A")
    assert list(sa) == ["draft"]
    assert sa["draft"]["acceptance"]["tenant"] == "A"
    assert ctl.tenant_stats("nobody") == {}


def test_interval_probe_needs_min_requests_and_probe_schedule():
    clock = FakeClock()
    ctl = KController(StubEstimator([0.0] * 100), lambda p: leviathan(0.2), clock,
                      probe_every_requests=100, probe_interval_s=10.0, probe_k=3, probe_min_requests=3,
                      probe_steps=2)
    ks = []
    for _ in range(8):
        clock.t += 100.0  # a slow tenant: every request is past the interval
        ks.append(ctl.decide("T", "draft", POLICY))
    assert [d.k for d in ks] == [0, 0, 3, 0, 0, 3, 0, 0]  # not every request, every 3rd at K=0
    sched = ks[2].k_schedule()
    assert [sched() for _ in range(4)] == [3, 3, 0, 0]
    assert ks[0].k_schedule() == 0


def test_record_with_step_costs_and_mixed_k_fallback():
    ctl = KController(clock=FakeClock())
    st = SpeculationStats()
    st.record_step(4, 4, 0.4, 3.0)  # first step: prefill inflates verify
    for _ in range(3):
        st.record_step(4, 4, 0.4, 0.7)
    costs = {"verify_s_by_positions": {5: [2.1, 3]}, "draft_s": 1.2, "drafted": 12}
    ctl.record("T", "draft", st, costs)
    cm = ctl.cost_model("draft")
    assert cm.verify_s(5) == pytest.approx(0.7)
    assert cm.draft_s_per_token == pytest.approx(0.1)
    # without costs: dominant K gets the verify time, the minority's share subtracted
    ctl2 = KController(clock=FakeClock())
    cm2 = ctl2.cost_model("draft")
    cm2.observe_verify(3, 0.5)
    mixed = SpeculationStats()
    for _ in range(6):
        mixed.record_step(4, 4, 0.4, 0.7)
    mixed.record_step(2, 2, 0.2, 0.5)  # the last step, shrunk near max_tokens
    ctl2.record("T", "draft", mixed)
    assert cm2.verify_s(5) == pytest.approx(0.7)


def test_request_turning_speculation_off_leaves_the_adaptive_state_alone():
    """A request with K = 0 (or proposer "none") is plain decoding for that request only: the
    tenant's held K, its pending switch and its counts stay as they were, so requests finishing
    meanwhile are not taken for probes (which would discount the tenant's history)."""
    rng = random.Random(11)
    ctl = KController(estimator=AcceptanceEstimator(half_life_steps=None, prior_half_life_steps=None), clock=FakeClock())
    for _ in range(30):
        run_request(ctl, "A", POLICY, 1.0, rng)
    assert ctl.current_k("A", "draft") == 6
    # one request of tenant A is in flight at K = 6 ...
    inflight = ctl.decide("A", "draft", POLICY)
    assert inflight.k == 6
    before = ctl.estimator.snapshot(("A", "draft"))
    last = ctl.tenant_stats("A")["draft"]["last_decision"]
    # ... when another asks for no speculation
    off = ctl.decide("A", "draft", POLICY, requested_k=0)
    assert (off.k, off.reason) == (0, "speculation off")
    assert ctl.current_k("A", "draft") == 6
    assert ctl.tenant_stats("A")["draft"]["last_decision"] == last
    # the in-flight request finishes: 4 steps, all 6 drafts accepted; recorded as such, no discount
    st = SpeculationStats()
    for _ in range(4):
        st.record_step(6, 6, 0.01, 0.1)
    ctl.record("A", "draft", st)
    after = ctl.estimator.snapshot(("A", "draft"))
    assert after.accepted == before.accepted + 24
    assert after.prior_accepted == before.prior_accepted and after.rejected_steps == before.rejected_steps
    assert ctl.decide("A", "draft", POLICY).k == 6


def _beatty(alpha):
    """Deterministic drafts of acceptance ``alpha``: ``accepted(k)`` for one step of K = k
    (draft token n accepted iff floor(n·α) > floor((n - 1)·α))."""
    n = [0]

    def accepted(k):
        a = 0
        while a < k:
            n[0] += 1
            if math.floor(n[0] * alpha) == math.floor((n[0] - 1) * alpha):
                break
            a += 1
        return a

    return accepted


def _request(ctl, decision, accepted, steps=10):
    """Run one request of ``steps`` steps under ``decision``'s schedule and record it (no
    timings: the cost model keeps its prior)."""
    sched = decision.k_schedule()
    st = SpeculationStats()
    for _ in range(steps):
        k = sched() if callable(sched) else sched
        st.record_step(k, accepted(k), 0.0, 0.0)
    ctl.record("T", "draft", st)
    return st


def _record_k2_history(ctl, alpha, requests):
    """Record ``requests`` requests of tenant T, 10 steps each at K = 2, drafts of acceptance
    ``alpha`` (:func:`_beatty`), no timings."""
    hist = _beatty(alpha)
    for _ in range(requests):
        st = SpeculationStats()
        for _ in range(10):
            st.record_step(2, hist(2), 0.0, 0.0)
        ctl.record("T", "draft", st)


@pytest.mark.parametrize("memory, back_after", [(8.0, 16), (None, 64)])
def test_one_probe_brings_back_a_tenant_with_a_long_stale_history(memory, back_after):
    """Draft cost c = 0.6 of a verify: speculation (K = 1) pays from α = 0.6. The tenant's long
    history (1000 steps at K = 2, α = 0.4) holds it at K = 0; then its drafts agree 95 % of the
    time. With the history capped at 8 trials when the probe's counts arrive, the first probe
    (16th request at K = 0) brings it back at the next request (α̂ 0.61: a small gain, taken at
    once from K = 0); with the discount alone (0.25 of ~1700 trials) it takes four probes."""
    clock = FakeClock()
    ctl = KController(cost_model_factory=lambda p: leviathan(0.6), clock=clock, probe_memory_trials=memory,
                      estimator=AcceptanceEstimator(half_life_steps=None), position_min_reached=None)
    _record_k2_history(ctl, 0.4, requests=100)
    assert abs(ctl.estimator.alpha(("T", "draft")) - 0.4) < 0.01
    good = _beatty(0.95)
    ds = []
    for _ in range(80):
        ds.append(ctl.decide("T", "draft", POLICY))
        _request(ctl, ds[-1], good)
    assert ds[0].k == 0 and ds[0].reason == "initial"
    assert [i for i, d in enumerate(ds) if d.probe][0] == 15 and ds[15].probe_steps == 4
    back = next(i for i, d in enumerate(ds) if d.k > 0 and not d.probe)
    assert back == back_after and ds[back].reason in ("switch: from K = 0", "switch: gain")
    assert [i for i, d in enumerate(ds[:back]) if d.probe] == list(range(15, back, 16))
    assert ctl.current_k("T", "draft") >= 1


def test_probe_steps_of_a_tenant_whose_drafts_disagree_are_few():
    """α = 0.1 at c = 0.6: held at K = 0; probes (4 steps each) run on the first two requests
    (no evidence of its own yet) and then on one request in 16: under 0.5 % of its steps."""
    clock = FakeClock()
    ctl = KController(cost_model_factory=lambda p: leviathan(0.6), clock=clock)
    bad = _beatty(0.1)
    steps = probe_steps = 0
    for _ in range(320):
        d = ctl.decide("T", "draft", POLICY)
        st = _request(ctl, d, bad, steps=64)
        steps += 64
        probe_steps += sum(v for k, v in st.k_counts.items() if k > 0)
        clock.t += 0.5
    assert ctl.current_k("T", "draft") == 0
    # the first two requests are probes (no evidence of its own yet), then one in 16
    assert probe_steps == 4 * (2 + 318 // 16) and probe_steps / steps < 0.005


def test_drafting_requests_while_held_at_k0_without_a_probe_are_plain_evidence():
    """Under K under load the draft replica chooses each step's K, so a request of a tenant
    the per-request controller holds at K = 0 may still draft: its counts add to the history
    as they are; only the result of a probe this controller decided discounts and caps it."""
    ctl = KController(cost_model_factory=lambda p: leviathan(0.6), clock=FakeClock(), position_min_reached=None,
                      estimator=AcceptanceEstimator(half_life_steps=None, prior_half_life_steps=None))
    _record_k2_history(ctl, 0.4, requests=20)
    d = ctl.decide("T", "draft", POLICY)
    assert d.k == 0 and not d.probe and ctl.current_k("T", "draft") == 0
    before = ctl.estimator.snapshot(("T", "draft"))
    st = SpeculationStats()
    for _ in range(3):
        st.record_step(2, 2, 0.0, 0.0)
    ctl.record("T", "draft", st)  # drafted at the draft replica's K, no probe decided
    after = ctl.estimator.snapshot(("T", "draft"))
    assert after.accepted == before.accepted + 6 and after.rejected_steps == before.rejected_steps
    # a probe decided: its result is discounted (0.25) and capped at 8 trials first
    ctl2 = KController(cost_model_factory=lambda p: leviathan(0.6), clock=FakeClock(), probe_k=2,
                       position_min_reached=None,
                       estimator=AcceptanceEstimator(half_life_steps=None, prior_half_life_steps=None))
    ctl2.estimator = ctl.estimator
    ctl2._state = ctl._state
    ctl2._state[("T", "draft")].zero_requests = 15
    probe = ctl2.decide("T", "draft", POLICY)
    assert probe.probe and probe.k == 2
    ctl2.record("T", "draft", st)
    capped = ctl2.estimator.snapshot(("T", "draft"))
    old = after.accepted + after.rejected_steps + after.prior_accepted + after.prior_rejected
    assert capped.accepted == pytest.approx(after.accepted * 8 / old + 6)
    assert capped.rejected_steps == pytest.approx(after.rejected_steps * 8 / old)
