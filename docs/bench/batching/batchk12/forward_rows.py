"""Seconds of one batched forward by rows, per draft weight format, and the target's batched verify.

    flock -w 1800 /tmp/specdec-heavy.lock timeout 300 .venv/bin/python docs/bench/batching/batchk12/forward_rows.py

Issue 10 (session 12): at 8 clients and K = 1 the int4 draft spent ~130 ms per batched draft
forward of 8 rows. Here every draft format ($DRAFTS, default int4, w8a8, float32) feeds one position per row
(a decoding draft row: its next position) at 1/2/4/8 rows,
and the target ($TARGETS, default w8a8) verifies 8 rows x 1/2/3 positions (K = 0/1/2), all through
:func:`specdec.engine.kv_cache.feed_many` as the batched scheduler calls it, formats and shapes
interleaved in rounds, caches cut back after each forward (every forward sees the same past).
Prints the median wall ms and CPU ms (all threads) per shape; 2 torch threads as the benchmarks.
"""
import os
import statistics
import sys
import time

import torch

from benchmarks.batching import _prompts
from specdec.engine.kv_cache import CachedSequence, feed_many
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec

ROUNDS = int(os.environ.get("ROUNDS", "4"))
PAST = int(os.environ.get("PAST", "24"))  # prompt tokens kept per row (the past each forward attends to)
torch.set_num_threads(2)
print(f"load {open('/proc/loadavg').read().strip()}", flush=True)
t0 = time.perf_counter()
from specdec.models.formats import cpu_flags, default_draft_format, default_format

print("cpu capability", torch.backends.cpu.get_cpu_capability(), "flags", sorted(f for f in cpu_flags() if "avx" in f or "amx" in f),
      "defaults", default_format(), default_draft_format(), flush=True)
TARGETS = os.environ.get("TARGETS", "w8a8").split(",")
DRAFTS = os.environ.get("DRAFTS", "int4,w8a8,float32").split(",")
targets = {f: load_model(parse_model_spec("demo:target"), weight_format=f) for f in TARGETS}
target = targets[TARGETS[0]]
drafts = {f: load_model(parse_model_spec("demo:draft"), weight_format=f) for f in DRAFTS}
print(f"loaded in {time.perf_counter() - t0:.1f} s; load {open('/proc/loadavg').read().strip()}", flush=True)
tok = target.tokenizer
ids = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
       for _, c in _prompts(8)]
ids = [list(x["input_ids"] if hasattr(x, "keys") else x)[:PAST] for x in ids]
print("prompt lengths", [len(x) for x in ids], flush=True)


def seqs_of(model):
    out = []
    with torch.inference_mode():
        for x in ids:
            s = CachedSequence(model, list(x))
            s.feed(x[:-1], keep=1)
            out.append(s)
    return out


models = {**{f"target-{f}": t.model for f, t in targets.items()}, **{f"draft-{f}": d.model for f, d in drafts.items()}}
seqs = {name: seqs_of(m) for name, m in models.items()}
shapes = [(f"target-{f}", r, p) for f in targets for r, p in ((1, 1), (8, 1), (8, 2), (8, 3))]
for f in drafts:
    for rows in (1, 2, 4, 8):
        shapes.append((f"draft-{f}", rows, 1))
wall: dict = {s: [] for s in shapes}
cpu: dict = {s: [] for s in shapes}
with torch.inference_mode():
    for rnd in range(ROUNDS + 1):
        order = shapes if rnd % 2 == 0 else shapes[::-1]
        for shape in order:
            name, rows, pos = shape
            ss = seqs[name][:rows]
            lens = [len(s.cached) for s in ss]
            items = [(s, s.token_ids[len(s.cached):len(s.cached) + 1] + [11] * (pos - 1), pos) for s in ss]
            c0, w0 = time.process_time(), time.perf_counter()
            feed_many(items)
            w, c = time.perf_counter() - w0, time.process_time() - c0
            for s, n in zip(ss, lens):
                s._crop(n)
            if rnd > 0:  # round 0 warms every shape up
                wall[shape].append(w)
                cpu[shape].append(c)
            else:
                print(f"warm-up {shape}: {w * 1e3:.1f} ms", flush=True)
        if rnd > 0:
            print(f"round {rnd}: " + ", ".join(f"{n}/{r}x{p} {wall[(n, r, p)][-1] * 1e3:.0f}" for n, r, p in shapes)
                  + f" ms; load {open('/proc/loadavg').read().split()[0]}", flush=True)
print(f"median of {ROUNDS} rounds (after one warm-up round), 2 torch threads, past {PAST} tokens per row")
print("| model | rows | positions/row | wall ms | CPU ms | wall ms per row | min wall ms |")
print("|---|---:|---:|---:|---:|---:|---:|")
for shape in shapes:
    name, rows, pos = shape
    mw, mc = statistics.median(wall[shape]) * 1e3, statistics.median(cpu[shape]) * 1e3
    print(f"| {name} | {rows} | {pos} | {mw:.1f} | {mc:.1f} | {mw / rows:.1f} | {min(wall[shape]) * 1e3:.1f} |")
print(f"load {open('/proc/loadavg').read().strip()}", flush=True)
