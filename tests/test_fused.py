"""Fused int4 projections (q/k/v, gate/up): bitwise the separate projections, end to end exact.

Tiny models of hidden size 128 (every projection a multiple of the int4 CPU packing's 64-row
blocks, so all groups fuse) and 64 (k/v of 32 rows: the fused packing is not the separate one,
which the load-time check must catch and leave unfused).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from transformers import DynamicCache

from specdec.engine.engine import SpeculativeEngine
from specdec.models.fused import FusedLinear, FusedSlice, _check_bitwise, fusable, fuse_projections
from specdec.models.loader import load_model
from specdec.models.spec import HFModelSpec
from specdec.request import GenerationRequest
from specdec.testing.tiny import build_tiny_model
from tests.quant_models import int4_narrow_qkv_fuses


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("fused")
    target = build_tiny_model(d / "t", seed=0, hidden_size=128, max_positions=512)
    draft = build_tiny_model(d / "d", seed=1, hidden_size=128, max_positions=512,
                             base=AutoModelForCausalLM.from_pretrained(target), noise=0.03)
    narrow = build_tiny_model(d / "n", seed=2, hidden_size=64)
    return target, draft, narrow


@pytest.fixture(scope="module")
def models(folders):
    """(fused, unfused) int4 target and draft, each loaded through the loader."""
    out = {}
    for name, folder in (("target", folders[0]), ("draft", folders[1])):
        out[name] = (load_model(HFModelSpec(path=folder), weight_format="int4"),
                     load_model(HFModelSpec(path=folder), weight_format="int4", fuse=False))
    return out


def _layer(loaded, i=0):
    return loaded.model.model.layers[i]


def test_int4_load_fuses_qkv_and_gate_up_of_every_layer(models):
    fused, plain = models["target"]
    for layer in fused.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
        assert [type(m) for m in projections] == [FusedSlice] * 5
        assert attn.q_proj.fused is attn.k_proj.fused is attn.v_proj.fused
        assert attn.q_proj.fused.bounds == [(0, 128), (128, 192), (192, 256)]
        assert mlp.gate_proj.fused.bounds == [(0, 256), (256, 512)]
        assert type(layer.mlp.down_proj) is torch.nn.Linear and type(attn.o_proj) is torch.nn.Linear
        # the fused linear is made shape-invariant like any other
        assert attn.q_proj.fused.linear._specdec_plan is not None
    assert type(_layer(plain).self_attn.q_proj) is torch.nn.Linear
    # idempotent: nothing left to fuse
    assert fuse_projections(fused.model) == 0


def test_fused_logits_bitwise_equal_unfused(models):
    """Prefill of 45 positions (two 32-row chunks), then blocks of 1 and 5: every logit equal."""
    fused, plain = models["target"]
    rng = random.Random(0)
    ids = [rng.randrange(3, 300) for _ in range(60)]
    outs = []
    for m in (fused, plain):
        cache = DynamicCache(config=m.model.config)
        got = []
        with torch.inference_mode():
            for lo, hi in ((0, 45), (45, 46), (46, 51), (51, 52)):
                got.append(m.model(input_ids=torch.tensor([ids[lo:hi]]), past_key_values=cache, use_cache=True).logits)
        outs.append(got)
    for a, b in zip(*outs):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_speculation_with_fused_pair_equals_target_alone(models, k):
    """Fused draft and target: greedy output token for token the unfused target alone's."""
    (target, target_plain), (draft, _) = models["target"], models["draft"]
    rng = random.Random(k)
    for n in (1, 7, 40):
        prompt = [rng.randrange(3, 300) for _ in range(n)]
        req = dict(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True, sampling={"temperature": 0.0})
        alone = SpeculativeEngine(target_plain).generate(GenerationRequest(**req, speculation={"proposer": "none"}))
        spec = SpeculativeEngine(target, draft).generate(
            GenerationRequest(**req, speculation={"proposer": "draft", "k": k}))
        assert spec.token_ids == alone.token_ids
        assert len(alone.token_ids) == 24


