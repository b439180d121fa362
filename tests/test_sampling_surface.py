"""The full sampling surface under speculation, against the target alone with transformers' own
logits processors: greedy with penalties / logit bias / min_tokens equals ``generate``; sampled
min-p, penalties and logit bias follow the target's processed distribution (chi-square over
every path of three tokens); top-N logprobs are the target's own."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from specdec.engine.engine import SpeculativeEngine
from specdec.errors import InvalidRequestError
from specdec.engine.processors import LogitProcessing
from specdec.engine.sampling import warp_probs
from specdec.request import GenerationRequest, SamplingParams, parse_request


class PresenceFrequency(LogitsProcessor):
    """OpenAI's presence / frequency penalties over the output (transformers has none)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = scores.clone()
        for row, ids in enumerate(input_ids):
            for t, c in zip(*torch.unique(ids[self.prompt_len:], return_counts=True)):
                out[row, t] -= self.frequency * float(c) + self.presence
        return out


def _reference(prompt_len, *, bias=None, repetition=1.0, presence=0.0, frequency=0.0):
    procs = []
    if bias:
        procs.append(SequenceBiasLogitsProcessor({(int(t),): float(b) for t, b in bias.items()}))
    if repetition != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition))
    if presence or frequency:
        procs.append(PresenceFrequency(prompt_len, presence, frequency))
    return procs


def _generate_alone(model, prompt, max_new, procs, min_new=0, eos=None):
    """The target alone, greedy, through transformers' ``generate`` with ``procs``."""
    kw = {"min_new_tokens": min_new} if min_new else {}
    out = model.model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
        eos_token_id=list(eos if eos is not None else model.eos_token_ids), pad_token_id=model.tokenizer.pad_token_id,
        logits_processor=LogitsProcessorList([p for p in procs if not isinstance(
            p, (SequenceBiasLogitsProcessor, RepetitionPenaltyLogitsProcessor))]),
        sequence_bias=next((p.sequence_bias for p in procs if isinstance(p, SequenceBiasLogitsProcessor)), None),
        repetition_penalty=next((p.penalty for p in procs if isinstance(p, RepetitionPenaltyLogitsProcessor)), None),
        **kw,
    )
    return out[0, len(prompt):].tolist()


PROMPT = [60, 61, 62, 60, 61, 62, 60]


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft_close):
    return SpeculativeEngine(tiny_target, tiny_draft_close)


def _run(engine, proposer, k, max_tokens, sampling, **kw):
    return engine.generate(GenerationRequest(prompt_token_ids=PROMPT, max_tokens=max_tokens, sampling=sampling,
                                             speculation={"proposer": proposer, "k": k}, **kw))


PENALTIES = {
    "repetition": dict(repetition_penalty=1.8),
    "presence+frequency": dict(presence_penalty=1.5, frequency_penalty=0.7),
    "logit_bias": dict(logit_bias={7: 6.0, 60: -100.0, 100: 4.0}),
    "all": dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={9: 5.0}),
}


@pytest.mark.parametrize("name", list(PENALTIES))
@pytest.mark.parametrize("proposer, k", [("draft", 1), ("draft", 4), ("ngram", 3)])
def test_greedy_with_penalties_equals_generate(engine, tiny_target, name, proposer, k):
    s = PENALTIES[name]
    ref_procs = _reference(len(PROMPT), bias=s.get("logit_bias"), repetition=s.get("repetition_penalty", 1.0),
                           presence=s.get("presence_penalty", 0.0), frequency=s.get("frequency_penalty", 0.0))
    with torch.inference_mode():
        ref = _generate_alone(tiny_target, PROMPT, 40, ref_procs)
        plain = _generate_alone(tiny_target, PROMPT, 40, [])
    assert ref != plain  # the processors change the greedy output: the comparison can fail
    res = _run(engine, proposer, k, 40, dict(temperature=0.0, **s))
    assert res.token_ids == ref
    assert res.stats.proposed > 0


@pytest.mark.parametrize("proposer, k", [("draft", 3), ("ngram", 3)])
def test_min_tokens_masks_eos_and_stop_ids_until_then(engine, tiny_target, proposer, k):
    with torch.inference_mode():
        plain = _generate_alone(tiny_target, PROMPT, 30, [])
    stop = plain[2]  # without min_tokens the generation stops at its third token
    res = _run(engine, proposer, k, 30, dict(temperature=0.0), stop_token_ids=[stop])
    assert res.token_ids == plain[:3] and res.finish_reason.value == "stop_token"
    eos = list(tiny_target.eos_token_ids) + [stop]
    with torch.inference_mode():
        ref = _generate_alone(tiny_target, PROMPT, 30, [], min_new=12, eos=eos)
    res = _run(engine, proposer, k, 30, dict(temperature=0.0), stop_token_ids=[stop], min_tokens=12)
    assert len(res.token_ids) >= 12 and stop not in res.token_ids[:11]
    assert res.token_ids == ref


