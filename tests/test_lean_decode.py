"""The draft's lean one-position decode (specdec/models/lean_decode.py): bitwise transformers'
forward, used only for plain one-position decode calls, and the draft's proposals unchanged."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specdec.engine.engine import SpeculativeEngine
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


def test_install_routes_only_plain_one_position_calls(models, monkeypatch):
    m = models["w8a8"].model
    assert lean_decode.install(m) and lean_decode.install(m)  # idempotent
    calls = []
    real = lean_decode.decode_one
    monkeypatch.setattr(lean_decode, "decode_one", lambda *a: calls.append(1) or real(*a))
    try:
        with torch.inference_mode():
            cache = DynamicCache(config=m.config)
            m(input_ids=torch.tensor([PROMPT]), cache=cache, use_cache=True, logits_to_keep=1)  # prefill
            assert calls == []
            m(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True, logits_to_keep=1)
            assert calls == [1]
            m(input_ids=torch.tensor([[5, 6]]), cache=cache, use_cache=True, logits_to_keep=2)  # a block
            m(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True,
              position_ids=torch.tensor([[len(PROMPT) + 3]]))  # position ids given (a packed batch)
            m(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True, logits_to_keep=torch.tensor([0]))
            assert calls == [1]
        m(input_ids=torch.tensor([[5]]), cache=DynamicCache(config=m.config), use_cache=True)  # not inference mode
        assert calls == [1]
    finally:
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
    unwrapped model's tokens; speculation at K = 1/4/8 (verify blocks through transformers'
    forward, K = 0 steps lean) gives them too."""
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
