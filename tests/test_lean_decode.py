"""The lean forward (specdec/models/lean_decode.py): bitwise transformers' forward for decode steps,
one sequence's blocks and prefill chunks, and packed forwards of several sequences; used only for
the calls the engine makes; the draft's proposals unchanged."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specdec.engine.engine import SpeculativeEngine
from specdec.engine.kv_cache import CachedSequence, feed_many
from specdec.engine.proposers.draft_model import DraftModelProposer
from specdec.models import lean_decode
from specdec.models.loader import load_model
from specdec.models.spec import HFModelSpec
from specdec.request import GenerationRequest, SamplingParams
from specdec.testing.tiny import build_tiny_model

FORMATS = ("bfloat16", "int8", "int4", "w8a8", "w7a8")
PROMPT = [1, 5, 9, 33, 70, 100, 7, 8, 250, 3, 44, 12]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # hidden 128: every int4 projection group fuses (test_fused.py), so fused and plain paths both run
    return build_tiny_model(tmp_path_factory.mktemp("lean") / "m", seed=5, hidden_size=128, max_positions=512)


@pytest.fixture(scope="module")
def models(folder):
    return {fmt: load_model(HFModelSpec(path=folder), weight_format=fmt) for fmt in FORMATS}


def _steps(model, tokens, lean: bool):
    """Prefill PROMPT through transformers, then decode ``tokens`` one at a time (lean or not):
    the logits of every step and the final cache's keys and values."""
    cache = DynamicCache(config=model.config)
    out = []
    with torch.inference_mode():
        model(input_ids=torch.tensor([PROMPT]), cache=cache, use_cache=True, logits_to_keep=1)
        for t in tokens:
            ids = torch.tensor([[t]])
            if lean:
                logits = lean_decode.decode_one(model, ids, cache)
            else:
                logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
            out.append(logits)
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    return torch.cat(out), kv


@pytest.mark.parametrize("fmt", FORMATS)
def test_lean_decode_is_bitwise_transformers_forward(models, fmt):
    m = models[fmt]
    lean_decode.uninstall(m.model)
    tokens = [17, 200, 3, 3, 99, 301, 45, 0, 128, 64] * 3
    ref, ref_kv = _steps(m.model, tokens, lean=False)
    got, got_kv = _steps(m.model, tokens, lean=True)
    assert got.dtype == ref.dtype and got.shape == ref.shape == (len(tokens), 1, m.vocab_rows)
    assert torch.equal(got, ref)
    for (k1, v1), (k2, v2) in zip(ref_kv, got_kv):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_lean_decode_from_an_empty_cache_equals_transformers(models):
    m = models["w8a8"].model
    lean_decode.uninstall(m)
    with torch.inference_mode():
        ref = m(input_ids=torch.tensor([[7]]), cache=DynamicCache(config=m.config), use_cache=True).logits
        got = lean_decode.decode_one(m, torch.tensor([[7]]), DynamicCache(config=m.config))
    assert torch.equal(got, ref)


def _blocks(model, lean: bool):
    """Prefill PROMPT (all logits), then blocks of 5, 1, 3 and 9 positions with every form of
    ``logits_to_keep`` (all, the last n, an index tensor), through the model's forward, wrapped by
    lean decode or not: the logits of every call and the final cache's keys and values."""
    if lean:
        lean_decode.install(model)
    cache = DynamicCache(config=model.config)
    out = []
    try:
        with torch.inference_mode():
            out.append(model(input_ids=torch.tensor([PROMPT]), cache=cache, use_cache=True).logits)
            for block, keep in (([17, 200, 3, 3, 99], 0), ([5], 1), ([301, 45, 0], 2),
                                ([128, 64, 1, 2, 3, 4, 5, 6, 7], torch.tensor([0, 4, 8]))):
                out.append(model(input_ids=torch.tensor([block]), cache=cache, use_cache=True,
                                 logits_to_keep=keep).logits)
    finally:
        lean_decode.uninstall(model)
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    return out, kv


