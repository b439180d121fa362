"""Batched forwards on a Llama-architecture model (SmolLM2, TinyLlama, ...), not only Qwen2.

Llama's forward builds its mask with ``create_causal_mask``, which takes a 4-D tensor as given but
not the ``{"full_attention": mask}`` mapping that Qwen2 (a model with layer types) accepts; the
packed forward passed the mapping, so every batched step of a Llama model failed with
``AttributeError: 'dict' object has no attribute 'ndim'`` (served: INTERNAL on the second
concurrent request, found serving SmolLM2-135M as target and draft).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.engine.batch import BatchScheduler
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.kv_cache import CachedSequence, feed_many
from specdec.request import GenerationRequest
from specdec.testing.tiny import build_tiny_tokenizer
from tests.conftest import load_tiny


def _tiny_llama(folder, seed: int):
    tok = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape) * 0.5)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return load_tiny(folder)


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("llamapair")
    return _tiny_llama(d / "t", 0), _tiny_llama(d / "d", 1)


def test_feed_many_on_llama_equals_separate_forwards(llama_pair):
    target, _ = llama_pair
    assert type(target.model).__name__ == "LlamaForCausalLM"
    alone = [CachedSequence(target.model, []) for _ in range(3)]
    packed = [CachedSequence(target.model, []) for _ in range(3)]
    for a, b, n in zip(alone, packed, [3, 10, 1]):
        a.feed(list(range(5, 5 + n)), keep=1)
        b.feed(list(range(5, 5 + n)), keep=1)
    news = [[7, 8], [9], [10, 11, 12]]
    ref = [s.feed(t, keep=len(t)) for s, t in zip(alone, news)]
    got = feed_many([(s, t, len(t)) for s, t in zip(packed, news)])
    for r, g, t in zip(ref, got, news):
        assert g.shape == (len(t), target.vocab_rows)
        assert torch.allclose(r, g, atol=1e-4, rtol=1e-4)
        assert torch.equal(r.argmax(-1), g.argmax(-1))
    assert [s.cached for s in packed] == [s.cached for s in alone]


def test_batched_llama_pair_outputs_equal_requests_alone(llama_pair):
    engine = SpeculativeEngine(*llama_pair)
    reqs = [GenerationRequest(prompt_token_ids=[5 + i, 9, 12, 5 + i, 9], max_tokens=12, ignore_eos=True,
                              speculation={"proposer": proposer, "k": k})
            for i, (proposer, k) in enumerate([("draft", 0), ("draft", 2), ("draft", 4), ("ngram", 3)])]
    alone = [engine.generate(r).token_ids for r in reqs]
    sched = BatchScheduler(engine, max_batch_positions=64)
    handles = [sched.submit(r) for r in reqs]
    sched.run_until_idle()
    assert [h.result().token_ids for h in handles] == alone
    assert all(len(ids) == 12 for ids in alone)
    assert max(len(t.answered) for t in sched.trace) == 4  # the four rows shared forwards
