"""Greedy drafting takes the argmax over the emittable ids only (no masked copy of the logits).

A padded draft (384 embedding rows for a 320-token tokenizer) whose padding rows are made to
outscore the real ids: the drafted ids must still be the masked argmax, i.e. exactly what the
same model decodes alone (the verifier masks the padding rows), with every draft accepted.
"""

from __future__ import annotations

import pytest
import torch

from specdec.engine.engine import SpeculativeEngine
from specdec.request import GenerationRequest
from specdec.testing.tiny import build_tiny_model
from tests.conftest import load_tiny

PROMPT = [5, 17, 42, 9, 100, 7, 23]


@pytest.fixture(scope="module")
def loud_padding(tmp_path_factory):
    """A tiny model with 64 padding rows, each 10x the output row of a real id (0..63)."""
    m = load_tiny(build_tiny_model(tmp_path_factory.mktemp("loudpad") / "m", seed=1, vocab_rows=384))
    assert m.emittable_vocab == 320 and m.vocab_rows == 384
    head = m.model.lm_head.weight
    with torch.no_grad():
        head[320:384] = 10 * head[0:64]
    return m


def test_greedy_draft_never_proposes_padding_ids_and_equals_the_model_alone(loud_padding):
    m = loud_padding
    req = dict(prompt_token_ids=PROMPT, max_tokens=24, ignore_eos=True, sampling={"temperature": 0.0})
    alone = SpeculativeEngine(m).generate(GenerationRequest(**req, speculation={"proposer": "none"}))
    spec = SpeculativeEngine(m, m).generate(GenerationRequest(**req, speculation={"proposer": "draft", "k": 4}))
    assert spec.token_ids == alone.token_ids and len(alone.token_ids) == 24
    assert max(alone.token_ids) < 320
    stats = spec.stats
    assert stats.accepted == stats.proposed > 0  # the draft is the target: every draft accepted
    # the padding rows do win the unmasked argmax on this path (else the test could not fail)
    with torch.inference_mode():
        logits = m.model(input_ids=torch.tensor([PROMPT + alone.token_ids[:-1]])).logits[0, len(PROMPT) - 1:]
    assert int((logits.argmax(-1) >= 320).sum()) > 0
