"""``specdec bench`` (benchmarks/inprocess.py) end to end on a tiny target/draft pair, ``--quick``."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.inprocess import PROMPT_TYPES, add_bench_arguments, run_bench
from benchmarks.report import read_bench_json
from specdec.testing.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny_pair_folders(tmp_path_factory):
    """(target folder, draft folder): a tiny Qwen2 target and a draft = target + small weight noise."""
    from transformers import Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("benchpair")
    # 1024 positions: the copy-heavy prompt (a code block to rewrite) is ~700 tiny-tokenizer tokens
    target = build_tiny_model(root / "target", seed=0, max_positions=1024)
    base = Qwen2ForCausalLM.from_pretrained(target)
    draft = build_tiny_model(root / "draft", seed=1, base=base, noise=0.03, max_positions=1024)
    return target, draft


def _parse(argv):
    parser = add_bench_arguments(argparse.ArgumentParser())
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def quick_report(tiny_pair_folders, tmp_path_factory):
    target, draft = tiny_pair_folders
    out = tmp_path_factory.mktemp("benchout")
    # one torch thread: the tiny model's matmuls gain nothing from two, and a busy machine slows
    # two spinning threads down a lot
    args = _parse(["--quick", "--threads", "1", "--target", str(target), "--draft", str(draft), "--out", str(out)])
    report = run_bench(args)
    return report, out


def test_quick_bench_writes_json_table_and_png(quick_report):
    report, out = quick_report
    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(report["rows"]))
    assert (out / "speedup.png").stat().st_size > 1000
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "table.md").read_text()
    assert "| method |" in table and "ours-draft-K1" in table

    meta = report["meta"]
    assert meta["tokens"] == 12 and meta["quick"] is True and meta["greedy"] is True
    hf = meta["hf_settings"]
    assert hf["hf-assisted"]["num_assistant_tokens"] >= 1
    assert "num_assistant_tokens_schedule" in hf["hf-assisted"]
    assert hf["hf-prompt-lookup"]["prompt_lookup_num_tokens"] == 10

    # every type but the full-length rewrite (code-rename-full: up to 256 new tokens, not --quick)
    assert {p["type"] for p in report["prompts"]} == set(PROMPT_TYPES) - {"copy_full"}
    assert set(report["summary"]) == set(PROMPT_TYPES) - {"copy_full"}


def test_quick_bench_rows_cover_every_method_and_match_target(quick_report):
    report, _ = quick_report
    rows = report["rows"]
    expected = {"target", "hf-assisted", "hf-prompt-lookup", "ours-none",
                "ours-draft-K1", "ours-draft-K2", "ours-draft-K3", "ours-ngram-K1", "ours-ngram-K3"}
    for p in report["prompts"]:
        prow = {r["method"]: r for r in rows if r["prompt"] == p["name"]}
        assert set(prow) == expected, p["name"]
        ref = prow["target"]
        assert ref["speedup"] == pytest.approx(1.0)
        for r in prow.values():
            # greedy: every method's output is the target alone's, token for token
            assert r["identical"] is True, (p["name"], r["method"])
            assert r["new_tokens"] == ref["new_tokens"]
            assert r["tokens_per_s"] > 0 and r["seconds"] > 0
            # paired with the target alone of the same repeat (here the one repeat's two runs)
            ref_tps = sorted(ref["new_tokens"] / x for x in ref["seconds_all"])
            if r["method"] != "target":
                assert r["speedup"] == pytest.approx(r["new_tokens"] / r["seconds_all"][0] / (sum(ref_tps) / 2))
        for label in ("ours-draft-K3", "hf-assisted"):
            r = prow[label]
            assert r["steps"] >= 1 and r["proposed"] >= 1
            assert 0.0 <= r["acceptance_rate"] <= 1.0
            assert r["mean_accepted_length"] >= 1.0
        assert prow["ours-none"]["proposed"] == 0 and prow["ours-none"]["acceptance_rate"] is None
        assert prow["ours-draft-K2"]["k"] == 2 and prow["ours-draft-K2"]["proposer"] == "draft"

    for t, per in report["summary"].items():
        assert per["target"]["speedup"] == pytest.approx(1.0)
        assert all(v["identical"] for v in per.values()), t


def test_format_axis_runs_each_format_and_compares(tiny_pair_folders, tmp_path):
    """``--formats``: one benchmark per weight format into <out>/<format>/, and formats.md."""
    from benchmarks.inprocess import run_formats

    target, draft = tiny_pair_folders
    out = tmp_path / "fmt"
    args = _parse(["--quick", "--threads", "1", "--target", str(target), "--draft", str(draft), "--out", str(out),
                   "--formats", "float32,int8", "--skip-hf", "--no-plot", "--proposers", "draft,none"])
    results = run_formats(args)
    assert list(results) == ["float32", "int8"]
    assert (out / "float32" / "bench.json").is_file() and (out / "int8" / "bench.json").is_file()
    text = (out / "formats.md").read_text()
    assert text.startswith("# Weight formats (float32, int8), one run")
    assert "| int8 |" in text and "| float32 |" in text
    assert results["int8"]["memory"]["target_weight_gb"] < results["float32"]["memory"]["target_weight_gb"]
    for fmt in results:  # every method's output equals its own format's target alone
        assert all(r["identical"] for r in results[fmt]["rows"])
    assert "Torch threads: 1." in text
    # the first format's target alone is 1.00x of itself by CPU time and by wall clock
    f32_target = next(line for line in text.splitlines() if line.startswith("| float32 |") and "| target |" in line)
    cells = f32_target.split(" | ")[4:-1]  # one per prompt type of --quick
    assert len(cells) == len(PROMPT_TYPES) - 1  # --quick has no copy_full prompt
    assert all(c.count("1.00x, 1.00x (wall ") == 1 and c.endswith(", 1.00x)") for c in cells), cells
    # formats.json's k_counts as bench.json's: ascending K on disk, int keys through read_bench_json
    raw = _k_counts_of(json.loads((out / "formats.json").read_text()))
    assert any(len(c) > 1 for c in raw)  # the adaptive rows ran several K
    assert all(list(map(int, c)) == sorted(map(int, c)) for c in raw), raw
    back = _k_counts_of(read_bench_json(out / "formats.json"))
    assert back == [{int(k): n for k, n in c.items()} for c in raw]


def _k_counts_of(obj) -> list[dict]:
    """Every ``*k_counts`` mapping in ``obj`` (a benchmark's JSON report), in document order."""
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in ([v] if k.endswith("k_counts") and isinstance(v, dict)
                                                     else _k_counts_of(v))]
    if isinstance(obj, list):
        return [x for v in obj for x in _k_counts_of(v)]
    return []


