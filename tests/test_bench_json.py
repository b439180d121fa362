"""``k_counts`` in the benchmarks' JSON: K in ascending order, int keys when read back.

``bench.json`` printed ``"k_counts": {"8": 4, "0": 1}`` (insertion order; JSON keys are strings),
so a reader compared string keys with the int ``k`` of the same row."""

from __future__ import annotations

import json

from benchmarks import report as report_mod
from benchmarks.report import k_counts_by_k, read_bench_json, write_report


def test_k_counts_are_sorted_by_k_and_read_back_as_ints(tmp_path, monkeypatch):
    monkeypatch.setattr(report_mod, "format_tables", lambda report: "")  # the tables have their own tests
    report = {"meta": {"adaptive_warm_up": {"w4/code": [{"k": 2, "k_counts": {2: 11, 10: 1, 0: 1}}]}},
              "prompts": [], "rows": [{"k": 8, "k_counts": {8: 4, 0: 1}}, {"k": None, "k_counts": None}],
              "summary": {}}
    write_report(report, tmp_path, plot=False)
    text = (tmp_path / "bench.json").read_text()
    assert '"k_counts": {\n    "0": 1,\n    "8": 4\n   }' in text
    back = read_bench_json(tmp_path / "bench.json")
    assert back["rows"][0]["k_counts"] == {0: 1, 8: 4} and list(back["rows"][0]["k_counts"]) == [0, 8]
    assert back["rows"][1]["k_counts"] is None
    assert list(back["meta"]["adaptive_warm_up"]["w4/code"][0]["k_counts"].items()) == [(0, 1), (2, 11), (10, 1)]
    assert json.loads(text)["rows"][0]["k"] == 8  # other fields as written


def test_other_keys_ending_elsewhere_are_left_alone():
    obj = {"adaptive_k_counts": {"4": 2, "1": 3}, "counts": {"b": 1, "a": 2}, "k": {"3": 1}}
    assert k_counts_by_k(obj) == {"adaptive_k_counts": {1: 3, 4: 2}, "counts": {"b": 1, "a": 2}, "k": {"3": 1}}
