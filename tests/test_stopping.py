"""Stop conditions inside accepted blocks: EOS, stop ids, stop strings, max_tokens; streaming."""

from __future__ import annotations

import copy

import pytest
from transformers import PreTrainedTokenizerFast

from specdec.engine.engine import SpeculativeEngine
from specdec.models.loaded import LoadedModel
from specdec.request import GenerationRequest
from specdec.engine.stopping import OutputAssembler
from specdec.testing.tiny import build_tiny_model, build_tiny_tokenizer
from specdec.types import FinishReason
from tests.conftest import load_tiny

K = 4
PROMPT = "def fibonacci(n):"
N_REF = 24


@pytest.fixture(scope="module")
def text_target(tmp_path_factory):
    """A tiny target whose every token decodes to printable text (SentencePiece-style ``▁``)."""
    folder = tmp_path_factory.mktemp("text_target")
    model = load_tiny(build_tiny_model(folder, seed=3, tokenizer=build_tiny_tokenizer(kind="text")))
    # AutoTokenizer rebuilds a byte-level Qwen2Tokenizer for a qwen2 config, ignoring the
    # SentencePiece-style pipeline in tokenizer.json; load that pipeline as it is.
    model.tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def engine(text_target):
    # A draft equal to the target accepts everything: every step emits a block of K + 1 = 5
    # tokens, so token j sits at position j % 5 of block j // 5.
    return SpeculativeEngine(text_target, text_target)


@pytest.fixture(scope="module")
def ref(engine):
    res = engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=N_REF, ignore_eos=True, speculation={"k": K}))
    assert res.stats.k_counts == {K: 4, 3: 1}  # 4 blocks of 5 tokens, then K capped by max_tokens
    return res.token_ids


def with_eos(model: LoadedModel, eos: int) -> LoadedModel:
    """The same model, but ending generations at ``eos``."""
    m = copy.copy(model)
    m.__class__ = type("WithEos", (LoadedModel,), {"eos_token_ids": property(lambda self: [eos])})
    return m


def first_occurrences(ref: list[int]) -> list[int]:
    return [j for j in range(len(ref)) if ref[j] not in ref[:j]]


def test_eos_at_every_position_of_a_block(text_target, ref):
    decode = text_target.tokenizer.decode
    positions = first_occurrences(ref)[:12]
    assert {j % (K + 1) for j in positions} == set(range(K + 1))  # every block position covered
    for j in positions:
        target = with_eos(text_target, ref[j])
        engine = SpeculativeEngine(target, target)
        res = engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=N_REF, speculation={"k": K}))
        assert res.finish_reason is FinishReason.EOS
        assert res.token_ids == ref[: j + 1]  # the EOS id is the last id
        assert res.text == decode(ref[:j])  # its text is not
        assert res.usage.completion_tokens == j + 1


def test_stop_token_at_every_position_of_a_block(engine, text_target, ref):
    for j in first_occurrences(ref)[:12]:
        res = engine.generate(
            GenerationRequest(prompt=PROMPT, max_tokens=N_REF, ignore_eos=True, stop_token_ids=[ref[j]], speculation={"k": K})
        )
        assert res.finish_reason is FinishReason.STOP_TOKEN
        assert res.token_ids == ref[: j + 1]
        assert res.text == text_target.tokenizer.decode(ref[:j])


@pytest.mark.parametrize("max_tokens", range(1, 2 * K + 3))
def test_max_tokens_never_exceeded(engine, text_target, ref, max_tokens):
    res = engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=max_tokens, ignore_eos=True, speculation={"k": K}))
    assert res.finish_reason is FinishReason.MAX_TOKENS
    assert res.token_ids == ref[:max_tokens]
    assert res.usage.completion_tokens == max_tokens
    assert res.stats.accepted + res.stats.steps == max_tokens  # no token generated past the limit


def _clean_span(text: str, start: int, end: int) -> str:
    span = text[start:end]
    assert "\ufffd" not in span and span, span
    return span


def test_stop_string_spanning_two_blocks(engine, text_target, ref):
    decode = text_target.tokenizer.decode
    full = decode(ref)
    boundary = len(decode(ref[: K + 1]))  # end of the first block's text
    stop = _clean_span(full, boundary - 2, boundary + 2)
    cut = full.find(stop)
    res = engine.generate(
        GenerationRequest(prompt=PROMPT, max_tokens=N_REF, ignore_eos=True, stop=[stop], speculation={"k": K})
    )
    assert res.finish_reason is FinishReason.STOP_STRING
    assert res.text == full[:cut]
    # ids: exactly the tokens whose text lies entirely before the match
    kept = max(n for n in range(len(ref) + 1) if len(decode(ref[:n])) <= cut)
    assert res.token_ids == ref[:kept]
    assert decode(res.token_ids) == full[: len(decode(ref[:kept]))]


