"""Session 12 (batchfwd12): one packed 8 x 1 target forward, main's code against this branch's, interleaved.

    flock -w 1800 /tmp/specdec-heavy.lock timeout 300 .venv/bin/python docs/bench/batching/batchfwd12/forward_ab.py

Demo target in w8a8 (FMT), 2 threads. Eight sequences with random contexts of 100..170 tokens (prefilled
once); each timed call is kv_cache.feed_many of one new token per sequence (8 clients at K = 0), cut back
afterwards; arms alternate call by call (order reversed every other round): "main" = row-wise attention
and the packed cache update from main's source (git) with checked appends; "new" = this tree; "new + row
worker" = ROW_WORKER_MIN_ROWS 8. Logits of every arm are compared bitwise with main's. Then one 1 x 1
forward per arm (one sequence alone) for the per-row cost. Per call: wall, and for "new" the time inside
row-wise attention and the packed cache update.
"""
import os, sys, time, random, subprocess, types, collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
import torch

torch.set_num_threads(int(os.environ.get("THREADS", 2)))
T0 = time.perf_counter()
REPS = int(os.environ.get("REPS", 8))
CTX, CTX_STEP = int(os.environ.get("CTX", 100)), int(os.environ.get("CTX_STEP", 10))  # context of sequence i: CTX + CTX_STEP * i
def stamp(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s {time.strftime('%H:%M:%S', time.gmtime())} load {os.getloadavg()[0]:.1f}] {msg}",
          flush=True)
stamp("start")
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec
from specdec.engine import kv_cache, kv_store, invariant
from specdec.engine.kv_cache import CachedSequence, feed_many
from transformers import AttentionInterface

BASE = os.environ.get("BASE", "568f940")  # main before this session's packed-forward changes (c39984a..d10f1db)
def module_from(src, path, name):
    m = types.ModuleType(name)
    m.__file__ = path
    sys.modules[name] = m
    exec(compile(src, path, "exec"), m.__dict__)
    return m
def git_src(path):
    return subprocess.run(["git", "show", f"{BASE}:{path}"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
old_inv = module_from(git_src("specdec/engine/invariant.py"), "specdec/engine/invariant.py", "old_invariant")
old_kvc = module_from(git_src("specdec/engine/kv_cache.py"), "specdec/engine/kv_cache.py", "old_kv_cache")

target = load_model(parse_model_spec("demo:target"), weight_format=os.environ.get("FMT", "w8a8"))
model = target.model
stamp(f"loaded {target.weight_format}, cpu {torch.backends.cpu.get_cpu_capability()}, attention "
      f"{model.config._attn_implementation}, main = {BASE}")

acc = collections.defaultdict(float)
def timed(name, fn):
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t
    return w
new_update = kv_cache._PackedCacheView.update
arms = {
    "main": (False, old_inv.rowwise_attention, old_kvc._PackedCacheView.update, 0),
    "new": (True, timed("attention", invariant.rowwise_attention), timed("update", new_update), 0),
    "new + row worker": (True, invariant.rowwise_attention, new_update, 8),
}
def use(name):
    fast, attn, upd, worker = arms[name]
    kv_store.FAST_APPEND = fast
    AttentionInterface.register(invariant.ATTENTION_NAME, attn)
    kv_cache._PackedCacheView.update = upd
    invariant.ROW_WORKER_MIN_ROWS = worker
    old_inv.ROW_WORKER_MIN_ROWS = worker

rng = random.Random(0)
seqs = []
with torch.inference_mode():
    use("new")
    for i in range(8):
        s = CachedSequence(model, [])
        s.feed([rng.randrange(100, 20000) for _ in range(CTX + CTX_STEP * i)], keep=1)
        seqs.append(s)
    stamp(f"prefilled 8 sequences, {[len(s.cached) for s in seqs]} positions")
    new_tok = [[rng.randrange(100, 20000)] for _ in seqs]

    def call(name, rows):
        use(name)
        acc.clear()
        t = time.perf_counter()
        out = feed_many([(s, tok, 1) for s, tok in zip(rows, new_tok)])
        wall = time.perf_counter() - t
        for s in rows:
            s._crop(len(s.cached) - 1)
        return wall, torch.cat(out), dict(acc)

    for name in arms:  # warm-up
        call(name, seqs)
        call(name, seqs[:1])
    res = collections.defaultdict(list)
    parts = collections.defaultdict(list)
    equal = collections.Counter()
    for r in range(REPS):
        names = list(arms) if r % 2 == 0 else list(arms)[::-1]
        logits = {}
        for name in names:
            for rows, shape in ((seqs, "8x1"), (seqs[:1], "1x1")):
                wall, lg, a = call(name, rows)
                res[(name, shape)].append(wall)
                logits[(name, shape)] = lg
                if name == "new":
                    parts[shape].append(a)
        for name in arms:
            for shape in ("8x1", "1x1"):
                equal[(name, shape)] += torch.equal(logits[(name, shape)], logits[("main", shape)])
        stamp(f"round {r}: " + ", ".join(f"{n} {s} {1e3 * res[(n, s)][-1]:.1f} ms" for n in arms for s in ("8x1", "1x1")))
    print(f"\n8 sequences of {[len(s.cached) for s in seqs]} cached positions, {REPS} rounds, ms per forward:")
    print("| arm | 8x1 median | 8x1 min | 1x1 median | 1x1 min | 8x1 / 1x1 (medians) | logits equal main's (8x1, 1x1) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    med = lambda v: sorted(v)[len(v) // 2]
    for n in arms:
        a, b = res[(n, "8x1")], res[(n, "1x1")]
        print(f"| {n} | {1e3 * med(a):.1f} | {1e3 * min(a):.1f} | {1e3 * med(b):.1f} | {1e3 * min(b):.1f} | "
              f"{med(a) / med(b):.2f} | {equal[(n, '8x1')]}/{REPS}, {equal[(n, '1x1')]}/{REPS} |")
    for shape in ("8x1", "1x1"):
        p = parts[shape]
        print(f"new {shape}: inside row-wise attention median {1e3 * med([x.get('attention', 0) for x in p]):.1f} ms, "
              f"packed cache update median {1e3 * med([x.get('update', 0) for x in p]):.1f} ms")
    pairs = [m / n for m, n in zip(res[("main", "8x1")], res[("new", "8x1")])]
    print(f"paired 8x1 main / new per round: {[round(x, 3) for x in pairs]}")
    if os.environ.get("PROF", "1") == "1":
        use("new")
        from torch.profiler import profile
        with profile() as prof:
            for _ in range(3):
                call("new", seqs)
        print("\ntorch.profiler, 3 calls of 8x1 (new):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
stamp("end")
