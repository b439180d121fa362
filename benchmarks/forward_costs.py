"""What one verify forward costs by what it holds: rows (sessions) and positions per row.

    python -m benchmarks.forward_costs --target demo:target --draft demo:draft --device cuda --out docs/bench/gpu

Speculation pays where verifying K + 1 positions costs about as much as decoding one (the
forward is bound by reading the weights; Leviathan et al. 2023, Section 3.4, "the cost
coefficient"), and batching pays where R rows cost about as much as one. This benchmark times
the engine's own packed forward (:func:`specdec.engine.kv_cache.feed_many`, what the batched
verifier and the draft proposer call) over ``R`` sessions of ``--context`` cached tokens each,
every session feeding ``P`` new positions (a verify block of K = P - 1), and prints each shape's
median seconds and its cost over the one-row, one-position decode. The cache is cut back after
every forward, so every repetition sees the same context.

Both the shape-invariant forward (the engine's default for every reduced-precision format:
:mod:`specdec.engine.invariant`, row-chunked linear layers, attention in the mode its load-time
probe chose) and the plain transformers forward of the same weights (``invariant=False``) are
timed, so the price of exactness on the device is measured side by side; where the probe chose
one attention call per sequence (a GPU that passes it), the invariant forward with one call per
row is timed too, so what that mode saves shows in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROWS = (1, 2, 4, 8)
POSITIONS = (1, 2, 3, 5, 9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_shapes(model, *, context: int, rows=ROWS, positions=POSITIONS, repeats: int = 5, seed: int = 0) -> list[dict]:
    """Median wall seconds of :func:`feed_many` per (rows, positions per row).

    Args:
        model: a loaded :class:`~specdec.models.loaded.LoadedModel`.
        context: cached tokens of every session before the timed forward.
        rows, positions: the shapes timed (every pair).
        repeats: timed forwards per shape (after one untimed warm-up forward).
        seed: seed of the random token ids.

    Returns:
        one dict per shape: ``rows``, ``positions`` (per row), ``seconds`` (median, wall),
        ``x_decode`` (over the one-row, one-position forward).
    """
    from specdec.engine.kv_cache import CachedSequence, feed_many

    g = torch.Generator().manual_seed(seed)
    vocab = min(model.model.config.vocab_size, 150000)
    dev = model.device
    out = []
    seqs = [CachedSequence(model.model, []) for _ in range(max(rows))]
    for s in seqs:
        s.feed(torch.randint(3, vocab, (context,), generator=g).tolist(), keep=1)
    base = None
    for r in rows:
        for p in positions:
            new = [torch.randint(3, vocab, (p,), generator=g).tolist() for _ in range(r)]
            times = []
            for i in range(repeats + 1):
                _sync(dev)
                t0 = time.perf_counter()
                logits = feed_many([(s, toks, p) for s, toks in zip(seqs, new)])
                float(logits[-1][-1, 0])  # waits for the forward on any device
                dt = time.perf_counter() - t0
                for s in seqs[:r]:
                    s._crop(context)
                if i:
                    times.append(dt)
            sec = statistics.median(times)
            base = base or sec
            out.append({"rows": r, "positions": p, "seconds": sec, "x_decode": sec / base})
    for s in seqs:
        s.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="demo:target")
    p.add_argument("--draft", default="demo:draft", help="a draft model spec, or 'none'")
    p.add_argument("--format", default=None, help="weight format (default: the device's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="folder for forward_costs.json / .md")
    a = p.parse_args(argv)
    from specdec.models.loader import load_model
    from specdec.models.spec import parse_model_spec

    from specdec.engine.invariant import attention_mode

    results = {}
    roles = [("target", a.target)] + ([("draft", a.draft)] if a.draft != "none" else [])
    for role, spec in roles:
        variants = [(True, None), (False, None)]  # (invariant, attention mode); one loaded at a time
        while variants:
            invariant, attention = variants.pop(0)
            m = load_model(parse_model_spec(spec), weight_format=a.format, device=a.device, invariant=invariant,
                           attention=attention)
            mode = attention_mode(m.model)
            if invariant and attention is None and mode == "sequence":  # also time one call per row
                variants.insert(0, (True, "row"))
            name = f"{role} {m.weight_format} " + (f"invariant (attention per {mode})" if invariant else "plain")
            rows = time_shapes(m, context=a.context, repeats=a.repeats,
                               positions=POSITIONS if role == "target" else (1,))
            results[name] = rows
            print(f"\n{name} on {m.device} ({a.context} cached tokens per row; seconds are medians of {a.repeats})")
            print("rows  positions/row  ms       x one-position decode")
            for x in rows:
                print(f"{x['rows']:4d}  {x['positions']:13d}  {1000 * x['seconds']:7.2f}  {x['x_decode']:5.2f}",
                      flush=True)
            del m
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "forward_costs.json").write_text(json.dumps({"args": vars(a) | {"out": str(a.out)},
                                                              "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
