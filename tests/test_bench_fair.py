"""``specdec bench``: fair ratios (paired by repeat, every method warmed the same way), the adaptive
method (the per-tenant K controller as a server runs it), per-prompt token caps, ``--only`` and
the goals table. Tiny target/draft pair."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.inprocess import add_bench_arguments, run_bench
from benchmarks.inprocess_goals import goals_table, paired
from benchmarks.inprocess_methods import Method, RunOutcome, warm_up
from benchmarks.report import tabulate


@pytest.fixture(scope="module")
def pair(tiny_pair_folders):
    return tuple(str(p) for p in tiny_pair_folders)


def _parse(argv):
    return add_bench_arguments(argparse.ArgumentParser()).parse_args(argv)


def _runs(cpu: list[float], n: int = 10) -> list[RunOutcome]:
    return [RunOutcome(token_ids=[1] * n, seconds=c, cpu_s=c, repeat=r) for r, c in enumerate(cpu)]


def test_speedup_is_the_median_of_ratios_within_each_repeat_not_of_medians():
    """Session 9's case: the first repeat's target alone ran cold (slow). Each method's ratio is
    taken against the target alone of its own repeat, then the median over repeats: 10/1.0 over
    10/4.0, 10/1.5 over 10/2.0, 10/1.2 over 10/1.8 -> 4.0, 1.333, 1.5 -> 1.5. Ratio of medians
    (the old way) would give (10/1.2)/(10/2.0) = 1.667."""
    prompts = [{"name": "p", "type": "code"}]
    methods = [Method("target", "target"), Method("ours-draft-K4", "ours", "draft", 4)]
    samples = {("p", "target"): _runs([4.0, 2.0, 1.8]), ("p", "ours-draft-K4"): _runs([1.0, 1.5, 1.2])}
    rows = {r["method"]: r for r in tabulate(prompts, methods, samples)}
    assert rows["ours-draft-K4"]["cpu_speedup_all"] == pytest.approx([4.0, 4 / 3, 1.5])
    assert rows["ours-draft-K4"]["cpu_speedup"] == pytest.approx(1.5)
    assert rows["ours-draft-K4"]["speedup"] == pytest.approx(1.5)
    assert rows["target"]["cpu_speedup"] == 1.0
    assert paired(rows["ours-draft-K4"], rows["target"]) == pytest.approx([4.0, 4 / 3, 1.5])


def test_warm_up_runs_every_method_once_at_full_length():
    """Not one short call per family: every method (label) at the prompt's full length, adaptive
    ones with a cold controller (warm = 0), so none carries first-call costs the others do not."""
    calls = []

    class FakeRunner:
        def run(self, m, ids, tokens):
            calls.append((m.label, m.k, m.warm, tokens))

    methods = [Method("target", "target"), Method("ours-draft-K4", "ours", "draft", 4),
               Method("ours-draft-K8", "ours", "draft", 8), Method("ours-adaptive-w3", "ours-adaptive", "draft", None, 0.0, 3)]
    warm_up(FakeRunner(), methods, [1, 2, 3], 32)
    assert calls == [("target", None, None, 32), ("ours-draft-K4", 4, None, 32), ("ours-draft-K8", 8, None, 32),
                     ("ours-adaptive-w3", None, 0, 32)]


def test_adaptive_method_full_rewrite_and_only(pair, tmp_path):
    """--adaptive 0,2: a cold controller per timed run and one taught by 2 earlier requests of the
    prompt's type (copied before every timed run, so both repeats decide the same); outputs stay the
    target's; code-rename-full runs to its own cap; --only limits a type's methods."""
    target, draft = pair
    args = _parse(["--threads", "1", "--target", target, "--draft", draft, "--out", str(tmp_path), "--no-plot",
                   "--tokens", "8", "--ks", "2", "--ngram-ks", "8", "--proposers", "draft,ngram", "--skip-hf",
                   "--repeats", "2", "--adaptive", "0,2", "--prompts", "poem-sea,code-rename-full",
                   "--only", "copy_full:ours-ngram-K8"])
    report = run_bench(args)
    rows = {(r["prompt"], r["method"]): r for r in report["rows"]}
    assert sorted(m for p, m in rows if p == "code-rename-full") == ["ours-ngram-K8", "target"]
    assert sorted(m for p, m in rows if p == "poem-sea") == ["ours-adaptive-w0", "ours-adaptive-w2",
                                                            "ours-draft-K2", "ours-ngram-K8", "target"]
    full = rows[("code-rename-full", "target")]
    # past --tokens to its own end (the tiny target writes EOS after 191 tokens), not cut at 8
    assert full["new_tokens"] == 191 and rows[("code-rename-full", "ours-ngram-K8")]["new_tokens"] == 191
    assert rows[("poem-sea", "target")]["new_tokens"] == 8
    assert [p["max_new_tokens"] for p in report["prompts"]] == [8, 256]
    assert all(r["identical"] for r in rows.values())
    cold, warm = rows[("poem-sea", "ours-adaptive-w0")], rows[("poem-sea", "ours-adaptive-w2")]
    # a fresh controller's first request runs at the probe's K (fresh_key_whole_probe; "probe" where the
    # calibrated costs held it at K = 0, "probe: fresh key" where at a K below the probe's), the same in both repeats
    assert len(cold["decisions"]) == 2 and cold["decisions"][0]["reason"] in ("probe", "probe: fresh key")
    assert cold["decisions"][0] == cold["decisions"][1] and cold["decisions"][0]["probe"] is True
    # every controller started from the costs calibrated once at load (every K of the policy measured)
    costs = report["meta"]["adaptive_calibrated_costs"]
    assert sorted(int(p) for p in costs["verify"]) == list(range(1, 10))
    assert len(warm["decisions"]) == 2 and warm["decisions"][0] == warm["decisions"][1]
    log = report["meta"]["adaptive_warm_up"]
    assert list(log) == ["w2/creative/c0"] and len(log["w2/creative/c0"]) == 2
    assert report["meta"]["adaptive"]["warm"] == [0, 2]


def test_only_with_an_unknown_label_is_refused(pair, tmp_path):
    target, draft = pair
    args = _parse(["--threads", "1", "--target", target, "--draft", draft, "--out", str(tmp_path), "--no-plot",
                   "--tokens", "4", "--ks", "2", "--proposers", "draft", "--skip-hf", "--prompts", "poem-sea",
                   "--only", "creative:ours-draft-K9"])
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['ours-draft-K9'\]"):
        run_bench(args)


@pytest.mark.parametrize("argv, message", [(["--only", "copy"], "expected PROMPT_OR_TYPE:LABEL"),
                                           (["--adaptive", "-1"], "expected whole numbers >= 0")])
def test_bad_only_and_adaptive_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_goals_table_reads_paired_ratios_and_the_rounds():
    def row(prompt, ptype, method, family, proposer, cpu, reps=(0, 1)):
        return {"prompt": prompt, "type": ptype, "method": method, "family": family, "proposer": proposer,
                "new_tokens": 32, "cpu_s_all": cpu, "repeats_all": list(reps)}

    rows = [row("code-prime", "code", "target", "target", None, [4.0, 3.0]),
            row("code-prime", "code", "hf-assisted", "hf-assisted", None, [2.0, 2.0]),
            row("code-prime", "code", "ours-draft-K8", "ours", "draft", [2.0, 1.5]),
            row("code-rename", "copy", "target", "target", None, [8.0, 8.0]),
            row("code-rename", "copy", "ours-ngram-K16", "ours", "ngram", [4.0, 3.0])]
    rounds = {"prompts": {"code-prime": {"float32": {"tps_cpu": 2.0, "ratios_cpu": [1.0, 1.0]},
                                         "w8a8": {"tps_cpu": 10.0, "ratios_cpu": [4.5, 5.0, 5.5]}}}}
    text = goals_table({"float32": {"rows": []}, "w8a8": {"rows": rows}}, ["float32", "w8a8"], rounds)
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| goal")]
    assert lines == [
        "| 1: target alone x float32 | code-prime | w8a8 | target | – | 10.00 | **5.00x** (4.50-5.50) | >= 3x | yes |",
        "| 2: x target alone | code-prime | w8a8 | ours-draft-K8 | 32 | 18.67 | **2.00x** (2.00-2.00) | >= 1.6x | yes |",
        "| 2: x transformers assisted | code-prime | w8a8 | ours-draft-K8 | 32 | 18.67 | **1.17x** (1.00-1.33) | "
        ">= 1.15x | yes |",
        "| 4: x target alone | code-rename | w8a8 | ours-ngram-K16 | 32 | 9.33 | **2.33x** (2.00-2.67) | >= 2x | yes |",
    ]


def test_alone_prompts_limit_the_baseline_format_and_the_rounds(pair, tmp_path):
    """--formats float32:alone,int8 --alone-prompts code-prime: float32 runs only that prompt, one
    timed run (its ratio comes from the rounds), and the rounds time only that prompt; int8 runs
    every prompt, both repeats; formats.md opens with the goals table."""
    from benchmarks.inprocess import run_formats

    target, draft = pair
    args = _parse(["--threads", "1", "--target", target, "--draft", draft, "--out", str(tmp_path), "--no-plot",
                   "--tokens", "6", "--ks", "2", "--proposers", "draft", "--skip-hf", "--repeats", "2", "--no-bracket",
                   "--formats", "float32:alone,int8", "--alone-prompts", "code-prime", "--alone-rounds", "2",
                   "--prompts", "code-prime,poem-sea"])
    results = run_formats(args)
    assert [(r["prompt"], r["method"], r["runs"]) for r in results["float32"]["rows"]] == [("code-prime", "target", 1)]
    assert sorted((r["prompt"], r["method"], r["runs"]) for r in results["int8"]["rows"]) == [
        ("code-prime", "ours-draft-K2", 2), ("code-prime", "target", 2),
        ("poem-sea", "ours-draft-K2", 2), ("poem-sea", "target", 2)]
    assert list(results["int8"]["alone_rounds"]) == ["code-prime"]
    text = (tmp_path / "formats.md").read_text()
    assert text.index("## Issue 9's goals in this run") < text.index("## Per format and method")
    assert "| 1: target alone x float32 | code-prime | int8 | target |" in text
