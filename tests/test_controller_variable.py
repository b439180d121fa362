"""Prompt lookup proposes as many tokens as its match supports, up to the tenant's K cap, and
the controller judges a cap by the block lengths it actually gets (issue 9)."""

from __future__ import annotations

import pytest

from specdec.control.controller import KController
from specdec.control.objective import (
    block_length_distribution,
    evaluate_variable_k,
    expected_tokens_per_step_positional,
)
from specdec.control.cost_model import CostModel
from specdec.engine.engine import SpeculativeEngine
from specdec.request import GenerationRequest, SpeculationParams
from specdec.types import SpeculationStats
from tests.conftest import target_greedy

#: verify seconds by positions scored, as measured on the 2-core CPU in float32 (issue 9)
CPU_VERIFY = {1: 0.46, 2: 1.0, 3: 1.37, 9: 1.4, 17: 1.5}


def _cost_model(draft_s_per_token: float) -> CostModel:
    cm = CostModel(prior_draft_s_per_token=draft_s_per_token)
    for positions, seconds in CPU_VERIFY.items():
        cm.observe_verify(positions, seconds)
    return cm


def _stats(blocks: list[tuple[int, int]]) -> SpeculationStats:
    """Stats of one request from (proposed, accepted) per step."""
    st = SpeculationStats()
    for k, a in blocks:
        st.record_step(k, a, 0.0, 0.0)
    return st


def test_block_length_distribution():
    hist = [0.0, 2.0, 0.0, 0.0, 6.0]  # 2 blocks of 1 token, 6 of 4
    assert block_length_distribution(hist, 2) == [0.0, 0.25, 0.75]
    assert block_length_distribution(hist, 8) == [0.0, 0.25, 0.0, 0.0, 0.75, 0.0, 0.0, 0.0, 0.0]
    assert block_length_distribution([], 3) == [0.0] * 4


def test_evaluate_variable_k_by_hand():
    cm = _cost_model(0.0)
    c = evaluate_variable_k(0.5, cm, 8, [0.0, 0.5, 0, 0, 0, 0, 0, 0, 0.5])
    e = 0.5 * 1.5 + 0.5 * (2 - 0.5 ** 8)  # 1 + α for ℓ = 1; (1 - α^9) / (1 - α) for ℓ = 8
    t = 0.5 * 1.0 + 0.5 * 1.4  # verify(2) and verify(9); free drafts, no round trip
    assert (c.k, c.expected_tokens, c.step_time_s) == (8, pytest.approx(e), pytest.approx(t))
    assert c.speedup == pytest.approx(e * 0.46 / t)


def test_copy_heavy_ngram_speculates_at_the_cap_while_the_draft_k_stays_low():
    ctl = KController(cost_model_factory=lambda p: _cost_model(0.0 if p == "ngram" else 0.3))
    policy = {"k_min": 0, "k_max": 8, "adaptive": True}
    for _ in range(12):  # the draft model agrees half the time and costs 0.3 s per token
        ctl.decide("acme", "draft", policy)
        ctl.record("acme", "draft", _stats([(2, 1), (2, 0), (2, 2), (2, 1)] * 5))
        # prompt lookup: a spurious one-token match (rejected) or an 8-token copy (accepted)
        ctl.decide("acme", "ngram", policy)
        ctl.record("acme", "ngram", _stats([(1, 0), (8, 8)] * 10 + [(0, 0)] * 7))
    draft = ctl.decide("acme", "draft", policy)
    ngram = ctl.decide("acme", "ngram", policy)
    assert draft.k <= 1
    assert ngram.k == 8  # the tenant's cap
    hist = ctl.block_lengths("acme", "ngram")
    assert hist[1] == pytest.approx(hist[8]) and sum(hist) > 0 and hist[0] == 0  # no-match steps left out
    dist = block_length_distribution(hist, 8)
    expected = evaluate_variable_k(ngram.alpha, ctl.cost_model("ngram"), 8, dist, ngram.position_alphas)
    assert ngram.expected_tokens == pytest.approx(expected.expected_tokens)
    assert ngram.step_time_s == pytest.approx(expected.step_time_s)
    # half the blocks are single tokens: far fewer tokens and cheaper steps than 8-token blocks
    full = expected_tokens_per_step_positional(ngram.alpha, 8, ngram.position_alphas)
    assert ngram.expected_tokens < 0.75 * full and ngram.step_time_s == pytest.approx(0.5 * 1.0 + 0.5 * 1.4)


def test_variable_length_probe_runs_the_whole_request_at_the_cap():
    ctl = KController(cost_model_factory=lambda p: _cost_model(0.0))
    policy = {"k_min": 0, "k_max": 6, "adaptive": True}
    d = ctl.decide("t", "ngram", policy)
    ctl.record("t", "ngram", _stats([(1, 0)] * 30))  # every match wrong: speculation does not pay
    decisions = [ctl.decide("t", "ngram", policy) for _ in range(40)]
    assert d.k > 0 and any(x.k == 0 for x in decisions)
    probes = [x for x in decisions if x.probe]
    assert probes and all(p.k == 6 and p.probe_steps is None and p.k_schedule() == 6 for p in probes)


def test_prompt_lookup_block_length_follows_the_match(tiny_target):
    """On a prompt that repeats itself, blocks are as long as the copy allows, up to the cap."""
    pattern = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
    prompt = pattern * 3 + pattern[:4]
    req = GenerationRequest(prompt_token_ids=prompt, max_tokens=40, ignore_eos=True,
                            speculation=SpeculationParams(proposer="ngram", k=16))
    result = SpeculativeEngine(tiny_target).generate(req)
    assert result.token_ids == target_greedy(tiny_target, prompt, 40)
    lengths = {k for k, n in result.stats.k_counts.items() if n}
    assert max(lengths) > 4 and len(lengths) >= 2, result.stats.k_counts  # variable, longer than a fixed 4


@pytest.mark.parametrize("spec, expected", [
    ({"proposer": "ngram"}, ("ngram", 16)),  # free drafts: not the server's default_max_k
    ({"proposer": "ngram", "k": 12}, ("ngram", 12)),
    ({"proposer": "draft"}, ("draft", 4)),
    ({"proposer": "draft", "k": 12}, ("draft", 4)),
    ({"proposer": "none", "k": 3}, ("none", 0)),
])
def test_router_caps_prompt_lookup_only_by_the_request_and_the_tenant(spec, expected):
    from deployments.config import AppConfig
    from deployments.router import Router

    router = Router.__new__(Router)  # only the config is needed to read the hints
    router.cfg = AppConfig(default_max_k=4)
    assert router._hints({"prompt": "x", "speculation": spec}) == expected
