"""Engine behaviour beyond greedy identity: context limits, logprobs, seeds, sampling, errors."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec.engine.engine import SpeculativeEngine
from specdec.errors import ContextLengthExceededError, InvalidRequestError, PromptTooLongError
from specdec.engine.prompt import check_context_length
from specdec.engine.proposers.prompt_lookup import find_continuation
from specdec.request import GenerationRequest, SamplingParams, parse_request
from specdec.engine.sampling import warp_probs
from specdec.testing.tiny import build_tiny_model
from specdec.types import FinishReason
from tests.conftest import load_tiny, target_greedy


# --- prompt lookup ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seq, k, nmin, nmax, eos, expected",
    [
        ([1, 2, 3, 4, 1, 2], 2, 1, 3, (), [3, 4]),  # bigram [1, 2] matched, its continuation proposed
        ([1, 2, 3, 4, 1, 2], 5, 1, 3, (), [3, 4, 1, 2]),  # continuation runs up to the end
        ([5, 6, 7], 3, 1, 3, (), []),  # no earlier occurrence: nothing to propose
        ([1, 9, 2, 1, 8, 2, 1], 2, 1, 1, (), [8, 2]),  # most recent unigram match wins
        ([3, 1, 2, 7, 2, 1, 2], 2, 1, 2, (), [7, 2]),  # the longer n-gram [1, 2] beats unigram [2]
        ([1, 2, 3, 9, 4, 1, 2], 3, 1, 3, (9,), [3, 9]),  # cut at (and including) an EOS
        ([1, 5, 6, 1, 9, 1], 2, 1, 1, (9,), [5, 6]),  # the latest [1] is followed by EOS: the earlier one wins
        ([1, 9, 1, 9, 2, 1], 2, 1, 1, (9,), [9]),  # only EOS follows [1]: EOS is proposed
        ([3, 1, 9, 2, 1, 7, 3, 1], 2, 1, 2, (9,), [9]),  # the longer n-gram [3, 1] still beats unigram [1]
        ([4, 4], 3, 1, 3, (), [4]),
        ([1], 3, 1, 3, (), []),
        ([1, 2, 1], 0, 1, 3, (), []),
    ],
)
def test_find_continuation(seq, k, nmin, nmax, eos, expected):
    assert find_continuation(seq, k, nmin, nmax, set(eos)) == expected


# --- context limit ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_pair(tmp_path_factory):
    """A target with 32 positions and a draft with only 20 (draft limit tighter than target's)."""
    d = tmp_path_factory.mktemp("short")
    target = load_tiny(build_tiny_model(d / "t", seed=5, max_positions=32))
    draft = load_tiny(build_tiny_model(d / "d", seed=5, max_positions=20))  # same weights, shorter limit
    return target, draft


def test_prompt_that_does_not_fit_is_refused(short_pair):
    target, draft = short_pair
    engine = SpeculativeEngine(target, draft)
    with pytest.raises(PromptTooLongError) as e:
        engine.start(GenerationRequest(prompt_token_ids=[5] * 32, max_tokens=4))
    assert str(e.value) == (
        f"prompt is 32 tokens but the target '{target.name}' holds 32 positions; "
        "at most 31 prompt tokens leave room for one generated token"
    )


def test_max_tokens_over_the_context_is_refused_not_cut_short(short_pair):
    """A prompt that fits, with a max_tokens the caller set that does not fit beside it, was
    generated and silently cut at the context (finish reason context_length); it is refused with
    OpenAI's context_length_exceeded message and its numbers. At the limit it is answered in full."""
    target, draft = short_pair
    engine = SpeculativeEngine(target, draft)
    prompt = [(7 * i) % 250 + 3 for i in range(20)]
    with pytest.raises(ContextLengthExceededError) as e:
        engine.start(GenerationRequest(prompt_token_ids=prompt, max_tokens=13, ignore_eos=True))
    assert isinstance(e.value, InvalidRequestError)
    assert (e.value.prompt_tokens, e.value.max_tokens, e.value.limit) == (20, 13, 32)
    assert str(e.value) == (
        "This model's maximum context length is 32 tokens. However, you requested 33 tokens "
        "(20 in the prompt, 13 in the completion). Please reduce the length of the prompt or completion."
    )
    # exactly at the limit: accepted, all 12 tokens, ended by max_tokens
    res = engine.generate(GenerationRequest(prompt_token_ids=prompt, max_tokens=12, ignore_eos=True))
    assert res.finish_reason is FinishReason.MAX_TOKENS
    assert res.token_ids == target_greedy(target, prompt, 12)
    # a chat request names its messages
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    n = len(engine.encode(GenerationRequest(messages=msgs)))
    with pytest.raises(ContextLengthExceededError) as e:
        engine.start(GenerationRequest(messages=msgs, max_tokens=32 - n + 1))
    assert str(e.value) == (
        f"This model's maximum context length is 32 tokens. However, you requested 33 tokens "
        f"({n} in the messages, {33 - n} in the completion). Please reduce the length of the messages or completion."
    )


def test_check_context_length_bounds():
    """The one rule of both the engine and the router: the prompt alone must leave a position;
    an explicit max_tokens must fit beside it; a left-out one (None) never fails."""
    check_context_length(20, 12, 32, "the target 't'")  # at the limit
    check_context_length(31, None, 32, "the target 't'")  # no max_tokens: up to the context
    check_context_length(31, 1, 32, "the target 't'")
    with pytest.raises(ContextLengthExceededError, match=r"requested 33 tokens \(31 in the prompt, 2 in the"):
        check_context_length(31, 2, 32, "the target 't'")
    with pytest.raises(PromptTooLongError, match="prompt is 32 tokens but the target 't' holds 32 positions"):
        check_context_length(32, None, 32, "the target 't'")
    with pytest.raises(PromptTooLongError):  # the prompt alone is the clearer error
        check_context_length(40, 1, 32, "the target 't'")


@pytest.mark.parametrize("prompt_len", [1, 12, 19, 25, 31])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_k_shrinks_at_the_context_limit(short_pair, prompt_len, k):
    """Without max_tokens (the default, 128, is more than the 32 positions) the generation runs
    up to the context, as OpenAI's API without max_tokens; an explicit one over it is refused
    (:func:`test_max_tokens_over_the_context_is_refused_not_cut_short`)."""
    target, draft = short_pair
    engine = SpeculativeEngine(target, draft)
    prompt = [(7 * i) % 250 + 3 for i in range(prompt_len)]
    res = engine.generate(GenerationRequest(prompt_token_ids=prompt, ignore_eos=True, speculation={"k": k}))
    # the sequence fills the context exactly, never more
    assert res.finish_reason is FinishReason.CONTEXT_LENGTH
    assert prompt_len + len(res.token_ids) == 32
    ref = target_greedy(target, prompt, 32 - prompt_len)
    assert res.token_ids == ref[: len(res.token_ids)]
    # the draft (20 positions) stops proposing near its own limit; steps past it are plain
    assert max(res.stats.k_counts) <= k


def test_ngram_context_limit(short_pair):
    target, _ = short_pair
    engine = SpeculativeEngine(target)
    prompt = [9, 10, 11] * 10  # 30 tokens, lots to match
    res = engine.generate(GenerationRequest(prompt_token_ids=prompt, ignore_eos=True, speculation={"proposer": "ngram", "k": 8}))
    assert len(prompt) + len(res.token_ids) == 32
    assert res.finish_reason is FinishReason.CONTEXT_LENGTH


# --- logprobs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("proposer, k", [("draft", 4), ("ngram", 3), ("none", 0)])
def test_logprobs_equal_target_alone(tiny_target, tiny_draft_close, proposer, k):
    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    prompt = [40, 41, 42, 43, 40, 41]
    res = engine.generate(
        GenerationRequest(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True, logprobs=True, speculation={"proposer": proposer, "k": k})
    )
    seq = torch.tensor([prompt + res.token_ids])
    with torch.inference_mode():
        logits = tiny_target.model(seq).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    expected = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(res.token_ids)]
    assert len(res.logprobs) == len(res.token_ids) == 16
    assert res.logprobs == pytest.approx(expected, abs=1e-4)