def test_format_axis_target_alone_only(tiny_pair_folders, tmp_path):
    """``--formats ... --draft none --skip-hf --proposers ''``: only the target-alone rows (the quick
    way to compare formats' plain decoding; docs/bench/formats/README: target alone)."""
    from benchmarks.inprocess import run_formats

    target, _ = tiny_pair_folders
    out = tmp_path / "fmt"
    args = _parse(["--quick", "--threads", "1", "--target", str(target), "--draft", "none", "--out", str(out),
                   "--formats", "float32,int4", "--skip-hf", "--no-plot", "--proposers", "", "--prompts", "code-prime"])
    results = run_formats(args)
    for fmt in ("float32", "int4"):
        rows = results[fmt]["rows"]
        assert [(r["prompt"], r["method"], r["runs"]) for r in rows] == [("code-prime", "target", 2)]  # bracketed
        assert rows[0]["new_tokens"] == 12 and rows[0]["cpu_s"] > 0
        assert results[fmt]["memory"]["draft_weight_gb"] is None
    formats_table = ((out / "formats.md").read_text().split("## Per format and method")[1]  # goals table before
                     .split("\n## Target alone in rounds")[0])  # rounds table after
    lines = [line for line in formats_table.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[3] for line in lines[1:]] == ["target", "target"]
    assert "median of 2 run(s) per method and prompt" in (out / "int4" / "table.md").read_text()


