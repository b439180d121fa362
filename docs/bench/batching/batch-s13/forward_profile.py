"""Session 13 (batch): where an 8-row x 1-position target forward's time goes against one row, on this CPU.

    flock -w 1800 /tmp/specdec-heavy.lock timeout 300 env PROF=1 python docs/bench/batching/batch-s13/forward_profile.py

The demo pair in the device's default formats (w8a8 target, int4 draft on an AVX512-VNNI CPU), 2 threads.
Eight cached sequences of LENS random tokens (default 70..230: batching_goal's prompts plus 0..128
generated tokens); every forward is ``kv_cache.feed_many`` (one item: the unbatched ``feed``), cut back
afterwards; shapes interleaved, REPS timed rounds; row-wise attention timed by a wrapper in a second pass;
then the torch profiler over 5 calls of 1x1 and 8x1 (PROF=1).
"""
import os, random, statistics as st, time

import torch

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
from specdec.engine import invariant
from specdec.engine.kv_cache import CachedSequence, feed_many
from specdec.models.loader import load_pair
from specdec.models.spec import ModelPairSpec, parse_model_spec

t0 = time.time()
target, draft = load_pair(ModelPairSpec(target=parse_model_spec(os.environ.get("TARGET", "demo:target")), draft=parse_model_spec(os.environ.get("DRAFT", "demo:draft"))))
print(f"load {time.time() - t0:.1f} s {target.weight_format}/{draft.weight_format} load {os.getloadavg()}", flush=True)
rng = random.Random(0)
TOP = min(30000, target.model.config.vocab_size)
LOW = min(1000, TOP // 4)
lens = [int(x) for x in os.environ.get("LENS", "70,95,120,140,160,180,200,230").split(",")]


def seqs_of(model):
    out = []
    for L in lens:
        ids = [rng.randrange(LOW, TOP) for _ in range(L)]
        s = CachedSequence(model, list(ids))
        feed_many([(s, ids, 1)])
        out.append(s)
    return out


T, D = seqs_of(target.model), seqs_of(draft.model)


def run(items):
    before = [len(s.cached) for s, _, _ in items]
    t, c = time.perf_counter(), time.process_time()
    feed_many(items)
    w, cc = time.perf_counter() - t, time.process_time() - c
    for (s, _, _), b in zip(items, before):
        s._crop(b)
    return w, cc


def tok():
    return rng.randrange(LOW, TOP)


cases = {
    "target 1x1": lambda: [(T[3], [tok()], 1)],
    "target 1x5": lambda: [(T[3], [tok() for _ in range(5)], 5)],
    "target 2x1": lambda: [(s, [tok()], 1) for s in T[:2]],
    "target 4x1": lambda: [(s, [tok()], 1) for s in T[:4]],
    "target 8x1": lambda: [(s, [tok()], 1) for s in T],
    "target 8x2": lambda: [(s, [tok(), tok()], 2) for s in T],
    "draft 1x1": lambda: [(D[3], [tok()], 1)],
    "draft 8x1": lambda: [(s, [tok()], 1) for s in D],
}
for name, f in cases.items():
    for _ in range(2):
        run(f())
R = int(os.environ.get("REPS", "8"))


def measure(names, label):
    res = {n: [] for n in names}
    for r in range(R):
        for n in (names if r % 2 == 0 else names[::-1]):
            res[n].append(run(cases[n]()))
    for n, v in res.items():
        print(f"{label}{n}: wall median {st.median(w for w, _ in v) * 1000:.1f} ms min {min(w for w, _ in v) * 1000:.1f}; "
              f"cpu median {st.median(c for _, c in v) * 1000:.1f} ms", flush=True)


measure(list(cases), "")
# variants of row-wise attention's threading, interleaved with the default, logits compared bitwise:
# "worker": rows of a call split over a helper Python thread (invariant.ROW_WORKER_MIN_ROWS = WORKER);
# "2t-rows": every row's call on the torch threads (heads split; invariant.SINGLE_THREAD_MAX_KEYS = -1)
WORKER = int(os.environ.get("WORKER", "4"))
VARIANTS = {"default": (0, invariant.SINGLE_THREAD_MAX_KEYS), "worker": (WORKER, invariant.SINGLE_THREAD_MAX_KEYS),
            "2t-rows": (0, -1)}


def variant(name):
    invariant.ROW_WORKER_MIN_ROWS, invariant.SINGLE_THREAD_MAX_KEYS = VARIANTS[name]


AB = ("target 1x1", "target 1x5", "target 8x1", "draft 1x1", "draft 8x1")
for n in ("target 8x1", "target 1x5", "draft 8x1"):
    items = cases[n]()
    outs = []
    for v in VARIANTS:
        variant(v)
        before = [len(s.cached) for s, _, _ in items]
        outs.append(feed_many(items))
        for (s, _, _), b in zip(items, before):
            s._crop(b)
    print(f"variants {n}: logits bitwise equal {all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))}",
          flush=True)
res = {}
names = list(VARIANTS)
for r in range(R):
    for v in (names if r % 2 == 0 else names[::-1]):
        variant(v)
        for n in AB:
            res.setdefault((v, n), []).append(run(cases[n]()))
variant("default")
for n in AB:
    for v in names:
        x = res[(v, n)]
        print(f"{v:8s} {n}: wall median {st.median(w for w, _ in x) * 1000:.1f} ms min {min(w for w, _ in x) * 1000:.1f}; "
              f"cpu median {st.median(c for _, c in x) * 1000:.1f} ms", flush=True)
# row-wise attention's share: the same forwards with the attention timed
from transformers import AttentionInterface

spent = [0.0, 0]


def timed_attention(*args, **kwargs):
    t = time.perf_counter()
    out = invariant.rowwise_attention(*args, **kwargs)
    spent[0] += time.perf_counter() - t
    spent[1] += 1
    return out


AttentionInterface.register(invariant.ATTENTION_NAME, timed_attention)
for n in ("target 1x1", "target 8x1", "draft 1x1", "draft 8x1"):
    spent[:] = [0.0, 0]
    ws = [run(cases[n]())[0] for _ in range(R)]
    print(f"attention in {n}: {spent[0] / R * 1000:.1f} ms of {st.mean(ws) * 1000:.1f} ms per forward "
          f"({spent[1] // R} calls)", flush=True)
AttentionInterface.register(invariant.ATTENTION_NAME, invariant.rowwise_attention)
print(f"load after {os.getloadavg()}", flush=True)
if os.environ.get("PROF"):
    from torch.profiler import ProfilerActivity, profile

    for n in ("target 1x1", "target 8x1"):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(5):
                run(cases[n]())
        print("=====", n, "(5 calls)")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