SAMPLED = {
    "min_p": dict(temperature=1.0, top_k=4, min_p=0.3),
    "repetition": dict(temperature=1.0, top_k=3, repetition_penalty=2.5),
    "presence+frequency": dict(temperature=0.9, top_k=3, presence_penalty=2.0, frequency_penalty=1.0),
    "logit_bias": dict(temperature=1.0, top_k=3, logit_bias={7: 3.0, 61: -2.0}),
}


def _paths(model, prompt, sampling: dict, steps: int):
    """Every path of ``steps`` tokens with its probability under the target alone, processed by
    transformers' processors then warped (temperature, top-k, min-p)."""
    procs = _reference(len(prompt), bias=sampling.get("logit_bias"),
                       repetition=sampling.get("repetition_penalty", 1.0),
                       presence=sampling.get("presence_penalty", 0.0), frequency=sampling.get("frequency_penalty", 0.0))
    procs.append(TemperatureLogitsWarper(sampling["temperature"]))
    procs.append(TopKLogitsWarper(sampling["top_k"]))
    if sampling.get("min_p"):
        procs.append(MinPLogitsWarper(sampling["min_p"]))
    emittable = model.emittable_vocab
    paths = [((), 1.0)]
    with torch.inference_mode():
        for _ in range(steps):
            grown = []
            for ids, p in paths:
                seq = torch.tensor([prompt + list(ids)])
                scores = model.model(seq).logits[0, -1:].float()
                scores[:, emittable:] = float("-inf")
                for proc in procs:
                    scores = proc(seq, scores)
                dist = scores.softmax(-1)[0]
                grown += [(ids + (t,), p * float(dist[t])) for t in dist.nonzero().flatten().tolist()]
            paths = grown
    return [c for c, _ in paths], [p for _, p in paths]


@pytest.mark.parametrize("name", list(SAMPLED))
def test_sampled_processors_follow_the_target(engine, tiny_target, name):
    """Three tokens, K = 2: the first step drafts two and verifies three positions, so positions
    1 and 2 are processed against prefixes that end in drafted tokens. Chi-square over every
    path (the reference uses transformers' processors); fixed seeds, deterministic."""
    s = SAMPLED[name]
    cells, probs = _paths(tiny_target, PROMPT, s, 3)
    n = 600
    counts = {c: 0 for c in cells}
    proposed = accepted = 0
    for seed in range(n):
        res = _run(engine, "draft", 2, 3, dict(s, seed=seed), ignore_eos=True)
        key = tuple(res.token_ids)
        assert key in counts, key  # nothing outside the processed support
        counts[key] += 1
        proposed += res.stats.proposed
        accepted += res.stats.accepted
    assert 0 < accepted < proposed  # both the accept and the reject paths ran
    observed = [counts[c] for c in cells]
    expected = [p * n for p in probs]
    scale = n / sum(expected)
    assert chisquare(observed, [e * scale for e in expected]).pvalue > 1e-3, (name, observed, expected)


#: float32 logprobs of one position scored in forwards of different shapes differ by reduction order
#: only; 1e-4 is five times the largest difference measured (1.9e-5, 12 positions x 5 values).
FLOAT32_SHAPE_TOL = 1e-4


def test_top_logprobs_are_the_target_alone(engine, tiny_target):
    res = _run(engine, "draft", 4, 12, dict(temperature=0.0), logprobs=True, top_logprobs=5, ignore_eos=True)
    assert len(res.top_logprobs) == len(res.token_ids) == 12
    with torch.inference_mode():
        logits = tiny_target.model(torch.tensor([PROMPT + res.token_ids])).logits[0].float()
    lp = torch.log_softmax(logits[len(PROMPT) - 1: -1, : tiny_target.emittable_vocab], dim=-1)
    # The tiny target is float32, whose forward is not shape-invariant (specdec.engine.invariant):
    # the reference scores all positions in one forward, the engine in verify blocks, so the values
    # differ by float32 reduction order: up to 1.9e-5 on an AMD EPYC (Zen 5) with MKL, ~1e-6 on
    # Sapphire Rapids. The ids must be the same; the values within FLOAT32_SHAPE_TOL.
    for i, top in enumerate(res.top_logprobs):
        values, ids = torch.topk(lp[i], 5)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=FLOAT32_SHAPE_TOL)
        assert res.logprobs[i] == pytest.approx(float(lp[i, res.token_ids[i]]), abs=FLOAT32_SHAPE_TOL)


def test_streamed_top_logprobs_concatenate_to_the_unary_ones(engine):
    req = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=10, logprobs=True, top_logprobs=3, stop=["zz"],
                            ignore_eos=True, speculation={"proposer": "draft", "k": 3})
    whole = engine.generate(req)
    pieces = [c for c in engine.stream(req)]
    assert sum((c.top_logprobs for c in pieces), []) == whole.top_logprobs
    assert sum((c.token_ids for c in pieces), []) == whole.token_ids