@pytest.mark.parametrize("fmt", FORMATS)
def test_lean_blocks_and_prefill_are_bitwise_transformers_forward(models, fmt, monkeypatch):
    """One sequence's prefill and verify blocks through lean_forward: the logits (every kept
    position) and the cached keys and values are bitwise transformers' forward."""
    m = models[fmt].model
    calls = []
    real = lean_decode.lean_forward
    monkeypatch.setattr(lean_decode, "lean_forward", lambda *a, **k: calls.append(a[1].shape[1]) or real(*a, **k))
    ref, ref_kv = _blocks(m, lean=False)
    assert calls == []
    got, got_kv = _blocks(m, lean=True)
    assert calls == [len(PROMPT), 5, 1, 3, 9]  # the one-position block by decode_one
    assert [tuple(g.shape) for g in got] == [(1, len(PROMPT), m.config.vocab_size), (1, 5, m.config.vocab_size),
                                            (1, 1, m.config.vocab_size), (1, 2, m.config.vocab_size),
                                            (1, 3, m.config.vocab_size)]
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(ref_kv, got_kv):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def _packed(model, lean: bool):
    """Three sequences of 12, 30 and 1 cached tokens, then two packed forwards over them with
    ragged new tokens (1 / 5 / 3, then 9 / 1 / 2) and ragged kept logits (one a prefill chunk
    keeping none): every returned logits tensor and every sequence's cached keys and values."""
    if lean:
        lean_decode.install(model)
    seqs = []
    try:
        for n in (12, 30, 1):
            ids = [(7 * i + n) % 300 for i in range(n)]
            s = CachedSequence(model, list(ids))
            s.feed(ids, keep=1)
            seqs.append(s)
        out = feed_many([(seqs[0], [5], 1), (seqs[1], [9, 8, 7, 6, 5], 5), (seqs[2], [1, 2, 3], 0)])
        out += feed_many([(seqs[0], [4, 3, 2, 1, 0, 11, 12, 13, 14], 3), (seqs[1], [44], 1), (seqs[2], [6, 7], 2)])
    finally:
        lean_decode.uninstall(model)
    kv = [[(layer.keys.clone(), layer.values.clone()) for layer in s.cache.layers] for s in seqs]
    return out, kv


@pytest.mark.parametrize("fmt", FORMATS)
def test_lean_packed_forward_is_bitwise_transformers_forward(models, fmt, monkeypatch):
    """A packed forward of several sequences (feed_many: ragged caches, ragged new positions, a
    prefill chunk beside decode rows and blocks) through lean_forward: every row's logits and every
    sequence's cache bitwise transformers' forward."""
    m = models[fmt].model
    packed = []
    real = lean_decode.lean_forward
    monkeypatch.setattr(lean_decode, "lean_forward",
                        lambda *a, **k: packed.append(len(a) > 3 and a[3] is not None) or real(*a, **k))
    ref, ref_kv = _packed(m, lean=False)
    assert packed == []
    got, got_kv = _packed(m, lean=True)
    assert packed.count(True) == 2  # the two packed forwards (position ids given); the rest: the feeds
    assert [tuple(g.shape) for g in got] == [(1, m.config.vocab_size), (5, m.config.vocab_size), (0, m.config.vocab_size),
                                            (3, m.config.vocab_size), (1, m.config.vocab_size), (2, m.config.vocab_size)]
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    for seq_ref, seq_got in zip(ref_kv, got_kv):
        for (k1, v1), (k2, v2) in zip(seq_ref, seq_got):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_install_routes_only_the_engines_calls(models, monkeypatch):
    m = models["w8a8"].model
    assert lean_decode.install(m) and lean_decode.install(m)  # idempotent
    calls = []
    real_one, real = lean_decode.decode_one, lean_decode.lean_forward
    monkeypatch.setattr(lean_decode, "decode_one", lambda *a: calls.append("one") or real_one(*a))
    monkeypatch.setattr(lean_decode, "lean_forward", lambda *a, **k: calls.append(a[1].shape[1]) or real(*a, **k))
    try:
        with torch.inference_mode():
            cache = DynamicCache(config=m.config)
            m(input_ids=torch.tensor([PROMPT]), cache=cache, use_cache=True, logits_to_keep=1)  # prefill
            assert calls == [len(PROMPT)]
            m(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True, logits_to_keep=1)
            assert calls[1:] == ["one", 1]  # decode_one is lean_forward of one position
            m(input_ids=torch.tensor([[5, 6]]), cache=cache, use_cache=True, logits_to_keep=2)  # a block
            m(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True, logits_to_keep=torch.tensor([0]))
            assert calls[3:] == [2, 1]
            del calls[:]
            # transformers' own calls: position ids without the packed cache view, a 2-D mask,
            # embeddings, a float logits_to_keep, a batch of two rows
            m(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True,
              position_ids=torch.tensor([[len(PROMPT) + 5]]))
            m(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True,
              attention_mask=torch.ones(1, len(PROMPT) + 7, dtype=torch.long))
            m(inputs_embeds=m.model.embed_tokens(torch.tensor([[5]])), cache=cache, use_cache=True)
            m(input_ids=torch.tensor([[5, 6], [7, 8]]), cache=DynamicCache(config=m.config), use_cache=True)
            assert calls == []
            lean_decode.MULTI_POSITION = False  # sessions 12-23: plain decode steps only
            m(input_ids=torch.tensor([[5, 6]]), cache=cache, use_cache=True, logits_to_keep=2)
            assert calls == []
            m(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True)
            assert calls == ["one", 1]
        m(input_ids=torch.tensor([[5]]), cache=DynamicCache(config=m.config), use_cache=True)  # not inference mode
        assert calls == ["one", 1]
    finally:
        lean_decode.MULTI_POSITION = True
        lean_decode.uninstall(m)
    assert "forward" not in vars(m)