def test_format_axis_alone_suffix_times_only_that_formats_target(tiny_pair_folders, tmp_path):
    """``--formats float32:alone,int8``: float32 runs its target alone only (no draft loaded), int8
    the whole benchmark; formats.md compares both against float32's target alone."""
    from benchmarks.inprocess import run_formats

    target, draft = tiny_pair_folders
    out = tmp_path / "fmt"
    args = _parse(["--quick", "--threads", "1", "--target", str(target), "--draft", str(draft), "--out", str(out),
                   "--formats", "float32:alone,int8", "--skip-hf", "--no-plot", "--proposers", "draft",
                   "--prompts", "code-prime", "--ks", "2"])
    results = run_formats(args)
    assert list(results) == ["float32", "int8"]
    assert [r["method"] for r in results["float32"]["rows"]] == ["target"]
    assert results["float32"]["memory"]["draft_weight_gb"] is None
    assert [r["method"] for r in results["int8"]["rows"]] == ["target", "ours-draft-K2"]
    assert results["int8"]["memory"]["draft_weight_gb"] > 0
    assert all(r["identical"] for r in results["int8"]["rows"])
    formats_table = ((out / "formats.md").read_text().split("## Per format and method")[1]  # goals table before
                     .split("\n## Target alone in rounds")[0])  # rounds table after
    lines = [line for line in formats_table.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[:4] for line in lines[1:]] == [
        ["| float32", f"{results['float32']['memory']['target_weight_gb']:.2f}", "0.00", "target"],
        ["| int8", f"{results['int8']['memory']['target_weight_gb']:.2f}",
         f"{results['int8']['memory']['draft_weight_gb']:.2f}", "target"],
        ["| int8", f"{results['int8']['memory']['target_weight_gb']:.2f}",
         f"{results['int8']['memory']['draft_weight_gb']:.2f}", "ours-draft-K2"]]
    bad = _parse(["--out", str(out)])  # the command line refuses it (next test); a caller's own args:
    bad.formats = ["int8:fast"]
    with pytest.raises(ValueError, match="unknown suffix 'fast'"):
        run_formats(bad)


def test_batching_bench_format_and_forward_stats(tiny_pair_folders, tmp_path):
    """``python -m benchmarks.batching --format``: both arms in the given format, outputs identical,
    and per forward the verify / draft seconds and the decode forwards grouped by rows."""
    from benchmarks.batching import main

    target, draft = tiny_pair_folders
    out = tmp_path / "batching"
    assert main(["--target", str(target), "--draft", str(draft), "--clients", "1,3", "--max-tokens", "6",
                 "--threads", "1", "--format", "int8", "--draft-format", "float32", "--out", str(out)]) == 0
    report = json.loads((out / "batching.json").read_text())
    assert report["settings"]["format"] == "int8" and report["settings"]["draft_format"] == "float32"
    assert [(r["format"], r["clients"]) for r in report["rows"]] == [("int8/float32", 1), ("int8/float32", 3)]
    for r in report["rows"]:
        assert r["identical_outputs"] is True
        assert r["batched_tokens"] == r["unbatched_tokens"] > 0
        for arm in ("batched", "unbatched"):
            assert r[f"{arm}_mean_verify_s_per_forward"] > 0 and r[f"{arm}_verify_s_total"] > 0
            by_rows = r[f"{arm}_decode_forwards_by_rows"]
            assert sum(v["forwards"] for v in by_rows.values()) <= r[f"{arm}_ticks"]
            for rows, v in by_rows.items():  # decode forwards: at most K + 1 positions per row
                assert 1 <= int(rows) <= r["clients"]
                assert v["mean_positions"] <= int(rows) * 5
    assert report["rows"][0]["batched_vs_1_client"] == 1.0
    table = (out / "batching.md").read_text()
    assert "(target/draft formats: int8/float32)" in table and "| int8/float32 | 6 | 3 |" in table
    # the header names the models measured, not the demo pair
    assert f"In-process, target {target}, draft {draft} (target/draft formats" in table and "demo pair" not in table


