"""specdec.models.folders: a built model folder found without torch, by the builders' own rules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from specdec.errors import ModelLoadError
from specdec.models import cache, convert, formats
from specdec.models.demo_models import DEMO_MODELS
from specdec.models.folders import built_folder, dtype_suffix, storage_dtype_name
from specdec.models.loader import resolve_folder
from specdec.models.spec import WeightFormat


def test_storage_dtype_and_suffix_follow_the_torch_rules():
    for fmt in get_args(WeightFormat):
        dtype = formats.storage_dtype(fmt)
        assert storage_dtype_name(fmt) == str(dtype).removeprefix("torch."), fmt
        assert dtype_suffix(storage_dtype_name(fmt)) == convert.folder_suffix(dtype), fmt
    assert [storage_dtype_name(f) for f in ("float32", "float16", "bfloat16", "int8", "int4", "w8a8", "w7a8")] == [
        "float32", "float32", "bfloat16", "bfloat16", "bfloat16", "bfloat16", "bfloat16"]
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        storage_dtype_name("int3")


def test_demo_folder_found_only_when_its_marker_names_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert built_folder("demo:target", "w8a8") is None  # not built: resolve_folder would build it
    folder = tmp_path / "demo" / "target-bfloat16"
    folder.mkdir(parents=True)
    cache.write_marker(folder, source_sha256="ab" * 32)
    assert built_folder("demo:target", "int4") is None  # another model's marker
    cache.write_marker(folder, source_sha256=DEMO_MODELS["target"].sha256)
    assert built_folder("demo:target", "w8a8") == str(folder)
    assert built_folder("demo:target", "w8a8") == resolve_folder("demo:target", "w8a8")  # no build: it is complete
    assert built_folder("demo:target", "float32") is None  # the float32 folder is another one
    assert built_folder("demo:target", None) is None  # the default format needs torch to decide


def test_gguf_and_hf_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not really a gguf")
    assert built_folder(str(gguf), "bfloat16") is None
    sha = cache.sha256_file(gguf)
    folder = tmp_path / "cache" / "gguf" / f"{sha}-bfloat16"
    folder.mkdir(parents=True)
    cache.write_marker(folder, source_sha256=sha)
    assert built_folder(str(gguf), "int8") == str(folder) == resolve_folder(str(gguf), "int8")
    with pytest.raises(ModelLoadError, match="missing.gguf' does not exist"):  # as resolve_folder
        built_folder(str(tmp_path / "missing.gguf"), "int8")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert built_folder(str(hf), "float32") == str(hf) == resolve_folder(str(hf), "float32")


def test_folders_module_imports_no_torch():
    code = "import sys, specdec.models.folders; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "False", out.stderr[-2000:]