def test_float32_model_is_not_wrapped(folder):
    m = load_model(HFModelSpec(path=folder), weight_format="float32")  # not shape-invariant
    assert "row-wise attention" in lean_decode.eligible(m.model)
    assert not lean_decode.install(m.model)


@pytest.mark.parametrize("fmt", ["w8a8", "int4"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_draft_proposals_and_q_are_unchanged(folder, models, fmt, temperature):
    """Blocks (tokens, q ids, q probabilities) drafted with the lean path equal those without."""
    sampling = SamplingParams(temperature=temperature, seed=11)

    def blocks(lean: bool):
        m = models[fmt]
        lean_decode.uninstall(m.model)
        proposer = DraftModelProposer(m, lean=lean)
        assert getattr(m.model, "_specdec_lean_decode", False) == lean
        s = proposer.open_session(list(PROMPT), sampling, seed=3)
        out = []
        for step in range(6):
            b = s.propose(5)
            out.append(b)
            s.commit(b.token_ids[:2].tolist() + [(step * 37) % 300])  # a partial acceptance + correction
        lean_decode.uninstall(m.model)
        return out

    plain, lean = blocks(False), blocks(True)
    for a, b in zip(plain, lean):
        assert torch.equal(a.token_ids, b.token_ids)
        if temperature:
            assert torch.equal(a.q_ids, b.q_ids) and torch.equal(a.q_probs, b.q_probs)


def test_engine_output_with_lean_draft_is_the_target_alone(folder, models):
    target = load_model(HFModelSpec(path=folder), weight_format="w8a8")  # its own copy: not wrapped
    draft = models["w8a8"]
    eng = SpeculativeEngine(target, draft, lean_target=False)
    assert getattr(draft.model, "_specdec_lean_decode", False) and "forward" not in vars(target.model)
    req = dict(prompt_token_ids=PROMPT, max_tokens=40, ignore_eos=True)
    alone = eng.generate(GenerationRequest(**req, speculation={"proposer": "none", "k": 0})).token_ids
    for k in (1, 4, 8):
        assert eng.generate(GenerationRequest(**req, speculation={"k": k})).token_ids == alone
    lean_decode.uninstall(draft.model)


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' ``generate`` (greedy, ``n`` new tokens, EOS ignored): the bench's target alone."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("fmt", ["w8a8", "int4", "bfloat16"])
def test_lean_target_plain_decode_is_transformers_generate(folder, fmt, monkeypatch):
    """The engine's lean target (the default): K = 0 steps run decode_one (one per step after the
    prefill), transformers' generate on the same wrapped model never does, and both give the
    unwrapped model's tokens; speculation at K = 1/4/8 (verify blocks through lean_forward too)
    gives them too."""
    target = load_model(HFModelSpec(path=folder), weight_format=fmt)  # its own copy
    draft = load_model(HFModelSpec(path=folder), weight_format="w8a8")
    n = 40
    ref = _hf_greedy(target.model, PROMPT, n)  # not wrapped yet
    eng = SpeculativeEngine(target, draft)
    assert eng.verifier.lean and getattr(target.model, "_specdec_lean_decode", False)
    calls = []
    real = lean_decode.decode_one
    monkeypatch.setattr(lean_decode, "decode_one", lambda m, *a: calls.append(m) or real(m, *a))
    assert _hf_greedy(target.model, PROMPT, n) == ref
    assert calls == []  # generate passes an attention mask: transformers' forward every step
    req = dict(prompt_token_ids=PROMPT, max_tokens=n, ignore_eos=True)
    plain = eng.generate(GenerationRequest(**req, speculation={"proposer": "none", "k": 0}))
    assert plain.token_ids == ref
    assert [m is target.model for m in calls] == [True] * (n - 1)  # every step after the prefill's
    for k in (1, 4, 8):
        assert eng.generate(GenerationRequest(**req, speculation={"k": k})).token_ids == ref
    lean_decode.uninstall(target.model)
    lean_decode.uninstall(draft.model)


def test_lean_target_off_leaves_the_target_unwrapped(folder):
    target = load_model(HFModelSpec(path=folder), weight_format="w8a8")
    eng = SpeculativeEngine(target, None, lean_target=False)
    assert not eng.verifier.lean and "forward" not in vars(target.model)


def test_float32_target_keeps_transformers_forward(folder):
    target = load_model(HFModelSpec(path=folder), weight_format="float32")  # not shape-invariant
    eng = SpeculativeEngine(target, None)
    assert not eng.verifier.lean and "forward" not in vars(target.model)
    req = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=12, ignore_eos=True,
                            speculation={"proposer": "none", "k": 0})
    assert eng.generate(req).token_ids == _hf_greedy(target.model, PROMPT, 12)


def test_k0_first_then_k_later_prefills_the_draft_only_when_it_drafts(folder):
    """A request held at K = 0 for its first steps (the adaptive arm on a creative prompt) runs no
    draft forward at all (the draft's prompt prefill is lazy: its cache is empty until its first
    drafting step); when K > 0 comes, the draft's first forward catches up on the prompt and
    every token decoded so far in one call, and the output is still transformers' generate."""
    target = load_model(HFModelSpec(path=folder), weight_format="w8a8")
    draft = load_model(HFModelSpec(path=folder), weight_format="w8a8")
    n, held = 30, 6
    ref = _hf_greedy(target.model, PROMPT, n)
    eng = SpeculativeEngine(target, draft)
    fed: list[tuple[int, int]] = []  # (step, positions) of every draft forward
    forward = draft.model.forward
    steps = []

    def counting(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        fed.append((len(steps), int(ids.shape[1])))
        return forward(*args, **kwargs)

    draft.model.forward = counting

    def k_schedule():
        steps.append(1)
        return 0 if len(steps) <= held else 3

    req = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=n, ignore_eos=True, speculation={"k": 3})
    try:
        res = eng.start(req, k=k_schedule).run()
    finally:
        lean_decode.uninstall(target.model)
        lean_decode.uninstall(draft.model)
    assert res.token_ids == ref
    assert res.stats.k_counts[0] == held and sum(res.stats.k_counts.values()) > held
    assert all(step > held for step, _ in fed)  # nothing before the first K > 0 step
    first_step, first_positions = fed[0]
    assert first_step == held + 1 and first_positions == len(PROMPT) + held  # prompt + the K = 0 tokens, one call


@pytest.mark.parametrize("fmt", ["bfloat16", "int4", "w8a8"])
def test_lean_forward_with_sequence_attention_is_bitwise_transformers_forward(folder, fmt):
    """The accelerator's attention form (one masked call per sequence, ``attention="sequence"``,
    forced here on the CPU): transformers passes a verify block after a cached prefix a boolean
    causal mask where the lean forward passes None, and the packed mask as given; both must give
    the same rows, logits and caches bitwise (the tests above run one call per row only)."""
    m = load_model(HFModelSpec(path=folder), weight_format=fmt, attention="sequence").model
    assert m._specdec_attention == "sequence"
    ref, ref_kv = _blocks(m, lean=False)
    got, got_kv = _blocks(m, lean=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert all(torch.equal(k1, k2) and torch.equal(v1, v2) for (k1, v1), (k2, v2) in zip(ref_kv, got_kv))
    ref, ref_kv = _packed(m, lean=False)
    got, got_kv = _packed(m, lean=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    for seq_ref, seq_got in zip(ref_kv, got_kv):
        assert all(torch.equal(k1, k2) and torch.equal(v1, v2) for (k1, v1), (k2, v2) in zip(seq_ref, seq_got))


def test_lean_forward_calls_the_registered_attention(models):
    """lean_forward looks the attention up where transformers does (the AttentionInterface), so a
    wrapper registered in row-wise attention's place (benchmarks.batching_profile's timer) sees its
    calls: one per layer of every forward, blocks, decode steps and packed forwards alike."""
    from transformers import AttentionInterface

    from specdec.engine import invariant

    m = models["w8a8"].model
    seen = []

    def counting(module, query, *args, **kwargs):
        seen.append(query.shape[2])
        return invariant.rowwise_attention(module, query, *args, **kwargs)

    AttentionInterface.register(invariant.ATTENTION_NAME, counting)
    try:
        out, _ = _blocks(m, lean=True)
        layers = m.config.num_hidden_layers
        assert seen == [n for n in (len(PROMPT), 5, 1, 3, 9) for _ in range(layers)]
        del seen[:]
        _packed(m, lean=True)  # three prefills, then two packed forwards of 9 and 12 positions
        assert seen == [n for n in (12, 30, 1, 9, 12) for _ in range(layers)]
    finally:
        AttentionInterface.register(invariant.ATTENTION_NAME, invariant.rowwise_attention)
