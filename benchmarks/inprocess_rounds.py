"""``specdec bench --formats ... --alone-rounds N``: every format's target alone timed in rounds,
the formats interleaved, and the per-round ratios over the first format.

Timing one format's target alone after the other (minutes apart) lets a change of load on the
machine between the two land in their ratio. Here the targets of all formats stay loaded, and
in each of ``N`` rounds every prompt runs once per format back to back (the format order
reversed every other round: float32, w8a8 | w8a8, float32 | ...). Per round and prompt the ratio
is the format's tokens per CPU-second over the first format's in the same round; the report keeps
the median of those ratios and their min and max (the spread), and the same by wall clock.
"""

from __future__ import annotations

import statistics
from typing import Callable

from benchmarks.inprocess_methods import Method, Runner, log
from benchmarks.inprocess_prompts import chat_request, select_prompts


def time_alone_rounds(targets: dict, args, rounds: int, *, make_runner: Callable = Runner) -> dict:
    """Time every format's target alone on every prompt of ``args.prompts`` in ``rounds`` rounds.

    Args:
        targets: format name -> loaded target (:class:`specdec.models.loaded.LoadedModel`), in
            report order (the first is the baseline of the ratios).
        args: the resolved ``specdec bench`` arguments (``prompts``, ``tokens``).
        rounds: number of rounds, >= 1.
        make_runner: ``(target, draft, args) -> Runner`` (tests may wrap it).

    Returns:
        ``{"rounds": N, "formats": [...], "runs": [{"round", "prompt", "format", "position",
        "new_tokens", "seconds", "cpu_s", "loadavg", "token_ids"}, ...] (in the order run),
        "prompts": {prompt: {format: summary}}}`` where a summary (:func:`summarize_rounds`)
        holds the median tokens per CPU-second and per second, the per-round ratios over the
        first format, their median / min / max, and whether every round's output equals the
        format's first.

    Raises:
        ValueError: ``rounds`` < 1 or no targets.
    """
    if rounds < 1 or not targets:
        raise ValueError(f"alone rounds need >= 1 round and a target, got {rounds} rounds, {len(targets)} targets")
    formats = list(targets)
    runners = {f: make_runner(t, None, args) for f, t in targets.items()}
    prompts = select_prompts(args.prompts)
    ids = {p["name"]: runners[formats[0]].engine.encode(chat_request(p)) for p in prompts}
    alone = Method("target", "target")
    for f in formats:  # untimed: the pages of a target loaded minutes ago
        runners[f].run(alone, ids[prompts[0]["name"]], min(args.tokens, 8))
    runs = []
    for r in range(rounds):
        order = formats if r % 2 == 0 else formats[::-1]
        for p in prompts:
            for pos, f in enumerate(order):
                o = runners[f].run(alone, ids[p["name"]], int(p.get("max_tokens") or args.tokens))
                runs.append({"round": r, "prompt": p["name"], "format": f, "position": pos,
                             "new_tokens": len(o.token_ids), "seconds": o.seconds, "cpu_s": o.cpu_s,
                             "loadavg": o.loadavg, "token_ids": list(o.token_ids)})
                log(f"alone round {r + 1}/{rounds} {p['name']:<18} {f:<9} {len(o.token_ids):>3} tok "
                    f"{o.seconds:6.2f} s (cpu {o.cpu_s:6.2f} s, load {o.loadavg or 0:.1f})")
    return {"rounds": rounds, "formats": formats, "runs": runs,
            "prompts": summarize_rounds(runs, formats, [p["name"] for p in prompts])}


def summarize_rounds(runs: list[dict], formats: list[str], prompts: list[str]) -> dict:
    """Per prompt and format, from the measured ``runs`` of :func:`time_alone_rounds`:
    ``tps_cpu`` / ``tps_wall`` (medians over rounds of new tokens / CPU or wall seconds),
    ``ratios_cpu`` / ``ratios_wall`` (per round: the format's tokens per second over the first
    format's in that round), ``ratio_cpu`` / ``ratio_wall`` (their medians), ``ratio_cpu_min`` /
    ``ratio_cpu_max`` / ``ratio_wall_min`` / ``ratio_wall_max`` and ``identical`` (every round's
    token ids equal that format's first round's)."""
    out: dict = {}
    for p in prompts:
        by = {(x["round"], x["format"]): x for x in runs if x["prompt"] == p}
        rounds = sorted({r for r, _ in by})
        per: dict = {}
        for f in formats:
            mine = [by[(r, f)] for r in rounds if (r, f) in by]
            if not mine:
                continue
            s = {"tps_cpu": statistics.median(x["new_tokens"] / x["cpu_s"] for x in mine),
                 "tps_wall": statistics.median(x["new_tokens"] / x["seconds"] for x in mine),
                 "identical": all(x["token_ids"] == mine[0]["token_ids"] for x in mine)}
            for clock, key in (("cpu", "cpu_s"), ("wall", "seconds")):
                ratios = [(by[(r, f)]["new_tokens"] / by[(r, f)][key])
                          / (by[(r, formats[0])]["new_tokens"] / by[(r, formats[0])][key])
                          for r in rounds if (r, f) in by and (r, formats[0]) in by]
                s[f"ratios_{clock}"] = ratios
                s[f"ratio_{clock}"] = statistics.median(ratios) if ratios else None
                s[f"ratio_{clock}_min"] = min(ratios) if ratios else None
                s[f"ratio_{clock}_max"] = max(ratios) if ratios else None
            per[f] = s
        out[p] = per
    return out


def rounds_table(result: dict) -> str:
    """Markdown section for ``formats.md``: one line per prompt and format."""
    formats, first = result["formats"], result["formats"][0]
    runs = result["runs"]
    loads = [x["loadavg"] for x in runs if x["loadavg"] is not None]
    lines = [f"## Target alone in rounds ({result['rounds']} rounds, formats interleaved)", "",
             f"Every round runs each prompt's target alone once per format back to back (order "
             f"{', '.join(formats)}, reversed every other round). `x {first}` = median over rounds of the "
             f"round's tokens per CPU-second over {first}'s in the same round, (min-max) of those ratios; "
             "`wall` the same by wall clock."
             + (f" 1-minute load average at the calls: {min(loads):.1f}-{max(loads):.1f}." if loads else ""), "",
             f"| prompt | format | tok/s (cpu), median | x {first} (min-max) | wall tok/s, median | "
             f"wall x {first} (min-max) | identical |",
             "|---|---|---:|---|---:|---|---|"]
    for p, per in result["prompts"].items():
        for f in formats:
            s = per.get(f)
            if s is None:
                continue
            lines.append(f"| {p} | {f} | {s['tps_cpu']:.2f} | {s['ratio_cpu']:.2f}x ({s['ratio_cpu_min']:.2f}-"
                         f"{s['ratio_cpu_max']:.2f}) | {s['tps_wall']:.2f} | {s['ratio_wall']:.2f}x "
                         f"({s['ratio_wall_min']:.2f}-{s['ratio_wall_max']:.2f}) | {s['identical']} |")
    return "\n".join(lines) + "\n"