def test_batching_bench_lengths_and_adaptive_arm_in_one_run(tiny_pair_folders, tmp_path):
    """``--max-tokens 4,7 --adaptive``: every request length runs its client counts in the one run,
    with a third arm (batched, K per tenant under load) whose outputs equal the other arms', and
    the 'vs 1 client' ratios are taken per arm against the same length's 1-client row."""
    from benchmarks.batching import main

    target, draft = tiny_pair_folders
    out = tmp_path / "batching"
    assert main(["--target", str(target), "--draft", str(draft), "--clients", "1,2", "--max-tokens", "4,7",
                 "--adaptive", "--threads", "1", "--format", "int8", "--draft-format", "float32",
                 "--out", str(out)]) == 0
    report = json.loads((out / "batching.json").read_text())
    assert report["settings"]["lengths"] == [4, 7] and report["settings"]["adaptive"] is True
    assert [(r["max_tokens"], r["clients"]) for r in report["rows"]] == [(4, 1), (4, 2), (7, 1), (7, 2)]
    for r in report["rows"]:
        assert r["identical_outputs"] is True
        assert r["adaptive_tokens"] == r["batched_tokens"] == r["unbatched_tokens"] <= r["clients"] * r["max_tokens"]
        assert sum(r["adaptive_k_counts"].values()) > 0 and max(map(int, r["adaptive_k_counts"])) <= 4
        first = next(x for x in report["rows"] if x["max_tokens"] == r["max_tokens"])
        for arm in ("unbatched", "batched", "adaptive"):
            assert r[f"{arm}_vs_1_client"] == r[f"{arm}_tok_per_s"] / first[f"{arm}_tok_per_s"]
        assert r["adaptive_vs_batched"] == r["adaptive_tok_per_s"] / r["batched_tok_per_s"]
    table = (out / "batching.md").read_text()
    assert "| int8/float32 | 7 | 2 |" in table and "adaptive vs 1 client" in table
    with pytest.raises(SystemExit):
        main(["--max-tokens", "16,0"])


def test_batching_bench_with_prefix_caching_keeps_outputs_and_holds_only_the_shared_opening(tiny_pair_folders,
                                                                                             tmp_path):
    """``--prefix-cache``: outputs of both arms identical; before each group the prefix caches hold
    only what the warm request left (never a measured prompt whole), in each of the group's
    tenants' scopes."""
    from benchmarks.batching import WARM_PROMPT, main, prefix_warm
    from specdec.engine.prefix_cache import disable_prefix_cache, enable_prefix_cache, prefix_scope

    target, draft = tiny_pair_folders
    out = tmp_path / "batching"
    assert main(["--target", str(target), "--draft", str(draft), "--clients", "1,2", "--max-tokens", "5",
                 "--threads", "1", "--format", "int8", "--prefix-cache", "--out", str(out)]) == 0
    report = json.loads((out / "batching.json").read_text())
    assert report["settings"]["prefix_cache"] is True
    assert all(r["identical_outputs"] for r in report["rows"])
    assert "prefix cache on" in (out / "batching.md").read_text()

    from specdec.engine.engine import SpeculativeEngine
    from specdec.models.loader import load_model
    from specdec.models.spec import HFModelSpec
    from specdec.request import GenerationRequest

    engine = SpeculativeEngine(*(load_model(HFModelSpec(kind="hf", path=f), weight_format="int8")
                                 for f in (target, draft)))
    store = enable_prefix_cache(engine.target.model)
    try:
        engine.generate(GenerationRequest(messages=[{"role": "user", "content": "a measured prompt"}], max_tokens=2))
        prefix_warm(engine)
        warm = engine.encode(GenerationRequest(messages=[{"role": "user", "content": WARM_PROMPT}], max_tokens=2))
        held = [tokens for _scope, tokens, _cache in store._closed.values()]
        assert len(held) == 1 and held[0][:len(warm)] == warm
        # a group's tenants: the warm request once in each tenant's scope (the scheduler's default
        # prefix_cache_scope "tenant" shares cached prefixes only within a tenant)
        prefix_warm(engine, ["code", "creative"])
        held = [(scope, tokens[:len(warm)]) for scope, tokens, _cache in store._closed.values()]
        assert held == [(prefix_scope("code"), warm), (prefix_scope("creative"), warm)]
    finally:
        disable_prefix_cache(engine.target.model)