def test_fused_draft_proposes_what_the_unfused_draft_proposes_sampled(models):
    """Seeded sampling: the fused draft's tokens and q rows equal the unfused draft's bitwise."""
    from specdec.engine.proposers.draft_model import DraftModelProposer
    from specdec.request import SamplingParams

    fused, plain = models["draft"]
    prompt = [random.Random(5).randrange(3, 300) for _ in range(30)]
    blocks = []
    for m in (fused, plain):
        s = DraftModelProposer(m).open_session(prompt, SamplingParams(temperature=0.9, top_k=40), seed=3)
        got = []
        for _ in range(3):
            b = s.propose(6)
            got.append(b)
            s.commit(b.token_ids.tolist()[:2] + [17])
        blocks.append(got)
    for a, b in zip(*blocks):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert torch.equal(a.q_ids, b.q_ids) and torch.equal(a.q_probs, b.q_probs)


def test_narrow_projections_that_do_not_concatenate_stay_unfused(folders):
    """hidden 64: k/v have 32 output rows, half of torch's 64-row int4 packing block on AVX-512
    CPUs; the packed weights do not concatenate, the bitwise check sees it and keeps q/k/v separate
    (gate/up, 128 rows, fuse). On an AVX2-only CPU the packing block is 32 rows: they concatenate
    and fuse (measured on the AVX2 AMD EPYC Zen 3 of 2 Dec 2026); the logits are the same either way."""
    m = load_model(HFModelSpec(path=folders[2]), weight_format="int4")
    qkv_fuses = int4_narrow_qkv_fuses()
    for layer in m.model.model.layers:
        assert type(layer.self_attn.q_proj) is (FusedSlice if qkv_fuses else torch.nn.Linear)
        assert type(layer.mlp.gate_proj) is FusedSlice
    plain = load_model(HFModelSpec(path=folders[2]), weight_format="int4", fuse=False)
    ids = torch.tensor([[5, 9, 33, 4, 120, 7, 64]])
    with torch.inference_mode():
        assert torch.equal(m.model(input_ids=ids).logits, plain.model(input_ids=ids).logits)


def test_check_catches_columns_in_the_wrong_order(models):
    _, plain = models["target"]
    attn = _layer(plain).self_attn
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    assert _check_bitwise(parts, FusedLinear(parts)) is None
    wrong = FusedLinear([attn.q_proj, attn.v_proj, attn.k_proj])
    assert _check_bitwise(parts, wrong).startswith("1 rows differ")


def test_not_fusable_reasons(models, folders):
    _, plain = models["target"]
    attn, mlp = _layer(plain).self_attn, _layer(plain).mlp
    assert fusable([attn.q_proj]) == "fewer than two layers"
    assert fusable([attn.q_proj, mlp.gate_proj]) == "some have a bias and some do not"
    assert fusable([attn.q_proj, mlp.down_proj]) == "input width, group size, dtype or device differ"
    bf16 = load_model(HFModelSpec(path=folders[0]), weight_format="bfloat16")
    q = _layer(bf16).self_attn.q_proj
    assert fusable([q, _layer(bf16).self_attn.k_proj]) == "weight is Parameter, not Int4OpaqueTensor"
    assert fuse_projections(bf16.model) == 0
    with pytest.raises(ValueError, match="cannot fuse: fewer than two layers"):
        FusedLinear([attn.q_proj])


