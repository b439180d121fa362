"""``specdec bench --formats``: the benchmark of :mod:`benchmarks.inprocess` once per weight format
in one process, and the table comparing them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from benchmarks.report import write_bench_json


def run_each_format(args: argparse.Namespace, run: Callable[..., dict], load: Callable[..., tuple]) -> dict:
    """``--formats``: the benchmark once per weight format (models loaded in it, one after the
    other, in one process), then ``<out>/formats.md`` and ``formats.json``: per format the
    weights in memory, target-alone tokens/s, and per method tokens/s with its speedup over the
    same format's target alone and over the first format's target alone (per prompt type,
    geometric mean; CPU-time ratios), and the same tokens/s and ratio over the first format by
    wall clock (``wall ...``: meaningful on a quiet machine; at more than one thread process CPU
    time also counts OpenMP threads waiting at barriers).

    A format written ``F:alone`` runs only the target alone in F (no draft, no speculation, no
    transformers' assisted or prompt-lookup runs): a baseline that costs minutes in float32; with
    rounds it runs one repeat in its block (the rounds give its ratios), and with
    ``--alone-prompts`` only those prompts (so do the rounds).

    With ``--alone-rounds N`` (default 3 for two or more formats; 0: off) every format's target
    stays loaded, and after the per-format runs the targets alone are timed again in N rounds,
    formats interleaved (:mod:`benchmarks.inprocess_rounds`); ``formats.md`` then ends with the
    per-prompt median ratio over the first format and its spread, each format's result its
    summaries under ``alone_rounds`` (prompt -> :func:`benchmarks.inprocess_rounds.summarize_rounds`'s
    entry), and ``formats.json`` also the runs (top-level ``alone_rounds``).

    Args:
        args: the parsed arguments of ``specdec bench`` with ``formats``.
        run: :func:`benchmarks.inprocess.run_bench` (``run(args, models=...) -> report``).
        load: :func:`benchmarks.inprocess.load_models` (``load(args, format) -> (target, draft,
            assistant)``).

    Raises:
        ValueError: an unknown format or suffix.
    """
    import gc
    import math

    from benchmarks.inprocess_args import resolve_args
    from benchmarks.inprocess_goals import goals_table
    from benchmarks.report import PROMPT_TYPES
    from benchmarks.inprocess_rounds import rounds_table, time_alone_rounds
    from specdec.models.formats import check_format, weight_bytes

    formats, alone = [], set()
    for f in args.formats:
        name, _, opt = f.partition(":")
        if opt not in ("", "alone"):
            raise ValueError(f"--formats {f!r}: unknown suffix {opt!r} (only ':alone')")
        formats.append(check_format(name))
        if opt:
            alone.add(formats[-1])
    base_out = Path(args.out)
    rounds = alone_rounds(args, len(formats))
    results, targets = {}, {}
    for fmt in formats:
        sub = argparse.Namespace(**vars(args))
        sub.formats, sub.out = None, str(base_out / fmt)
        if fmt in alone:
            sub.draft, sub.skip_hf, sub.proposers, sub.only, sub.adaptive = "none", True, [], None, None
            if getattr(args, "alone_prompts", None):
                sub.prompts = list(args.alone_prompts)
            if rounds:  # its ratios come from the interleaved rounds; one timed run in the block
                sub.repeats = 1
        models = load(sub, fmt)
        mem = {"target_weight_gb": weight_bytes(models[0].model) / 2**30,
               "draft_weight_gb": weight_bytes(models[1].model) / 2**30 if models[1] is not None else None}
        report = run(sub, models=models)
        mem["assistant_weight_gb"] = (weight_bytes(models[2].model) / 2**30
                                      if models[2] is not None and models[2] is not models[1] else None)
        results[fmt] = {"memory": mem, "rows": report["rows"], "meta": report["meta"]}
        if rounds:
            targets[fmt] = models[0]
        del models, report
        gc.collect()
    rounds_args = resolve_args(args)
    if getattr(args, "alone_prompts", None):
        rounds_args.prompts = list(args.alone_prompts)
    by_rounds = time_alone_rounds(targets, rounds_args, rounds) if rounds else None
    targets.clear()
    if by_rounds is not None:
        for fmt in formats:
            results[fmt]["alone_rounds"] = {p: per[fmt] for p, per in by_rounds["prompts"].items()}
    first = formats[0]

    def gmean(xs):
        xs = [x for x in xs if x]
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")

    types = [t for t in PROMPT_TYPES if any(r["type"] == t for f in formats for r in results[f]["rows"])]
    base_cpu = {t: {r["prompt"]: r["new_tokens"] / r["cpu_s"] for r in results[first]["rows"]
                    if r["type"] == t and r["family"] == "target"} for t in types}
    base_wall = {t: {r["prompt"]: r["tokens_per_s"] for r in results[first]["rows"]
                     if r["type"] == t and r["family"] == "target"} for t in types}
    lines = [f"# Weight formats ({', '.join(formats)}), one run", "", goals_table(results, formats, by_rounds),
             "## Per format and method", "",
             "Per prompt type, geometric mean over its prompts, CPU-time ratios. `x own` = speedup over the "
             f"same format's target alone; `x {first}` = over {first}'s target alone (the first format of the run); "
             f"`wall` = tokens/s and x {first} by wall clock. "
             f"Torch threads: {results[first]['meta'].get('torch_threads')}. "
             "Every row's output is identical to its own format's target alone (column `identical`).", ""]
    lines.append("| format | target weights GB | draft weights GB | method | " +
                 " | ".join(f"{t}: tok/s (cpu), x own, x {first} (wall tok/s, x {first})" for t in types)
                 + " | identical |")
    lines.append("|---|---:|---:|---|" + "---|" * len(types) + "---|")
    for fmt in formats:
        rows, mem = results[fmt]["rows"], results[fmt]["memory"]
        for label in dict.fromkeys(r["method"] for r in rows):
            cells = []
            for t in types:
                rs = [r for r in rows if r["type"] == t and r["method"] == label]
                if not rs:
                    cells.append("–")
                    continue
                tps = gmean([r["new_tokens"] / r["cpu_s"] for r in rs])
                own = gmean([r["cpu_speedup"] for r in rs])
                vs_first = gmean([r["new_tokens"] / r["cpu_s"] / base_cpu[t][r["prompt"]] for r in rs
                                  if r["prompt"] in base_cpu[t]])
                wall = gmean([r["tokens_per_s"] for r in rs])
                wall_first = gmean([r["tokens_per_s"] / base_wall[t][r["prompt"]] for r in rs
                                    if r["prompt"] in base_wall[t]])
                vs_first_s = "–" if math.isnan(vs_first) else f"{vs_first:.2f}x"
                wall_first_s = "–" if math.isnan(wall_first) else f"{wall_first:.2f}x"
                cells.append(f"{tps:.2f}, {own:.2f}x, {vs_first_s} (wall {wall:.2f}, {wall_first_s})")
            ident = all(r["identical"] for r in rows if r["method"] == label)
            lines.append(f"| {fmt} | {mem['target_weight_gb']:.2f} | "
                         f"{(mem['draft_weight_gb'] or 0):.2f} | {label} | " + " | ".join(cells) + f" | {ident} |")
    text = "\n".join(lines) + "\n"
    if by_rounds is not None:
        text += "\n" + rounds_table(by_rounds)
    (base_out / "formats.md").write_text(text)
    dump = dict(results, alone_rounds=by_rounds) if by_rounds is not None else results
    write_bench_json(base_out / "formats.json", dump, indent=1, default=str)
    print(text)
    return results


def alone_rounds(args: argparse.Namespace, n_formats: int) -> int:
    """Rounds of the interleaved target-alone timing: ``--alone-rounds``, by default 3 when the run
    compares two or more formats, else 0.

    Raises:
        ValueError: a negative ``--alone-rounds``.
    """
    n = getattr(args, "alone_rounds", None)
    if n is None:
        return 3 if n_formats >= 2 else 0
    if n < 0:
        raise ValueError(f"--alone-rounds must be >= 0, got {n}")
    return n
