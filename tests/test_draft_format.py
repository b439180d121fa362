"""The draft's default weight format (specdec.models.formats.default_draft_format): int4 where the
target's CPU default is w8a8 without AMX-INT8 (AVX512-VNNI + bfloat16, this project's AMD EPYC);
otherwise the target's default. docs/bench/formats/PROFILE.md section 12."""

from __future__ import annotations

import pytest

from specdec.models import formats
from specdec.models.loader import load_pair
from specdec.models.spec import HFModelSpec, ModelPairSpec
from specdec.testing.tiny import build_tiny_model

EPYC = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni"}
SAPPHIRE_RAPIDS = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"}


def test_draft_default_is_int4_on_vnni_without_amx_and_the_targets_elsewhere():
    assert formats.choose_cpu_format(EPYC, "AVX512") == "w8a8"
    assert formats.choose_draft_cpu_format(EPYC, "AVX512") == formats.CPU_VNNI_DRAFT_DEFAULT == "int4"
    assert formats.choose_draft_cpu_format(SAPPHIRE_RAPIDS, "AVX512") == "w8a8"
    assert formats.choose_draft_cpu_format({"avx2", "avx512f", "avx512_bf16"}, "AVX512") == "int4"
    # torch on its AVX2 kernels (the AVX2-only AMD EPYC Zen 3 of session 16): w8a8 on fbgemm, else int4
    assert formats.choose_draft_cpu_format({"avx", "avx2", "fma"}, "AVX2", fbgemm=True) == formats.CPU_AVX2_DRAFT_DEFAULT == "w7a8"
    assert formats.choose_draft_cpu_format({"avx", "avx2", "fma"}, "AVX2", fbgemm=False) == "int4"
    assert formats.choose_draft_cpu_format(EPYC, "AVX2", fbgemm=False) == "int4"
    assert formats.choose_draft_cpu_format({"sse4_2"}, "DEFAULT") == "float32"


def test_default_draft_format_honours_the_environment_and_cuda(monkeypatch):
    monkeypatch.delenv("SPECDEC_WEIGHT_FORMAT", raising=False)
    assert formats.default_draft_format("cuda") == "bfloat16"
    here = formats.choose_draft_cpu_format(formats.cpu_flags(), __import__("torch").backends.cpu.get_cpu_capability())
    assert formats.default_draft_format("cpu") == here
    monkeypatch.setenv("SPECDEC_WEIGHT_FORMAT", "bfloat16")
    assert formats.default_draft_format("cpu") == "bfloat16"
    monkeypatch.setenv("SPECDEC_WEIGHT_FORMAT", "int3")
    with pytest.raises(ValueError, match="^SPECDEC_WEIGHT_FORMAT='int3' is not a weight format; known formats: "):
        formats.default_draft_format("cpu")
    monkeypatch.setenv("SPECDEC_WEIGHT_FORMAT", " W8A8 ")
    assert formats.default_draft_format("cpu") == "w8a8"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("draftfmt")
    return ModelPairSpec(target=HFModelSpec(path=str(build_tiny_model(d / "t", seed=0, hidden_size=128))),
                         draft=HFModelSpec(path=str(build_tiny_model(d / "d", seed=1, hidden_size=128))))


def test_load_pair_gives_the_draft_its_own_default_only_when_no_format_is_named(pair, monkeypatch):
    monkeypatch.delenv("SPECDEC_WEIGHT_FORMAT", raising=False)
    monkeypatch.setattr(formats, "default_format", lambda device="cpu": "bfloat16")
    monkeypatch.setattr(formats, "default_draft_format", lambda device="cpu": "int4")
    target, draft = load_pair(pair)
    assert (target.weight_format, draft.weight_format) == ("bfloat16", "int4")
    target, draft = load_pair(pair, weight_format="bfloat16")  # a named format: the draft follows it
    assert (target.weight_format, draft.weight_format) == ("bfloat16", "bfloat16")
    target, draft = load_pair(pair, draft_format="w8a8")
    assert (target.weight_format, draft.weight_format) == ("bfloat16", "w8a8")
    spec = pair.model_copy(update={"draft": pair.draft.model_copy(update={"format": "bfloat16"})})
    assert load_pair(spec)[1].weight_format == "bfloat16"  # the draft spec's own format


