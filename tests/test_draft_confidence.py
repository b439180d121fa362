"""Early stop of drafting by draft confidence (``draft_min_confidence``): exact and effective."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError
from scipy.stats import chisquare

from specdec.engine.engine import SpeculativeEngine
from specdec.request import GenerationRequest, SamplingParams
from specdec.engine.sampling import warp_probs
from tests.conftest import target_greedy

MAX_NEW = 24


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(99)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17)]


def _req(prompt, k, c, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=list(prompt), max_tokens=kw.pop("max_tokens", MAX_NEW),
                             speculation={"proposer": "draft", "k": k, "draft_min_confidence": c}, **kw)


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("c", [0.3, 0.6, 1.0])
@pytest.mark.parametrize("draft_kind", ["close", "far"])
def test_greedy_output_is_the_targets_at_any_threshold(k, c, draft_kind, tiny_target, tiny_draft_close, tiny_draft_far):
    draft = tiny_draft_close if draft_kind == "close" else tiny_draft_far
    engine = SpeculativeEngine(tiny_target, draft)
    for prompt in _prompts(tiny_target.emittable_vocab):
        res = engine.generate(_req(prompt, k, c))
        assert res.token_ids == target_greedy(tiny_target, prompt, MAX_NEW), (k, c, prompt)
        s = res.stats
        assert s.proposed <= k * s.steps
        if c == 1.0:  # no drafted token has probability >= 1: every block is one token long
            assert max(s.k_counts) == 1 and s.proposed == s.k_counts[1]


def test_threshold_shortens_blocks_and_raises_acceptance(tiny_target, tiny_draft_close):
    """Stopping at unsure tokens drafts fewer tokens per step, and a larger share of what it
    drafts is accepted; the output does not change."""
    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    totals = {}
    for c in (0.0, 0.5):
        proposed = accepted = steps = 0
        outputs = []
        for prompt in _prompts(tiny_target.emittable_vocab):
            res = engine.generate(_req(prompt, 8, c))
            proposed, accepted, steps = proposed + res.stats.proposed, accepted + res.stats.accepted, steps + res.stats.steps
            outputs.append(res.token_ids)
        totals[c] = (proposed / steps, accepted / proposed, outputs)
    (blk0, acc0, out0), (blk5, acc5, out5) = totals[0.0], totals[0.5]
    assert out0 == out5
    assert blk5 < blk0
    assert acc5 > acc0, (acc5, acc0, blk5, blk0)


def test_sampled_output_follows_the_target_with_early_stop(tiny_target, tiny_draft_close):
    """Joint distribution of four sampled tokens equals the target's own when blocks stop early.

    K=3 and max_tokens=4: the first step may draft 3 (later steps are capped below 3 by
    max_tokens), so a request whose first block was shorter was cut by the confidence rule.
    Chi-square over the top-k=2 support (16 cells); fixed seeds, so deterministic.
    """
    params = SamplingParams(temperature=1.0, top_k=2)
    prompt = [40, 41, 42]
    with torch.inference_mode():
        def dist(ids):
            return warp_probs(tiny_target.model(torch.tensor([ids])).logits[0, -1:].float(), params)[0]

        paths = [((), 1.0)]
        for _ in range(4):
            grown = []
            for ids, p in paths:
                d = dist(prompt + list(ids))
                grown += [(ids + (t,), p * float(d[t])) for t in d.nonzero().flatten().tolist()]
            paths = grown
    cells, probs = [c for c, _ in paths], [p for _, p in paths]
    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    n = 800
    counts = {cell: 0 for cell in cells}
    first_block_full = first_block_cut = 0
    for seed in range(n):
        res = engine.generate(_req(prompt, 3, 0.5, max_tokens=4, ignore_eos=True,
                                   sampling={"temperature": 1.0, "top_k": 2, "seed": seed}))
        key = tuple(res.token_ids)
        assert key in counts, key
        counts[key] += 1
        if len(res.stats.proposed_per_position) == 3:
            first_block_full += 1
        else:
            first_block_cut += 1
    assert first_block_full > 50 and first_block_cut > 50  # the rule fired, and not always
    observed = [counts[c] for c in cells]
    expected = [p * n for p in probs]
    scale = n / sum(expected)
    assert chisquare(observed, [e * scale for e in expected]).pvalue > 1e-3, (observed, expected)


def test_threshold_outside_0_1_is_refused():
    with pytest.raises(ValidationError, match="draft_min_confidence"):
        GenerationRequest(prompt="x", speculation={"draft_min_confidence": 1.5})
