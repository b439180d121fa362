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
(pyproject.toml): :func:`add_bench_arguments` and :func:`run_bench`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from benchmarks.report import PROMPT_TYPES, format_tables, summarize, tabulate, write_report
from specdec.cli import Command

#: The code block the copy-heavy prompt asks to rewrite with one rename.
RENAME_SOURCE = """from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def total_price(items: list[Item], discount: float = 0.0) -> float:
    \"\"\"Sum of price times quantity over the items, less a fractional discount.\"\"\"
    if not 0.0 <= discount < 1.0:
        raise ValueError(f"discount must be in [0, 1), got {discount}")
    subtotal = sum(item.price * item.quantity for item in items)
    return round(subtotal * (1.0 - discount), 2)


def print_receipt(items: list[Item]) -> None:
    for item in items:
        print(f"{item.name:20s} {item.quantity:3d} x {item.price:8.2f}")
    print(f"{'total':20s} {total_price(items):16.2f}")
"""

#: The prompts: name, type, one user message (rendered with the target's chat template).
PROMPTS: list[dict] = [
    {
        "name": "code-prime",
        "type": "code",
        "content": "Write a Python function `is_prime(n: int) -> bool` that returns True when n is a prime "
        "number. Include a docstring and handle n < 2.",
    },
    {
        "name": "code-merge",
        "type": "code",
        "content": "Write a Python function `merge_sorted(a: list[int], b: list[int]) -> list[int]` that merges "
        "two sorted lists into one sorted list in linear time. Include type hints and a docstring.",
    },
    {
        "name": "json-book",
        "type": "sql_json",
        "content": "Return only a JSON object describing a book, with the fields title, author, year, isbn, "
        "genres (a list of strings), publisher (an object with name and city) and ratings (an object "
        "with average and count).",
    },
    {
        "name": "sql-top-customers",
        "type": "sql_json",
        "content": "Write an SQL query that returns the ten customers with the highest total order value in "
        "2023, given the tables customers(id, name, country) and orders(id, customer_id, total, "
        "created_at). Show the customer name, country and total.",
    },
    {
        # copy-heavy: the answer repeats the prompt's code with one identifier renamed, the case
        # prompt lookup (n-gram drafting) is made for
        "name": "code-rename",
        "type": "copy",
        "content": "Rewrite this Python code with the function `total_price` renamed to `order_total` "
        "everywhere. Return only the code.\n\n```python\n" + RENAME_SOURCE + "```",
    },
    {
        "name": "poem-sea",
        "type": "creative",
        "content": "Write a short poem about the sea at night, with vivid images of the moon, the waves and a "
        "lonely lighthouse.",
    },
]

#: ``--quick``: tiny smoke run settings
QUICK = {"tokens": 12, "ks": [1, 2, 3], "ngram_ks": [1, 3], "repeats": 1, "prompts": ["code-prime", "json-book", "code-rename", "poem-sea"]}


