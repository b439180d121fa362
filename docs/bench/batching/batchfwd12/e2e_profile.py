"""Session 12 (batchfwd12): where a batched K=0 step of 8 clients goes, end to end.

    flock -w 1800 /tmp/specdec-heavy.lock timeout 300 .venv/bin/python docs/bench/batching/batchfwd12/e2e_profile.py

One engine (demo pair, w8a8, prefix cache on both models as benchmarks.batching_goal), 2 threads.
Warm-up group (8 clients x 8 tokens), then one timed group of 8 clients x MAX_TOKENS at K=0 whose
every tick is split by wall clock into: scheduler outside verify, verify_batch's check/pending,
the mask, the model forward (of which row-wise attention, packed cache update), the logits
conversion, decide. Then a short group under torch.profiler (PROF_TICKS ticks after the prefill)
for the op table. Prints the load before and after.
"""
import os, sys, time, json, collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
import torch

torch.set_num_threads(int(os.environ.get("THREADS", 2)))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", 64))
CLIENTS = int(os.environ.get("CLIENTS", 8))
PROF_TICKS = int(os.environ.get("PROF_TICKS", 8))
T0_ALL = time.perf_counter()
print("load before", open("/proc/loadavg").read().strip(), time.strftime("%H:%M:%S", time.gmtime()), flush=True)

from benchmarks.batching import _prompts, prefix_warm, run_group
from specdec.engine.engine import SpeculativeEngine
from specdec.models.loader import load_pair
from specdec.models.spec import ModelPairSpec, parse_model_spec
from specdec.engine.prefix_cache import enable_prefix_cache
from specdec.engine import kv_cache, invariant, verifier as vf
from specdec.engine.batch import BatchScheduler
from specdec.request import GenerationRequest
from transformers import AttentionInterface

t = time.perf_counter()
FMT = os.environ.get("FMT", "w8a8")
target, draft = load_pair(ModelPairSpec(target=parse_model_spec("demo:target"), draft=parse_model_spec("demo:draft")),
                          weight_format=FMT, draft_format=os.environ.get("DRAFT_FMT", "int4"))
print("formats", target.weight_format, draft.weight_format, "cpu capability", torch.backends.cpu.get_cpu_capability(),
      "attn", target.model.config._attn_implementation, flush=True)
engine = SpeculativeEngine(target, draft)
enable_prefix_cache(target.model, entries=8)
enable_prefix_cache(draft.model, entries=8)
print(f"loaded in {time.perf_counter() - t:.1f} s", flush=True)
run_group(engine, _prompts(CLIENTS), batched=True, k=0, proposer="draft", max_tokens=8, budget=128)
run_group(engine, _prompts(1), batched=True, k=4, proposer="draft", max_tokens=8, budget=128)
one = run_group(engine, _prompts(1), batched=True, k=4, proposer="draft", max_tokens=MAX_TOKENS, budget=128)
print(f"1 client K=4 x {MAX_TOKENS}: {one['tokens']} tokens in {one['wall_s']:.2f} s, {one['tokens'] / one['wall_s']:.2f} tok/s",
      flush=True)

acc = collections.defaultdict(float)
cnt = collections.Counter()
def timed(name, fn):
    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t0
            cnt[name] += 1
    return w

model = target.model
orig_forward = model.forward
model.forward = timed("model forward", orig_forward)
kv_cache._packed_mask = timed("mask", kv_cache._packed_mask)
kv_cache._PackedCacheView.update = timed("packed cache update", kv_cache._PackedCacheView.update)
AttentionInterface.register(invariant.ATTENTION_NAME, timed("row-wise attention", invariant.rowwise_attention))
vf.feed_many = timed("feed_many", kv_cache.feed_many)
vf.TargetSession.decide = timed("decide", vf.TargetSession.decide)
vf.TargetSession.pending = timed("pending (sync)", vf.TargetSession.pending)
vf.TargetSession.check = timed("check", vf.TargetSession.check)
orig_vb = vf.TargetVerifier.verify_batch
vf.TargetVerifier.verify_batch = timed("verify_batch", orig_vb)
import specdec.engine.decoder as dec
dec.Generation.apply = timed("generation.apply", dec.Generation.apply)
dec.Generation.plan = timed("generation.plan", dec.Generation.plan)