def test_slices_called_with_other_inputs_or_threads_get_their_own_columns(models):
    """A slice answers for its own input: k called with another tensor than q, interleaved
    groups, and two threads stepping at once all get the separate projections' outputs."""
    fused, plain = models["target"]
    fa, pa = _layer(fused).self_attn, _layer(plain).self_attn
    g = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randn(3, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    with torch.inference_mode():
        assert torch.equal(fa.q_proj(x1), pa.q_proj(x1))
        assert torch.equal(fa.k_proj(x2), pa.k_proj(x2))  # another input: recomputed
        assert torch.equal(fa.v_proj(x1), pa.v_proj(x1))
        assert torch.equal(fa.q_proj(x1), pa.q_proj(x1))
        assert torch.equal(fa.q_proj(x1), pa.q_proj(x1))  # the same part twice: recomputed
        errors: list[str] = []

        def worker(x):
            with torch.inference_mode():
                for _ in range(50):
                    for name in ("q_proj", "k_proj", "v_proj"):
                        if not torch.equal(getattr(fa, name)(x), getattr(pa, name)(x)):
                            errors.append(name)

        threads = [threading.Thread(target=worker, args=(x,)) for x in (x1, x2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


@pytest.fixture(scope="module")
def w8a8_models(folders):
    """(fused, unfused) w8a8 target and draft, each loaded through the loader."""
    return {name: (load_model(HFModelSpec(path=folder), weight_format="w8a8"),
                   load_model(HFModelSpec(path=folder), weight_format="w8a8", fuse=False))
            for name, folder in (("target", folders[0]), ("draft", folders[1]))}


def test_w8a8_load_fuses_every_layer_and_logits_equal_unfused(w8a8_models):
    """w8a8: q/k/v and gate/up of every layer become one W8A8Linear each; logits of a 45-position
    prefill and blocks of 1 and 5 are bitwise the unfused model's."""
    from specdec.models.formats import W8A8Linear

    fused, plain = w8a8_models["target"]
    for layer in fused.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert [type(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)] == [FusedSlice] * 5
        assert type(attn.q_proj.fused.linear) is W8A8Linear and attn.q_proj.fused.bounds == [(0, 128), (128, 192), (192, 256)]
        assert attn.q_proj.fused.linear.bias is not None and mlp.gate_proj.fused.linear.bias is None
        assert type(mlp.down_proj) is W8A8Linear and type(attn.o_proj) is W8A8Linear
    assert type(_layer(plain).self_attn.q_proj) is W8A8Linear
    assert fuse_projections(fused.model) == 0
    rng = random.Random(1)
    ids = [rng.randrange(3, 300) for _ in range(60)]
    outs = []
    for m in (fused, plain):
        cache = DynamicCache(config=m.model.config)
        with torch.inference_mode():
            outs.append([m.model(input_ids=torch.tensor([ids[lo:hi]]), past_key_values=cache, use_cache=True).logits
                         for lo, hi in ((0, 45), (45, 46), (46, 51), (51, 52))])
    for a, b in zip(*outs):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max().item()


def test_w8a8_greedy_speculation_with_fused_pair_equals_target_alone(w8a8_models):
    (target, target_plain), (draft, _) = w8a8_models["target"], w8a8_models["draft"]
    rng = random.Random(5)
    for n, k in ((1, 4), (40, 8)):
        prompt = [rng.randrange(3, 300) for _ in range(n)]
        req = dict(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True, sampling={"temperature": 0.0})
        alone = SpeculativeEngine(target_plain).generate(GenerationRequest(**req, speculation={"proposer": "none"}))
        spec = SpeculativeEngine(target, draft).generate(GenerationRequest(**req, speculation={"proposer": "draft", "k": k}))
        assert spec.token_ids == alone.token_ids and len(alone.token_ids) == 24


def test_w8a8_not_fusable_reasons(folders, onednn_int8_prepack):
    # loaded as on a VNNI CPU (the fixture), where the tiny layers are too narrow to prepack at load
    plain = load_model(HFModelSpec(path=folders[0]), weight_format="w8a8", fuse=False)
    attn, mlp = _layer(plain).self_attn, _layer(plain).mlp
    assert fusable([attn.q_proj, mlp.gate_proj]) == "some have a bias and some do not"
    assert fusable([attn.o_proj, mlp.down_proj]) == "input width, dtype or device differ"
    assert fusable([attn.o_proj, _layer(plain, 1).self_attn.o_proj]) is None
    # a layer that has run (its weight prepacked by oneDNN, int8 rows dropped) is not fused
    gate, up = mlp.gate_proj, mlp.up_proj
    gate.QLINEAR_MIN_OUT = 0  # this layer runs oneDNN's qlinear (the tiny layers are below the width bound)
    with torch.inference_mode():
        gate(torch.randn(1, gate.in_features, dtype=torch.bfloat16))
    assert gate.prepacked
    assert fusable([gate, up]) == "w8a8 weight already prepacked (its int8 rows are gone)"


def test_w8a8_fusion_check_does_not_prepack_the_layers_it_discards(folders, monkeypatch):
    """The load-time bitwise check computes the separate projections on their int8 rows
    (aten._int_mm) instead of prepacking oneDNN copies of them that are thrown away with them;
    the fused layer, which stays, is prepacked by the check; its columns equal the separate
    layers' oneDNN results bitwise. On a CPU whose oneDNN int8 sums are not exact (AVX2 only) no
    layer prepacks for oneDNN: the fused layer prepacks for fbgemm (specdec.models.cpu_features,
    quant_linear.cpu_int8_kernel), the separate ones still compute the check on their int8 rows."""
    from specdec.models.formats import W8A8Linear
    from specdec.models.quant_linear import cpu_int8_kernel

    monkeypatch.setattr(W8A8Linear, "KERNEL", "int_mm")  # the load prepacks nothing (fbgemm would prepack all)
    plain = load_model(HFModelSpec(path=folders[0]), weight_format="w8a8", fuse=False, invariant=False)
    monkeypatch.setattr(W8A8Linear, "KERNEL", "qlinear")
    monkeypatch.setattr(W8A8Linear, "QLINEAR_MIN_OUT", 0)  # from now on every tiny layer runs its CPU's kernel
    attn = _layer(plain).self_attn
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    assert not any(p.prepacked for p in parts)
    assert fuse_projections(attn) == 1
    assert [(p.prepacked, p.qweight.numel(), "KERNEL" in vars(p)) for p in parts] == \
        [(False, 128 * 128, False), (False, 64 * 128, False), (False, 64 * 128, False)]
    fused = attn.q_proj.fused.linear
    exact = cpu_int8_kernel() != "int_mm"  # prepacked for oneDNN or fbgemm
    assert fused.prepacked == exact and (fused.qweight.numel() == 0) == exact
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.inference_mode():
        separate = torch.cat([p(x) for p in parts], dim=-1)  # now prepacked (oneDNN or fbgemm)
        assert all(p.prepacked == exact for p in parts)
        assert torch.equal(fused(x), separate)


def test_w8a8_fusion_checks_one_group_per_signature(folders, monkeypatch):
    """w8a8 columns are exact integer sums whatever the weights, so fuse_projections checks the
    first q/k/v and the first gate/up group of a model (two signatures) and gives every other group
    of the same signature that verdict: all fused when it passes, none when it fails."""
    import specdec.models.fused as fused_mod

    calls = []
    real = fused_mod._check_bitwise

    def counting(parts, fused, seed=0):
        calls.append(tuple(p.out_features for p in parts))
        return real(parts, fused, seed)

    from specdec.models.formats import W8A8Linear

    monkeypatch.setattr(fused_mod, "_check_bitwise", counting)
    monkeypatch.setattr(W8A8Linear, "KERNEL", "int_mm")  # loaded unpacked (a packed layer cannot be fused)
    plain = load_model(HFModelSpec(path=folders[0]), weight_format="w8a8", fuse=False, invariant=False)
    again = load_model(HFModelSpec(path=folders[0]), weight_format="w8a8", fuse=False, invariant=False)
    monkeypatch.setattr(W8A8Linear, "KERNEL", "qlinear")
    layers = plain.model.model.layers
    assert len(layers) >= 2
    assert fuse_projections(plain.model) == 2 * len(layers)
    assert calls == [(128, 64, 64), (256, 256)]
    assert all(type(layer.self_attn.k_proj) is FusedSlice for layer in layers)

    calls.clear()
    monkeypatch.setattr(fused_mod, "_check_bitwise", lambda parts, fused, seed=0: calls.append(1) or "1 rows differ")
    assert fuse_projections(again.model) == 0 and calls == [1, 1]
    assert all(type(layer.mlp.gate_proj) is not FusedSlice for layer in again.model.model.layers)