def test_batching_bench_formats_axis_in_one_run(tiny_pair_folders, tmp_path):
    """``--formats``: every pair loaded once, each client count run per format, ratios per format."""
    from benchmarks.batching import main

    target, draft = tiny_pair_folders
    out = tmp_path / "batching"
    assert main(["--target", str(target), "--draft", str(draft), "--clients", "1,2", "--max-tokens", "5",
                 "--threads", "1", "--formats", "float32,int8/float32", "--out", str(out)]) == 0
    report = json.loads((out / "batching.json").read_text())
    assert report["settings"]["formats"] == ["float32/float32", "int8/float32"]
    assert [(r["format"], r["clients"]) for r in report["rows"]] == [
        ("float32/float32", 1), ("int8/float32", 1), ("float32/float32", 2), ("int8/float32", 2)]
    for r in report["rows"]:
        assert r["identical_outputs"] is True
        first = next(x for x in report["rows"] if x["format"] == r["format"])
        assert r["batched_vs_1_client"] == r["batched_tok_per_s"] / first["batched_tok_per_s"]


def test_forward_stats_groups_decode_forwards_by_rows():
    from benchmarks.batching import forward_stats
    from specdec.engine.batch import TickRecord

    trace = [
        TickRecord([0, 1], [0, 1], 40, 40, 0.5, 2.0),   # prefill of two prompts: not a decode forward
        TickRecord([0, 1], [0, 1], 10, 10, 0.25, 1.0),  # 2 rows x (K=4 + 1)
        TickRecord([0, 1], [0, 1], 8, 8, 0.25, 0.5),
        TickRecord([1], [1], 5, 5, 0.25, 0.25),
        TickRecord([0], [], 3, 0, 0.75, 0.0),           # draft prefill chunk only: no forward
    ]
    s = forward_stats(trace, k=4)
    assert s["mean_verify_s_per_forward"] == (2.0 + 1.0 + 0.5 + 0.25) / 4
    assert s["mean_draft_s_per_tick"] == 2.0 / 5
    assert s["verify_s_total"] == 3.75 and s["draft_s_total"] == 2.0
    assert s["decode_forwards_by_rows"] == {
        1: {"forwards": 1, "mean_positions": 5.0, "mean_verify_s": 0.25},
        2: {"forwards": 2, "mean_positions": 9.0, "mean_verify_s": 0.75},
    }


def test_serving_batch_delta_and_step_stats():
    """The served benchmark's per-group numbers from two BatchStats snapshots and the responses' stats."""
    from benchmarks.serving import batch_delta, step_stats
    from protos.specdec.v1 import specdec_pb2 as pb

    before = {"forwards": 4, "mean_rows": 1.0, "mean_positions": 5.0}
    after = {"forwards": 10, "mean_rows": 2.2, "mean_positions": 11.0}
    # 6 new forwards holding 22 - 4 = 18 rows and 110 - 20 = 90 positions
    assert batch_delta(before, after) == {"forwards": 6, "mean_rows": 3.0, "mean_positions": 15.0}
    assert batch_delta(None, after) is None
    assert batch_delta(before, {**after, "forwards": 1000}) is None  # the target's window wrapped
    assert batch_delta(after, after) == {"forwards": 0, "mean_rows": 0.0, "mean_positions": 0.0}

    a = pb.SpeculationStats(steps=2, proposed=8, accepted=6, target_compute_s=0.5, round_trip_s=0.75,
                            draft_time_s=0.5)
    b = pb.SpeculationStats(steps=6, proposed=24, accepted=10, target_compute_s=0.25, round_trip_s=0.5,
                            draft_time_s=1.5)
    s = step_stats([a, b])
    assert s == {"steps": 8, "target_compute_s_per_step": (1.0 + 1.5) / 8, "round_trip_s_per_step": (1.5 + 3.0) / 8,
                 "draft_s_per_step": 2.0 / 8, "acceptance_rate": 16 / 32}
    assert step_stats([]) == {"steps": 0}


