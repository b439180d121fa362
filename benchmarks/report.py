"""The report of ``specdec bench`` (:mod:`benchmarks.inprocess`): rows, summary, tables, plot.

From the measured runs of every (prompt, method) to ``bench.json``, ``table.md`` (markdown,
ratios side by side) and ``speedup.png``; nothing here measures anything.
"""

from __future__ import annotations

import json
import math
import os
import sys
import statistics
from pathlib import Path

#: prompt types, in table/plot order
PROMPT_TYPES = ("code", "sql_json", "copy", "copy_full", "creative")


def median(xs: list[float]) -> float | None:
    """Median of ``xs``, None when empty."""
    return statistics.median(xs) if xs else None


def k_counts_by_k(obj):
    """``obj`` with every ``*k_counts`` mapping (K -> steps) keyed by int K in ascending order,
    at any depth. JSON object keys are strings by definition, so a written ``{8: 4, 0: 1}``
    read back as ``{"8": 4, "0": 1}`` (string keys, in insertion order); written through this it
    is ``{"0": 1, "8": 4}``, and :func:`read_bench_json` gives ``{0: 1, 8: 4}`` back."""
    if isinstance(obj, dict):
        return {k: (dict(sorted((int(a), b) for a, b in v.items()))
                    if isinstance(k, str) and k.endswith("k_counts") and isinstance(v, dict)
                    else k_counts_by_k(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [k_counts_by_k(v) for v in obj]
    return obj


def read_bench_json(path: str | Path):
    """A benchmark's JSON report (``bench.json``, ``formats.json``, ``goal.json``, ...) with every
    ``*k_counts`` mapping keyed by int K again (:func:`k_counts_by_k`)."""
    return k_counts_by_k(json.loads(Path(path).read_text()))


def write_bench_json(path: str | Path, obj, **dumps_kwargs) -> None:
    """Write a benchmark's JSON report to ``path`` with every ``*k_counts`` mapping in ascending K
    (:func:`k_counts_by_k`), the form :func:`read_bench_json` reads back; ``dumps_kwargs`` go to
    :func:`json.dumps` (``indent``, ``default``)."""
    Path(path).write_text(json.dumps(k_counts_by_k(obj), **dumps_kwargs) + "\n")


def geomean(xs: list[float]) -> float | None:
    """Geometric mean of the positive values of ``xs``, None when there are none."""
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def paired_ratios(runs: list, ref_runs: list, key: str) -> list[float]:
    """Per run of a method: its new tokens per ``key`` second (``"seconds"`` or ``"cpu_s"``) over
    the target alone's in the same repeat (the median of that repeat's target-alone runs; a run
    without a repeat, or whose repeat has none, is compared with all of them).

    Both sides were warmed the same way and ran in the same round, so no method gains from
    running later in the process than the target alone it is compared with."""
    def tps(o) -> float:
        return len(o.token_ids) / getattr(o, key)

    by_rep: dict = {}
    for o in ref_runs:
        by_rep.setdefault(getattr(o, "repeat", None), []).append(tps(o))
    every = [tps(o) for o in ref_runs]
    return [tps(o) / median(by_rep.get(getattr(o, "repeat", None)) or every) for o in runs]


def tabulate(prompts: list[dict], methods: list, samples: dict) -> list[dict]:
    """One row per prompt and method: median seconds over its runs, tokens/s, speedup over the
    target alone of the same prompt (wall and CPU; the median over repeats of the repeat's ratio,
    :func:`paired_ratios`), acceptance, and identity with the target."""
    rows = []
    for p in prompts:
        ref_runs = samples.get((p["name"], "target"))
        if not ref_runs:
            continue
        ref_ids = ref_runs[0].token_ids
        for m in methods:
            runs = samples.get((p["name"], m.label))
            if not runs:
                continue
            last = runs[-1]
            secs = median([o.seconds for o in runs])
            n = len(last.token_ids)
            tps = n / secs
            wall_ratios = [1.0] * len(runs) if m.family == "target" else paired_ratios(runs, ref_runs, "seconds")
            cpu_ratios = [1.0] * len(runs) if m.family == "target" else paired_ratios(runs, ref_runs, "cpu_s")
            row = {
                "prompt": p["name"],
                "type": p["type"],
                "method": m.label,
                "family": m.family,
                "proposer": m.proposer,
                "k": m.k if m.family == "ours" else None,
                "new_tokens": n,
                "runs": len(runs),
                "seconds": secs,
                "seconds_all": [o.seconds for o in runs],
                "tokens_per_s": tps,
                "speedup": median(wall_ratios),
                "cpu_s": median([o.cpu_s for o in runs]),
                "cpu_s_all": [o.cpu_s for o in runs],
                "cpu_speedup": median(cpu_ratios),
                "cpu_speedup_all": cpu_ratios,
                "repeats_all": [getattr(o, "repeat", None) for o in runs],
                "loadavg_all": [o.loadavg for o in runs],
                "identical": all(o.token_ids == ref_ids for o in runs),
                "steps": last.steps,
                "proposed": last.proposed,
                "accepted": last.accepted,
                "acceptance_rate": (last.accepted / last.proposed) if last.proposed else None,
                "mean_accepted_length": (n / last.steps) if last.steps else None,
                "draft_time_s": median([o.draft_time_s for o in runs if o.draft_time_s is not None]),
                "verify_time_s": median([o.verify_time_s for o in runs if o.verify_time_s is not None]),
                "ttft_s": median([o.ttft_s for o in runs if getattr(o, "ttft_s", None) is not None]),
                "k_counts": getattr(last, "k_counts", None),
                "decisions": [o.decision for o in runs if getattr(o, "decision", None) is not None] or None,
            }
            if m.family == "target":
                row["steps"] = n
                row["mean_accepted_length"] = 1.0
            rows.append(row)
    return rows


def summarize(rows: list[dict], methods: list) -> dict:
    """Per prompt type and method: geometric-mean speedup, pooled tokens/s and acceptance."""
    out: dict = {}
    for t in PROMPT_TYPES:
        trows = [r for r in rows if r["type"] == t]
        if not trows:
            continue
        per: dict = {}
        for m in methods:
            mr = [r for r in trows if r["method"] == m.label]
            if not mr:
                continue
            proposed = sum(r["proposed"] or 0 for r in mr)
            accepted = sum(r["accepted"] or 0 for r in mr)
            steps = sum(r["steps"] or 0 for r in mr)
            toks = sum(r["new_tokens"] for r in mr)
            per[m.label] = {
                "family": m.family,
                "proposer": m.proposer,
                "k": m.k if m.family == "ours" else None,
                "prompts": len(mr),
                "speedup": geomean([r["speedup"] for r in mr]),
                "cpu_speedup": geomean([r["cpu_speedup"] for r in mr]),
                "tokens_per_s": toks / sum(r["seconds"] for r in mr),
                "acceptance_rate": accepted / proposed if proposed else None,
                "mean_accepted_length": toks / steps if steps else None,
                "identical": all(r["identical"] for r in mr),
            }
        out[t] = per
    return out


def _fmt(x, spec: str, none: str = "–") -> str:
    return none if x is None else format(x, spec)


def _runs_text(rows: list[dict]) -> str:
    runs = sorted({r["runs"] for r in rows if r["method"] != "target"}) or sorted({r["runs"] for r in rows})
    if not runs:
        return "0 runs"
    return (f"{runs[0]}" if len(runs) == 1 else f"{runs[0]}-{runs[-1]}") + " run(s)"


def format_tables(report: dict) -> str:
    """Markdown: a summary per prompt type (ratios side by side) and the per-prompt detail."""
    summary = report["summary"]
    types = [t for t in PROMPT_TYPES if t in summary]
    labels: list[str] = []
    for t in types:
        for lab in summary[t]:
            if lab not in labels:
                labels.append(lab)
    m = report["meta"]
    lines = [
        f"{m['tokens']} new tokens, greedy, {m['torch_threads']} torch thread(s), median of "
        f"{_runs_text(report['rows'])} per method and prompt. speedup = tokens/s ÷ target-alone tokens/s of the same "
        "prompt (wall clock; geometric mean over the prompts of a type); cpu = the same ratio on process CPU "
        "seconds (less sensitive to other load on the machine); acc = accepted ÷ proposed draft tokens; "
        "tok/step = new tokens per target forward (mean accepted length).",
        "",
        "| method | " + " | ".join(f"{t} speedup | {t} cpu | {t} acc | {t} tok/step" for t in types) + " | identical |",
        "|---|" + "---:|---:|---:|---:|" * len(types) + ":---:|",
    ]
    for lab in labels:
        cells = []
        ident = True
        for t in types:
            s = summary[t].get(lab)
            if s is None:
                cells += ["", "", "", ""]
                continue
            ident = ident and s["identical"]
            cells += [f"{s['speedup']:.2f}x", f"{s['cpu_speedup']:.2f}x", _fmt(s["acceptance_rate"], ".2f"),
                      _fmt(s["mean_accepted_length"], ".2f")]
        lines.append(f"| {lab} | " + " | ".join(cells) + f" | {'yes' if ident else '**NO**'} |")
    lines += [
        "",
        "| prompt | method | new tokens | seconds | tok/s | speedup | cpu s | cpu speedup | acc | tok/step | identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['prompt']} | {r['method']} | {r['new_tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.2f} | "
            f"{r['speedup']:.2f}x | {r['cpu_s']:.2f} | {r['cpu_speedup']:.2f}x | {_fmt(r['acceptance_rate'], '.2f')} | "
            f"{_fmt(r['mean_accepted_length'], '.2f')} | {'yes' if r['identical'] else '**NO**'} |"
        )
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: Path, plot: bool) -> None:
    """Write ``bench.json`` (atomically), ``table.md`` and, with ``plot``, ``speedup.png`` into ``out_dir``."""
    tmp = out_dir / "bench.json.tmp"
    tmp.write_text(json.dumps(k_counts_by_k(report), indent=1) + "\n")
    os.replace(tmp, out_dir / "bench.json")
    (out_dir / "table.md").write_text(format_tables(report))
    if plot:
        try:
            import matplotlib  # noqa: F401  (the `dev` extra; scripts/demo.sh does not install it)
        except ImportError:
            print("no speedup.png: matplotlib is not installed (pip install -e '.[dev]')", file=sys.stderr)
            return
        plot_speedup(report, out_dir / "speedup.png")


def plot_speedup(report: dict, path: Path) -> Path:
    """Speedup against K, one panel per prompt type, one line per proposer; HF as horizontal lines.

    Top row: wall-clock speedup; bottom row: the same ratio on process CPU seconds.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    types = [t for t in PROMPT_TYPES if t in summary]
    ncol = max(1, len(types))
    fig, axes = plt.subplots(2, ncol, figsize=(max(7, 5 * ncol), 8), sharey="row", squeeze=False)
    colors = {"draft": "tab:blue", "ngram": "tab:orange"}
    for row, (key, what) in enumerate((("speedup", "wall clock"), ("cpu_speedup", "process CPU seconds"))):
        for ax, t in zip(axes[row], types):
            per = summary[t]
            for prop in ("draft", "ngram"):
                pts = sorted((v["k"], v[key]) for v in per.values() if v["family"] == "ours" and v["proposer"] == prop)
                if pts:
                    ax.plot([k for k, _ in pts], [s for _, s in pts], "o-", color=colors[prop], label=f"ours, {prop}")
            none = per.get("ours-none")
            if none:
                ax.plot([0], [none[key]], "kx", label=f"ours, none (K=0) {none[key]:.2f}x")
            for lab, color, name in (("hf-assisted", colors["draft"], "HF assisted"),
                                     ("hf-prompt-lookup", colors["ngram"], "HF prompt lookup")):
                if lab in per:
                    ax.axhline(per[lab][key], color=color, linestyle=":", label=f"{name} ({per[lab][key]:.2f}x)")
            ax.axhline(1.0, color="gray", linewidth=0.8)
            n = per["target"]["prompts"] if "target" in per else 0
            ax.set_title(f"{t} ({n} prompt{'s' if n != 1 else ''}): {what}", fontsize=10)
            ax.set_xlabel("K (draft tokens per step)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="best")
        axes[row][0].set_ylabel(f"speedup over target alone\n({what})")
    m = report["meta"]
    fig.suptitle(f"{m['target']} / {m['draft'] or 'no draft'}\n{m['tokens']} new tokens, greedy, "
                 f"{m['torch_threads']} torch thread(s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