# --- arguments ----------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    if not out or any(k < 1 for k in out):
        raise argparse.ArgumentTypeError(f"expected K values >= 1 like '1-8' or '1,2,4', got {text!r}")
    return sorted(set(out))


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers in [0, 1] like '0,0.4', got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``specdec bench`` options to ``parser`` (returns it)."""
    g = parser.add_argument_group("bench")
    g.add_argument("--target", default="demo:target",
                   help="target model spec: demo:target, a Hugging Face folder, or a .gguf file (default demo:target)")
    g.add_argument("--draft", default="demo:draft",
                   help="draft model spec, or 'none' to skip the draft proposer and assisted generation "
                        "(default demo:draft)")
    g.add_argument("--formats", type=_name_list, default=None, metavar="F[,F...]",
                   help="weight formats to compare (float32, bfloat16, float16, int8, int4, w8a8): the whole "
                        "benchmark runs once per format, draft and target in that format, into <out>/<format>/, "
                        "and <out>/formats.md compares them (default: one run in the default format); "
                        "F:alone times only that format's target alone (no draft loaded), e.g. the float32 baseline")
    g.add_argument("--draft-vocab-subset", type=int, default=None, metavar="N",
                   help="our draft scores only the N most frequent token ids (FR-Spec); transformers' "
                        "assisted generation gets the full-vocabulary draft, loaded too, in the same format")
    g.add_argument("--draft-vocab-table", default=None, metavar="FILE",
                   help="token frequency table for --draft-vocab-subset (default: the one shipped for the demo pair)")
    g.add_argument("--tokens", type=int, default=None, help="new tokens per generation (default 64; --quick 12)")
    g.add_argument("--ks", type=_int_list, default=None,
                   help="K values of the draft proposer, e.g. '1-8' or '1,2,4' (default 1-8)")
    g.add_argument("--ngram-ks", type=_int_list, default=None,
                   help="K values of the ngram proposer (default: same as --ks)")
    g.add_argument("--proposers", type=_name_list, default=["draft", "ngram", "none"],
                   help="our proposers to run: draft, ngram, none (plain decoding through our loop); comma "
                        "separated, default all three")
    g.add_argument("--prompts", type=_name_list, default=None,
                   help="prompt names or types to run, comma separated, in this order (default all: "
                        + ", ".join(p["name"] for p in PROMPTS) + ")")
    g.add_argument("--repeats", type=int, default=None, help="timed runs per method and prompt; median kept (default 1)")
    g.add_argument("--budget-min", type=float, default=None,
                   help="time budget in minutes for the timed runs: the first block of each prompt type "
                        "always runs; any other prompt block starts only when the mean block time still fits "
                        "(default: no budget)")
    g.add_argument("--no-bracket", dest="bracket", action="store_false",
                   help="time the target alone once per prompt block instead of at its start and end")
    g.add_argument("--draft-min-confidence", type=_float_list, default=[0.0], metavar="C[,C...]",
                   help="draft proposer: early-stop thresholds to run, each with every K "
                        "(0 = none, the default; 0.4 is transformers' assisted default); "
                        "methods are labelled ours-draft-K<k>-c<C>")
    g.add_argument("--ngram-min", type=int, default=1, help="our prompt lookup: shortest n-gram (default 1)")
    g.add_argument("--ngram-max", type=int, default=3, help="our prompt lookup: longest n-gram (default 3)")
    g.add_argument("--hf-lookup-tokens", type=int, default=10,
                   help="transformers' prompt_lookup_num_tokens (default 10)")
    g.add_argument("--hf-lookup-ngram", type=int, default=2,
                   help="transformers' max_matching_ngram_size (default 2, its own default)")
    g.add_argument("--hf", type=_name_list, default=["assisted", "prompt-lookup"],
                   help="transformers' methods to run: assisted, prompt-lookup (default both)")
    g.add_argument("--skip-hf", action="store_true", help="skip transformers' assisted and prompt-lookup runs")
    g.add_argument("--device", default="cpu",
                   help="torch device of both models, e.g. cuda (default cpu; scripts/gpu-check.sh uses cuda)")
    g.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's choice)")
    g.add_argument("--quick", action="store_true",
                   help="tiny smoke run: 12 tokens, K 1-3 (ngram 1,3), one prompt per type, 1 repeat")
    g.add_argument("--out", default="bench-out", help="output folder for bench.json, table.md, speedup.png")
    g.add_argument("--no-plot", dest="plot", action="store_false", help="do not write the PNG")
    return parser


# --- measurement --------------------------------------------------------------------------------


@dataclass
class Method:
    """One thing to time on a prompt."""

    label: str
    family: str  # target | hf-assisted | hf-prompt-lookup | ours
    proposer: str | None = None  # draft | ngram | none (ours only)
    k: int | None = None
    min_confidence: float = 0.0  # draft proposer: early stop below this draft probability


@dataclass
class RunOutcome:
    token_ids: list[int]
    seconds: float
    cpu_s: float = 0.0
    loadavg: float | None = None
    proposed: int | None = None
    accepted: int | None = None
    steps: int | None = None
    draft_time_s: float | None = None
    verify_time_s: float | None = None


@dataclass
class _HFRecorder:
    """Counts transformers' candidate/match numbers per assisted step (patched in for a call)."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    config: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.steps = self.proposed = self.accepted = 0
        self.config = {}


