"""AcceptanceEstimator: exact pooled MLE, per-position counts, decay and the global prior."""

import random

import pytest

from specdec.control.acceptance import GLOBAL_PRIOR_WEIGHT, AcceptanceEstimator
from specdec.types import SpeculationStats

KEY = ("acme", "draft")


def exact(**kw):
    return AcceptanceEstimator(half_life_steps=None, global_half_life_steps=None, prior_weight=0.0, **kw)


#: the raw global pool (no pseudo-trials of its own): the tests of the pool's arithmetic
RAW_POOL = dict(global_prior_weight=0.0)


def test_truncated_geometric_mle_by_hand_with_varying_k():
    est = exact()
    # (K, a): rejections at a < K only.
    for k, a in [(4, 4), (4, 2), (2, 0), (3, 3), (5, 1), (0, 0)]:
        est.record(KEY, k, a)
    # Σa = 4+2+0+3+1 = 10; rejecting steps: (4,2), (2,0), (5,1) = 3; K=0 ignored.
    assert est.alpha(KEY) == pytest.approx(10 / 13, abs=1e-15)
    s = est.snapshot(KEY)
    assert (s.accepted, s.rejected_steps, s.steps, s.proposed, s.raw_steps) == (10, 3, 5, 18, 5)
    assert s.proposed_per_position == (5, 5, 4, 3, 1)
    assert s.accepted_per_position == (4, 3, 2, 1, 0)
    # reached_j: steps with K > j whose first j drafts were accepted.
    assert s.reached_per_position == (5, 4, 3, 1, 0)
    assert s.position_alphas == (4 / 5, 3 / 4, 2 / 3, 1.0, None)
    # Pooled identity: Σ accepted_j / Σ reached_j == Σa / (Σa + R).
    assert sum(s.accepted_per_position) / sum(s.reached_per_position) == pytest.approx(s.alpha)


def test_all_accepted_is_one_none_accepted_is_zero():
    est = exact()
    est.record(("a", "draft"), 3, 3)
    est.record(("b", "draft"), 3, 0)
    assert est.alpha(("a", "draft")) == 1.0
    assert est.alpha(("b", "draft")) == 0.0


def test_record_rejects_impossible_steps():
    est = exact()
    with pytest.raises(ValueError):
        est.record(KEY, 2, 3)
    with pytest.raises(ValueError):
        est.record(KEY, 2, -1)
    with pytest.raises(ValueError):
        est.record_counts(KEY, accepted=1, rejected_steps=3, spec_steps=2)


def test_record_stats_equals_step_by_step():
    steps = [(4, 4), (4, 1), (4, 0), (4, 3), (0, 0), (4, 4)]
    st = SpeculationStats()
    a, b = exact(), exact()
    for k, acc in steps:
        st.record_step(k, acc, 0.0, 0.0)
        a.record(KEY, k, acc)
    b.record_stats(KEY, st)
    sa, sb = a.snapshot(KEY), b.snapshot(KEY)
    assert sa == sb  # constant K: reached counts are exact from the per-request counters
    assert sb.alpha == pytest.approx(12 / 15)


def test_record_counts_with_dict_and_inconsistent_sums():
    est = exact()
    est.record_counts(KEY, accepted=5, rejected_steps=1, spec_steps=2,
                      accepted_per_position=[2, 2, 1], proposed_per_position=[2, 2, 2])
    assert est.alpha(KEY) == pytest.approx(5 / 6)
    with pytest.raises(ValueError):
        est.record_counts(KEY, accepted=4, rejected_steps=1, spec_steps=2,
                          accepted_per_position=[2, 2, 1], proposed_per_position=[2, 2, 2])


def test_decay_halves_old_counts_per_half_life_in_steps():
    est = AcceptanceEstimator(half_life_steps=10, global_half_life_steps=None, prior_weight=0.0)
    est.record_counts(KEY, accepted=0, rejected_steps=10, spec_steps=10)
    est.record_counts(KEY, accepted=30, rejected_steps=0, spec_steps=10)
    s = est.snapshot(KEY)
    assert s.rejected_steps == pytest.approx(5.0)  # one half-life later
    assert s.accepted == pytest.approx(30.0)
    assert s.alpha == pytest.approx(30 / 35)


def test_decay_follows_drift():
    rng = random.Random(0)
    est = AcceptanceEstimator(half_life_steps=100)
    for alpha_true in (0.9, 0.3):
        for _ in range(1500):
            a = 0
            while a < 4 and rng.random() < alpha_true:
                a += 1
            est.record(KEY, 4, a)
        assert est.alpha(KEY) == pytest.approx(alpha_true, abs=0.06)


def test_new_key_starts_from_global_pool_of_its_proposer():
    est = AcceptanceEstimator(half_life_steps=None, global_half_life_steps=None, prior_weight=20, default_alpha=0.5,
                              prior_half_life_steps=None, **RAW_POOL)
    assert est.alpha(("new", "draft")) == 0.5  # nothing anywhere: default
    est.record_counts(("old", "draft"), accepted=80, rejected_steps=20, spec_steps=30)
    assert est.global_alpha("draft") == pytest.approx(0.8)
    assert est.alpha(("new", "draft")) == pytest.approx(0.8)  # unseen key reads the global
    assert est.alpha(("new", "ngram")) == 0.5  # other proposer's pool is separate
    # First record: prior = 20 pseudo-trials at 0.8 -> 16 accepted, 4 rejections.
    est.record(("new", "draft"), 2, 0)
    s = est.snapshot(("new", "draft"))
    assert (s.prior_accepted, s.prior_rejected) == pytest.approx((16.0, 4.0))
    assert s.alpha == pytest.approx(16 / 21)
    assert s.evidence == 1


