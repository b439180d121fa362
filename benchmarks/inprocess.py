"""``specdec bench``: ours against transformers on the same prompts, in one process.

For each prompt (code, SQL/JSON and open creative writing, rendered with the target's chat
template) and a fixed number of new tokens, greedy, it times:

1. ``target``: the target alone, ``model.generate(do_sample=False)`` of transformers;
2. ``hf-assisted``: transformers' assisted generation (``assistant_model=draft``) with its own
   defaults (recorded in the JSON: in transformers 5.24 up to 20 draft tokens per step, schedule
   ``constant``, and a draft-confidence stop at 0.4, adapted per step only when scikit-learn is
   installed);
3. ``hf-prompt-lookup``: transformers' prompt lookup (``prompt_lookup_num_tokens``);
4. ``ours-<proposer>-K<k>``: :class:`specdec.engine.engine.SpeculativeEngine` with proposer ``draft`` or
   ``ngram`` and each K of the list, plus ``ours-none`` (plain decoding through our loop).

Each call is timed with ``time.perf_counter`` around the call only, after a warm-up call per
method family, so first-call costs (allocations, lazy inits) do not count. Tokens/s is new tokens
÷ wall seconds; with ``--repeats N`` every run is repeated N times (the method order is reversed
on every other repeat, and the target alone runs at the start and at the end of every prompt's
block) and the median seconds is kept. Speedup = tokens/s ÷ the target-alone tokens/s of the same
prompt in the same run. Every output is compared token for token with the target alone.

Writes (:mod:`benchmarks.report`) ``<out>/bench.json`` (rewritten after every prompt block, so an interrupted run keeps what
it measured), ``<out>/table.md`` (markdown tables) and ``<out>/speedup.png`` (speedup against K per
prompt type and proposer, with transformers' assisted and prompt-lookup speedups as horizontal
lines).

``specdec bench`` is :data:`BENCH`, registered in the ``specdec.commands`` entry-point group
(pyproject.toml): :func:`add_bench_arguments` and :func:`run_bench`. Its pieces:
:mod:`benchmarks.inprocess_args` (the command line), :mod:`benchmarks.inprocess_prompts` (the
prompts), :mod:`benchmarks.inprocess_methods` (the timed methods), :mod:`benchmarks.inprocess_formats`
(``--formats``), :mod:`benchmarks.report` (tables, summary, plot).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import time
from pathlib import Path

import torch

from benchmarks.inprocess_args import QUICK, add_bench_arguments, resolve_args  # noqa: F401 (re-exported)
from benchmarks.inprocess_formats import run_each_format
from benchmarks.inprocess_methods import RunOutcome, Runner, bench_methods, log, methods_for, warm_up
from benchmarks.inprocess_prompts import PROMPTS, chat_request, select_prompts  # noqa: F401 (re-exported)
from benchmarks.report import PROMPT_TYPES, format_tables, summarize, tabulate, write_report  # noqa: F401
from specdec.cli import Command

#: the old private name (docs/bench scripts import it)
_chat_request = chat_request

# --- loading --------------------------------------------------------------------------------------


def load_models(args, weight_format: str | None = None):
    """``(target, draft, assistant)``: the draft for transformers' assisted generation is the
    draft itself, or with ``--draft-vocab-subset`` the full-vocabulary draft loaded beside it
    (same spec and format; None when assisted generation is not run)."""
    from specdec.models.loader import load_model, load_pair
    from specdec.models.spec import ModelPairSpec, parse_model_spec

    target_spec = parse_model_spec(args.target)
    device = getattr(args, "device", "cpu") or "cpu"
    if str(args.draft).strip().lower() in ("", "none"):
        return load_model(target_spec, device=device, weight_format=weight_format), None, None
    pair = ModelPairSpec(target=target_spec, draft=parse_model_spec(args.draft))
    subset = getattr(args, "draft_vocab_subset", None)
    target, draft = load_pair(pair, device=device, weight_format=weight_format, draft_vocab_subset=subset,
                              draft_vocab_table=getattr(args, "draft_vocab_table", None))
    assistant = draft
    if subset is not None:
        assisted = "assisted" in args.hf and not args.skip_hf
        assistant = load_model(pair.draft, device=device, weight_format=weight_format) if assisted else None
    return target, draft, assistant


# --- the benchmark ------------------------------------------------------------------------------


def run_formats(args: argparse.Namespace) -> dict:
    """``--formats``: :func:`run_bench` once per weight format in one process, then
    ``<out>/formats.md`` and ``formats.json`` (:func:`benchmarks.inprocess_formats.run_each_format`;
    ``F:alone``: only F's target alone).

    Raises:
        ValueError: an unknown format or suffix.
    """
    return run_each_format(args, run_bench, load_models)


def run_bench(args: argparse.Namespace, *, models=None) -> dict:
    """Run the benchmark described by ``args`` (see :func:`add_bench_arguments`).

    Args:
        args: parsed arguments.
        models: optional already loaded ``(target, draft)`` or ``(target, draft, assistant)``
            (draft may be None; assistant: the draft transformers' assisted generation uses,
            default the draft), instead of loading ``args.target``/``args.draft``.

    Returns:
        The report written to ``<out>/bench.json``: ``meta``, ``prompts``, ``rows`` (one per prompt
        and method) and ``summary`` (per prompt type and method).
    """
    from transformers.utils import logging as hf_logging

    a = resolve_args(args)
    if a.threads:
        torch.set_num_threads(a.threads)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = select_prompts(a.prompts)

    t_load = time.perf_counter()
    target, draft, *rest = models if models is not None else load_models(a)
    assistant = rest[0] if rest else draft
    load_s = time.perf_counter() - t_load
    log(f"bench: loaded {target.name}" + (f" and {draft.name}" if draft else "") + f" in {load_s:.1f} s")

    runner = Runner(target, draft, a, assistant=assistant)
    methods = bench_methods(a, draft is not None, assistant is not None)
    only = dict(a.only or {})
    for p in prompts:
        p["token_ids"] = runner.engine.encode(chat_request(p))
        p["max_new_tokens"] = prompt_tokens(p, a.tokens)
        p["methods"] = methods_for(methods, p, only)
        if len(p["token_ids"]) + p["max_new_tokens"] > target.max_positions:
            raise ValueError(f"prompt {p['name']} ({len(p['token_ids'])} tokens) + {p['max_new_tokens']} new tokens "
                             f"exceeds the target's {target.max_positions} positions")

    report = {
        "meta": _meta(a, target, draft, load_s),
        "prompts": [{"name": p["name"], "type": p["type"], "content": p["content"],
                     "prompt_tokens": len(p["token_ids"]), "max_new_tokens": p["max_new_tokens"],
                     "methods": [m.label for m in p["methods"]]} for p in prompts],
        "rows": [],
        "summary": {},
    }
    old_verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # generate's notes on unused sampling defaults, once per call
    try:
        runner.tenant = tenant_of(prompts[0])
        warm_up(runner, prompts[0]["methods"], prompts[0]["token_ids"], prompts[0]["max_new_tokens"])
        report["meta"]["hf_settings"] = runner.hf_config
        t_start = time.perf_counter()
        samples: dict[tuple[str, str], list[RunOutcome]] = {}
        done, total = 0, a.repeats * sum(len(p["methods"]) + (1 if a.bracket else 0) for p in prompts)
        blocks_done, stopped, covered = 0, None, set()
        for rep in range(a.repeats):
            if stopped:
                break
            for p in prompts:
                el = time.perf_counter() - t_start
                new_type = p["type"] not in covered
                if a.budget_min is not None and not new_type and el + el / blocks_done > a.budget_min * 60:
                    stopped = f"budget of {a.budget_min} min: stopped before repeat {rep + 1} of {p['name']}"
                    log(f"bench: {stopped}")
                    report["meta"]["stopped_early"] = stopped
                    break
                pm = p["methods"]
                order = pm[1:] if rep % 2 == 0 else list(reversed(pm[1:]))
                schedule = [pm[0]] + order + ([pm[0]] if a.bracket else [])
                runner.tenant = tenant_of(p)
                for m in schedule:
                    o = runner.run(m, p["token_ids"], p["max_new_tokens"])
                    o.repeat = rep
                    samples.setdefault((p["name"], m.label), []).append(o)
                    done += 1
                    el = time.perf_counter() - t_start
                    log(f"[{done}/{total}] {p['name']:<18} {m.label:<18} {len(o.token_ids):>3} tok "
                         f"{o.seconds:6.2f} s (cpu {o.cpu_s:6.2f} s, load {o.loadavg or 0:.1f}) "
                         f"{len(o.token_ids) / o.seconds:6.2f} tok/s  "
                         f"(elapsed {el / 60:.1f} min, eta {el / done * (total - done) / 60:.1f} min)")
                report["rows"] = tabulate(prompts, methods, samples)
                report["summary"] = summarize(report["rows"], methods)
                blocks_done += 1
                covered.add(p["type"])
                report["meta"]["bench_s"] = time.perf_counter() - t_start
                report["meta"]["blocks_done"] = blocks_done
                write_report(report, out_dir, plot=False)
    finally:
        hf_logging.set_verbosity(old_verbosity)
    if runner._adaptive is not None:
        report["meta"]["adaptive_warm_up"] = runner.adaptive.warm_log
        report["meta"]["adaptive_calibrated_costs"] = runner.adaptive.costs
    write_report(report, out_dir, plot=a.plot)
    print(format_tables(report))
    return report


def prompt_tokens(p: dict, tokens: int) -> int:
    """The most new tokens of prompt ``p``: its own ``max_tokens`` (a rewrite runs to the end of
    its block or EOS) or the run's ``--tokens``."""
    return int(p.get("max_tokens") or tokens)


def tenant_of(p: dict) -> str:
    """The tenant of an adaptive method's requests on prompt ``p``: its ``tenant`` or its type."""
    return p.get("tenant") or p["type"]


def _meta(a, target, draft, load_s: float) -> dict:
    import transformers

    return {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "target": target.name,
        "draft": draft.name if draft else None,
        "tokens": a.tokens,
        "ks": a.ks,
        "ngram_ks": a.ngram_ks,
        "proposers": a.proposers,
        "repeats": a.repeats,
        "bracket": a.bracket,
        "quick": bool(a.quick),
        "greedy": True,
        "draft_vocab_subset": getattr(a, "draft_vocab_subset", None),
        "hf_assisted_draft": ("the full-vocabulary draft, loaded beside the subset draft"
                              if getattr(a, "draft_vocab_subset", None) is not None else "the draft"),
        "ours_ngram": {"ngram_min": a.ngram_min, "ngram_max": a.ngram_max},
        "adaptive": {"warm": getattr(a, "adaptive", None), "min_confidence": getattr(a, "adaptive_min_confidence", 0.0),
                     "policy": "K in 0..8, adaptive (the served default); tenant = the prompt's type"},
        "hf_prompt_lookup_args": {"prompt_lookup_num_tokens": a.hf_lookup_tokens,
                                  "max_matching_ngram_size": a.hf_lookup_ngram},
        "load_s": load_s,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "dtype": str(next(target.model.parameters()).dtype),
        "device": str(target.device),
        "timing": "time.perf_counter (wall) and time.process_time (cpu) around the generate call only, after "
                  "one untimed full-length call of every method on the first prompt; every repeat runs each "
                  "method once (order reversed every other repeat) with the target alone at its start (and end "
                  "with bracket); a speedup is the median over repeats of the method's tokens/s over the same "
                  "repeat's target alone; tokens/s = new tokens / seconds (prompt prefill included)",
    }


def _run_command(args: argparse.Namespace) -> int:
    if getattr(args, "formats", None):
        run_formats(args)
    else:
        run_bench(args)
    return 0


#: ``specdec bench``, registered in the ``specdec.commands`` entry-point group (pyproject.toml).
BENCH = Command(help="benchmark against transformers on the demo pair", add_arguments=add_bench_arguments,
                run=_run_command)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.inprocess`` (``specdec bench`` runs :data:`BENCH`)."""
    parser = add_bench_arguments(argparse.ArgumentParser(prog="specdec bench", description=__doc__.split("\n")[0]))
    return _run_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