prefix_warm(engine)
sched = BatchScheduler(engine, batched=True, max_batch_positions=128)
handles = [sched.submit(GenerationRequest(messages=[{"role": "user", "content": c}], max_tokens=MAX_TOKENS,
                                          speculation={"proposer": "draft", "k": 0}), tenant=tn)
           for tn, c in _prompts(CLIENTS)]
ticks = []
t0 = time.perf_counter(); c0 = time.process_time()
while not sched.idle:
    before = dict(acc)
    s = time.perf_counter()
    rec = sched.step()
    w = time.perf_counter() - s
    d = {k: acc[k] - before.get(k, 0.0) for k in acc}
    ticks.append({"wall": w, "rows": len(rec.rows) if rec else 0, "positions": rec.positions_fed if rec else 0,
                  **d})
wall = time.perf_counter() - t0; cpu = time.process_time() - c0
res = [h.result() for h in handles]
tokens = sum(len(r.token_ids) for r in res)
print(f"ratio 8 clients K=0 / 1 client K=4: {(tokens / wall) / (one['tokens'] / one['wall_s']):.2f}x")
print(f"{CLIENTS} clients x {MAX_TOKENS} K=0: {tokens} tokens in {wall:.2f} s wall, {cpu:.2f} CPU s, "
      f"{tokens / wall:.2f} tok/s, {len(ticks)} ticks, prompts {[r.usage.prompt_tokens for r in res]}", flush=True)

def summarize(sel, label):
    if not sel:
        return
    n = len(sel)
    keys = ["wall", "verify_batch", "feed_many", "model forward", "row-wise attention", "packed cache update", "mask",
            "decide", "pending (sync)", "check", "generation.plan", "generation.apply"]
    print(f"\n{label}: {n} ticks, rows/tick {sum(x['rows'] for x in sel) / n:.2f}, positions/tick "
          f"{sum(x['positions'] for x in sel) / n:.1f}")
    for k in keys:
        v = [x.get(k, 0.0) for x in sel]
        print(f"  {k:22s} total {sum(v):7.3f} s  mean {1e3 * sum(v) / n:7.2f} ms  median {1e3 * sorted(v)[n // 2]:7.2f} ms")
    out = [x["wall"] - x.get("verify_batch", 0) for x in sel]
    vb_out = [x.get("verify_batch", 0) - x.get("feed_many", 0) for x in sel]
    fm_out = [x.get("feed_many", 0) - x.get("model forward", 0) for x in sel]
    mf_out = [x.get("model forward", 0) - x.get("row-wise attention", 0) - x.get("packed cache update", 0) for x in sel]
    for k, v in (("tick outside verify", out), ("verify outside feed_many", vb_out),
                 ("feed_many outside model", fm_out), ("model minus attn/update", mf_out)):
        print(f"  {k:22s} total {sum(v):7.3f} s  mean {1e3 * sum(v) / n:7.2f} ms")

decode = [x for x in ticks if x["positions"] and x["positions"] == x["rows"]]
other = [x for x in ticks if not (x["positions"] and x["positions"] == x["rows"])]
summarize(ticks, "all ticks")
summarize(decode, "decode ticks (positions == rows)")
summarize(other, "prefill / mixed ticks")
print("\nprefill/mixed ticks (rows, positions, wall ms):", [(x["rows"], x["positions"], round(1e3 * x["wall"], 1)) for x in other])
by_rows = collections.defaultdict(list)
for x in decode:
    by_rows[x["rows"]].append(x["model forward"])
