"""Draft forwards by format: 1 row and 8 rows, one process, interleaved, median."""
import os, random, statistics as st, time, sys
import torch
torch.set_num_threads(2)
from specdec.engine.kv_cache import CachedSequence, feed_many
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec
spec = parse_model_spec("demo:draft")
VARIANTS = {"int4": dict(weight_format="int4"), "w8a8": dict(weight_format="w8a8"),
            "int4+v64k": dict(weight_format="int4", vocab_subset=65536), "w8a8+v64k": dict(weight_format="w8a8", vocab_subset=65536)}
M = {k: load_model(spec, **v) for k, v in VARIANTS.items()}
rng = random.Random(0)
LENS = (70, 95, 120, 140, 160, 180, 200, 230)
def seqs(model):
    out = []
    for n in LENS:
        ids = [rng.randrange(1000, 30000) for _ in range(n)]
        s = CachedSequence(model, ids); feed_many([(s, ids, 1)]); out.append(s)
    return out
S = {k: seqs(m.model) for k, m in M.items()}
tok = lambda: rng.randrange(1000, 30000)
CASES = {"1 row": lambda T: [(T[3], [tok()], 1)], "8 rows": lambda T: [(s, [tok()], 1) for s in T],
         "1x5": lambda T: [(T[3], [tok() for _ in range(5)], 5)]}
res = {(k, c): [] for k in M for c in CASES}
for rep in range(int(os.environ.get("REPS", "12"))):
    order = list(M) if rep % 2 == 0 else list(M)[::-1]
    for c, mk in CASES.items():
        for k in order:
            items = mk(S[k])
            before = [len(s.cached) for s, _, _ in items]
            t = time.perf_counter(); feed_many(items); dt = time.perf_counter() - t
            for (s, _, _), b in zip(items, before): s._crop(b)
            res[(k, c)].append(dt)
for c in CASES:
    print(c, "  ".join(f"{k} {1000*st.median(res[(k, c)]):.1f} ms" for k in M), flush=True)
