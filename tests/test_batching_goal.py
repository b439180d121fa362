"""``python -m benchmarks.batching_goal`` (issue 10's in-process goal) end to end on a tiny pair."""

from __future__ import annotations

import json

import pytest

from benchmarks.report import read_bench_json



def test_batching_goal_runs_both_sides_in_one_run_with_identical_outputs(tiny_pair_folders, tmp_path):
    """Per length: one client at K=--k and adaptive, many clients at every --ks and adaptive;
    the ratios are over the one client's best arm, outputs are identical across arms (and the
    many clients' first request is the one client's), and the goal line is printed."""
    from benchmarks.batching_goal import GOAL, main

    target, draft = tiny_pair_folders
    out = tmp_path / "goal"
    assert main(["--target", str(target), "--draft", str(draft), "--clients", "3", "--ks", "0,2", "--k", "2",
                 "--max-tokens", "5,7", "--threads", "1", "--format", "int8", "--out", str(out)]) == 0
    report = read_bench_json(out / "goal.json")
    assert not (out / "goal.partial.json").exists()
    assert [r["max_tokens"] for r in report["rows"]] == [5, 7]
    for row in report["rows"]:
        assert row["identical_outputs"] is True
        assert list(row["one_client"]) == ["K=2", "adaptive"]
        assert list(row["many_clients"]) == ["K=0", "K=2", "adaptive"]
        one = row["one_client"][row["one_client_best"]]
        assert one["tok_per_s"] == max(r["tok_per_s"] for r in row["one_client"].values())
        for arm, r in row["many_clients"].items():
            assert r["tokens"] == 3 * row["max_tokens"]  # the tiny pair never stops early at these lengths
            assert r["vs_one_client"] == r["tok_per_s"] / one["tok_per_s"]
            assert r["vs_one_client_per_cpu_s"] == r["tok_per_cpu_s"] / one["tok_per_cpu_s"]
            assert r["other_s"] == pytest.approx(r["wall_s"] - r["verify_s_total"] - r["draft_s_total"])
        assert row["many_clients"]["K=0"]["k_counts"] == {0: 3 * row["max_tokens"]}  # plain batched decoding
        adaptive = row["many_clients"]["adaptive"]["k_counts"]
        assert max(adaptive) <= 2 and list(adaptive) == sorted(adaptive)
        assert row["adaptive_vs_one_client"] == row["many_clients"]["adaptive"]["vs_one_client"]
    table = (out / "goal.md").read_text()
    assert f"**5 tokens: 3 clients adaptive = {report['rows'][0]['adaptive_vs_one_client']:.2f}x one client** " \
           f"(goal {GOAL}x" in table
    assert "| 7 | 3 | K=0 |" in table and "| 7 | 1 | K=2 |" in table


def test_batching_goal_rounds_report_each_arm_by_its_median_round(tiny_pair_folders, tmp_path):
    """--rounds 3: every arm runs three times (order reversed in the second round), its row is the
    median round by tokens/s, every round's tokens/s is kept, and outputs match across rounds."""
    from benchmarks.batching_goal import main

    target, draft = tiny_pair_folders
    out = tmp_path / "goal"
    assert main(["--target", str(target), "--draft", str(draft), "--clients", "2", "--ks", "0", "--k", "2",
                 "--max-tokens", "4", "--threads", "1", "--format", "int8", "--rounds", "3", "--out", str(out)]) == 0
    row = read_bench_json(out / "goal.json")["rows"][0]
    assert row["identical_outputs"] is True
    for side in ("one_client", "many_clients"):
        for arm, r in row[side].items():
            assert len(r["rounds_tok_per_s"]) == 3
            assert r["tok_per_s"] == sorted(r["rounds_tok_per_s"])[1]


@pytest.mark.parametrize("argv", [["--clients", "1"], ["--k", "0"], ["--ks", "0,-1"], ["--ks", "a"],
                                  ["--max-tokens", "0"], ["--rounds", "0"]])
def test_batching_goal_refuses_bad_arguments(argv):
    from benchmarks.batching_goal import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


def test_batching_profile_row_dtype_both_profiles_each_group_in_both_dtypes(tiny_pair_folders, tmp_path):
    """``benchmarks.batching_profile --row-dtype both``: every group twice, the row-wise attention
    in the model's own dtype (int8 weights, bfloat16 activations) then in float32, with the same
    tokens and attention calls; the module's CPU_ROW_DTYPE is float32 again afterwards."""
    import torch

    from benchmarks.batching_profile import main
    from specdec.engine import invariant

    target, draft = tiny_pair_folders
    out = tmp_path / "prof"
    assert main(["--target", str(target), "--draft", str(draft), "--format", "int8", "--clients", "2,1",
                 "--max-tokens", "4", "--threads", "1", "--row-dtype", "both", "--out", str(out)]) == 0
    groups = json.loads((out / "profile-1t-4tok.json").read_text())["groups"]
    assert [(g["clients"], g["row_dtype"]) for g in groups] == [(2, "native"), (2, "float32"), (1, "native"),
                                                                (1, "float32")]
    for native, f32 in (groups[:2], groups[2:]):
        assert native["tokens"] == f32["tokens"] == 4 * native["clients"]
        attention = "  of which row-wise attention"
        assert native["parts"][attention]["calls"] == f32["parts"][attention]["calls"] > 0
    assert invariant.CPU_ROW_DTYPE == torch.float32
    assert "row-wise attention rows in native" in (out / "profile-1t-4tok.md").read_text()