# --- sampling ---------------------------------------------------------------------------------


def test_seed_reproducible_and_requests_independent(tiny_target, tiny_draft_close):
    engine = SpeculativeEngine(tiny_target, tiny_draft_close)

    def run(seed):
        return engine.generate(
            GenerationRequest(prompt="def add(a, b):", max_tokens=20, ignore_eos=True, sampling={"temperature": 1.0, "seed": seed}, speculation={"k": 3})
        ).token_ids

    a = run(1)
    b = run(2)
    assert run(1) == a
    assert a != b
    # interleaving another request does not change a seeded request's output
    gen1 = engine.start(GenerationRequest(prompt="def add(a, b):", max_tokens=20, ignore_eos=True, sampling={"temperature": 1.0, "seed": 1}, speculation={"k": 3}))
    gen2 = engine.start(GenerationRequest(prompt="def add(a, b):", max_tokens=20, ignore_eos=True, sampling={"temperature": 1.0, "seed": 2}, speculation={"k": 3}))
    while not (gen1.finished and gen2.finished):
        gen1.step()
        gen2.step()
    assert gen1.result().token_ids == a
    assert gen2.result().token_ids == b


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_speculative_samples_follow_target_distribution(tiny_target, tiny_draft_close, proposer, n=1500):
    """The joint distribution of the first two sampled tokens equals the target's own.

    With max_tokens=2 the step uses K=1: the first token is an accepted draft or a correction,
    the second a bonus token or a plain sample, so every path of the sampler is exercised. A
    noisy draft (or a lookup match the target does not always follow) gives both accepted and
    rejected drafts. Chi-square test over the top-k=3 support (9 cells);
    seeds are fixed, so the test is deterministic.
    """
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = [60, 61, 62]
    with torch.inference_mode():
        if proposer == "ngram":
            # X + [a] + X: prompt lookup proposes a (one-hot q); pick an a the target allows there
            for a in range(3, tiny_target.emittable_vocab):
                cand = prompt + [a] + prompt
                p_end = warp_probs(tiny_target.model(torch.tensor([cand])).logits[0, -1:].float(), params)[0]
                if 0.2 < float(p_end[a]) < 0.8:
                    prompt = cand
                    break
            assert len(prompt) == 7
        logits0 = tiny_target.model(torch.tensor([prompt])).logits[0, -1:].float()
        p0 = warp_probs(logits0, params)[0]
        firsts = p0.nonzero().flatten().tolist()
        cells, probs = [], []
        for a in firsts:
            l1 = tiny_target.model(torch.tensor([prompt + [a]])).logits[0, -1:].float()
            p1 = warp_probs(l1, params)[0]
            for b in p1.nonzero().flatten().tolist():
                cells.append((a, b))
                probs.append(float(p0[a]) * float(p1[b]))
    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    counts = {c: 0 for c in cells}
    proposed = accepted = 0
    for seed in range(n):
        res = engine.generate(
            GenerationRequest(
                prompt_token_ids=prompt, max_tokens=2, ignore_eos=True,
                sampling={"temperature": 1.0, "top_k": 3, "seed": seed},
                speculation={"proposer": proposer, "k": 1},
            )
        )
        proposed += res.stats.proposed
        accepted += res.stats.accepted
        key = tuple(res.token_ids)
        assert key in counts, key  # top-k never emits outside the allowed set
        counts[key] += 1
    assert proposed >= n  # every request drafted at least once
    assert 0 < accepted < proposed  # both the accept and the reject paths ran
    observed = [counts[c] for c in cells]
    expected = [p * n for p in probs]
    scale = n / sum(expected)
    res = chisquare(observed, [e * scale for e in expected])
    assert res.pvalue > 1e-3, (observed, expected)


