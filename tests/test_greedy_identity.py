"""Greedy speculative output equals the target alone, token for token (tiny models)."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.engine.engine import SpeculativeEngine
from specdec.request import GenerationRequest
from specdec.engine.sampling import greedy_token
from specdec.types import DraftBlock, FinishReason
from tests.conftest import load_tiny, target_greedy
from specdec.testing.tiny import build_tiny_model

MAX_NEW = 24


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [
        [rng.randrange(3, vocab) for _ in range(n)]  # ids 0..2 are special tokens
        for n in (1, 2, 7, 31)
    ]


class AlwaysWrongSession:
    """A proposer session that proposes, at every position, a token the target will reject.

    It runs the target greedily itself and proposes ``argmax + 1``: the worst possible draft.
    """

    def __init__(self, target, token_ids):
        self.target = target
        self._ids = list(token_ids)

    @property
    def token_ids(self):
        return self._ids

    @torch.inference_mode()
    def propose(self, k):
        ids = list(self._ids)
        out = []
        for _ in range(k):
            logits = self.target.model(torch.tensor([ids])).logits[0, -1]
            right = int(greedy_token(logits))
            wrong = (right + 1) % self.target.emittable_vocab
            out.append(wrong)
            ids.append(right)  # continue along the target's own path
        return DraftBlock(token_ids=torch.tensor(out, dtype=torch.long))

    def commit(self, token_ids):
        self._ids.extend(token_ids)

    def close(self):
        pass


@pytest.fixture(scope="module")
def references(tiny_target):
    return {tuple(p): target_greedy(tiny_target, p, MAX_NEW) for p in _prompts(tiny_target.emittable_vocab)}


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("draft_kind", ["equal", "close", "far"])
def test_draft_proposer_matches_target(k, draft_kind, tiny_target, tiny_draft_close, tiny_draft_far, references):
    draft = {"equal": tiny_target, "close": tiny_draft_close, "far": tiny_draft_far}[draft_kind]
    engine = SpeculativeEngine(tiny_target, draft)
    for prompt, ref in references.items():
        req = GenerationRequest(prompt_token_ids=list(prompt), max_tokens=MAX_NEW, speculation={"proposer": "draft", "k": k})
        res = engine.generate(req)
        assert res.token_ids == ref, (draft_kind, k, prompt)
        assert res.usage.completion_tokens == len(ref)
        assert res.usage.prompt_tokens == len(prompt)
        s = res.stats
        # every step emits accepted + 1 tokens; K is capped so max_tokens is never overshot
        if res.finish_reason is FinishReason.MAX_TOKENS:
            assert s.accepted + s.steps == len(ref)
        else:
            assert s.accepted + s.steps >= len(ref)
        if draft_kind == "equal":
            # a draft equal to the target is never rejected
            assert s.accepted == s.proposed
            assert s.rejected_steps == 0


@pytest.mark.parametrize("k", range(1, 9))
def test_ngram_proposer_matches_target(k, tiny_target, references):
    engine = SpeculativeEngine(tiny_target)
    for prompt, ref in references.items():
        # A prompt that repeats itself gives prompt lookup something to match.
        doubled = list(prompt) * 2
        ref2 = target_greedy(tiny_target, doubled, MAX_NEW)
        for p, r in ((list(prompt), ref), (doubled, ref2)):
            res = engine.generate(
                GenerationRequest(prompt_token_ids=p, max_tokens=MAX_NEW, speculation={"proposer": "ngram", "k": k})
            )
            assert res.token_ids == r, (k, p)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_always_wrong_draft_matches_target_and_accepts_nothing(k, tiny_target, references):
    engine = SpeculativeEngine(tiny_target)
    for prompt, ref in references.items():
        gen = engine.start(GenerationRequest(prompt_token_ids=list(prompt), max_tokens=MAX_NEW, speculation={"proposer": "none", "k": 0}))
        gen.proposer = AlwaysWrongSession(tiny_target, prompt)
        gen._k = k
        res = gen.run()
        assert res.token_ids == ref
        assert res.stats.accepted == 0
        # every step emits exactly one token (the correction)
        assert res.stats.steps == len(ref)
        assert res.stats.proposed > 0


@pytest.mark.parametrize("model_seed", [11, 12, 13])
def test_identity_over_model_seeds_and_text_prompts(model_seed, tmp_path):
    target = load_tiny(build_tiny_model(tmp_path / "t", seed=model_seed))
    draft = load_tiny(build_tiny_model(tmp_path / "d", seed=model_seed + 100, base=target.model, noise=0.02))
    engine = SpeculativeEngine(target, draft)
    for text in ["def add(a, b):", 'SELECT id FROM users WHERE', '{"name": "specdec", "tags": [']:
        ids = target.tokenizer.encode(text)
        ref = target_greedy(target, ids, MAX_NEW)
        for k in (1, 3, 5, 8):
            for proposer in ("draft", "ngram"):
                res = engine.generate(GenerationRequest(prompt=text, max_tokens=MAX_NEW, speculation={"proposer": proposer, "k": k}))
                assert res.token_ids == ref, (model_seed, text, k, proposer)
                if res.finish_reason is not FinishReason.EOS:
                    assert res.text == target.tokenizer.decode(ref, skip_special_tokens=True)  # as vLLM


def test_plain_decoding_matches_target(tiny_target, references):
    engine = SpeculativeEngine(tiny_target)
    for prompt, ref in references.items():
        res = engine.generate(GenerationRequest(prompt_token_ids=list(prompt), max_tokens=MAX_NEW, speculation={"proposer": "none"}))
        assert res.token_ids == ref
        assert res.stats.proposed == 0
        assert res.stats.steps == len(ref)