@contextlib.contextmanager
def _record_hf_steps(recorder: _HFRecorder):
    """Wrap ``update_candidate_strategy`` of transformers' candidate generators to count matches.

    transformers calls it once per assisted step with the target's logits over the candidates
    plus one (``scores [1, K+1, V]``) and the number of accepted candidates; the wrapper adds a
    few microseconds per step. It also records the settings the generator actually used.
    """
    from transformers.generation import candidate_generator as cg

    classes = [cg.AssistedCandidateGenerator, cg.PromptLookupCandidateGenerator]
    # prompt lookup inherits the method from CandidateGenerator: wrap the inherited one on the subclass
    originals = {c: c.update_candidate_strategy for c in classes}
    own = {c: "update_candidate_strategy" in c.__dict__ for c in classes}

    def wrap(orig):
        def update_candidate_strategy(self, input_ids, scores, num_matches):
            recorder.steps += 1
            recorder.proposed += int(scores.shape[1]) - 1
            recorder.accepted += int(num_matches)
            if not recorder.config:
                recorder.config = _generator_settings(self)
            return orig(self, input_ids, scores, num_matches)

        return update_candidate_strategy

    for c, orig in originals.items():
        setattr(c, "update_candidate_strategy", wrap(orig))
    try:
        yield recorder
    finally:
        for c, orig in originals.items():
            if own[c]:
                setattr(c, "update_candidate_strategy", orig)
            else:
                delattr(c, "update_candidate_strategy")


def _generator_settings(gen) -> dict:
    out: dict = {"candidate_generator": type(gen).__name__}
    if hasattr(gen, "num_output_tokens"):  # prompt lookup
        out["prompt_lookup_num_tokens"] = int(gen.num_output_tokens)
        out["max_matching_ngram_size"] = int(gen.max_matching_ngram_size)
    agc = getattr(gen, "assistant_generation_config", None)
    if agc is not None:
        out["num_assistant_tokens"] = int(gen.num_assistant_tokens)
        out["num_assistant_tokens_schedule"] = agc.num_assistant_tokens_schedule
        out["assistant_confidence_threshold"] = agc.assistant_confidence_threshold
        out["confidence_threshold_adapted"] = hasattr(gen, "probs")  # only with scikit-learn installed
    return out


