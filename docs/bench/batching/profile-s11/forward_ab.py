"""A/B of target forwards: variants interleaved in one process (wall and process CPU per forward)."""
import os, sys, time, random, statistics as st
import torch
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec
from specdec.engine import kv_cache, invariant, kv_store
from specdec.engine.kv_cache import CachedSequence, feed_many

target = load_model(parse_model_spec(os.environ.get("MODEL", "demo:target")))
model = target.model
rng = random.Random(0)
lens = [int(x) for x in os.environ.get("LENS", "70,95,120,140,160,180,200,230").split(",")]
def make(growing, store):
    kv_store.GROWING_CACHE = growing; kv_store.STORE_ROW_DTYPE = store
    out = []
    r2 = random.Random(0)
    for L in lens:
        ids = [r2.randrange(1000, 30000) for _ in range(L)]
        s = CachedSequence(model, list(ids)); s.feed(ids, keep=1); out.append(s)
    return out
SEQS = {(False, False): make(False, False), (True, False): make(True, False), (True, True): make(True, True)}
print("kv dtypes", {k: v[0].cache.layers[0].keys.dtype for k, v in SEQS.items()}, flush=True)
seqs = SEQS[(False, False)]

VARIANTS = {
    "old": dict(PACKED_PARTS=False, ROW_WORKER_MIN_ROWS=0, G=(False, False)),
    "new-nof32": dict(PACKED_PARTS=True, ROW_WORKER_MIN_ROWS=6, G=(True, False)),
    "new": dict(PACKED_PARTS=True, ROW_WORKER_MIN_ROWS=6, G=(True, True)),
    "new-w4": dict(PACKED_PARTS=True, ROW_WORKER_MIN_ROWS=4, G=(True, True)),
    "new-noworker": dict(PACKED_PARTS=True, ROW_WORKER_MIN_ROWS=0, G=(True, True)),
}
only = os.environ.get("VARIANTS")
if only:
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in only.split(",")}
def setv(v):
    global seqs
    kv_cache.PACKED_PARTS = v["PACKED_PARTS"]; invariant.ROW_WORKER_MIN_ROWS = v["ROW_WORKER_MIN_ROWS"]
    seqs = SEQS[v["G"]]

def run(items):
    before = [len(s.cached) for s, _, _ in items]
    t, c = time.perf_counter(), time.process_time()
    out = feed_many(items)
    w, cc = time.perf_counter() - t, time.process_time() - c
    for (s, _, _), b in zip(items, before):
        s._crop(b)
    return w, cc, out

cases = {
    "1x1": lambda toks: [(seqs[3], toks[:1], 1)],
    "1x5": lambda toks: [(seqs[3], toks[:5], 5)],
    "8x1": lambda toks: [(s, [t], 1) for s, t in zip(seqs, toks)],
}
res = {(c, v): [] for c in cases for v in VARIANTS}
R = int(os.environ.get("REPS", "6"))
for r in range(R + 1):
    for c, f in cases.items():
        toks = [rng.randrange(1000, 30000) for _ in range(10)]
        ref = None
        for v in (VARIANTS if r % 2 else dict(reversed(list(VARIANTS.items())))):
            setv(VARIANTS[v])
            w, cc, out = run(f(toks))
            if ref is None: ref = out
            else: assert all(torch.equal(a, b) for a, b in zip(ref, out)), (c, v)
            if r >= 1: res[(c, v)].append((w, cc))
            print(f"r{r} {c} {v} {w*1000:.1f} ms wall {cc*1000:.1f} ms cpu", flush=True)
for c in cases:
    base = None
    for v in VARIANTS:
        x = res[(c, v)]
        w, cc = st.median(a for a, _ in x), st.median(b for _, b in x)
        base = base or (w, cc)
        print(f"{c:4s} {v:14s} wall med {w*1000:7.1f} ms (min {min(a for a,_ in x)*1000:6.1f})  cpu med {cc*1000:7.1f} ms   x old wall {w/base[0]:.3f} cpu {cc/base[1]:.3f}", flush=True)
print("load", os.getloadavg())
