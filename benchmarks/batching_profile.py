"""Where the time of an in-process batched run goes: forwards by kind, attention, scheduler overhead.

    python -m benchmarks.batching_profile --clients 8 --max-tokens 32 --threads 2 --out docs/bench/batching/inprocess-s9

One group of ``--clients`` concurrent greedy requests (the prompts of :mod:`benchmarks.batching`)
runs under a batched :class:`specdec.engine.batch.BatchScheduler`, after a warm-up group; every
packed forward (:func:`specdec.engine.kv_cache.feed_many`, as called by the verifier and the
draft proposer) is timed in wall seconds and process CPU seconds (all threads) and sorted by kind:

- ``target prefill only`` / ``target verify + prefill`` / ``target verify``: target forwards
  that fed only prompt chunks, both prompt tails and draft blocks, or only blocks (a decode row
  feeds its bonus token and its K drafts: positions = logits kept);
- ``draft prefill`` / ``draft decode``: draft forwards whose rows fed more than
  :data:`~specdec.engine.proposers.draft_model.DECODE_TAIL` positions each on average (a prompt or
  a catch-up) or not.

Inside the forwards, the row-wise attention (:func:`specdec.engine.invariant.rowwise_attention`)
is timed too. What the ticks spent outside the forwards is the scheduler's own Python work
(planning, fairness, acceptance decisions, commits, output assembly); the submit phase (chat
template, tokenizer, session opening) is reported on its own. ``cpu/wall`` > 1 means both cores
worked; the rest of ``threads x wall`` is idle.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.batching import _prompts


class Meter:
    """Wall and process-CPU seconds, counts and sizes per category."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}

    def add(self, kind: str, wall: float, cpu: float, rows: int = 0, positions: int = 0, prefill: int = 0) -> None:
        r = self.rows.setdefault(kind, {"calls": 0, "wall_s": 0.0, "cpu_s": 0.0, "rows": 0, "positions": 0,
                                        "prefill_positions": 0})
        r["calls"] += 1
        r["wall_s"] += wall
        r["cpu_s"] += cpu
        r["rows"] += rows
        r["positions"] += positions
        r["prefill_positions"] += prefill