def test_serving_modes_parse_settings():
    from benchmarks.serving import parse_mode

    assert parse_mode("unbatched") == (False, {"target_batching": False, "draft_batching": False})
    assert parse_mode("batched:batch_window_s=0.05:cpu_threads=1") == (
        True, {"target_batching": True, "draft_batching": True, "batch_window_s": 0.05, "cpu_threads": 1})
    with pytest.raises(ValueError, match="expected batched or unbatched"):
        parse_mode("fast")
    with pytest.raises(ValueError, match="not field=value"):
        parse_mode("batched:target_tp=2")
    with pytest.raises(ValueError, match="cpu_threads needs a int, got 'two'"):
        parse_mode("batched:cpu_threads=two")


@pytest.mark.parametrize("value, message", [
    ("w8a8:foo", "argument --formats: unknown suffix 'foo' in 'w8a8:foo' (only ':alone')"),
    ("int4,bogus", "argument --formats: unknown format 'bogus' in 'bogus'; known: float32, bfloat16, float16, int8, int4, w8a8, w7a8"),
])
def test_bad_formats_are_a_usage_error_before_any_model_loads(value, message, capsys):
    parser = add_bench_arguments(argparse.ArgumentParser(prog="specdec bench"))
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--formats", value])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"specdec bench: error: {message}")
    assert parser.parse_args(["--formats", "w8a8, float32:alone"]).formats == ["w8a8", "float32:alone"]


def test_alone_rounds_interleave_formats_and_report_median_ratio_with_spread(tiny_pair_folders, tmp_path):
    """``--alone-rounds 3``: both targets stay loaded and run alone in 3 rounds, formats back to back
    (order reversed every other round); formats.md's rounds table holds the median of the per-round
    CPU ratios over float32 and their min-max, computed from the recorded runs."""
    import statistics

    from benchmarks.inprocess import run_formats

    target, _ = tiny_pair_folders
    out = tmp_path / "fmt"
    args = _parse(["--quick", "--threads", "1", "--target", str(target), "--draft", "none", "--out", str(out),
                   "--formats", "float32:alone,int8:alone", "--skip-hf", "--no-plot", "--proposers", "",
                   "--prompts", "code-prime,poem-sea", "--alone-rounds", "3"])
    results = run_formats(args)
    assert list(results) == ["float32", "int8"]
    dump = json.loads((out / "formats.json").read_text())["alone_rounds"]
    runs = dump["runs"]
    assert [(x["round"], x["prompt"], x["format"]) for x in runs] == [
        (0, "code-prime", "float32"), (0, "code-prime", "int8"), (0, "poem-sea", "float32"), (0, "poem-sea", "int8"),
        (1, "code-prime", "int8"), (1, "code-prime", "float32"), (1, "poem-sea", "int8"), (1, "poem-sea", "float32"),
        (2, "code-prime", "float32"), (2, "code-prime", "int8"), (2, "poem-sea", "float32"), (2, "poem-sea", "int8")]
    assert all(x["new_tokens"] == 12 and x["cpu_s"] > 0 and x["seconds"] > 0 for x in runs)
    table = (out / "formats.md").read_text()
    assert "## Target alone in rounds (3 rounds, formats interleaved)" in table
    for prompt in ("code-prime", "poem-sea"):
        # greedy: every round gives the format's own output; the tiny int8 target differs from float32 nowhere here
        by = {(x["round"], x["format"]): x for x in runs if x["prompt"] == prompt}
        assert len({tuple(by[(r, "int8")]["token_ids"]) for r in range(3)}) == 1
        ratios = [(12 / by[(r, "int8")]["cpu_s"]) / (12 / by[(r, "float32")]["cpu_s"]) for r in range(3)]
        s = results["int8"]["alone_rounds"][prompt]
        assert s["ratios_cpu"] == pytest.approx(ratios)
        assert s["ratio_cpu"] == pytest.approx(statistics.median(ratios))
        assert (s["ratio_cpu_min"], s["ratio_cpu_max"]) == (pytest.approx(min(ratios)), pytest.approx(max(ratios)))
        assert s["tps_cpu"] == pytest.approx(statistics.median(12 / by[(r, "int8")]["cpu_s"] for r in range(3)))
        assert s["identical"] is True
        assert (f"| {prompt} | int8 | {s['tps_cpu']:.2f} | {statistics.median(ratios):.2f}x "
                f"({min(ratios):.2f}-{max(ratios):.2f}) |") in table
        assert f"| {prompt} | float32 | " in table
        assert results["float32"]["alone_rounds"][prompt]["ratios_cpu"] == [1.0, 1.0, 1.0]
    f32_line = next(line for line in table.splitlines() if line.startswith("| code-prime | float32 |"))
    assert "| 1.00x (1.00-1.00) |" in f32_line


