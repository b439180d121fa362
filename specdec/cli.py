"""The ``specdec`` command line.

Subcommands:

- ``generate``: one completion in this process (prompt or chat messages), text and stats printed.
- ``prefetch``: assemble the demo pair into the cache (what a Kubernetes init step runs).

and the subcommands other packages register in the entry-point group ``specdec.commands``
(pyproject.toml), each a :class:`Command`:

- ``bench`` (:mod:`benchmarks.inprocess`): target alone vs transformers' assisted generation and
  prompt lookup vs ours.
- ``serve`` (:mod:`deployments.cli`): start a local Ray, deploy the Serve application, optionally
  send one real gRPC request and print the answer.
- ``client`` (:mod:`deployments.cli`): call a running server over gRPC.

So the core never imports the serving layer or the benchmarks: it finds their subcommands by
name in the installed package's metadata (an entry point that does not import, e.g. without its
dependencies, is left out), and they import Ray and gRPC only when they run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

from specdec.errors import SpecDecError

#: Entry-point group in which other packages register subcommands (each a :class:`Command`).
COMMANDS_GROUP = "specdec.commands"


@dataclass(frozen=True)
class Command:
    """A subcommand of ``specdec`` registered by another package (entry-point group
    :data:`COMMANDS_GROUP`, the entry point's name is the subcommand's).

    Attributes:
        help: one line for ``specdec --help``.
        add_arguments: adds the subcommand's arguments to its parser.
        run: runs it with the parsed arguments; returns the exit status.
    """

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], object]
    run: Callable[[argparse.Namespace], int]


def registered_commands() -> dict[str, Command]:
    """Subcommands registered in :data:`COMMANDS_GROUP`, by name (sorted).

    An entry point that cannot be imported (its package or its dependencies are not installed)
    is left out, like a missing optional feature.
    """
    from importlib.metadata import entry_points

    found: dict[str, Command] = {}
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            command = ep.load()
        except ImportError:
            continue
        if isinstance(command, Command):
            found[ep.name] = command
    return found


#: ``--target-format`` / ``--draft-format`` choices (specdec.models.formats.WEIGHT_FORMATS)
WEIGHT_FORMAT_CHOICES = ("float32", "bfloat16", "float16", "int8", "int4", "w8a8", "w7a8")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="one completion in this process",
                       description="One completion in this process (no Ray): text on stdout, stats on stderr.")
    p.add_argument("prompt", nargs="?", help="prompt text (or use --message)")
    p.add_argument("--message", action="append", default=[], metavar="ROLE:TEXT",
                   help="chat message, repeatable, e.g. --message 'user:Write a sort function'")
    p.add_argument("--target", default="demo:target",
                   help="model spec: demo:target, an HF folder or a .gguf file (default: demo:target)")
    p.add_argument("--draft", default="demo:draft", help="draft model spec, or 'none' (default: demo:draft)")
    p.add_argument("--target-format", choices=WEIGHT_FORMAT_CHOICES, default=None,
                   help="target weight format (default: the device's, see README 'Weight formats')")
    p.add_argument("--draft-format", choices=WEIGHT_FORMAT_CHOICES, default=None,
                   help="draft weight format (default: --target-format when given, else the device's draft "
                        "default, see README 'Weight formats')")
    p.add_argument("--draft-vocab-subset", type=int, default=None, metavar="N",
                   help="the draft scores only the N most frequent token ids (FR-Spec; output stays the "
                        "target's); default: the full vocabulary")
    p.add_argument("--draft-vocab-table", default=None, metavar="FILE",
                   help="token frequency table for --draft-vocab-subset (scripts/vocab_table.py); default: the "
                        "one shipped for the demo pair's tokenizer")
    p.add_argument("--proposer", choices=["draft", "ngram", "none"], default=None,
                   help="draft model, prompt lookup or plain decoding (default: draft, or ngram with --draft none)")
    p.add_argument("-k", "--k", type=int, default=4, help="speculation length K (draft tokens per step; default: 4)")
    p.add_argument("--draft-min-confidence", type=float, default=0.0, metavar="C",
                   help="draft proposer: end a block after a drafted token whose draft probability "
                        "is below C (0 = always draft K; 0.4 is transformers' assisted default)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="most tokens to generate; the prompt plus this must fit the target's context "
                        "(default: 128, cut short at the context)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (default: 0, off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default: 1, off)")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed of a sampled request, 0..2**64-1 (default: a random one)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below MIN_P x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="over prompt and output (1: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the output")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the output")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS to the logit of token ID (repeatable)")
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop token before this many tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string, repeatable")
    p.add_argument("--logprobs", action="store_true", help="return the target's log-probabilities (--json shows them)")
    p.add_argument("--top-logprobs", type=int, default=0, metavar="N",
                   help="with --logprobs: the target's N most likely tokens per position (--json shows them)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")


#: core request field path -> the ``specdec generate`` / ``specdec client`` flag that sets it
#: (validation errors name the flag the user typed, not the request field)
FLAG_OF_FIELD = {
    "max_tokens": "--max-tokens", "min_tokens": "--min-tokens", "stop": "--stop", "logprobs": "--logprobs",
    "top_logprobs": "--top-logprobs", "messages": "--message", "sampling.temperature": "--temperature",
    "sampling.top_k": "--top-k", "sampling.top_p": "--top-p", "sampling.seed": "--seed", "sampling.min_p": "--min-p",
    "sampling.repetition_penalty": "--repetition-penalty", "sampling.presence_penalty": "--presence-penalty",
    "sampling.frequency_penalty": "--frequency-penalty", "sampling.logit_bias": "--logit-bias",
    "speculation.k": "-k", "speculation.draft_min_confidence": "--draft-min-confidence",
}


def request_from_flags(args) -> dict:
    """The core request (plain data for :func:`specdec.request.parse_request`) that the flags of
    ``specdec generate`` or ``specdec client`` set; a flag left at None is left out (the core's
    or the server's default applies).

    Raises:
        SpecDecError: a ``--logit-bias`` that is not ``ID=BIAS``, a ``--message`` that is not ``ROLE:TEXT``.
    """
    bias: dict[int, float] = {}
    for item in args.logit_bias:
        tid, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            bias[int(tid)] = float(value)
        except ValueError:
            raise SpecDecError(f"--logit-bias must be ID=BIAS, got {item!r}") from None
    data: dict = {
        **_set({"max_tokens": args.max_tokens}),  # left out: the default, cut short at the context
        "min_tokens": args.min_tokens,
        "stop": args.stop,
        "logprobs": args.logprobs,
        "top_logprobs": args.top_logprobs,
        "sampling": _set({"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
                          "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
                          "presence_penalty": args.presence_penalty, "frequency_penalty": args.frequency_penalty,
                          "logit_bias": bias}),
        "speculation": _set({"proposer": _proposer(args), "k": args.k,
                             "draft_min_confidence": args.draft_min_confidence}),
    }
    if args.message:
        msgs = []
        for m in args.message:
            role, sep, text = m.partition(":")
            if not sep:
                raise SpecDecError(f"--message must be ROLE:TEXT, got {m!r}")
            msgs.append({"role": role, "content": text})
        data["messages"] = msgs
    else:
        data["prompt"] = args.prompt
    return data


def _set(values: dict) -> dict:
    return {k: v for k, v in values.items() if v is not None}


def _proposer(args) -> str:
    """``--proposer``, or as the server chooses without one: the draft model when there is one,
    else prompt lookup (``ngram``)."""
    if args.proposer is not None:
        return args.proposer
    return "ngram" if getattr(args, "draft", None) == "none" else "draft"


def check_fits_before_loading(target_spec, weight_format: str, request):
    """Tokenize ``request``'s prompt with the target's tokenizer and refuse it against the target's
    context, as :meth:`SpeculativeEngine.start` does, from the target folder's tokenizer and config
    files only: a prompt plus ``--max-tokens`` over the context is refused in about a second, not
    after both models loaded (20-28 s for the demo pair). Returns the tokenizer, for the load.

    Raises:
        ModelLoadError: the target's folder, tokenizer or config cannot be read.
        InvalidRequestError, PromptTooLongError, ContextLengthExceededError: as the engine.
    """
    from specdec.engine.prompt import check_context_length, encode_prompt, prompt_name, requested_max_tokens
    from specdec.models.loader import read_model_facts

    facts = read_model_facts(target_spec, weight_format)
    prompt = encode_prompt(facts.tokenizer, request, facts.emittable_vocab)
    check_context_length(len(prompt), requested_max_tokens(request), facts.max_positions,
                         f"the target '{facts.name}'", prompt_name(request))
    return facts.tokenizer


def run_generate(args) -> int:
    from specdec.engine.engine import SpeculativeEngine
    from specdec.models.formats import env_format
    from specdec.models.loader import load_model, load_pair, resolve_format
    from specdec.models.spec import ModelPairSpec, parse_model_spec
    from specdec.request import parse_request

    env_format(SpecDecError)  # a set but invalid $SPECDEC_WEIGHT_FORMAT: refused even with both --*-format
    args.proposer = _proposer(args)
    if args.proposer == "draft" and args.draft == "none":  # before loading the target (minutes)
        raise SpecDecError("--proposer draft needs a draft model; --draft none loads none (use --proposer ngram or none)")
    request = parse_request(request_from_flags(args), FLAG_OF_FIELD)
    target_spec = parse_model_spec(args.target)
    draft_spec = None if args.draft == "none" or args.proposer != "draft" else parse_model_spec(args.draft)
    tokenizer = check_fits_before_loading(target_spec, resolve_format(target_spec, args.target_format), request)
    if draft_spec is None:
        target, draft = load_model(target_spec, weight_format=args.target_format, tokenizer=tokenizer), None
    else:
        target, draft = load_pair(ModelPairSpec(target=target_spec, draft=draft_spec),
                                  weight_format=args.target_format, draft_format=args.draft_format,
                                  draft_vocab_subset=args.draft_vocab_subset,
                                  draft_vocab_table=args.draft_vocab_table, target_tokenizer=tokenizer)
    engine = SpeculativeEngine(target, draft)
    t0 = time.perf_counter()
    if args.stream and not args.json:  # --json prints one JSON document only (as `specdec client`)
        gen = engine.start(request)
        for chunk in gen:
            print(chunk.text, end="", flush=True)
        print()
        result = gen.result()
    else:
        result = engine.generate(request)
    wall = time.perf_counter() - t0
    loaded_formats = {"target_format": target.weight_format,
                      "draft_format": None if draft is None else draft.weight_format}
    if args.json:
        print(json.dumps({**result.as_dict(), "elapsed_s": wall, **loaded_formats}, indent=2))
        return 0
    if not args.stream:
        print(result.text)
    s = result.stats
    rate = f"{s.acceptance_rate:.2f}" if s.acceptance_rate is not None else "n/a"
    print(
        f"\n-- {result.usage.completion_tokens} tokens in {wall:.2f} s "
        f"({result.usage.completion_tokens / wall:.2f} tokens/s), finish: {result.finish_reason.value}, "
        f"proposer {args.proposer}, {format_names(target, draft)}, K {args.k}, steps {s.steps}, "
        f"acceptance rate {rate}, "
        f"mean accepted length {s.mean_accepted_length or 0:.2f}, accepted per position {s.accepted_per_position}, "
        f"draft {s.draft_time_s:.2f} s, verify {s.verify_time_s:.2f} s",
        file=sys.stderr,
    )
    return 0


def format_names(target, draft) -> str:
    """The weight formats the models were loaded in, for the stats line:
    ``"target w7a8 / draft int4"``, ``"target w7a8 / no draft"``."""
    return f"target {target.weight_format} / " + ("no draft" if draft is None else f"draft {draft.weight_format}")


def _add_prefetch(sub) -> None:
    p = sub.add_parser("prefetch", help="assemble the demo pair into the model cache",
                       description="Assemble the demo pair into the model cache ($SPECDEC_CACHE, default "
                                   "~/.cache/specdec) and build the weight format's entry; nothing is loaded "
                                   "when the cache is warm (a Kubernetes init step).")
    p.add_argument("roles", nargs="*", metavar="{target,draft}", help="default: both")
    p.add_argument("--format", choices=WEIGHT_FORMAT_CHOICES, default=None, dest="weight_format",
                   help="build the cache a weight format loads from (float32/float16: the float32 folder; "
                        "bfloat16: the bfloat16 folder; int8/int4/w8a8: the bfloat16 folder and the quantized "
                        "weights next to it); default: the format each model loads by default (the draft's: "
                        "specdec.models.formats.default_draft_format)")


def run_prefetch(args) -> int:
    """Build the demo pair's cache entries for a weight format; on a warm cache print one line per
    model saying so and load nothing (a quantized format's entry is checked by its key alone)."""
    from specdec.models import cache, quant_cache
    from specdec.models.convert import folder_suffix
    from specdec.models.demo import demo_model, ensure_demo_folder
    from specdec.models.formats import QUANTIZED_FORMATS, default_draft_format, default_format, env_format, storage_dtype

    bad = [r for r in args.roles if r not in ("target", "draft")]
    if bad:
        raise SpecDecError(f"prefetch: unknown role {bad[0]!r}; choose from 'target', 'draft'")
    env_format(SpecDecError)  # a bad $SPECDEC_WEIGHT_FORMAT: one line, even with --format
    for role in args.roles or ["target", "draft"]:
        # the format the role loads when none is named (the draft's own default: int4 on a VNNI CPU)
        fmt = getattr(args, "weight_format", None) or (default_draft_format if role == "draft" else default_format)("cpu")
        dtype = storage_dtype(fmt)
        folder = cache.cache_root() / "demo" / (role + folder_suffix(dtype))
        if cache.is_complete(folder, demo_model(role).sha256):
            if fmt not in QUANTIZED_FORMATS:
                print(f"demo {role}: {folder} (already in the cache)")
                continue
            entry = quant_cache.cached_entry(folder, fmt)
            if entry is not None:
                print(f"demo {role} {fmt}: {entry} (already in the cache)")
                continue
        folder = ensure_demo_folder(role, dtype=dtype)
        print(f"demo {role}: {folder}")
        if fmt in QUANTIZED_FORMATS:
            from specdec.models.loader import load_model
            from specdec.models.quant_cache import cache_folder
            from specdec.models.spec import DemoModelSpec

            loaded = load_model(DemoModelSpec(role=role), weight_format=fmt, invariant=False)
            print(f"demo {role} {fmt}: {cache_folder(folder, fmt)} ({loaded.quant_cache})")
            del loaded
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``specdec`` command; returns the exit status.

    A reader that goes away (``specdec client --tenant-stats | head``) ends the command quietly
    with status 1, as Python's own documentation advises for EPIPE, not with a BrokenPipeError
    traceback.
    """
    try:
        try:
            return _dispatch(argv)
        finally:  # on SystemExit too (--help): the write to a closed pipe fails here, not at exit
            sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 1


def _dispatch(argv: list[str] | None) -> int:
    """Parse ``argv`` and run the subcommand; returns its exit status."""
    parser = argparse.ArgumentParser(
        prog="specdec", description="Exact speculative decoding: generate in this process, serve on Ray Serve "
                                    "(gRPC and the OpenAI HTTP API), call a server, benchmark. See README.md.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_prefetch(sub)
    commands = {name: c for name, c in registered_commands().items() if name not in ("generate", "prefetch")}
    for name, command in commands.items():
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help[:1].upper() + command.help[1:] + "."))
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            if not args.prompt and not args.message:
                parser.error("generate needs a prompt or --message")
            if args.prompt is not None and args.message:
                parser.error("generate takes a prompt or --message, not both (the prompt would be ignored)")
            return run_generate(args)
        if args.command == "prefetch":
            return run_prefetch(args)
        if args.command in commands:
            return commands[args.command].run(args)
    except SpecDecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    # run the module's main, not __main__'s: registered commands are specdec.cli.Command objects
    from specdec.cli import main as _main

    sys.exit(_main())