def test_load_pair_reports_a_bad_environment_format_of_the_draft_as_a_model_load_error(pair, monkeypatch):
    """The target names its format, the draft none: the draft's default reads $SPECDEC_WEIGHT_FORMAT,
    and a bad value is a ModelLoadError (load_pair's documented error), as for the target."""
    from specdec.errors import ModelLoadError

    monkeypatch.setenv("SPECDEC_WEIGHT_FORMAT", "bogus")
    named = ModelPairSpec(target=HFModelSpec(path=pair.target.path, format="float32"), draft=pair.draft)
    with pytest.raises(ModelLoadError) as e:
        load_pair(named)
    assert str(e.value).startswith("SPECDEC_WEIGHT_FORMAT='bogus' is not a weight format; known formats: ")


def test_prefetch_builds_each_roles_own_default_format(tmp_path, monkeypatch, capsys):
    """``specdec prefetch`` without --format builds what each model loads by default: the draft's
    own default, not the target's (else a pod's init container warms the wrong cache entry)."""
    import argparse

    from specdec import cli
    from specdec.models import cache, demo, loader

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(formats, "default_format", lambda device="cpu": "w8a8")
    monkeypatch.setattr(formats, "default_draft_format", lambda device="cpu": "int4")
    monkeypatch.setattr(cache, "is_complete", lambda folder, sha: False)
    monkeypatch.setattr(demo, "ensure_demo_folder", lambda role, dtype: tmp_path / f"{role}-{dtype}")
    loads = []
    monkeypatch.setattr(loader, "load_model", lambda spec, weight_format, invariant: loads.append(
        (spec.role, weight_format)) or argparse.Namespace(quant_cache="built"))
    assert cli.run_prefetch(argparse.Namespace(roles=[], weight_format=None)) == 0
    assert loads == [("target", "w8a8"), ("draft", "int4")]
    assert cli.run_prefetch(argparse.Namespace(roles=["draft"], weight_format="w8a8")) == 0  # --format: both
    assert loads[-1] == ("draft", "w8a8")


def test_every_entry_point_refuses_a_bad_environment_format_in_one_line(monkeypatch, capsys, tmp_path):
    """``SPECDEC_WEIGHT_FORMAT=int3 specdec prefetch`` was default_format's ValueError traceback;
    ``specdec generate --target-format X --draft-format Y`` ignored the bad variable (it was read only
    for a default) while ``specdec serve`` refused it even with both dtypes set. Every entry point
    now refuses a set-but-invalid variable with one line naming it, its value and the known formats,
    whether or not a format is named (``specdec serve`` checks it with its model specs, before Ray
    starts; the loader before loading anything)."""
    from deployments.config import AppConfig
    from deployments.serve_checks import check_model_specs
    from specdec import cli
    from specdec.errors import ModelLoadError, SpecDecError
    from specdec.models.loader import load_model, resolve_format

    monkeypatch.setenv("SPECDEC_WEIGHT_FORMAT", "int3")
    message = ("SPECDEC_WEIGHT_FORMAT='int3' is not a weight format; "
               "known formats: float32, bfloat16, float16, int8, int4, w8a8, w7a8")
    target, draft = str(tmp_path / "no-target"), str(tmp_path / "no-draft")  # refused before either is read
    for argv in (["prefetch"], ["prefetch", "--format", "float32"],
                 ["generate", "--target", target, "--draft", draft, "hi"],
                 ["generate", "--target", target, "--draft", draft, "--target-format", "float32",
                  "--draft-format", "bfloat16", "hi"],
                 ["generate", "--target", target, "--draft", "none", "--target-format", "float32", "hi"]):
        assert cli.main(argv) == 2, argv
        assert capsys.readouterr().err == f"specdec: error: {message}\n", argv
    for cfg in (AppConfig(draft_model=None), AppConfig(target_dtype="float32", draft_dtype="int4")):
        with pytest.raises(SpecDecError) as e:
            check_model_specs(cfg)
        assert str(e.value) == message
    spec = HFModelSpec(path=str(tmp_path), format="float32")
    for call in (lambda: resolve_format(spec, "float32"), lambda: load_model(spec, weight_format="float32"),
                 lambda: load_pair(ModelPairSpec(target=spec, draft=spec), weight_format="float32",
                                   draft_format="float32")):
        with pytest.raises(ModelLoadError) as e:
            call()
        assert str(e.value) == message
    with pytest.raises(ValueError) as e:  # the one reader: ValueError unless told its caller's error type
        formats.env_format()
    assert type(e.value) is ValueError and str(e.value) == message