def test_rounds_put_k0_next_to_adaptive_and_never_after_the_dearest_arm():
    """Session 10's order ran the many clients' adaptive arm right after their K=4 arm in rounds
    1 and 3 (its K = 0 forwards measured 0.83-0.90x the K = 0 arm's): now K = 0 and adaptive are
    neighbours that swap places every round, and neither follows the many clients' largest K."""
    from benchmarks.batching_goal import arm_order

    order = arm_order(["K=4", "adaptive"], ["K=0", "K=1", "K=2", "K=4", "adaptive"])
    assert order == [("many", "K=1"), ("many", "K=2"), ("many", "K=4"), ("one", "K=4"), ("many", "K=0"),
                     ("many", "adaptive"), ("one", "adaptive")]
    for rnd in (order, order[::-1]):
        i, j = rnd.index(("many", "K=0")), rnd.index(("many", "adaptive"))
        assert abs(i - j) == 1
        assert ("many", "K=4") not in (rnd[i - 1] if i else None, rnd[j - 1] if j else None)
    assert arm_order(["K=2", "adaptive"], ["K=2", "adaptive"]) == [("many", "K=2"), ("one", "K=2"),
                                                                   ("many", "adaptive"), ("one", "adaptive")]


def test_paired_ratios_are_medians_of_each_rounds_own_ratio():
    from benchmarks.batching_goal import paired_ratios

    def r(tps, cpu):
        return {"tok_per_s": tps, "tok_per_cpu_s": cpu}

    runs = {("many", "K=0"): [r(70, 35), r(80, 40), r(60, 30)],
            ("many", "K=2"): [r(50, 25), r(90, 45), r(40, 20)],
            ("many", "adaptive"): [r(63, 35), r(84, 42), r(66, 30)],
            ("one", "adaptive"): [r(1, 1)] * 3}
    out = paired_ratios(runs, ["K=0", "K=2"])
    assert out["adaptive_vs_k0_rounds"] == [0.9, 1.05, 1.1]
    assert out["adaptive_vs_k0_paired"] == 1.05
    assert out["adaptive_vs_k0_paired_per_cpu_s"] == 1.0
    # round 2's best fixed is K=2 (90 tok/s): 84 / 90
    assert out["adaptive_vs_best_fixed_rounds"] == [0.9, round(84 / 90, 4), 1.1]
    assert out["adaptive_vs_best_fixed_paired"] == 84 / 90
    assert "adaptive_vs_k0_paired" not in paired_ratios({k: v for k, v in runs.items() if k[1] != "K=0"}, ["K=2"])


def test_batching_goal_traces_the_adaptive_decisions_and_runs_float32_without_prefix_cache(
        tiny_pair_folders, tmp_path, monkeypatch):
    """SPECDEC_BATCH_K_TRACE: one JSON line per decision (K per tenant, what K = 0 would give under
    the same costs, the priced forwards) and per tick (the measured verify forward), labelled with
    the arm; float32 (the default on CPUs without AVX2 or AVX-512 kernels) is not shape-invariant, so prefix caching is
    turned off instead of refusing the run."""
    from benchmarks.batching_goal import main

    target, draft = tiny_pair_folders
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("SPECDEC_BATCH_K_TRACE", str(trace))
    out = tmp_path / "goal"
    assert main(["--target", str(target), "--draft", str(draft), "--clients", "2", "--ks", "0", "--k", "2",
                 "--max-tokens", "3", "--threads", "1", "--format", "float32", "--out", str(out)]) == 0
    report = json.loads((out / "goal.json").read_text())
    assert report["format"] == "float32/float32" and report["settings"]["prefix_cache"] is False
    assert report["rows"][0]["identical_outputs"] is True
    recs = [json.loads(line) for line in trace.read_text().splitlines()]
    decisions = [r for r in recs if "decision" in r]
    ticks = [r for r in recs if "tick" in r]
    assert {r["arm"] for r in decisions} == {"warm-up", "3 tokens many adaptive round 1", "3 tokens one adaptive round 1"}
    for d in decisions:
        assert set(d["decision"]) <= {"code", "creative"} and all(0 <= k <= 2 for k in d["decision"].values())
        assert d["k0_tokens_per_s"] <= d["tokens_per_s"] + 1e-9  # the decision is the best it priced
        assert d["priced"]["draft_s(8)"] >= d["priced"]["draft_s(1)"] > 0
    assert all(t["tick"][0] >= 1 and t["tick"][1] >= t["tick"][0] and t["tick"][2] > 0 for t in ticks)
