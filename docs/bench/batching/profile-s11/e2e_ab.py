"""End to end, in one process: 8 clients K=0 and 1 client K=4 (batching_goal's prompts, prefix cache on),
old path (DynamicLayer bf16 caches, concatenated packed keys, no row worker) vs new, alternating."""
import os, sys, time
import torch
torch.set_num_threads(2)
from specdec.engine import kv_cache, invariant, kv_store
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.prefix_cache import enable_prefix_cache
from specdec.models.loader import load_pair
from specdec.models.spec import ModelPairSpec, parse_model_spec
from benchmarks.batching import _prompts, run_group
T = int(os.environ.get("TOK", "32"))
target, draft = load_pair(ModelPairSpec(target=parse_model_spec("demo:target"), draft=parse_model_spec("demo:draft")))
for m in (target.model, draft.model):
    enable_prefix_cache(m, entries=8)
engine = SpeculativeEngine(target, draft)
def setv(arm):
    new = arm != "old"
    kv_store.GROWING_CACHE = new; kv_store.STORE_ROW_DTYPE = new; kv_cache.PACKED_PARTS = new
    invariant.ROW_WORKER_MIN_ROWS = 6 if arm == "new+worker" else 0
for arm in ("old", "new+worker"):  # warm-up: every kernel shape of both group kinds, both paths
    setv(arm)
    run_group(engine, _prompts(8), batched=True, k=0, proposer="draft", max_tokens=8, budget=128)
    run_group(engine, _prompts(1), batched=True, k=4, proposer="draft", max_tokens=8, budget=128)
outs = {}
for rnd in range(int(os.environ.get("ROUNDS", "2"))):
    order = ["old", "new", "new+worker"] if rnd % 2 == 0 else ["new+worker", "new", "old"]
    for clients, k in ((8, 0), (1, 4)):
        for new in order:
            setv(new)
            r = run_group(engine, _prompts(clients), batched=True, k=k, proposer="draft", max_tokens=T, budget=128)
            key = (clients, k)
            if key in outs:
                assert outs[key] == r["outputs"], ("outputs differ", key, new)
            outs[key] = r["outputs"]
            print(f"round {rnd} clients {clients} K={k} {new}: {r['tokens']} tok {r['wall_s']:.2f} s wall "
                  f"{r['cpu_s']:.2f} s cpu: {r['tok_per_s']:.2f} tok/s {r['tok_per_cpu_s']:.2f} tok/cpu-s load {os.getloadavg()[0]:.1f}",
                  flush=True)
