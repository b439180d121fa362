"""A model process that never encodes or decodes text keeps its tokenizer's facts only
(specdec.models.loaded.TokenizerFacts): the TP rank's LoadedModel (deployments/tp_load.py)."""

from __future__ import annotations

import torch

from specdec.models.loaded import LoadedModel, TokenizerFacts
from specdec.testing.tiny import build_tiny_model, build_tiny_tokenizer


def test_facts_are_the_length_and_eos_id():
    tok = build_tiny_tokenizer()
    facts = TokenizerFacts.of(tok)
    assert (len(facts), facts.eos_token_id, facts.pad_token_id) == (len(tok), tok.eos_token_id, tok.pad_token_id) == (320, 2, 0)
    assert TokenizerFacts.of(facts) is facts


def test_a_loaded_model_with_facts_has_the_same_limits_and_eos_ids(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model(tmp_path / "m", vocab_rows=384)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = build_tiny_tokenizer()
    full = LoadedModel("m", model, tok, 256, 384)
    lean = LoadedModel("m", model, TokenizerFacts.of(tok), 256, 384)
    assert (lean.emittable_vocab, lean.eos_token_ids) == (full.emittable_vocab, full.eos_token_ids) == (320, [2])


def test_the_tp_rank_keeps_no_tokenizer(tmp_path):
    from deployments.tp_load import load_tp_model

    folder = build_tiny_model(tmp_path / "m", vocab_rows=384)
    loaded = load_tp_model(str(folder), 0, 1, "w8a8")
    assert loaded.tokenizer == TokenizerFacts(320, 2, 0)
    assert (loaded.emittable_vocab, loaded.eos_token_ids) == (320, [2])
    with torch.inference_mode():
        assert loaded.model(torch.tensor([[1, 5, 9]])).logits.shape == (1, 3, 384)
