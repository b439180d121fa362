"""Micro: target forwards at 1 row x1, 1 row x5, 8 rows x1 (ragged caches), interleaved; torch profiler."""
import os, sys, time, random
import torch
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
from specdec.models.loader import load_pair, load_model
from specdec.models.spec import parse_model_spec
from specdec.engine.kv_cache import CachedSequence, feed_many
from specdec.engine import prefix_cache

t0 = time.time()
target = load_model(parse_model_spec("demo:target"))
model = target.model
print("load", time.time() - t0, "s", next(model.parameters()).dtype, flush=True)
rng = random.Random(0)
lens = [int(x) for x in os.environ.get("LENS", "70,95,120,140,160,180,200,230").split(",")]
seqs = []
for L in lens:
    ids = [rng.randrange(1000, 30000) for _ in range(L)]
    s = CachedSequence(model, list(ids))
    s.feed(ids, keep=1)
    seqs.append(s)

def run(items):
    before = [len(s.cached) for s, _, _ in items]
    t, c = time.perf_counter(), time.process_time()
    feed_many(items)
    w, cc = time.perf_counter() - t, time.process_time() - c
    for (s, _, _), b in zip(items, before):
        s._crop(b)
    return w, cc

cases = {
    "1x1": lambda: [(seqs[3], [rng.randrange(1000, 30000)], 1)],
    "1x5": lambda: [(seqs[3], [rng.randrange(1000, 30000) for _ in range(5)], 5)],
    "8x1": lambda: [(s, [rng.randrange(1000, 30000)], 1) for s in seqs],
    "4x1": lambda: [(s, [rng.randrange(1000, 30000)], 1) for s in seqs[:4]],
    "2x1": lambda: [(s, [rng.randrange(1000, 30000)], 1) for s in seqs[:2]],
}
for name, f in cases.items():
    for _ in range(3):
        run(f())
res = {n: [] for n in cases}
R = int(os.environ.get("REPS", "12"))
for r in range(R):
    for n, f in cases.items():
        res[n].append(run(f()))
import statistics as st
for n, v in res.items():
    print(f"{n}: wall median {st.median(w for w, _ in v)*1000:.1f} ms min {min(w for w, _ in v)*1000:.1f}; cpu median {st.median(c for _, c in v)*1000:.1f} ms", flush=True)
if os.environ.get("PROF"):
    from torch.profiler import profile, ProfilerActivity
    for n in ("1x1", "1x5", "8x1"):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(5):
                run(cases[n]())
        print("=====", n, "(5 calls)")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
