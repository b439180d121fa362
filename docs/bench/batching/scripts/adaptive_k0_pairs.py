"""Interleaved K=0 vs adaptive (deciding K=0) at 8 clients: per-arm verify time, forward calls/shapes, gc.

    PYTHONPATH=. python docs/bench/batching/scripts/adaptive_k0_pairs.py K0,ad,ad,K0,K0,ad 32

Arms in the given order (K0: fixed K = 0; ad: adaptive with a goodput guard, controller warmed as in
benchmarks.batching_goal; K4: fixed K = 4), one JSON line each: tokens/s, tokens per CPU s, target forward calls,
draft forward calls, mean wall and CPU s of the 8-row (1, 8) target forwards, gc collections.
Output: docs/bench/batching/inprocess-s11/k0-pairs-32tok-loaded.log."""
import gc, os, sys, time, json, collections
import torch
torch.set_num_threads(2)
from benchmarks.batching import _prompts, batch_controller, run_group
from specdec.control.goodput_guard import GoodputGuard
from specdec.engine.engine import SpeculativeEngine
from specdec.models.loader import load_pair
from specdec.models.spec import ModelPairSpec, parse_model_spec
from specdec.engine.prefix_cache import enable_prefix_cache

order = sys.argv[1].split(",")  # e.g. K0,ad,ad,K0 or K4,K0,K4,ad
n = int(sys.argv[2]) if len(sys.argv) > 2 else 32
class A: budget = 128; k = 4
target, draft = load_pair(ModelPairSpec(target=parse_model_spec("demo:target"), draft=parse_model_spec("demo:draft")))
engine = SpeculativeEngine(target, draft)
enable_prefix_cache(target.model, entries=8); enable_prefix_cache(draft.model, entries=8)
calls = collections.Counter()
fwd = collections.Counter()
def wrap(m, name):
    orig = m.forward
    def f(*a, **kw):
        ids = kw.get("input_ids", a[0] if a else None)
        calls[(name, tuple(ids.shape) if ids is not None else None)] += 1
        c0, w0 = time.process_time(), time.perf_counter()
        out = orig(*a, **kw)
        if ids is not None and tuple(ids.shape) == (1, 8):
            fwd["cpu"] += time.process_time() - c0; fwd["wall"] += time.perf_counter() - w0; fwd["n"] += 1
        return out
    m.forward = f
wrap(target.model, "T"); wrap(draft.model, "D")
gcs = []
t_gc = {}
def cb(phase, info):
    if phase == "start": t_gc["t"] = time.perf_counter()
    else: gcs.append((info["generation"], time.perf_counter() - t_gc["t"]))
gc.callbacks.append(cb)
run_group(engine, _prompts(2), batched=True, k=4, proposer="draft", max_tokens=4, budget=128)
ctl = batch_controller(A)
run_group(engine, _prompts(10)[2:], batched=True, k=4, proposer="draft", max_tokens=8, budget=128, controller=ctl, guard=GoodputGuard())
run_group(engine, _prompts(3)[2:], batched=True, k=4, proposer="draft", max_tokens=16, budget=128, controller=ctl, guard=GoodputGuard())
res = collections.defaultdict(list)
for arm in order:
    calls.clear(); gcs.clear(); fwd.clear()
    k = int(arm[1:]) if arm.startswith("K") else 4
    ad = arm == "ad"
    r = run_group(engine, _prompts(8), batched=True, k=k, proposer="draft", max_tokens=n, budget=128,
                  controller=ctl if ad else None, guard=GoodputGuard() if ad else None)
    tc = {str(s): c for (nm, s), c in sorted(calls.items(), key=lambda x: str(x)) if nm == "T"}
    dc = sum(c for (nm, s), c in calls.items() if nm == "D")
    g = collections.Counter(); gt = collections.Counter()
    for gen, dt in gcs: g[gen] += 1; gt[gen] += dt
    line = dict(arm=arm, tok_s=round(r["tok_per_s"], 2), tok_cpu=round(r["tok_per_cpu_s"], 2), wall=round(r["wall_s"], 3),
                verify=round(r["verify_s_total"], 3), draft=round(r["draft_s_total"], 3), ticks=r["ticks"], k=r["k_counts"],
                by_rows={k2: (v["forwards"], round(v["mean_verify_s"], 4)) for k2, v in r["decode_forwards_by_rows"].items()},
                target_calls=sum(tc.values()), draft_calls=dc, gc={k2: (g[k2], round(gt[k2], 3)) for k2 in g},
                load=os.getloadavg()[0], fwd8_wall=round(fwd['wall']/max(1,fwd['n']),4), fwd8_cpu=round(fwd['cpu']/max(1,fwd['n']),4), fwd8_n=fwd['n'])
    res[arm].append(line)
    print(json.dumps(line), flush=True)

import statistics
for arm, ls in res.items():
    print(arm, "median tok/s", statistics.median(l["tok_s"] for l in ls), "tok/cpu", statistics.median(l["tok_cpu"] for l in ls),
          "fwd8 wall", statistics.median(l["fwd8_wall"] for l in ls), "fwd8 cpu", statistics.median(l["fwd8_cpu"] for l in ls))