@contextlib.contextmanager
def _timer(outcome_times: dict):
    """Wall (perf_counter) and process CPU seconds of the block, into ``outcome_times``."""
    gc.collect()
    outcome_times["loadavg"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        yield outcome_times
    finally:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # kernels queued by the call belong to it
        outcome_times["seconds"] = time.perf_counter() - t0
        outcome_times["cpu_s"] = time.process_time() - c0


class _Runner:
    """Runs one method on one prompt (ids) for ``tokens`` new tokens and times the call."""

    def __init__(self, target, draft, args, assistant=None):
        from specdec.engine.engine import SpeculativeEngine

        self.target = target
        self.draft = draft
        self.assistant = assistant if assistant is not None else draft  # transformers' assisted generation
        self.args = args
        self.engine = SpeculativeEngine(target, draft)
        self.recorder = _HFRecorder()
        self.eos = target.eos_token_ids
        pad = target.tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.eos[0]
        self.hf_config: dict[str, dict] = {}

    def _hf_kwargs(self, ids: torch.Tensor, tokens: int) -> dict:
        return dict(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )

    @torch.inference_mode()
    def run(self, method: Method, prompt_ids: list[int], tokens: int) -> RunOutcome:
        if method.family == "ours":
            return self._run_ours(method, prompt_ids, tokens)
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.target.device)
        kwargs = self._hf_kwargs(ids, tokens)
        if method.family == "hf-assisted":
            kwargs["assistant_model"] = self.assistant.model
        elif method.family == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = self.args.hf_lookup_tokens
            kwargs["max_matching_ngram_size"] = self.args.hf_lookup_ngram
        self.recorder.reset()
        tm: dict = {}
        with _record_hf_steps(self.recorder), _timer(tm):
            out = self.target.model.generate(**kwargs)
        new = out[0, len(prompt_ids):].tolist()
        # batch size 1: generate stops at the first EOS; drop any padding after it defensively
        for i, t in enumerate(new):
            if t in self.eos:
                new = new[: i + 1]
                break
        outcome = RunOutcome(token_ids=new, **tm)
        if method.family != "target":
            r = self.recorder
            outcome.steps, outcome.proposed, outcome.accepted = r.steps, r.proposed, r.accepted
            if r.config:
                self.hf_config[method.family] = dict(r.config)
        return outcome

    def _run_ours(self, method: Method, prompt_ids: list[int], tokens: int) -> RunOutcome:
        from specdec.request import GenerationRequest

        spec = {"proposer": method.proposer, "k": method.k or 0,
                "ngram_min": self.args.ngram_min, "ngram_max": self.args.ngram_max,
                "draft_min_confidence": method.min_confidence}
        req = GenerationRequest(prompt_token_ids=list(prompt_ids), max_tokens=tokens, speculation=spec)
        tm: dict = {}
        with _timer(tm):
            res = self.engine.generate(req)
        s = res.stats
        return RunOutcome(token_ids=list(res.token_ids), **tm, proposed=s.proposed, accepted=s.accepted,
                          steps=s.steps, draft_time_s=s.draft_time_s, verify_time_s=s.verify_time_s)


# --- bookkeeping --------------------------------------------------------------------------------


def _methods(args, have_draft: bool, have_assistant: bool | None = None) -> list[Method]:
    out = [Method("target", "target")]
    if not args.skip_hf:
        if (have_draft if have_assistant is None else have_assistant) and "assisted" in args.hf:
            out.append(Method("hf-assisted", "hf-assisted"))
        if "prompt-lookup" in args.hf:
            out.append(Method("hf-prompt-lookup", "hf-prompt-lookup"))
    if "none" in args.proposers:
        out.append(Method("ours-none", "ours", "none", 0))
    if "draft" in args.proposers and have_draft:
        for c in args.draft_min_confidence:
            tag = f"-c{c:g}" if c > 0 else ""
            out += [Method(f"ours-draft-K{k}{tag}", "ours", "draft", k, c) for k in args.ks]
    if "ngram" in args.proposers:
        out += [Method(f"ours-ngram-K{k}", "ours", "ngram", k) for k in args.ngram_ks]
    return out


def _select_prompts(names: list[str] | None) -> list[dict]:
    """The prompts named (by name or type), in the order given; all prompts when ``names`` is empty."""
    if not names:
        return [dict(p) for p in PROMPTS]
    unknown = [n for n in names if n not in {p["name"] for p in PROMPTS} | set(PROMPT_TYPES)]
    if unknown:
        raise ValueError(f"unknown prompt(s) {unknown}; known: {[p['name'] for p in PROMPTS]} or types {PROMPT_TYPES}")
    chosen: list[dict] = []
    for n in names:
        for p in PROMPTS:
            if n in (p["name"], p["type"]) and all(c["name"] != p["name"] for c in chosen):
                chosen.append(dict(p))
    return chosen


