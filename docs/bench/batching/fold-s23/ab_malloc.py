"""Forward times of the demo target with and without mallopt (one process per variant; run alternately)."""
import ctypes, os, random, statistics as st, sys, time
if sys.argv[1] == "mallopt":
    libc = ctypes.CDLL("libc.so.6"); libc.mallopt(-3, 32 << 20); libc.mallopt(-1, 1 << 30)
import torch
torch.set_num_threads(2)
from sessions import cached_sessions, timed_forward  # this folder's shared setup
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec
target = load_model(parse_model_spec("demo:target"))
rng = random.Random(0)
seqs = cached_sessions(target.model, rng)
def run(items):
    return timed_forward(items)[0]
shapes = {"1x1": (1, 1), "8x1": (8, 1), "4x32": (4, 32)}
res = {n: [] for n in shapes}
for r in range(13):
    for n, (rows, p) in shapes.items():
        toks = [[rng.randrange(1000, 30000) for _ in range(p)] for _ in range(rows)]
        w = run([(s, t, p) for s, t in zip(seqs, toks)])
        if r: res[n].append(w)
print(sys.argv[1], " ".join(f"{n} {1000*st.median(v):.1f}" for n, v in res.items()), flush=True)
