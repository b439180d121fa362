"""A/B: row-wise attention's folded row call (session 23) against torch's grouped-query call, demo target
(this CPU's default format), forwards of 1x1, 1x5, 8x1, 8x5 over ragged caches, interleaved, same tokens."""
import os, random, statistics as st, time
import torch
import torch.nn.functional as F
torch.set_num_threads(2)
from specdec.engine import invariant as inv
from sessions import cached_sessions, timed_forward  # this folder's shared setup
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec

folded = inv.row_call
def gqa(q, k, v, scaling):
    return F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
target = load_model(parse_model_spec("demo:target"))
print("target", target.weight_format, flush=True)
rng = random.Random(0)
seqs = cached_sessions(target.model, rng, [int(x) for x in os.environ.get("LENS", "170,195,220,240,260,280,300,330").split(",")])
def run(items):
    return timed_forward(items)
shapes = {"1x1": (1, 1), "1x5": (1, 5), "8x1": (8, 1), "8x5": (8, 5)}
res = {(n, v): [] for n in shapes for v in ("gqa", "folded")}
R = int(os.environ.get("REPS", "8"))
for r in range(R + 1):
    for n, (rows, p) in shapes.items():
        toks = [[rng.randrange(1000, 30000) for _ in range(p)] for _ in range(rows)]
        order = ("gqa", "folded") if r % 2 else ("folded", "gqa")
        for v in order:
            inv.row_call = folded if v == "folded" else gqa
            w, _ = run([(s, t, p) for s, t in zip(seqs, toks)])
            if r: res[(n, v)].append(w)
inv.row_call = folded
print("shape  gqa median/min ms   folded median/min ms   folded/gqa (median)")
for n in shapes:
    a, b = res[(n, "gqa")], res[(n, "folded")]
    print(f"{n}   {1000*st.median(a):7.1f} / {1000*min(a):6.1f}   {1000*st.median(b):7.1f} / {1000*min(b):6.1f}   {st.median(b)/st.median(a):.3f}", flush=True)