def _resolve(args) -> argparse.Namespace:
    """Fill the defaults that depend on --quick; validate."""
    a = argparse.Namespace(**vars(args))
    q = bool(getattr(a, "quick", False))
    if a.tokens is None:
        a.tokens = QUICK["tokens"] if q else 64
    if a.ks is None:
        a.ks = list(QUICK["ks"]) if q else list(range(1, 9))
    if a.ngram_ks is None:
        a.ngram_ks = list(QUICK["ngram_ks"]) if q else list(a.ks)
    if a.repeats is None:
        a.repeats = QUICK["repeats"] if q else 1
    if a.prompts is None and q:
        a.prompts = list(QUICK["prompts"])
    if a.tokens < 1 or a.repeats < 1:
        raise ValueError("--tokens and --repeats must be >= 1")
    bad_hf = [h for h in a.hf if h not in ("assisted", "prompt-lookup")]
    if bad_hf:
        raise ValueError(f"unknown --hf method(s) {bad_hf}; expected assisted, prompt-lookup")
    bad = [p for p in a.proposers if p not in ("draft", "ngram", "none")]
    if bad:
        raise ValueError(f"unknown proposer(s) {bad}; expected draft, ngram, none")
    return a


def _load(args, weight_format: str | None = None):
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


def run_formats(args: argparse.Namespace) -> dict:
    """``--formats``: the benchmark once per weight format (models loaded in it, one after the
    other, in one process), then ``<out>/formats.md`` and ``formats.json``: per format the
    weights in memory, target-alone tokens/s, and per method tokens/s with its speedup over the
    same format's target alone and over the first format's target alone (per prompt type,
    geometric mean; CPU-time ratios), and the same tokens/s and ratio over the first format by
    wall clock (``wall ...``: meaningful on a quiet machine; at more than one thread process CPU
    time also counts OpenMP threads waiting at barriers).

    A format written ``F:alone`` runs only the target alone in F (no draft, no speculation, no
    transformers' assisted or prompt-lookup runs): a baseline that costs minutes in float32.

    Raises:
        ValueError: an unknown format or suffix.
    """
    import gc
    import math

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
    results = {}
    for fmt in formats:
        sub = argparse.Namespace(**vars(args))
        sub.formats, sub.out = None, str(base_out / fmt)
        if fmt in alone:
            sub.draft, sub.skip_hf, sub.proposers = "none", True, []
        models = _load(sub, fmt)
        mem = {"target_weight_gb": weight_bytes(models[0].model) / 2**30,
               "draft_weight_gb": weight_bytes(models[1].model) / 2**30 if models[1] is not None else None}
        report = run_bench(sub, models=models)
        mem["assistant_weight_gb"] = (weight_bytes(models[2].model) / 2**30
                                      if models[2] is not None and models[2] is not models[1] else None)
        results[fmt] = {"memory": mem, "rows": report["rows"], "meta": report["meta"]}
        del models, report
        gc.collect()
    first = formats[0]

    def gmean(xs):
        xs = [x for x in xs if x]
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")

    types = sorted({r["type"] for r in results[first]["rows"]})
    base_cpu = {t: {r["prompt"]: r["new_tokens"] / r["cpu_s"] for r in results[first]["rows"]
                    if r["type"] == t and r["family"] == "target"} for t in types}
    base_wall = {t: {r["prompt"]: r["tokens_per_s"] for r in results[first]["rows"]
                     if r["type"] == t and r["family"] == "target"} for t in types}
    lines = [f"# Weight formats ({', '.join(formats)}), one run", "",
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
                tps = gmean([r["new_tokens"] / r["cpu_s"] for r in rs])
                own = gmean([r["cpu_speedup"] for r in rs])
                vs_first = gmean([r["new_tokens"] / r["cpu_s"] / base_cpu[t][r["prompt"]] for r in rs
                                  if r["prompt"] in base_cpu[t]])
                wall = gmean([r["tokens_per_s"] for r in rs])
                wall_first = gmean([r["tokens_per_s"] / base_wall[t][r["prompt"]] for r in rs
                                    if r["prompt"] in base_wall[t]])
                cells.append(f"{tps:.2f}, {own:.2f}x, {vs_first:.2f}x (wall {wall:.2f}, {wall_first:.2f}x)")
            ident = all(r["identical"] for r in rows if r["method"] == label)
            lines.append(f"| {fmt} | {mem['target_weight_gb']:.2f} | "
                         f"{(mem['draft_weight_gb'] or 0):.2f} | {label} | " + " | ".join(cells) + f" | {ident} |")
    text = "\n".join(lines) + "\n"
    (base_out / "formats.md").write_text(text)
    (base_out / "formats.json").write_text(json.dumps(results, indent=1, default=str))
    print(text)
    return results


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- the benchmark ------------------------------------------------------------------------------


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

    a = _resolve(args)
    if a.threads:
        torch.set_num_threads(a.threads)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = _select_prompts(a.prompts)

    t_load = time.perf_counter()
    target, draft, *rest = models if models is not None else _load(a)
    assistant = rest[0] if rest else draft
    load_s = time.perf_counter() - t_load
    _log(f"bench: loaded {target.name}" + (f" and {draft.name}" if draft else "") + f" in {load_s:.1f} s")

    runner = _Runner(target, draft, a, assistant=assistant)
    methods = _methods(a, draft is not None, assistant is not None)
    for p in prompts:
        p["token_ids"] = runner.engine.encode(_chat_request(p))
        if len(p["token_ids"]) + a.tokens > target.max_positions:
            raise ValueError(f"prompt {p['name']} ({len(p['token_ids'])} tokens) + {a.tokens} new tokens exceeds the "
                             f"target's {target.max_positions} positions")

    report = {
        "meta": _meta(a, target, draft, load_s),
        "prompts": [{"name": p["name"], "type": p["type"], "content": p["content"],
                     "prompt_tokens": len(p["token_ids"])} for p in prompts],
        "rows": [],
        "summary": {},
    }
    old_verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # generate's notes on unused sampling defaults, once per call
    try:
        _warm_up(runner, methods, prompts[0]["token_ids"], a)
        report["meta"]["hf_settings"] = runner.hf_config
        t_start = time.perf_counter()
        samples: dict[tuple[str, str], list[RunOutcome]] = {}
        done, total = 0, len(prompts) * a.repeats * (len(methods) + (1 if a.bracket else 0))
        blocks_done, stopped, covered = 0, None, set()
        for rep in range(a.repeats):
            if stopped:
                break
            for p in prompts:
                el = time.perf_counter() - t_start
                new_type = p["type"] not in covered
                if a.budget_min is not None and not new_type and el + el / blocks_done > a.budget_min * 60:
                    stopped = f"budget of {a.budget_min} min: stopped before repeat {rep + 1} of {p['name']}"
                    _log(f"bench: {stopped}")
                    report["meta"]["stopped_early"] = stopped
                    break
                order = methods[1:] if rep % 2 == 0 else list(reversed(methods[1:]))
                schedule = [methods[0]] + order + ([methods[0]] if a.bracket else [])
                for m in schedule:
                    o = runner.run(m, p["token_ids"], a.tokens)
                    samples.setdefault((p["name"], m.label), []).append(o)
                    done += 1
                    el = time.perf_counter() - t_start
                    _log(f"[{done}/{total}] {p['name']:<18} {m.label:<18} {len(o.token_ids):>3} tok "
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
    write_report(report, out_dir, plot=a.plot)
    print(format_tables(report))
    return report


def _chat_request(p: dict):
    from specdec.request import GenerationRequest

    return GenerationRequest(messages=[{"role": "user", "content": p["content"]}], max_tokens=1)


def _warm_up(runner: _Runner, methods: list[Method], prompt_ids: list[int], a) -> None:
    """One short untimed call per method family (and per proposer), so first-call costs don't count."""
    n = min(a.tokens, 8)
    seen = set()
    t0 = time.perf_counter()
    for m in methods:
        key = (m.family, m.proposer)
        if key in seen:
            continue
        seen.add(key)
        warm = Method(m.label, m.family, m.proposer, min(m.k or 0, 2) if m.proposer != "none" else 0)
        runner.run(warm, prompt_ids, n)
    _log(f"bench: warm-up ({len(seen)} calls of {n} tokens) took {time.perf_counter() - t0:.1f} s")


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
                  "one warm-up call per method family; median over repeats; tokens/s = new tokens / seconds "
                  "(prompt prefill included)",
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