def instrument(engine, meter: Meter):
    """Patch the forwards of ``engine``'s verifier and draft proposer to time into ``meter``;
    returns a function that undoes the patches."""
    import specdec.engine.proposers.draft_model as dm
    import specdec.engine.verifier as vf
    from specdec.engine import invariant
    from transformers import AttentionInterface

    target_model = engine.target.model
    orig = {"vf": vf.feed_many, "dm": dm.feed_many}

    def timed(fn):
        def feed(items):
            t0, c0 = time.perf_counter(), time.process_time()
            out = fn(items)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            rows = len(items)
            positions = sum(len(tokens) for _, tokens, _ in items)
            if items and items[0][0].model is target_model:
                # a decode row feeds its bonus token + K drafts and keeps K + 1 logits
                prefill = sum(len(tokens) - keep for _, tokens, keep in items)
                decode = positions - prefill
                kind = ("target prefill only" if decode == 0 else "target verify + prefill" if prefill
                        else "target verify")
            else:
                prefill = positions if positions > dm.DECODE_TAIL * rows else 0
                kind = "draft prefill" if prefill else "draft decode"
            meter.add(kind, wall, cpu, rows, positions, prefill)
            return out
        return feed

    vf.feed_many = timed(orig["vf"])
    dm.feed_many = timed(orig["dm"])

    def attention(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        out = invariant.rowwise_attention(*args, **kwargs)
        meter.add("  of which row-wise attention", time.perf_counter() - t0, time.process_time() - c0,
                  positions=args[1].shape[2])
        return out

    AttentionInterface.register(invariant.ATTENTION_NAME, attention)

    def undo():
        vf.feed_many, dm.feed_many = orig["vf"], orig["dm"]
        AttentionInterface.register(invariant.ATTENTION_NAME, invariant.rowwise_attention)

    return undo


def profile_group(engine, clients: int, max_tokens: int, k: int, budget: int, proposer: str = "draft") -> dict:
    """Run one batched group of ``clients`` requests with every forward timed; the breakdown."""
    from specdec.engine.batch import BatchScheduler
    from specdec.request import GenerationRequest

    from benchmarks.batching import prefix_warm

    prompts = _prompts(clients)
    # with prefix caching: only the chat template's opening held (in each tenant's scope), not these prompts
    prefix_warm(engine, sorted({t for t, _ in prompts}))
    meter = Meter()
    undo = instrument(engine, meter)
    try:
        sched = BatchScheduler(engine, batched=True, max_batch_positions=budget)
        t0, c0 = time.perf_counter(), time.process_time()
        handles = [sched.submit(GenerationRequest(messages=[{"role": "user", "content": c}], max_tokens=max_tokens,
                                                  speculation={"proposer": proposer, "k": k}), tenant=t)
                   for t, c in prompts]
        meter.add("submit (template, tokenizer, sessions)", time.perf_counter() - t0, time.process_time() - c0)
        ticks = 0
        while not sched.idle:
            s0, sc0 = time.perf_counter(), time.process_time()
            sched.step()
            meter.add("ticks (all)", time.perf_counter() - s0, time.process_time() - sc0)
            ticks += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        undo()
    results = [h.result() for h in handles]
    tokens = sum(len(r.token_ids) for r in results)
    rows = meter.rows
    fwd = [k_ for k_ in rows if k_.startswith(("target", "draft"))]
    inside = {x: sum(rows[k_][x] for k_ in fwd) for x in ("wall_s", "cpu_s")}
    tick = rows.pop("ticks (all)")
    rows["scheduler (ticks outside forwards)"] = {"calls": tick["calls"], "wall_s": tick["wall_s"] - inside["wall_s"],
                                                  "cpu_s": tick["cpu_s"] - inside["cpu_s"], "rows": 0, "positions": 0,
                                                  "prefill_positions": 0}
    return {"clients": clients, "max_tokens": max_tokens, "k": k, "budget": budget, "threads": torch.get_num_threads(),
            "wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tok_per_s": tokens / wall, "ticks": ticks,
            "prompt_tokens": [r.usage.prompt_tokens for r in results],
            "acceptance_rate": sum(r.stats.accepted for r in results) / max(1, sum(r.stats.proposed for r in results)),
            "load_avg": os.getloadavg()[0], "parts": rows}


def table(p: dict) -> str:
    lines = [f"{p['clients']} clients x {p['max_tokens']} tokens, K={p['k']}, budget {p['budget']}, "
             f"prefix cache {'on' if p.get('prefix_cache') else 'off'}, row-wise attention rows in "
             f"{p.get('row_dtype', 'float32')}, "
             f"{p['threads']} threads: {p['tokens']} tokens in {p['wall_s']:.2f} s wall, {p['cpu_s']:.2f} s CPU "
             f"({p['tok_per_s']:.2f} tok/s), {p['ticks']} ticks, prompts {p['prompt_tokens']} tokens, "
             f"acceptance {p['acceptance_rate']:.2f}, load {p['load_avg']:.1f}",
             "",
             "| part | calls | wall s | share of wall | CPU s | cpu/wall | rows/call | positions/call | prefill positions |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind, r in p["parts"].items():
        n = max(1, r["calls"])
        lines.append(f"| {kind} | {r['calls']} | {r['wall_s']:.3f} | {100 * r['wall_s'] / p['wall_s']:.1f}% | "
                     f"{r['cpu_s']:.3f} | {r['cpu_s'] / r['wall_s'] if r['wall_s'] > 0 else 0:.2f} | "
                     f"{r['rows'] / n:.1f} | {r['positions'] / n:.1f} | {r['prefill_positions']} |")
    lines.append(f"| idle (threads x wall - CPU) | | | | {p['threads'] * p['wall_s'] - p['cpu_s']:.3f} | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="demo:target")
    ap.add_argument("--draft", default="demo:draft")
    ap.add_argument("--format", default=None, help="weight format (default: the device's default)")
    ap.add_argument("--clients", default="1,8", help="comma list: one profiled group per count")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--k", default="4", help="K of every group, or a comma list: one K per --clients entry "
                    "(e.g. --clients 1,8 --k 4,0: one client speculating, eight plain)")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="folder for profile-<threads>t-<tokens>tok.json/.md")
    ap.add_argument("--prefix-cache", choices=("off", "on", "both"), default="off",
                    help="prefix caching (specdec.engine.prefix_cache) of both models; both: every group twice, "
                         "off then on (the cache warmed by the warm-up group, as a running server's)")
    ap.add_argument("--row-dtype", choices=("float32", "native", "both"), default="float32",
                    help="dtype row-wise attention computes bfloat16 rows in on a CPU "
                         "(specdec.engine.invariant.CPU_ROW_DTYPE): float32 (the default), native (the bfloat16 "
                         "kernel, sessions 6-9), both: every group twice, native then float32")
    a = ap.parse_args(argv)
    try:
        clients = [int(x) for x in a.clients.split(",")]
        ks = [int(x) for x in a.k.split(",")]
    except ValueError:
        ap.error(f"--clients and --k take comma lists of integers, got {a.clients!r} and {a.k!r}")
    if len(ks) == 1:
        ks = ks * len(clients)
    if len(ks) != len(clients):
        ap.error(f"--k needs one value or one per --clients entry ({len(clients)}), got {a.k!r}")
    torch.set_num_threads(a.threads)
    from benchmarks.batching import run_group
    from specdec.engine.engine import SpeculativeEngine
    from specdec.models.loader import load_pair
    from specdec.models.spec import ModelPairSpec, parse_model_spec

    target, draft = load_pair(ModelPairSpec(target=parse_model_spec(a.target), draft=parse_model_spec(a.draft)),
                              weight_format=a.format)
    engine = SpeculativeEngine(target, draft)
    from specdec.engine.prefix_cache import disable_prefix_cache, enable_prefix_cache

    stores = {}

    def prefix(on: bool) -> None:  # the same stores each time: what they hold survives an "off" group
        for m in (target.model, draft.model):
            disable_prefix_cache(m)
            if on:
                stores[id(m)] = stores.get(id(m)) or enable_prefix_cache(m, entries=8)
                m._specdec_prefix_cache = stores[id(m)]

    modes = {"off": [False], "on": [True], "both": [False, True]}[a.prefix_cache]
    for on in modes:  # warm-up (allocator, kernels; the prefix cache's entries)
        prefix(on)
        run_group(engine, _prompts(2), batched=True, k=max(ks), proposer="draft", max_tokens=4, budget=a.budget)
    from specdec.engine import invariant

    row_dtypes = {"float32": [torch.float32], "native": [None], "both": [None, torch.float32]}[a.row_dtype]
    out = []
    for c, k in zip(clients, ks):
        for on in modes:
            for dt in row_dtypes:
                invariant.CPU_ROW_DTYPE = dt
                prefix(on)
                p = profile_group(engine, c, a.max_tokens, k, a.budget)
                p["prefix_cache"] = on
                p["row_dtype"] = "native" if dt is None else str(dt).replace("torch.", "")
                out.append(p)
                print(table(p) + "\n", flush=True)
    invariant.CPU_ROW_DTYPE = torch.float32
    if a.out:
        d = Path(a.out)
        d.mkdir(parents=True, exist_ok=True)
        name = f"profile-{a.threads}t-{a.max_tokens}tok"
        (d / f"{name}.json").write_text(json.dumps({"argv": sys.argv, "groups": out}, indent=2))
        (d / f"{name}.md").write_text("\n\n".join(table(p) for p in out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