# --- request errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, message",
    [
        ({"max_tokens": 4}, "invalid request: give exactly one of prompt, messages or prompt_token_ids"),
        ({"prompt": "", "max_tokens": 4}, "invalid request: prompt is empty"),
        ({"prompt": "x", "max_tokens": 0}, "invalid request: max_tokens: Input should be greater than or equal to 1"),
        ({"prompt": "x", "sampling": {"temperature": -1}}, "invalid request: sampling.temperature: Input should be greater than or equal to 0"),
        ({"prompt": "x", "sampling": {"top_p": 0}}, "invalid request: sampling.top_p: Input should be greater than 0"),
        ({"prompt": "x", "speculation": {"k": 17}}, "invalid request: speculation.k: Input should be less than or equal to 16"),
        ({"prompt": "x", "speculation": {"proposer": "eagle"}}, "invalid request: speculation.proposer: Input should be 'draft', 'ngram' or 'none'"),
        ({"prompt": "x", "stop": [""]}, "invalid request: stop strings must not be empty"),
        ({"prompt": "x", "sampling": {"temperature": float("nan")}}, "invalid request: sampling.temperature: Input should be a finite number"),
        ({"prompt": "x", "sampling": {"top_p": float("nan")}}, "invalid request: sampling.top_p: Input should be a finite number"),
        ({"prompt": "x", "speculation": {"draft_min_confidence": float("inf")}},
         "invalid request: speculation.draft_min_confidence: Input should be a finite number"),
        # top_k past the gRPC field's uint32 range (was accepted, then failed building the draft job's proto)
        ({"prompt": "x", "sampling": {"top_k": 2**32}},
         "invalid request: sampling.top_k: Input should be less than or equal to 4294967295"),
        # lone surrogates (a JSON \ud800 escape, undecodable argv bytes): no tokenizer encodes them
        ({"prompt": "ab\ud800cd"},
         "invalid request: prompt: not valid Unicode text: a lone surrogate U+D800 at character 2"),
        ({"messages": [{"role": "user", "content": "x\udcff"}]},
         "invalid request: messages.0.content: not valid Unicode text: a lone surrogate U+DCFF at character 1"),
        ({"prompt": "x", "stop": ["ok", "\udc80"]},
         "invalid request: stop: not valid Unicode text: a lone surrogate U+DC80 at character 0"),
    ],
)
def test_invalid_requests(data, message):
    with pytest.raises(InvalidRequestError) as e:
        parse_request(data)
    assert str(e.value) == message


