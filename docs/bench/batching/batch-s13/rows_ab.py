"""Session 13 (batch): end-to-end A/B of row-wise attention's threading, paired in one process.

    flock -w 3000 /tmp/specdec-heavy.lock timeout 300 python docs/bench/batching/batch-s13/rows_ab.py

One engine (demo pair, device formats, prefix cache on both models, as benchmarks.batching_goal), 2 threads.
Per round, both arms ("one": every row's call on one thread, invariant.ROWS_ON_ONE_THREAD = True, sessions 10-12;
"all": a row's call on all torch threads), order reversed every other round: 8 clients at K = 0 and one client
at K = 4 (benchmarks.batching.run_group, batching_goal's prompts), MAX_TOKENS tokens. Outputs compared token for
token between the arms. Prints tokens/s per group and the 8-client / one-client ratio per arm and round.
"""
import os
import statistics as st
import sys
import time

import torch

torch.set_num_threads(2)
from benchmarks.batching import _prompts, run_group
from specdec.engine import invariant
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.prefix_cache import enable_prefix_cache
from specdec.models.loader import load_pair
from specdec.models.spec import ModelPairSpec, parse_model_spec

N = int(os.environ.get("MAX_TOKENS", "32"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
print(f"start {time.strftime('%H:%M:%S', time.gmtime())} load {os.getloadavg()}", flush=True)
target, draft = load_pair(ModelPairSpec(target=parse_model_spec("demo:target"), draft=parse_model_spec("demo:draft")))
engine = SpeculativeEngine(target, draft)
enable_prefix_cache(target.model, entries=8)
enable_prefix_cache(draft.model, entries=8)
for arm in (True, False):  # warm-up of both arms
    invariant.ROWS_ON_ONE_THREAD = arm
    run_group(engine, _prompts(8), batched=True, k=0, proposer="draft", max_tokens=4, budget=128)
    run_group(engine, _prompts(1), batched=True, k=4, proposer="draft", max_tokens=4, budget=128)
res = {}
outs = {}
for r in range(ROUNDS):
    for arm in ((True, False) if r % 2 == 0 else (False, True)):
        invariant.ROWS_ON_ONE_THREAD = arm
        name = "one" if arm else "all"
        many = run_group(engine, _prompts(8), batched=True, k=0, proposer="draft", max_tokens=N, budget=128)
        one = run_group(engine, _prompts(1), batched=True, k=4, proposer="draft", max_tokens=N, budget=128)
        outs.setdefault(name, (many["outputs"], one["outputs"]))
        same = outs[name] == (many["outputs"], one["outputs"])
        res.setdefault(name, []).append((many["tok_per_s"], one["tok_per_s"]))
        print(f"round {r + 1} rows on {name} thread(s): 8 clients K=0 {many['tok_per_s']:.2f} tok/s "
              f"(verify {many['verify_s_total']:.2f} s), 1 client K=4 {one['tok_per_s']:.2f} tok/s, ratio "
              f"{many['tok_per_s'] / one['tok_per_s']:.2f}x; same outputs as its first round {same}; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
print(f"outputs identical across arms: {outs['one'] == outs['all']}")
for name, v in res.items():
    print(f"rows on {name}: 8 clients median {st.median(m for m, _ in v):.2f} tok/s, 1 client median "
          f"{st.median(o for _, o in v):.2f}, ratio median {st.median(m / o for m, o in v):.2f}x")
paired = [a[0] / b[0] for a, b in zip(res["all"], res["one"])]
paired1 = [a[1] / b[1] for a, b in zip(res["all"], res["one"])]
print(f"all / one, paired per round: 8 clients {[round(x, 3) for x in paired]}, 1 client {[round(x, 3) for x in paired1]}")
print(f"end {time.strftime('%H:%M:%S', time.gmtime())} load {os.getloadavg()}", flush=True)