print("decode model forward by rows (count, median ms, min ms):",
      {r: (len(v), round(1e3 * sorted(v)[len(v) // 2], 1), round(1e3 * min(v), 1)) for r, v in sorted(by_rows.items())})
dw = [x["wall"] for x in decode]
print("decode tick wall per third of the run (median ms):",
      [round(1e3 * sorted(p)[len(p) // 2], 1) for p in (dw[:len(dw) // 3], dw[len(dw) // 3:2 * len(dw) // 3], dw[2 * len(dw) // 3:]) if p])
Path(ROOT / "docs/bench/batching/batchfwd12/e2e-ticks.json").write_text(json.dumps(ticks))
print("load mid", open("/proc/loadavg").read().strip(), flush=True)

# profiler over PROF_TICKS decode ticks of a fresh group
if PROF_TICKS:
    from torch.profiler import profile, ProfilerActivity
    prefix_warm(engine)
    sched = BatchScheduler(engine, batched=True, max_batch_positions=128)
    handles = [sched.submit(GenerationRequest(messages=[{"role": "user", "content": c}], max_tokens=64,
                                              speculation={"proposer": "draft", "k": 0}), tenant=tn)
               for tn, c in _prompts(CLIENTS)]
    while True:
        rec = sched.step()
        if rec and rec.positions_fed == len(rec.rows) == CLIENTS:
            break
    for _ in range(3):
        sched.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(PROF_TICKS):
            sched.step()
    while not sched.idle:
        sched.step()
    print(f"\ntorch.profiler over {PROF_TICKS} decode ticks of {CLIENTS} rows (self CPU time, per tick = / {PROF_TICKS})")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))

# A/B, interleaved in this process: 8 clients x AB_TOKENS at K=0, arms alternate, order reversed every other round.
# "main": row-wise attention and the packed cache update as on main (their source from git), checked appends.
import subprocess, types
from specdec.engine import kv_store
model.forward = orig_forward
vf.feed_many = kv_cache.feed_many
vf.TargetVerifier.verify_batch = orig_vb
BASE = os.environ.get("BASE", "568f940")  # main before this session's packed-forward changes
def old_module(path, name):
    src = subprocess.run(["git", "show", f"{BASE}:{path}"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    m = types.ModuleType(name)
    m.__file__ = path
    sys.modules[name] = m
    exec(compile(src, path, "exec"), m.__dict__)
    return m
old_inv = old_module("specdec/engine/invariant.py", "old_invariant")
old_kvc = old_module("specdec/engine/kv_cache.py", "old_kv_cache")
new_update = kv_cache._PackedCacheView.update.__wrapped__ if hasattr(kv_cache._PackedCacheView.update, "__wrapped__") else None
import importlib
src_new = (ROOT / "specdec/engine/kv_cache.py").read_text()
new_kvc = types.ModuleType("new_kv_cache"); sys.modules["new_kv_cache"] = new_kvc; exec(compile(src_new, "kv_cache.py", "exec"), new_kvc.__dict__)
AB_ROUNDS = int(os.environ.get("AB_ROUNDS", 2))
AB_TOKENS = int(os.environ.get("AB_TOKENS", 32))
arms = {"main (" + BASE + ")": (False, old_inv.rowwise_attention, old_kvc._PackedCacheView.update, 0),
        "new": (True, invariant.rowwise_attention, new_kvc._PackedCacheView.update, 0),
        "new + row worker": (True, invariant.rowwise_attention, new_kvc._PackedCacheView.update, 8)}
outs = {}
print(f"\nA/B: {CLIENTS} clients x {AB_TOKENS} tokens K=0, {AB_ROUNDS} rounds", flush=True)
for rnd in range(AB_ROUNDS):
    names = list(arms) if rnd % 2 == 0 else list(arms)[::-1]
    for name in names:
        if time.perf_counter() - T0_ALL > 265:
            print("time guard: A/B stopped", flush=True)
            break
        fast, attn, upd, worker = arms[name]
        kv_store.FAST_APPEND = fast
        AttentionInterface.register(invariant.ATTENTION_NAME, attn)
        kv_cache._PackedCacheView.update = upd
        invariant.ROW_WORKER_MIN_ROWS = worker
        old_inv.ROW_WORKER_MIN_ROWS = worker
        l0 = os.getloadavg()[0]
        g = run_group(engine, _prompts(CLIENTS), batched=True, k=0, proposer="draft", max_tokens=AB_TOKENS, budget=128)
        same = outs.setdefault("ref", g["outputs"]) == g["outputs"]
        print(f"round {rnd} {name:20s}: {g['tokens'] / g['wall_s']:6.2f} tok/s ({g['tokens']} tokens in {g['wall_s']:.2f} s, "
              f"{g['cpu_s']:.2f} CPU s; load {l0:.1f}) outputs equal to the first arm's: {same}", flush=True)
kv_store.FAST_APPEND = True
invariant.ROW_WORKER_MIN_ROWS = 0
print("load after", open("/proc/loadavg").read().strip(), time.strftime("%H:%M:%S", time.gmtime()), flush=True)