def test_position_alphas_need_enough_reached():
    est = exact()
    for _ in range(40):
        est.record(KEY, 2, 1)
    # position 0 reached 40 times (all accepted), position 1 reached 40 (never accepted)
    assert est.position_alphas(KEY, min_reached=30) == [1.0, 0.0]
    assert est.position_alphas(KEY, min_reached=50) == []
    assert est.position_alphas(("nobody", "draft")) == []


def test_discount_keeps_alpha_and_lowers_weight():
    est = exact()
    est.record_counts(KEY, accepted=10, rejected_steps=10, spec_steps=10)
    est.discount(KEY, 0.25)
    assert est.alpha(KEY) == pytest.approx(0.5)
    est.record_counts(KEY, accepted=10, rejected_steps=0, spec_steps=10)
    assert est.alpha(KEY) == pytest.approx(12.5 / 15)


def test_prior_fades_with_the_keys_own_steps():
    est = AcceptanceEstimator(half_life_steps=None, global_half_life_steps=None, prior_weight=20,
                              prior_half_life_steps=20, **RAW_POOL)
    est.record_counts(("good", "draft"), accepted=95, rejected_steps=5, spec_steps=25)
    assert est.global_alpha("draft") == pytest.approx(0.95)
    for _ in range(60):  # a draft that never agrees: one rejection per step
        est.record(("bad", "draft"), 4, 0)
    s = est.snapshot(("bad", "draft"))
    assert s.prior_accepted == pytest.approx(19 * 0.5 ** 3)
    assert s.alpha == pytest.approx(s.prior_accepted / (s.prior_accepted + s.prior_rejected + 60))
    assert s.alpha < 0.05  # without the fade: 19 / 80 = 0.24


def test_global_prior_weight_keeps_a_new_keys_prior_off_an_extreme():
    """Without pseudo-counts in the global estimate, one rejected step of one tenant made α_g = 0,
    so the next tenant's prior was 20 pseudo-rejections. With global_prior_weight 20 the global
    is (Σa + 20·0.5) / (Σa + R + 20): the default, in process as served (one constant)."""
    exact = dict(half_life_steps=None, global_half_life_steps=None, prior_weight=20, prior_half_life_steps=None)
    raw = AcceptanceEstimator(**exact, **RAW_POOL)
    raw.record(("a", "draft"), 4, 0)
    assert raw.global_alpha("draft") == 0.0
    raw.record(("b", "draft"), 4, 0)
    assert raw.alpha(("b", "draft")) == 0.0
    est = AcceptanceEstimator(**exact)
    assert est.global_prior_weight == GLOBAL_PRIOR_WEIGHT == 20 and AcceptanceEstimator().global_prior_weight == 20
    assert est.global_alpha("draft") == 0.5
    est.record(("a", "draft"), 4, 0)
    assert est.global_alpha("draft") == pytest.approx(10 / 21)
    assert est.alpha(("a", "draft")) == pytest.approx(10 / 21)  # its prior was the empty pool's 0.5
    est.record(("b", "draft"), 4, 0)
    s = est.snapshot(("b", "draft"))
    assert (s.prior_accepted, s.prior_rejected) == pytest.approx((200 / 21, 220 / 21))
    assert s.alpha == pytest.approx((200 / 21) / (200 / 21 + 220 / 21 + 1))
    est.record_counts(("c", "draft"), accepted=80, rejected_steps=20, spec_steps=30)
    assert est.global_alpha("draft") == pytest.approx((80 + 10) / (80 + 22 + 20))
    with pytest.raises(ValueError, match="global_prior_weight must be >= 0"):
        AcceptanceEstimator(global_prior_weight=-1)


def test_upper_alpha_is_an_upper_confidence_bound_on_the_keys_own_evidence():
    """upper_alpha: max(alpha, m + z·sd) of the Beta(Σa + 1, R + 1) posterior of the key's own
    counts (the prior's pseudo-counts left out: they are what the bound is optimistic about). No
    evidence: 0.5 + 0.289·z; a first rejected step does not crush it (0.57 at z = 1, α̂ 0.48
    with the served prior); 4 steps of 4 accepted drafts: 0.96 where α̂ is 0.72; many rejected
    steps: α̂ (the prior holds it higher), the bound below it."""
    exact = dict(half_life_steps=None, global_half_life_steps=None, global_prior_weight=20)
    est = AcceptanceEstimator(**exact)
    key = ("t", "draft")
    assert est.upper_alpha(key) == pytest.approx(0.5 + (0.25 / 3) ** 0.5)
    assert est.upper_alpha(key, z=0.0) == est.alpha(key) == 0.5
    est.record(key, 1, 0)
    assert est.upper_alpha(key) == pytest.approx(1 / 3 + (2 / 9 / 4) ** 0.5) and est.alpha(key) < 0.48
    for _ in range(4):
        est.record(key, 4, 4)
    m = 17 / 19
    assert est.upper_alpha(key) == pytest.approx(m + (m * (1 - m) / 20) ** 0.5) and est.alpha(key) < 0.73
    low = AcceptanceEstimator(**exact)
    for _ in range(10):
        low.record(key, 4, 0)
    assert low.upper_alpha(key) == low.alpha(key) > 1 / 12 + (1 / 12 * 11 / 12 / 13) ** 0.5
    with pytest.raises(ValueError, match="z must be >= 0"):
        est.upper_alpha(key, z=-1)