def test_alone_rounds_summary_from_given_runs():
    """summarize_rounds on hand-made runs: medians and spread of the per-round ratios, exactly."""
    from benchmarks.inprocess_rounds import rounds_table, summarize_rounds

    def run(r, f, cpu, wall, ids=(1, 2)):
        return {"round": r, "prompt": "p", "format": f, "position": 0, "new_tokens": 10, "seconds": wall,
                "cpu_s": cpu, "loadavg": 1.5, "token_ids": list(ids)}

    runs = [run(0, "float32", 5.0, 5.0), run(0, "w8a8", 2.0, 2.5),   # ratio cpu 2.5, wall 2.0
            run(1, "w8a8", 1.0, 1.0), run(1, "float32", 4.0, 4.0),   # 4.0, 4.0
            run(2, "float32", 6.0, 6.0), run(2, "w8a8", 2.0, 2.0, ids=(1, 3))]  # 3.0, 3.0
    s = summarize_rounds(runs, ["float32", "w8a8"], ["p"])["p"]
    assert s["w8a8"]["ratios_cpu"] == [2.5, 4.0, 3.0]
    assert (s["w8a8"]["ratio_cpu"], s["w8a8"]["ratio_cpu_min"], s["w8a8"]["ratio_cpu_max"]) == (3.0, 2.5, 4.0)
    assert (s["w8a8"]["ratio_wall"], s["w8a8"]["ratio_wall_min"], s["w8a8"]["ratio_wall_max"]) == (3.0, 2.0, 4.0)
    assert s["w8a8"]["tps_cpu"] == 5.0 and s["float32"]["tps_cpu"] == 2.0
    assert s["w8a8"]["identical"] is False and s["float32"]["identical"] is True
    table = rounds_table({"rounds": 3, "formats": ["float32", "w8a8"], "runs": runs, "prompts": {"p": s}})
    assert "| p | w8a8 | 5.00 | 3.00x (2.50-4.00) | 5.00 | 3.00x (2.00-4.00) | False |" in table
    assert "| p | float32 | 2.00 | 1.00x (1.00-1.00) | 2.00 | 1.00x (1.00-1.00) | True |" in table
    assert "load average at the calls: 1.5-1.5" in table


@pytest.mark.parametrize("argv, rounds", [(["--formats", "float32:alone,w8a8"], 3), (["--formats", "w8a8"], 0),
                                          (["--formats", "float32,w8a8", "--alone-rounds", "0"], 0),
                                          (["--formats", "w8a8", "--alone-rounds", "5"], 5)])
def test_alone_rounds_default(argv, rounds):
    from benchmarks.inprocess_formats import alone_rounds

    args = _parse(argv)
    assert alone_rounds(args, len(args.formats)) == rounds


def test_negative_alone_rounds_is_a_usage_error(capsys):
    parser = add_bench_arguments(argparse.ArgumentParser(prog="specdec bench"))
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--alone-rounds", "-1"])
    assert info.value.code == 2
    assert "argument --alone-rounds: expected a whole number >= 0, got '-1'" in capsys.readouterr().err
