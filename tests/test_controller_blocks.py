"""K controller, session 12: draft blocks priced first forward + later forwards, early stop as a
cap over learned block lengths, the draft's prompt prefill spread over a request. Costs are the
s11 EPYC's (w8a8 pair, code-prime and poem-sea, 32 tokens: k-prediction replay in
docs/bench/formats/bench-s12/costk12/)."""

import pytest

from specdec.control.acceptance import AcceptanceEstimator
from specdec.control.controller import KController
from specdec.control.objective import early_stop_lengths, expected_tokens_per_step

POLICY = {"k_min": 0, "k_max": 8, "adaptive": True, "fixed_k": None}
#: measured on the s11 EPYC, code-prime: verify seconds by positions, draft seconds by block length
VERIFY = {1: 0.0809, 2: 0.0772, 3: 0.0899, 4: 0.0977, 5: 0.1096, 9: 0.1175}
BLOCKS = {1: 0.0327, 2: 0.0637, 3: 0.0932, 4: 0.1138, 8: 0.1929}


def _controller(blocks: bool = True) -> KController:
    c = KController(estimator=AcceptanceEstimator(half_life_steps=None, prior_weight=0.0, global_prior_weight=0.0),
                    position_min_reached=None, learn_early_stop=True)
    cm = c.cost_model("draft")
    for p, t in VERIFY.items():
        cm.observe_verify(p, t)
    cm.observe_draft(100, 2.78)  # 27.8 ms per drafted token, the per-token average of the same runs
    if blocks:
        for d, t in BLOCKS.items():
            cm.observe_draft_block(d, t)
    # α̂ = 86 / (86 + 14) = 0.86 (code-prime at K = 4 and 8), 30 own steps (no probe)
    c.estimator.record_counts(("code", "draft"), accepted=86, rejected_steps=14, spec_steps=30, proposed=110)
    return c


def test_code_picks_a_long_k_when_blocks_are_priced_first_plus_later_forwards():
    """Per drafted token (27.8 ms) K = 3 wins (what session 11's taught controller held on
    code-prime); priced by block length, K = 6: the first forward (33 ms) is paid once per block,
    each later one costs 19-30 ms."""
    legacy = _controller(blocks=False).decide("code", "draft", POLICY, 8)
    assert legacy.k == 3
    d = _controller().decide("code", "draft", POLICY, 8)
    assert (d.k, d.reason) == (6, "initial")
    c6 = d.candidates[6]
    draft6 = 0.1138 + (0.1929 - 0.1138) * 2 / 4  # between the measured blocks of 4 and 8
    verify7 = 0.1096 + (0.1175 - 0.1096) * 2 / 4
    assert c6.step_time_s == pytest.approx(draft6 + verify7)
    assert c6.expected_tokens == pytest.approx(expected_tokens_per_step(0.86, 6))
    assert c6.speedup == pytest.approx(expected_tokens_per_step(0.86, 6) * 0.0809 / (draft6 + verify7))
    assert d.draft_s == pytest.approx(draft6)


def test_early_stop_hazards_from_block_lengths_and_k_as_a_cap():
    """Blocks shorter than the K decided stopped early; the cap's length is censored. Every K
    is then a cap: E[N] and the step seconds are expectations over the block lengths."""
    c = _controller()
    first = c.decide("code", "draft", POLICY, 8)
    assert first.k == 6
    stats = {"accepted": 40, "rejected_steps": 10, "steps": 20, "proposed": 60,
             "k_counts": {1: 4, 2: 4, 6: 12}}
    c.record("code", "draft", stats)
    # position 1: 4 stopped of 20; position 2: 4 of 16; 3..5: 0 of 12; 6 censored (the cap)
    hz = c.stop_hazards("code", "draft", 8)
    pooled = 8 / (8 + 16 + 12 + 12 * 3)  # stopped / (stopped + continued) over positions 1..5
    assert hz[:5] == pytest.approx([4 / 20, 4 / 16, 0.0, 0.0, 0.0])
    assert hz[5:] == pytest.approx([pooled] * 3)  # too few trials there: the pooled rate
    assert early_stop_lengths(hz, 3) == pytest.approx([0.0, 0.2, 0.8 * 0.25, 0.8 * 0.75])
    d = c.decide("code", "draft", POLICY, 8)
    alpha = d.alpha
    lengths = early_stop_lengths(hz, 8)
    cm = c.cost_model("draft")
    e = sum(p * expected_tokens_per_step(alpha, ell) for ell, p in enumerate(lengths))
    t = sum(p * cm.step_time(ell) for ell, p in enumerate(lengths))
    c8 = d.candidates[8]
    assert (c8.expected_tokens, c8.step_time_s) == (pytest.approx(e), pytest.approx(t))
    assert d.k == 6 and d.reason == "hold"


