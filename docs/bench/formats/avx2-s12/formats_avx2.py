"""Per weight format on this AVX2-only CPU: the demo target and draft loaded by the engine's own
loader (specdec.models.loader.load_model, invariant forward as served: on for every format but
float32), warm cache. One format per process (its RSS alone).

usage: python formats_avx2.py FORMAT      (run_avx2.sh runs every format under the heavy lock)
env: REPS (default 3), MS (default 1,2,3,5,9), CAP_S (a forward slower than this: one rep, no larger M; default 4)

Prints one JSON line: load_s and RSS after the target, target forward median seconds per M new
positions on a 64-token prefilled cache (cropped back after each) at 1 and 2 threads, the linear
row plans make_invariant measured (or the error), a bitwise check that a 5-position block's logits
equal five one-position forwards', the draft's load_s and one-position step median (1 and 2
threads), and RSS with both loaded.
"""
import gc, json, logging, os, statistics, sys, time, warnings
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch
from transformers import DynamicCache
from specdec.models.loader import load_model
from specdec.models.spec import DemoModelSpec, parse_model_spec
SPEC = {r: parse_model_spec(os.environ[f"SPEC_{r.upper()}"]) if os.environ.get(f"SPEC_{r.upper()}") else DemoModelSpec(role=r)
        for r in ("target", "draft")}  # env SPEC_TARGET / SPEC_DRAFT: other specs (a tiny model to check the script)

fmt = sys.argv[1]
REPS = int(os.environ.get("REPS", "3"))
MS = [int(m) for m in os.environ.get("MS", "1,2,3,5,9").split(",")]
CAP = float(os.environ.get("CAP_S", "4"))
THREADS = [int(t) for t in os.environ.get("THREADS", "1,2").split(",")]  # env THREADS: thread counts timed
SKIP_TARGET = os.environ.get("SKIP_TARGET") == "1"  # env SKIP_TARGET=1: the draft only
SKIP_DRAFT = os.environ.get("SKIP_DRAFT") == "1"  # env SKIP_DRAFT=1: the target only


def rss_gib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return round(int(line.split()[1]) / 2**20, 2)


def plans(model):
    out = {}
    for m in model.modules():
        p = getattr(m, "_specdec_plan", None)
        if p is not None:
            out[f"{m.in_features}x{m.out_features}"] = [p.min_rows, p.max_rows if p.max_rows < 1 << 40 else "unchunked"]
    return out


def timed_forwards(model, ids, ms, threads):
    torch.set_num_threads(threads)
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([ids[:64]]), past_key_values=cache, use_cache=True)
    res = {}
    for m in ms:
        new = torch.tensor([ids[64:64 + m]])
        ts = []
        for r in range(REPS):
            t0 = time.perf_counter()
            model(input_ids=new, past_key_values=cache, use_cache=True)
            ts.append(time.perf_counter() - t0)
            cache.crop(-m)
            if ts[-1] > CAP:
                break
        res[m] = round(statistics.median(ts), 4)
        if ts[-1] > CAP:
            break
    return res


def block_equals_steps(model, ids):
    """logits of 5 positions in one forward == the same 5 one by one (bitwise)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([ids[:64]]), past_key_values=cache, use_cache=True)
    block = model(input_ids=torch.tensor([ids[64:69]]), past_key_values=cache, use_cache=True).logits[0]
    cache.crop(-5)
    steps = torch.cat([model(input_ids=torch.tensor([[i]]), past_key_values=cache, use_cache=True).logits[0]
                       for i in ids[64:69]])
    return bool(torch.equal(block, steps)), float((block.float() - steps.float()).abs().max())


out = {"fmt": fmt, "load_before": open("/proc/loadavg").read().split()[0]}
with torch.inference_mode():
    torch.set_num_threads(2)
    text = open(os.path.join(os.path.dirname(__file__), "..", "scripts", "text_code.py.txt")).read()[:4000]
    if not SKIP_TARGET:
        t0 = time.perf_counter()
        tgt = load_model(SPEC["target"], weight_format=fmt)
        out["target_load_s"] = round(time.perf_counter() - t0, 1)
        out["target_cache"] = tgt.quant_cache
        out["target_invariant"] = tgt.invariant
        out["target_rss_gib"] = rss_gib()
        out["target_plans"] = plans(tgt.model)
        ids = tgt.tokenizer.encode(text)[:80]
        for th in THREADS:
            out[f"target_fwd_s_{th}t"] = timed_forwards(tgt.model, ids, MS, th)
            print(json.dumps({"partial": fmt, f"t{th}": out[f"target_fwd_s_{th}t"]}), flush=True)
        torch.set_num_threads(2)
        if tgt.invariant:
            out["target_block5_eq_steps"] = block_equals_steps(tgt.model, ids)
    if SKIP_DRAFT:
        print(json.dumps(out), flush=True)
        sys.exit(0)
    t0 = time.perf_counter()
    dr = load_model(SPEC["draft"], weight_format=fmt)
    out["draft_load_s"] = round(time.perf_counter() - t0, 1)
    out["draft_cache"] = dr.quant_cache
    out["pair_rss_gib" if not SKIP_TARGET else "draft_rss_gib"] = rss_gib()
    if SKIP_TARGET:
        ids = dr.tokenizer.encode(text)[:80]
    for th in THREADS:
        REPS = 7
        out[f"draft_step_s_{th}t"] = timed_forwards(dr.model, ids, [1], th)[1]
    if dr.invariant:
        torch.set_num_threads(2)
        out["draft_block5_eq_steps"] = block_equals_steps(dr.model, ids)
out["load_after"] = open("/proc/loadavg").read().split()[0]
print(json.dumps(out), flush=True)
