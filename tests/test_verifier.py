"""Verification rules: greedy prefix matching and modified rejection sampling."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from specdec.engine.sampling import greedy_token, restrict_support, warp_probs
from specdec.request import SamplingParams
from specdec.engine.verifier import rejection_sample, verify_greedy


def logits_with_argmax(ids: list[int], vocab: int = 6) -> torch.Tensor:
    """[len(ids), vocab] logits whose argmax at row i is ids[i]."""
    out = torch.zeros(len(ids), vocab)
    for i, t in enumerate(ids):
        out[i, t] = 5.0
    return out


@pytest.mark.parametrize(
    "drafts, target_choice, n, tokens",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4]),  # all accepted + bonus
        ([1, 2, 3], [5, 2, 3, 4], 0, [5]),  # first rejected: the target's token
        ([1, 2, 3], [1, 5, 3, 4], 1, [1, 5]),  # agreement after a rejection does not count
        ([1, 2, 3], [1, 2, 0, 4], 2, [1, 2, 0]),
        ([], [4], 0, [4]),  # K = 0: plain decoding
    ],
)
def test_verify_greedy(drafts, target_choice, n, tokens):
    got = verify_greedy(torch.tensor(drafts, dtype=torch.long), logits_with_argmax(target_choice))
    assert got == (n, tokens)


def test_greedy_tie_break_is_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0]])
    assert greedy_token(logits).tolist() == [1, 0]
    # a full 151,936-id row (vectorized kernels split it into blocks): ties far apart, -inf rows
    big = torch.full((3, 151936), -5.0)
    big[0, [70001, 9, 150000]] = 2.5
    big[1, 151935] = 1.0
    big[2] = float("-inf")
    assert greedy_token(big).tolist() == [9, 151935, 0]
    assert greedy_token(big[:, :151665]).tolist() == [9, 0, 0]  # a view over the emittable ids


def test_verify_greedy_rejects_wrong_shape():
    with pytest.raises(ValueError, match=r"\[K\+1=3, V\]"):
        verify_greedy(torch.tensor([1, 2]), torch.zeros(2, 6))


def test_top_k_and_top_p_allowed_sets():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0] > 0).nonzero().flatten().tolist() == [1, 3]
    assert torch.allclose(p[0, [1, 3]], torch.tensor([0.4, 0.3]) / 0.7)
    # top-p 0.8: 0.4 + 0.3 = 0.7 < 0.8, so 0.15 joins; 0.1 and 0.05 stay out
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert (p[0] > 0).nonzero().flatten().tolist() == [1, 3, 4]
    # temperature sharpens: T=0.5 squares the ratios before normalising
    p = warp_probs(logits, SamplingParams(temperature=0.5))
    expect = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]) ** 2
    assert torch.allclose(p[0], expect / expect.sum(), atol=1e-6)


def test_restrict_support_keeps_top_m_renormalised():
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    ids, q = restrict_support(probs, 2)
    assert ids.tolist() == [[1, 3]]
    assert torch.allclose(q, torch.tensor([[0.5 / 0.75, 0.25 / 0.75]]))


def _sample_blocks(p, q_full, k, trials, seed, one_hot_draft=None):
    """Run ``trials`` verifications of K-blocks drafted from q; return emitted sequences."""
    gen = torch.Generator().manual_seed(seed)
    draw = torch.Generator().manual_seed(seed + 1)
    outs = []
    for _ in range(trials):
        if one_hot_draft is not None:
            drafts = torch.tensor(one_hot_draft[:k])
            q_ids = q_probs = None
        else:
            drafts = torch.stack([torch.multinomial(q_full[i], 1, generator=draw)[0] for i in range(k)])
            q_ids, q_probs = restrict_support(q_full[:k], q_full.shape[1])
        n, toks = rejection_sample(drafts, q_ids, q_probs, p, gen)
        assert len(toks) == n + 1
        outs.append(toks)
    return outs


def expected(dist: torch.Tensor, n: int):
    """Expected counts of ``n`` draws from ``dist`` (float64, summing exactly to n)."""
    d = dist.double()
    return (d / d.sum() * n).numpy()


# Position-independent p so that each emitted position must follow p exactly.
P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
Q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])  # a poor draft: many rejections


@pytest.mark.parametrize("k", [1, 2, 4])
def test_rejection_sampling_first_token_follows_target(k):
    p = P.expand(k + 1, -1).clone()
    q = Q.expand(k, -1).clone()
    trials = 6000
    outs = _sample_blocks(p, q, k, trials, seed=k)
    counts = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=5).double()
    # chi-square goodness of fit of the first emitted token against p; the seed is fixed, so
    # this is deterministic; a biased sampler (e.g. plain draft sampling) fails with p < 1e-30.
    res = chisquare(counts.numpy(), expected(P, trials))
    assert res.pvalue > 1e-3, (counts.tolist(), res)
    # a sampler that just kept the draft would follow Q instead: make sure the test can tell
    bad = chisquare(expected(Q, trials), expected(P, trials))
    assert bad.pvalue < 1e-30


def test_rejection_sampling_second_token_follows_target():
    k = 3
    p = P.expand(k + 1, -1).clone()
    q = Q.expand(k, -1).clone()
    trials = 6000
    outs = _sample_blocks(p, q, k, trials, seed=99)
    seconds = [o[1] for o in outs if len(o) >= 2]
    counts = torch.bincount(torch.tensor(seconds), minlength=5).double()
    res = chisquare(counts.numpy(), expected(P, len(seconds)))
    assert res.pvalue > 1e-3, (counts.tolist(), res)


def test_rejection_sampling_with_deterministic_draft():
    # q one-hot at token 3 (prompt lookup): accepted with probability p(3) = 0.1,
    # otherwise resampled from p without token 3.
    k = 1
    p = P.expand(k + 1, -1).clone()
    trials = 6000
    outs = _sample_blocks(p, None, k, trials, seed=5, one_hot_draft=[3])
    accepted = sum(1 for o in outs if len(o) == 2)
    # binomial(6000, 0.1): mean 600, sd ~23
    assert abs(accepted - 600) < 5 * math.sqrt(6000 * 0.1 * 0.9)
    counts = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=5).double()
    res = chisquare(counts.numpy(), expected(P, trials))
    assert res.pvalue > 1e-3


def test_rejection_sampling_never_leaves_allowed_set():
    params = SamplingParams(temperature=1.0, top_k=2)
    logits = torch.log(P).expand(3, -1).clone()
    p = warp_probs(logits, params)  # support {0, 1}
    q = warp_probs(torch.log(Q).expand(2, -1).clone(), SamplingParams(temperature=1.0, top_k=2))  # {3, 4}
    outs = _sample_blocks(p, q, 2, 2000, seed=3)
    emitted = {t for o in outs for t in o}
    assert emitted == {0, 1}


def test_rejection_sampling_equal_distributions_accept_everything():
    k = 4
    p = P.expand(k + 1, -1).clone()
    outs = _sample_blocks(p, P.expand(k, -1).clone(), k, 500, seed=8)
    assert all(len(o) == k + 1 for o in outs)