def test_draft_prefill_keeps_a_short_request_plain():
    """The first step's draft seconds beyond a block of its length are the draft's prompt
    prefill (0.40 - 0.0637 s); spread over 8 tokens it costs more than K = 6 saves, over 128
    it does not."""
    def taught() -> KController:
        c = _controller()
        c.record("code", "draft", {"accepted": 0, "rejected_steps": 0, "steps": 1, "proposed": 2,
                                   "k_counts": {2: 1}},
                 {"verify_s_by_positions": {}, "draft_s": 0.0, "drafted": 0,
                  "draft_s_by_drafted": {2: [0.0637, 1]}, "first_draft_s": 0.40, "first_drafted": 2})
        return c

    c = taught()
    cm = c.cost_model("draft")
    assert cm.draft_prefill_s == pytest.approx(0.40 - 0.0637)
    short = c.decide("code", "draft", POLICY, 8, tokens=8)
    assert (short.k, short.reason) == (0, "initial")
    c6 = short.candidates[6]
    assert c6.speedup == pytest.approx(8 * 0.0809 / (8 / c6.expected_tokens * c6.step_time_s + 0.40 - 0.0637))
    long = taught().decide("code", "draft", POLICY, 8, tokens=128)
    assert long.k == 6


def test_served_default_learns_no_early_stop_from_block_lengths():
    """Served, the draft replica's K under load shortens blocks too: by default the controller
    does not read short blocks as early stops (every block is K long, as before)."""
    c = KController()
    c.decide("code", "draft", POLICY, 8)
    c.record("code", "draft", {"accepted": 10, "rejected_steps": 5, "steps": 10, "proposed": 20,
                               "k_counts": {1: 5, 3: 5}})
    assert c.stop_hazards("code", "draft", 4) == [0.0, 0.0, 0.0, 0.0]


def test_in_request_retune_raises_a_fresh_tenants_k_within_its_first_request():
    """A fresh tenant (prior α 0.5: K = 2) whose blocks are all accepted: with
    ``in_request_retune`` its request's K is re-chosen before every step from α̂ with the
    request's own counts (prior faded by its steps), so it moves to K = 3 and then 5 within the
    request; the goodput guard's exploration of plain decoding (steps 6-9) still runs. Without,
    K = 2 throughout."""
    from specdec.control.acceptance import GLOBAL_PRIOR_WEIGHT
    from specdec.control.step_guard import in_request_guard
    from specdec.types import SpeculationStats

    def run(retune: bool) -> list[int]:
        c = KController(estimator=AcceptanceEstimator(global_prior_weight=GLOBAL_PRIOR_WEIGHT),
                        step_guard=in_request_guard(), in_request_retune=retune, learn_early_stop=True)
        d = c.decide("code", "draft", POLICY, 8, tokens=32)
        assert (d.k, d.reason) == (2, "initial")
        g = c.guarded_k("code", "draft", d)
        stats = SpeculationStats()
        g.attach(stats)
        for i in range(14):
            k = g()
            stats.record_step(k, k, 0.02 * k + (0.3 if i == 0 else 0.0), 0.08 + 0.005 * k)
        return g.ks

    assert run(False) == [2, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 2]
    assert run(True) == [2, 2, 2, 2, 2, 0, 0, 0, 0, 3, 3, 3, 3, 5]


def test_early_stop_counts_survive_a_snapshot():
    """The early-stop counts behind the hazards are in the controller's snapshot (plain JSON):
    a controller restored from it has the same hazards and decides the same K; a snapshot
    written before they existed restores without them (the fixed-length model); counts of
    unequal lengths are refused whole."""
    import json

    c = _controller()
    c.decide("code", "draft", POLICY, 8)
    c.record("code", "draft", {"accepted": 40, "rejected_steps": 10, "steps": 20, "proposed": 60,
                               "k_counts": {1: 4, 2: 4, 6: 12}})
    data = json.loads(json.dumps(c.export_learned()))
    (entry,) = data["stops"]
    assert entry[:2] == ["code", "draft"]
    assert entry[2] == pytest.approx([4, 4, 0, 0, 0, 0])  # stopped at positions 1..6 (one record: no decay yet)
    assert entry[3] == pytest.approx([16, 12, 12, 12, 12, 0])  # continued past them

    restored = _controller()
    restored.import_learned(data)
    assert restored.stop_hazards("code", "draft", 8) == pytest.approx(c.stop_hazards("code", "draft", 8))
    assert restored.stop_hazards("code", "draft", 8)[:2] == pytest.approx([4 / 20, 4 / 16])
    assert restored.decide("code", "draft", POLICY, 8).k == c.decide("code", "draft", POLICY, 8).k

    del data["stops"]
    old = _controller()
    old.import_learned(data)
    assert old.stop_hazards("code", "draft", 8) == [0.0] * 8

    data["stops"] = [["code", "draft", [1.0, 2.0], [3.0]]]
    kept = _controller()
    kept.record_stops(("code", "draft"), {1: 2, 4: 2}, 4)
    before = kept.stop_hazards("code", "draft", 4)
    with pytest.raises(ValueError, match="2 stopped counts but 1 continued"):
        kept.import_learned(data)
    assert kept.stop_hazards("code", "draft", 4) == before
