"""Issue 9's in-process goals, read off one ``specdec bench --formats`` run (``formats.md``'s
first section; nothing here measures anything).

1. code: the default format's target alone >= 3x float32's (the interleaved ``--alone-rounds``
   median, its min-max);
2. code: speculation >= 1.6x the same format's target alone and >= 1.15x transformers' assisted
   generation with the same weights;
3. creative: >= 0.95x the target alone;
4. copy (rewrite a code block with one rename): prompt lookup >= 2x the target alone, both at
   ``--tokens`` (type ``copy``) and run to the end of the block (type ``copy_full``).

Every ratio against a method of the run is paired by repeat (:func:`paired`): the method's tokens
per CPU-second over the other's in the same repeat, median over the repeats (min-max), both
warmed the same way (:func:`benchmarks.inprocess_methods.warm_up`).
"""

from __future__ import annotations

import statistics

#: goal -> (prompt type, what, threshold)
GOALS = {
    "2": ("code", "x target alone", 1.6),
    "2b": ("code", "x transformers assisted", 1.15),
    "3": ("creative", "x target alone", 0.95),
    "4": ("copy", "x target alone", 2.0),
    "4full": ("copy_full", "x target alone", 2.0),
}


def paired(row: dict, ref: dict) -> list[float]:
    """Per repeat of ``row``: its new tokens per CPU-second over ``ref``'s median in the same
    repeat (rows of :func:`benchmarks.report.tabulate`; ``cpu_s_all`` / ``repeats_all``)."""
    by: dict = {}
    for s, r in zip(ref["cpu_s_all"], ref.get("repeats_all") or [None] * len(ref["cpu_s_all"])):
        by.setdefault(r, []).append(ref["new_tokens"] / s)
    every = [ref["new_tokens"] / s for s in ref["cpu_s_all"]]
    reps = row.get("repeats_all") or [None] * len(row["cpu_s_all"])
    return [(row["new_tokens"] / s) / statistics.median(by.get(r) or every) for s, r in zip(row["cpu_s_all"], reps)]


def _cell(ratios: list[float], goal: float) -> tuple[str, str]:
    if not ratios:
        return "–", "–"
    med = statistics.median(ratios)
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"**{med:.2f}x**{spread}", "yes" if med >= goal else "no"


def goals_table(results: dict, formats: list[str], by_rounds: dict | None) -> str:
    """Markdown: one line per goal and method.

    Args:
        results: format -> ``{"rows": [...]}`` (:func:`benchmarks.inprocess_formats.run_each_format`).
        formats: the run's formats, the first the baseline of goal 1.
        by_rounds: :func:`benchmarks.inprocess_rounds.time_alone_rounds`'s result, or None.
    """
    first = formats[0]
    lines = ["## Issue 9's goals in this run", "",
             "Tokens per CPU-second. Ratios to a method of the same format: median over the repeats of the "
             "ratio within the repeat (both warmed the same way), (min-max). Goal 1: the interleaved target-alone "
             "rounds. `new tok` = new tokens of the timed runs.", "",
             "| goal | prompt | format | method | new tok | tok/s (cpu) | ratio | goal | met |",
             "|---|---|---|---|---:|---:|---|---|---|"]
    if by_rounds is not None:
        for prompt, per in by_rounds["prompts"].items():
            for f in formats[1:]:
                s = per.get(f)
                if s is None:
                    continue
                cell, met = _cell(s["ratios_cpu"], 3.0)
                lines.append(f"| 1: target alone x {first} | {prompt} | {f} | target | – | {s['tps_cpu']:.2f} | "
                             f"{cell} | >= 3x | {met} |")
    for f in formats:
        rows = results[f]["rows"]
        for goal, (ptype, what, thr) in GOALS.items():
            for prompt in dict.fromkeys(r["prompt"] for r in rows if r["type"] == ptype):
                prow = {r["method"]: r for r in rows if r["prompt"] == prompt}
                ref = prow.get("hf-assisted" if goal == "2b" else "target")
                if ref is None:
                    continue
                for label, r in prow.items():
                    if not r["family"].startswith("ours") or r["proposer"] == "none":
                        continue
                    if goal in ("4", "4full") and r["proposer"] != "ngram":
                        continue
                    cell, met = _cell(paired(r, ref), thr)
                    tps = statistics.median(r["new_tokens"] / s for s in r["cpu_s_all"])
                    lines.append(f"| {goal[0]}: {what} | {prompt} | {f} | {label} | {r['new_tokens']} | {tps:.2f} | "
                                 f"{cell} | >= {thr:g}x | {met} |")
    return "\n".join(lines) + "\n"