@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 5e-324])
@pytest.mark.parametrize("proposer, k", [("draft", 3), ("ngram", 3), ("none", 0)])
def test_vanishing_temperature_samples_the_argmax(tiny_target, tiny_draft_close, temperature, proposer, k):
    """T -> 0 is greedy: no overflow to inf/nan (1e-40 and 5e-324 are below float32's range)."""
    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    prompt = [60, 61, 62, 63]
    res = engine.generate(GenerationRequest(
        prompt_token_ids=prompt, max_tokens=16, ignore_eos=True,
        sampling={"temperature": temperature, "seed": 1}, speculation={"proposer": proposer, "k": k},
    ))
    greedy = engine.generate(GenerationRequest(
        prompt_token_ids=prompt, max_tokens=16, ignore_eos=True, speculation={"proposer": "none", "k": 0},
    ))
    assert res.token_ids == greedy.token_ids


def test_bad_token_ids_and_missing_draft(tiny_target):
    engine = SpeculativeEngine(tiny_target)
    with pytest.raises(InvalidRequestError, match=r"prompt_token_ids: id 320 is outside the vocabulary 0\.\.319"):
        engine.start(GenerationRequest(prompt_token_ids=[1, 320]))
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids: id 400 is outside the vocabulary 0\.\.319"):
        engine.start(GenerationRequest(prompt="x", stop_token_ids=[2, 400]))
    with pytest.raises(InvalidRequestError, match="proposer 'draft' needs a draft model; none is loaded"):
        engine.start(GenerationRequest(prompt="x", speculation={"proposer": "draft"}))


def test_chat_messages_use_the_chat_template(tiny_target):
    engine = SpeculativeEngine(tiny_target)
    req = GenerationRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=3, speculation={"proposer": "none"})
    ids = engine.encode(req)
    assert tiny_target.tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_cancel_frees_caches(tiny_target, tiny_draft_close):
    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    gen = engine.start(GenerationRequest(prompt="def add(a, b):", max_tokens=50, ignore_eos=True, speculation={"k": 4}))
    gen.step()
    assert gen.target.seq.cache is not None and gen.proposer.seq.cache is not None
    gen.cancel()
    assert gen.finished and gen.result().finish_reason is FinishReason.CANCELLED
    assert gen.target.seq.cache is None and gen.proposer.seq.cache is None


