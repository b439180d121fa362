"""What a load hands back (specdec/models/release.py): a warm w8a8 load prepacks every oneDNN
layer, keeps no reference to the unpacked int8 rows and no mapping of the cache file; a warm int4
load keeps its mapping but drops the pages no live tensor covers; the logits stay bitwise those of
a fresh quantization."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from specdec.models.formats import W8A8Linear
from specdec.models.quant_cache import TENSORS, cache_folder
from specdec.models.release import _mapping_stats, _tensors, file_mappings
from specdec.models import cache
from specdec.testing.tiny import build_tiny_model
from tests.quant_models import load, logits, marked_tiny_model


@pytest.fixture
def marked(tmp_path, monkeypatch):
    return marked_tiny_model(tmp_path, monkeypatch, "tiny-release", hidden_size=128)


def _maps_of(path):
    return [m for m in file_mappings() if m[2] == str(path)]


def test_warm_w8a8_load_prepacks_and_unmaps_the_cache_file(marked, monkeypatch):
    """Where oneDNN's int8 sums are exact (VNNI, AMX-INT8) the wide layers are prepacked at load and
    the cache file is unmapped; on a CPU without (AVX2 only) every layer, narrow ones too, is
    prepacked for fbgemm (specdec.models.cpu_features, quant_linear.cpu_int8_kernel) and the file
    unmapped as well. Either way the logits are a fresh quantization's."""
    from specdec.models.quant_linear import cpu_int8_kernel

    monkeypatch.setattr(W8A8Linear, "QLINEAR_MIN_OUT", 200)  # the tiny model's wide layers run oneDNN
    assert load(marked, "w8a8").quant_cache == "built"
    gc.collect()
    warm = load(marked, "w8a8")
    assert warm.quant_cache == "hit"
    gc.collect()
    layers = [m for m in warm.model.modules() if isinstance(m, W8A8Linear)]
    wide = [m for m in layers if m.out_features >= 200]
    narrow = [m for m in layers if m.out_features < 200]  # o_proj, down_proj: aten._int_mm on their int8 rows
    # q/k/v fused, gate/up fused (per layer), lm_head; o_proj, down_proj
    assert len(wide) == 2 * 2 + 1 and len(narrow) == 2 * 2
    kernel = cpu_int8_kernel()
    if kernel == "fbgemm":
        assert all(m.prepacked and m.qweight.numel() == 0 and m._kind == "fbgemm" for m in layers)
        assert _maps_of(cache_folder(marked, "w8a8") / TENSORS) == []
    elif kernel == "qlinear":
        assert _maps_of(cache_folder(marked, "w8a8") / TENSORS) == []  # nothing left in the file's mapping
        assert all(m.prepacked and m.qweight.numel() == 0 for m in wide)  # prepacked at load, int8 rows gone
    else:
        assert not any(m.prepacked for m in wide)
    if kernel != "fbgemm":
        assert all(not m.prepacked and m.qweight.numel() == m.out_features * m.in_features for m in narrow)
    monkeypatch.setenv("SPECDEC_QUANT_CACHE", "0")
    assert torch.equal(logits(warm), logits(load(marked, "w8a8")))


def test_warm_int4_load_keeps_only_live_pages_of_the_cache_file(marked):
    assert load(marked, "int4").quant_cache == "built"
    gc.collect()
    warm = load(marked, "int4")
    assert warm.quant_cache == "hit"
    (lo, hi, _), = _maps_of(cache_folder(marked, "int4") / TENSORS)
    # the fused q/k/v and gate/up copied their parts out of the file: those pages were read, then dropped
    live = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in _tensors(warm.model)
            if lo <= t.untyped_storage().data_ptr() < hi}
    assert live  # o_proj, down_proj, lm_head still read from the file
    page = mmap.PAGESIZE
    live_pages = sum(-(-n // page) + 1 for _, n in live)  # each range may straddle one more page
    rss = _mapping_stats()[lo]["Rss"]
    assert 0 < rss <= live_pages * page < (hi - lo)
    fresh = load(marked, "int4")
    assert torch.equal(logits(warm), logits(fresh))


ROWS = 131072


def _mapping_rss(lo):
    return _mapping_stats().get(lo, {}).get("Rss", 0)


@pytest.fixture
def wide_vocab(tmp_path, monkeypatch):
    """A marked tiny model in bfloat16 whose input embedding takes 32 MiB (131072 rows x 128)."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDEC_QUANT_CACHE", raising=False)
    from transformers import AutoModelForCausalLM

    f32 = build_tiny_model(tmp_path / "tiny", seed=4, hidden_size=128, vocab_rows=ROWS)
    folder = tmp_path / "tiny-bfloat16"
    AutoModelForCausalLM.from_pretrained(f32, dtype=torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((f32 / name).read_bytes())
    cache.write_marker(folder, source_sha256="tiny-embedding", name="tiny", dtype="bfloat16")
    return folder


@pytest.mark.parametrize("fmt", ["w8a8"])
def test_the_input_embedding_stays_mapped_and_only_looked_up_rows_come_back(wide_vocab, fmt, monkeypatch):
    """The input embedding table is a view of the bfloat16 folder's safetensors file, none of its
    pages resident after the load; a forward brings back the pages of the rows it looks up (at
    least their own pages; at most, with the kernel's fault-around and large page-cache folios,
    the 2 MiB-aligned windows around them), not the table; logits bitwise those of a load that
    copies the table into anonymous memory."""
    from specdec.models import release

    assert load(wide_vocab, fmt).quant_cache == "built"
    gc.collect()
    warm = load(wide_vocab, fmt)
    assert warm.quant_cache == "hit"
    emb = release.input_embedding(warm.model)
    assert tuple(emb.shape) == (ROWS, 128) and emb.dtype == torch.bfloat16
    (lo, hi, _), = _maps_of(wide_vocab / "model.safetensors")
    assert lo <= emb.data_ptr() and emb.data_ptr() + emb.nbytes <= hi  # the file's bytes, not a copy
    # the only tensor of the model left in the file: the norms and biases were copied out
    assert [t for t in _tensors(warm.model) if lo <= t.data_ptr() < hi and t.data_ptr() != emb.data_ptr()] == []
    assert _mapping_rss(lo) == 0
    ids = [3, 40000, 80000, 131000]
    with torch.no_grad():
        mapped = warm.model(torch.tensor([ids])).logits[0]
    rows = [(emb.data_ptr() + i * 256, emb.data_ptr() + (i + 1) * 256) for i in ids]
    pages = {a // mmap.PAGESIZE for r in rows for a in (r[0], r[1] - 1)}
    windows = {a >> 21 for r in rows for a in (r[0], r[1] - 1)}
    assert len(pages) * mmap.PAGESIZE <= _mapping_rss(lo) <= len(windows) << 21 == 8 << 20 < emb.nbytes // 2
    monkeypatch.setattr(release, "EMBEDDINGS_MAPPED", False)
    copied = load(wide_vocab, fmt)
    emb_copy = release.input_embedding(copied.model)
    assert release.file_mappings() == [] or not release._in_mapping(emb_copy, release.file_mappings())
    assert torch.equal(emb_copy, emb)
    with torch.no_grad():
        assert torch.equal(copied.model(torch.tensor([ids])).logits[0], mapped)
