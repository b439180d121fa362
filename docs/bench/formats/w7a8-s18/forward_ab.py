"""Session 18: the demo pair's forwards in w8a8 (fbgemm, two 7-bit halves per row) against w7a8
(fbgemm, one pass), side by side in one process, on an AVX2 CPU.

    flock -w 1800 /tmp/specdec-heavy.lock python docs/bench/formats/w7a8-s18/forward_ab.py

Eight cached sequences per model (70..230 random tokens); every forward is ``kv_cache.feed_many``
(one item: the unbatched ``feed``), cut back afterwards; the two formats' cases interleaved,
REPS rounds in alternating order; median wall time per forward.
"""
import os
import random
import statistics as st
import time

import torch

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
from specdec.engine.kv_cache import CachedSequence, feed_many  # noqa: E402
from specdec.models.loader import load_pair  # noqa: E402
from specdec.models.spec import ModelPairSpec, parse_model_spec  # noqa: E402

FORMATS = ("w8a8", "w7a8")
spec = ModelPairSpec(target=parse_model_spec("demo:target"), draft=parse_model_spec("demo:draft"))
pairs = {f: load_pair(spec, weight_format=f) for f in FORMATS}
print(f"cpu {torch.backends.cpu.get_cpu_capability()} threads {torch.get_num_threads()} load {os.getloadavg()}", flush=True)
rng = random.Random(0)
LENS = (70, 95, 120, 140, 160, 180, 200, 230)


def seqs(model):
    out = []
    for n in LENS:
        ids = [rng.randrange(1000, 30000) for _ in range(n)]
        s = CachedSequence(model, ids)
        feed_many([(s, ids, 1)])
        out.append(s)
    return out


S = {f: (seqs(t.model), seqs(d.model)) for f, (t, d) in pairs.items()}


def tok():
    return rng.randrange(1000, 30000)


CASES = {
    "target 1 position": lambda T, D: [(T[3], [tok()], 1)],
    "target 5 positions (verify K=4)": lambda T, D: [(T[3], [tok() for _ in range(5)], 5)],
    "target 8 rows x 1": lambda T, D: [(s, [tok()], 1) for s in T],
    "target 8 rows x 5": lambda T, D: [(s, [tok() for _ in range(5)], 5) for s in T],
    "target prefill 64": lambda T, D: [(T[0], [tok() for _ in range(64)], 1)],
    "draft 1 position": lambda T, D: [(D[3], [tok()], 1)],
    "draft 8 rows x 1": lambda T, D: [(s, [tok()], 1) for s in D],
}


def run(items):
    before = [len(s.cached) for s, _, _ in items]
    t = time.perf_counter()
    feed_many(items)
    w = time.perf_counter() - t
    for (s, _, _), b in zip(items, before):
        s._crop(b)
    return w


res = {}
for r in range(int(os.environ.get("REPS", "6"))):
    for f in (FORMATS if r % 2 == 0 else FORMATS[::-1]):
        for name, make in CASES.items():
            res.setdefault((f, name), []).append(run(make(*S[f])))
print(f"{'forward':34s} {'w8a8 ms':>9s} {'w7a8 ms':>9s} {'w8a8/w7a8':>10s}")
for name in CASES:
    a, b = st.median(res[("w8a8", name)]), st.median(res[("w7a8", name)])
    print(f"{name:34s} {a * 1000:9.1f} {b * 1000:9.1f} {a / b:10.2f}")
print(f"load after {os.getloadavg()}")
