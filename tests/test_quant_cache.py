"""The int8/int4/w8a8 weight cache (specdec/models/quant_cache.py): a warm start reads the quantized
layers instead of quantizing again, and gives bitwise the logits a fresh quantization gives; a
stale key, a changed source or a corrupt file rebuilds the entry with one log line."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from specdec.models import cache
from specdec.models.formats import Int8WeightOnlyLinear, W8A8Linear
from specdec.models.quant_cache import TENSORS, cache_folder
from specdec.testing.tiny import build_tiny_model
from tests.quant_models import int4_narrow_qkv_fuses, load, logits, marked_tiny_model


@pytest.fixture
def marked(tmp_path, monkeypatch):
    """A tiny model folder with a cache marker, as the demo/GGUF conversions write them."""
    return marked_tiny_model(tmp_path, monkeypatch, "tiny-seed-3")


@pytest.mark.parametrize("fmt", ["int8", "int4", "w8a8", "w7a8"])
def test_cached_load_is_bitwise_a_fresh_quantization(marked, fmt, monkeypatch):
    built = load(marked, fmt)
    assert built.quant_cache == "built"
    entry = cache_folder(marked, fmt)
    assert entry.name == f"tiny-{fmt}" and (entry / TENSORS).is_file()
    marker = cache.read_marker(entry)
    assert marker["key"]["format"] == fmt and marker["key"]["source_sha256"] == "tiny-seed-3"

    warm = load(marked, fmt)
    assert warm.quant_cache == "hit"
    monkeypatch.setenv("SPECDEC_QUANT_CACHE", "0")
    fresh = load(marked, fmt)
    assert fresh.quant_cache == "off"

    q = warm.model.model.layers[0].self_attn.q_proj
    if fmt == "int8":
        assert isinstance(q, Int8WeightOnlyLinear) and q.qweight.dtype == torch.int8
    elif fmt in ("w8a8", "w7a8"):
        q = q.fused.linear  # q/k/v fused into one W8A8Linear after the load (specdec.models.fused)
        assert isinstance(q, W8A8Linear) and q.qweight.dtype == torch.int8 and q.scale.dtype == torch.float32
        assert isinstance(warm.model.lm_head, W8A8Linear)
        stored = torch.load(entry / TENSORS, weights_only=True)["model.layers.0.self_attn.q_proj"]
        assert stored["kind"] == "w8a8" and int(stored["qweight"].abs().max()) <= (64 if fmt == "w7a8" else 128)
        assert q.one_pass == (fmt == "w7a8")  # restored 7-bit weights run fbgemm's one pass (AVX2)
    else:
        if int4_narrow_qkv_fuses():
            q = q.fused.linear
        assert type(q.weight.data).__name__ == "Int4OpaqueTensor"
    expected = logits(fresh)
    assert torch.equal(logits(built), expected)
    assert torch.equal(logits(warm), expected)


def test_stale_key_rebuilds_with_one_log_line(marked, caplog):
    load(marked, "int4")
    entry = cache_folder(marked, "int4")
    marker = json.loads((entry / cache.MARKER).read_text())
    marker["key"]["torchao"] = "0.0.1"
    marker["key_sha256"] = "0" * 64
    (entry / cache.MARKER).write_text(json.dumps(marker))
    with caplog.at_level(logging.WARNING, logger="specdec.models.quant_cache"):
        again = load(marked, "int4")
    assert again.quant_cache == "built"
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec.models.quant_cache"]
    assert len(lines) == 1 and "stale" in lines[0] and "torchao '0.0.1' -> " in lines[0]
    assert load(marked, "int4").quant_cache == "hit"


def test_changed_source_rebuilds(marked, caplog):
    load(marked, "int8")
    cache.write_marker(marked, source_sha256="another-gguf", name="tiny", dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger="specdec.models.quant_cache"):
        assert load(marked, "int8").quant_cache == "built"
    assert any("source_sha256 'tiny-seed-3' -> 'another-gguf'" in r.getMessage() for r in caplog.records)


def test_corrupt_file_rebuilds(marked, caplog):
    ref = logits(load(marked, "int8"))
    f = cache_folder(marked, "int8") / TENSORS
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="specdec.models.quant_cache"):
        rebuilt = load(marked, "int8")
    assert rebuilt.quant_cache == "built"
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec.models.quant_cache"]
    assert len(lines) == 1 and "unusable" in lines[0]
    assert torch.equal(logits(rebuilt), ref)
    assert load(marked, "int8").quant_cache == "hit"


def test_entry_of_another_model_rebuilds(marked, tmp_path, caplog):
    """An entry whose key matches but whose layers do not fit the model (here: copied from a
    wider model) is caught before anything is replaced."""
    other = build_tiny_model(tmp_path / "wide-bfloat16", seed=3, hidden_size=128)
    cache.write_marker(other, source_sha256="tiny-seed-3", name="tiny", dtype="bfloat16")
    load(other, "int8")
    load(marked, "int8")
    (cache_folder(marked, "int8") / TENSORS).write_bytes((cache_folder(other, "int8") / TENSORS).read_bytes())
    with caplog.at_level(logging.WARNING, logger="specdec.models.quant_cache"):
        assert load(marked, "int8").quant_cache == "built"
    assert any("unusable" in r.getMessage() and "stored shape" in r.getMessage() for r in caplog.records)


def test_folder_without_marker_is_quantized_at_every_load(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    folder = build_tiny_model(tmp_path / "plain", seed=0)
    assert load(folder, "int4").quant_cache == "off"
    assert not cache_folder(folder, "int4").exists()
    assert load(folder, "bfloat16").quant_cache == "none"


_FRESH = r"""
import sys, torch
from specdec.models.loader import load_model
from specdec.models.spec import HFModelSpec
m = load_model(HFModelSpec(path=sys.argv[1]), weight_format=sys.argv[2])
with torch.no_grad():
    logits = m.model(torch.tensor([[1, 5, 9, 33, 70, 100, 7, 8, 250, 3, 44, 12]])).logits[0]
torch.save(logits, sys.argv[3])
print(m.quant_cache)
"""


@pytest.mark.parametrize("fmt", ["int8", "int4", "w8a8"])
def test_a_new_process_reads_the_cache(marked, fmt, tmp_path):
    """A fresh interpreter (torchao's tensor classes not imported yet) loads the entry with
    ``weights_only=True`` and gets the same logits."""
    import subprocess
    import sys

    ref = logits(load(marked, fmt))
    out = tmp_path / "logits.pt"
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(marked), fmt, str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "hit", proc.stderr[-2000:]
    assert torch.equal(torch.load(out), ref)


def test_formats_have_entries_of_their_own(marked):
    """int8 and w8a8 store the same kind of tensors (int8 rows, per-row scales): each format has
    its own entry and key, so one never loads as the other."""
    int8 = load(marked, "int8")
    w8a8 = load(marked, "w8a8")
    assert (int8.quant_cache, w8a8.quant_cache) == ("built", "built")
    assert cache.read_marker(cache_folder(marked, "w8a8"))["key"]["format"] == "w8a8"
    assert load(marked, "w8a8").quant_cache == "hit" and load(marked, "int8").quant_cache == "hit"
    assert isinstance(load(marked, "w8a8").model.model.layers[1].mlp.down_proj, W8A8Linear)
    assert not torch.equal(logits(int8), logits(w8a8))  # the activations are quantized too