def test_two_stop_strings_completing_in_one_block(engine, text_target, ref):
    decode = text_target.tokenizer.decode
    full = decode(ref)
    b1, b2 = len(decode(ref[: K + 1])), len(decode(ref[: 2 * (K + 1)]))  # second block's text
    assert b2 - b1 >= 4
    # s_late starts first but completes last; s_early completes first: s_early wins.
    s_late = _clean_span(full, b1, b2)
    s_early = _clean_span(full, b1 + 1, b2 - 1)
    assert full.find(s_early) == b1 + 1 and full.find(s_late) == b1
    res = engine.generate(
        GenerationRequest(
            prompt=PROMPT, max_tokens=N_REF, ignore_eos=True, stop=[s_late, s_early], speculation={"k": K}
        )
    )
    assert res.finish_reason is FinishReason.STOP_STRING
    assert res.text == full[: b1 + 1]


def test_first_condition_to_fire_wins(engine, text_target, ref):
    decode = text_target.tokenizer.decode
    j = first_occurrences(ref)[6]
    # a stop string that completes after the stop token does not fire
    later = _clean_span(decode(ref), len(decode(ref[: j + 2])) - 2, len(decode(ref[: j + 2])))
    res = engine.generate(
        GenerationRequest(
            prompt=PROMPT, max_tokens=N_REF, ignore_eos=True, stop=[later], stop_token_ids=[ref[j]], speculation={"k": K}
        )
    )
    assert decode(ref).find(later) >= len(decode(ref[:j]))  # it would complete after token j
    assert res.finish_reason is FinishReason.STOP_TOKEN
    assert res.token_ids == ref[: j + 1]
    # max_tokens equal to the stop token's position + 1: the stop token fires (checked first)
    res = engine.generate(
        GenerationRequest(prompt=PROMPT, max_tokens=j + 1, ignore_eos=True, stop_token_ids=[ref[j]], speculation={"k": K})
    )
    assert res.finish_reason is FinishReason.STOP_TOKEN


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"max_tokens": 7},
        {"logprobs": True},
        {"speculation": {"proposer": "none"}},
        {"speculation": {"proposer": "ngram", "k": 3}},
        {"sampling": {"temperature": 0.8, "top_k": 20, "seed": 4}},
    ],
)
def test_stream_concatenates_to_unary(engine, text_target, ref, extra):
    decode = text_target.tokenizer.decode
    full = decode(ref)
    b = len(decode(ref[: K + 1]))
    stop = _clean_span(full, b - 1, b + 3)
    base = {"prompt": PROMPT, "max_tokens": N_REF, "ignore_eos": True, "stop": [stop], "speculation": {"k": K}}
    req = GenerationRequest.model_validate({**base, **extra})
    unary = engine.generate(req)
    chunks = list(engine.stream(req))
    assert chunks[-1].finish_reason is unary.finish_reason
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == unary.token_ids
    if req.logprobs:
        assert [x for c in chunks for x in c.logprobs] == unary.logprobs
    for c in chunks:
        assert stop not in c.text


def test_assembler_stop_string_starting_mid_token(text_target):
    tok = text_target.tokenizer
    ids = tok.encode("return a + b\n")
    text = tok.decode(ids)
    a = OutputAssembler(tok, max_tokens=50, stop=["n a"])  # starts inside the token of "return"
    a.add(ids)
    assert a.finish_reason is FinishReason.STOP_STRING
    assert a.text == "retur"
    for n in range(len(ids) + 1):
        if len(tok.decode(ids[:n])) > len("retur"):
            break
    assert a.token_ids == ids[: n - 1]
    assert tok.decode(a.token_ids) == text[: len(tok.decode(a.token_ids))]


@pytest.mark.parametrize("kind", ["text", "bytelevel"])
def test_special_tokens_are_skipped_in_text_as_vllm_does(tmp_path, kind):
    """With ``ignore_eos`` the text held ``<|im_end|>`` for every EOS generated past; vLLM's
    default (``skip_special_tokens=True``) drops special tokens' text and keeps their ids."""
    folder = build_tiny_model(tmp_path / kind, seed=3, tokenizer=build_tiny_tokenizer(kind=kind))
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    eos = tok.eos_token_id
    ids = tok.encode("return a") + [eos] + tok.encode(" + b") + [eos]
    assert tok.decode(ids) == "return a<|im_end|> + b<|im_end|>"  # what the text was
    a = OutputAssembler(tok, max_tokens=50)
    for t in ids:
        a.add([t])
    assert a.text == "return a + b" and a.token_ids == ids
    # the EOS's (empty) text ends where " a" ends, not after the next token's " +"
    assert a.detok.offsets[len(tok.encode("return a"))] == len("return a")
    # a stop string right after the EOS keeps the EOS, whose text lies before the match
    b = OutputAssembler(tok, max_tokens=50, stop=[" +"])
    b.add(ids)
    assert b.finish_reason is FinishReason.STOP_STRING and b.text == "return a"
    assert b.token_ids == ids[: len(tok.encode("return a")) + 1]


def test_ignore_eos_text_has_no_special_token_text(text_target):
    """End to end: a generation forced onto EOS with ``ignore_eos`` has its ids, and no text."""
    eos = text_target.tokenizer.eos_token_id
    engine = SpeculativeEngine(text_target, text_target)
    req = GenerationRequest(prompt=PROMPT, max_tokens=5, ignore_eos=True, speculation={"k": K},
                            sampling={"temperature": 0.0, "logit_bias": {eos: 100.0}})
    res = engine.generate(req)
    assert res.token_ids == [eos] * 5 and res.text == ""
    assert "".join(c.text for c in engine.stream(req)) == ""