def test_seeded_output_survives_session_rebuilds(tiny_target, tiny_draft_close):
    """Rebuilding both sessions from the token history mid-request (a replica restarted or the
    session moved) gives the same seeded sample: each step's randomness depends on (seed,
    position) only."""
    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    req = GenerationRequest(
        prompt="def add(a, b):", max_tokens=24, ignore_eos=True, sampling={"temperature": 1.0, "seed": 11}, speculation={"k": 3}
    )
    expected = engine.generate(req).token_ids
    gen = engine.start(req)
    for _ in range(3):
        gen.step()
    history = list(gen.target.token_ids)
    t_seed, d_seed = gen.target.seed, gen.proposer.seed
    gen.target.close()
    gen.proposer.close()
    gen.target = engine.verifier.open_session(history, req.sampling, t_seed)
    gen.proposer = engine.draft_proposer.open_session(history, req.sampling, d_seed)
    assert gen.run().token_ids == expected


def test_cli_prefetch_on_a_warm_cache_loads_nothing(tmp_path, monkeypatch, capsys):
    """prefetch loaded the model (transformers' "Loading weights" bars) to find the quantized
    cache entry already there: a warm cache is now recognised by its markers alone."""
    import argparse

    import torch

    from specdec import cli
    from specdec.models import cache, demo, loader
    from specdec.models.quant_cache import quantize_cached
    from specdec.testing.tiny import build_tiny_model

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    folder = build_tiny_model(tmp_path / "demo" / "target-bfloat16", seed=0)
    cache.write_marker(folder, source_sha256=demo.DEMO_MODELS["target"].sha256, dtype="bfloat16", name="tiny")
    model = load_tiny(folder).model.to(torch.bfloat16)
    assert quantize_cached(model, "int8", folder) == "built"  # the cache entry a real load leaves

    loads = []
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: loads.append(a) or argparse.Namespace(quant_cache="hit"))
    monkeypatch.setattr(demo, "ensure_demo_folder", lambda role, dtype: loads.append(role) or folder)
    assert cli.run_prefetch(argparse.Namespace(roles=["target"], weight_format="int8")) == 0
    assert cli.run_prefetch(argparse.Namespace(roles=["target"], weight_format="bfloat16")) == 0
    assert loads == []
    assert capsys.readouterr().out == (f"demo target int8: {tmp_path}/demo/target-int8 (already in the cache)\n"
                                       f"demo target: {folder} (already in the cache)\n")
    # a stale entry (another format's key) is rebuilt through the loader, as before
    assert cli.run_prefetch(argparse.Namespace(roles=["target"], weight_format="w8a8")) == 0
    assert len(loads) == 2 and loads[0] == "target"
    assert capsys.readouterr().out == (f"demo target: {folder}\n"
                                       f"demo target w8a8: {tmp_path}/demo/target-w8a8 (hit)\n")


def test_cli_prefetch_arguments():
    import argparse

    from specdec import cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli._add_prefetch(sub)
    assert parser.parse_args(["prefetch"]).roles == []  # run_prefetch then does both
    assert parser.parse_args(["prefetch", "target", "draft"]).roles == ["target", "draft"]
    with pytest.raises(cli.SpecDecError, match="prefetch: unknown role 'everything'"):
        cli.run_prefetch(parser.parse_args(["prefetch", "everything"]))
    assert parser.parse_args(["prefetch", "--format", "int4"]).weight_format == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["prefetch", "--format", "int3"])


def test_cli_generate_stream_with_json_prints_one_json_document(tiny_dir, tiny_target, tiny_draft_close, capsys):
    """``specdec generate --stream --json`` printed the streamed text before the JSON, so its
    output was not JSON (``| jq`` failed); --json now wins, as with ``specdec client``."""
    import json

    from specdec import cli

    argv = ["generate", "--target", str(tiny_dir / "target"), "--draft", str(tiny_dir / "draft_close"), "def f(",
            "--max-tokens", "5", "--temperature", "0", "-k", "2", "--json"]
    assert cli.main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main(argv + ["--stream"]) == 0
    streamed = json.loads(capsys.readouterr().out)
    ids = tiny_target.tokenizer.encode("def f(")
    assert streamed["token_ids"] == plain["token_ids"] == target_greedy(tiny_target, ids, 5)
    assert streamed["text"] == plain["text"]
