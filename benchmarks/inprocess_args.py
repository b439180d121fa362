"""The command line of ``specdec bench`` (:mod:`benchmarks.inprocess`): its arguments and the
defaults that depend on ``--quick``."""

from __future__ import annotations

import argparse

from benchmarks.inprocess_prompts import PROMPTS

#: ``--quick``: tiny smoke run settings
QUICK = {"tokens": 12, "ks": [1, 2, 3], "ngram_ks": [1, 3], "repeats": 1, "prompts": ["code-prime", "json-book", "code-rename", "poem-sea"]}


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


def _count(text: str) -> int:
    """A whole number >= 0 (``--alone-rounds``)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return n


def _count_list(text: str) -> list[int]:
    """``--adaptive``: comma-separated whole numbers >= 0 (``0,4``)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(n < 0 for n in out):
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 0 like '0,4', got {text!r}")
    return sorted(set(out))


def _only(text: str) -> tuple[str, list[str]]:
    """``--only PROMPT_OR_TYPE:LABEL[,LABEL...]``."""
    where, sep, labels = text.partition(":")
    names = _name_list(labels)
    if not sep or not where.strip() or not names:
        raise argparse.ArgumentTypeError(f"expected PROMPT_OR_TYPE:LABEL[,LABEL...] like "
                                         f"'copy:ours-ngram-K16', got {text!r}")
    return where.strip(), names


def _name_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _format_list(text: str) -> list[str]:
    """``--formats``: comma-separated weight formats, each optionally ``:alone``; a bad name or
    suffix is a usage error (exit 2) naming it, before any model loads."""
    from specdec.models.formats import WEIGHT_FORMATS

    out = _name_list(text)
    for f in out:
        name, _, opt = f.partition(":")
        if name not in WEIGHT_FORMATS:
            raise argparse.ArgumentTypeError(f"unknown format {name!r} in {f!r}; known: {', '.join(WEIGHT_FORMATS)}")
        if opt not in ("", "alone"):
            raise argparse.ArgumentTypeError(f"unknown suffix {opt!r} in {f!r} (only ':alone')")
    return out


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``specdec bench`` options to ``parser`` (returns it)."""
    g = parser.add_argument_group("bench")
    g.add_argument("--target", default="demo:target",
                   help="target model spec: demo:target, a Hugging Face folder, or a .gguf file (default demo:target)")
    g.add_argument("--draft", default="demo:draft",
                   help="draft model spec, or 'none' to skip the draft proposer and assisted generation "
                        "(default demo:draft)")
    g.add_argument("--formats", type=_format_list, default=None, metavar="F[,F...]",
                   help="weight formats to compare (float32, bfloat16, float16, int8, int4, w8a8, w7a8): the whole "
                        "benchmark runs once per format, draft and target in that format, into <out>/<format>/, "
                        "and <out>/formats.md compares them (default: one run in the default format); "
                        "F:alone times only that format's target alone (no draft loaded), e.g. the float32 baseline")
    g.add_argument("--alone-rounds", type=_count, default=None, metavar="N",
                   help="with --formats: keep every format's target loaded and time the targets alone again in "
                        "N rounds, formats interleaved (float32, w8a8 | w8a8, float32 | ...); formats.md reports "
                        "per prompt the median per-round ratio over the first format and its min-max "
                        "(default 3 with two or more formats; 0: off)")
    g.add_argument("--alone-prompts", type=_name_list, default=None, metavar="P[,P...]",
                   help="with --formats: the prompts (names or types) of the F:alone formats and of the "
                        "interleaved rounds (default: --prompts); e.g. code, to time a float32 baseline on "
                        "the code prompt only")
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
    g.add_argument("--adaptive", type=_count_list, default=None, metavar="W[,W...]",
                   help="also run our engine with the per-tenant K controller as a server runs it (tenant = the "
                        "prompt's type, K in 0..8): ours-adaptive-w<W> for each W, its controller taught by W "
                        "earlier requests of the same type (other prompts, untimed) before every timed run; "
                        "W = 0: a fresh controller (a fresh server's first request)")
    g.add_argument("--adaptive-min-confidence", type=float, default=0.0, metavar="C",
                   help="the adaptive method's draft early stop (default 0: none)")
    g.add_argument("--only", type=_only, action="append", default=None, metavar="PROMPT_OR_TYPE:LABEL[,LABEL...]",
                   help="run only these methods (and the target alone) on that prompt or prompt type; "
                        "repeatable, e.g. --only copy:ours-ngram-K16")
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


def resolve_args(args) -> argparse.Namespace:
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
    if not 0.0 <= getattr(a, "adaptive_min_confidence", 0.0) <= 1.0:
        raise ValueError(f"--adaptive-min-confidence must be in [0, 1], got {a.adaptive_min_confidence}")
    only = getattr(a, "only", None)
    a.only = dict(only) if only else None
    bad_hf = [h for h in a.hf if h not in ("assisted", "prompt-lookup")]
    if bad_hf:
        raise ValueError(f"unknown --hf method(s) {bad_hf}; expected assisted, prompt-lookup")
    bad = [p for p in a.proposers if p not in ("draft", "ngram", "none")]
    if bad:
        raise ValueError(f"unknown proposer(s) {bad}; expected draft, ngram, none")
    return a