def test_processing_rows_see_the_drafted_prefix():
    """Row i of a block is processed against the history up to the i-th drafted token."""
    proc = LogitProcessing(prompt_len=2, repetition_penalty=2.0, frequency_penalty=1.0, min_tokens=2,
                           suppress_ids=(0,))
    logits = torch.ones(2, 5)
    out = proc.apply(logits, [1, 1, 3, 4])  # prompt [1, 1], output [3], one drafted token: 4
    # row 0 after [1, 1, 3]: 1 and 3 penalised; one output token so far (< 2): id 0 masked
    assert out[0].tolist() == [float("-inf"), 0.5, 1.0, 0.5 - 1.0, 1.0]
    # row 1 after [1, 1, 3, 4]: 4 penalised too; two output tokens: id 0 allowed
    assert out[1].tolist() == [1.0, 0.5, 1.0, -0.5, -0.5]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"sampling": {"min_p": 1.5}}, "sampling.min_p: Input should be less than or equal to 1"),
        ({"sampling": {"repetition_penalty": 0}}, "sampling.repetition_penalty: Input should be greater than 0"),
        ({"sampling": {"presence_penalty": 3}}, "sampling.presence_penalty: Input should be less than or equal to 2"),
        ({"sampling": {"logit_bias": {"5": 200}}}, "logit_bias: the bias of token 5 must be in -100..100, got 200.0"),
        ({"sampling": {"logit_bias": {"x": 1}}}, "sampling.logit_bias.x.[key]: Input should be a valid integer"),
        ({"top_logprobs": 3}, "top_logprobs needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs: Input should be less than or equal to 20"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens (9) must be <= max_tokens (4)"),
    ],
)
def test_bad_sampling_values_are_refused(data, message):
    with pytest.raises(InvalidRequestError) as info:
        parse_request({"prompt": "x", **data})
    assert message in str(info.value)


def test_logit_bias_outside_the_vocabulary_is_refused(engine):
    with pytest.raises(InvalidRequestError, match=r"logit_bias: id 99999 is outside the vocabulary 0\.\.319"):
        engine.generate(GenerationRequest(prompt="x", sampling={"logit_bias": {99999: 1.0}}))


def test_generate_command_flags_carry_the_sampling_surface():
    import argparse

    from specdec import cli
    from specdec.errors import SpecDecError

    parser = argparse.ArgumentParser()
    cli._add_generate(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["generate", "x", "--min-p", "0.1", "--repetition-penalty", "1.2", "--presence-penalty",
                              "0.5", "--frequency-penalty", "0.25", "--logit-bias", "7=2.5", "--min-tokens", "3",
                              "--logprobs", "--top-logprobs", "4", "--temperature", "0.7"])
    req = parse_request(cli.request_from_flags(args))
    s = req.sampling
    assert (s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (0.1, 1.2, 0.5, 0.25)
    assert (s.logit_bias, req.min_tokens, req.top_logprobs) == ({7: 2.5}, 3, 4)
    with pytest.raises(SpecDecError, match="--logit-bias must be ID=BIAS, got '7'"):
        cli.request_from_flags(parser.parse_args(["generate", "x", "--logit-bias", "7"]))


def test_a_vanishing_repetition_penalty_saturates_instead_of_nan():
    """repetition_penalty 1e-300 (valid: > 0) rounds to 0 in float32: a seen positive logit became
    inf and a seen zero logit 0 / 0 = nan, and the sampled step raised in torch.multinomial
    (served: HTTP 500 for that request and every request batched with it). The penalty now acts
    as float32's smallest normal number and a logit beyond float32's range saturates."""
    big, tiny = torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny
    proc = LogitProcessing(prompt_len=3, repetition_penalty=1e-300)
    out = proc.apply(torch.tensor([[2.0, 0.0, -1.0, 3.0, 0.5, 5.0]]), [0, 1, 2, 5])  # 0, 1, 2 and 5 seen
    assert out[0].tolist() == [float(torch.tensor(2.0) / tiny), 0.0, -tiny, 3.0, 0.5, big]
    assert warp_probs(out, SamplingParams(temperature=1.0))[0].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("proposer, k", [("none", 0), ("draft", 3)])
def test_sampling_with_a_vanishing_repetition_penalty_emits_a_top_token(engine, tiny_target, proposer, k):
    """Every sampled token is one of the target's most likely tokens after processing (the
    distribution is the saturated seen tokens, uniform among them), with and without drafts."""
    res = _run(engine, proposer, k, 12, dict(temperature=1.0, repetition_penalty=1e-300, seed=3), ignore_eos=True)
    assert len(res.token_ids) == 12
    proc = LogitProcessing(prompt_len=len(PROMPT), repetition_penalty=1e-300)
    with torch.inference_mode():
        logits = tiny_target.model(torch.tensor([PROMPT + res.token_ids])).logits[0].float()
    for i, t in enumerate(res.token_ids):
        row = proc.apply(logits[len(PROMPT) - 1 + i: len(PROMPT) + i, : tiny_target.emittable_vocab],
                         PROMPT + res.token_ids[:i])[0]
        assert float(row[t]) == float(row.max()), (i, t)
