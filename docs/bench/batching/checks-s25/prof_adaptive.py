"""Where adaptive's extra time goes: one engine, arms interleaved, controller calls timed."""
import os, sys, time, functools, collections
import torch
torch.set_num_threads(2)
from benchmarks.batching import _prompts, batch_controller, run_group
from benchmarks.batching_goal import guard_of
from specdec.engine.engine import SpeculativeEngine
from specdec.models.loader import load_pair
from specdec.models.spec import ModelPairSpec, parse_model_spec
from specdec.engine.prefix_cache import enable_prefix_cache
import specdec.engine.batch as B
import specdec.engine.batch_adaptive as BA
class A: budget=128; k=4; guard=True
a=A()
target, draft = load_pair(ModelPairSpec(target=parse_model_spec("demo:target"), draft=parse_model_spec("demo:draft")), device="cpu")
engine = SpeculativeEngine(target, draft)
enable_prefix_cache(target.model, entries=8); enable_prefix_cache(draft.model, entries=8)
run_group(engine, _prompts(2), batched=True, k=4, proposer="draft", max_tokens=4, budget=128)
controller = batch_controller(a)
T = collections.defaultdict(float); N = collections.Counter()
def timed(obj, name, key):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*x, **y):
        t = time.perf_counter()
        try: return f(*x, **y)
        finally: T[key] += time.perf_counter() - t; N[key] += 1
    setattr(obj, name, w)
for n in ("decide", "step_k", "observe_row", "observe_tick"):
    timed(controller, n, n)
timed(BA.TenantGuards, "record_tick", "guard.record_tick")
B.decide_under_load = BA.decide_under_load
run_group(engine, _prompts(10)[2:], batched=True, k=4, proposer="draft", max_tokens=8, budget=128, controller=controller, guard=guard_of(a))
run_group(engine, _prompts(3)[2:], batched=True, k=4, proposer="draft", max_tokens=16, budget=128, controller=controller, guard=guard_of(a))
n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
for rnd in range(3):
    for clients, arm in ((1, "K=4"), (1, "adaptive"), (8, "K=0"), (8, "adaptive"))[::(1 if rnd % 2 == 0 else -1)]:
        T.clear(); N.clear()
        ad = arm == "adaptive"
        r = run_group(engine, _prompts(clients), batched=True, k=4 if clients == 1 or ad else 0, proposer="draft",
                      max_tokens=n, budget=128, controller=controller if ad else None, guard=guard_of(a) if ad else None)
        print(f"r{rnd} {clients} {arm:9s} {r['tok_per_s']:6.2f} tok/s wall {r['wall_s']:.3f} verify {r['verify_s_total']:.3f} draft {r['draft_s_total']:.3f} ticks {r['ticks']} K {r['k_counts']} ctl " +
              " ".join(f"{k}={T[k]*1000:.1f}ms/{N[k]}" for k in sorted(T)), flush=True)
