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
from tests.quant_models import load, logits, marked_tiny_model


@pytest.fixture
def marked(tmp_path, monkeypatch):
    return marked_tiny_model(tmp_path, monkeypatch, "tiny-release", hidden_size=128)


def _maps_of(path):
    return [m for m in file_mappings() if m[2] == str(path)]


def test_warm_w8a8_load_prepacks_and_unmaps_the_cache_file(marked, monkeypatch):
    monkeypatch.setattr(W8A8Linear, "QLINEAR_MIN_OUT", 200)  # the tiny model's wide layers run oneDNN
    assert load(marked, "w8a8").quant_cache == "built"
    gc.collect()
    warm = load(marked, "w8a8")
    assert warm.quant_cache == "hit"
    gc.collect()
    assert _maps_of(cache_folder(marked, "w8a8") / TENSORS) == []  # nothing left in the file's mapping
    layers = [m for m in warm.model.modules() if isinstance(m, W8A8Linear)]
    wide = [m for m in layers if m.out_features >= 200]
    # q/k/v fused, gate/up fused (per layer), lm_head: prepacked at load, their int8 rows gone
    assert len(wide) == 2 * 2 + 1 and all(m.prepacked and m.qweight.numel() == 0 for m in wide)
    narrow = [m for m in layers if m.out_features < 200]  # o_proj, down_proj: aten._int_mm on their int8 rows
    assert len(narrow) == 2 * 2 and all(not m.prepacked and m.qweight.numel() == m.out_features * m.in_features
                                        for m in narrow)
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
