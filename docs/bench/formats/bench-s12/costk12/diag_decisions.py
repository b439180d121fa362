"""Diagnostic: what the in-process adaptive controller learns on code (128 tokens) and decides.

Run under the heavy lock from the repository root:
``.venv/bin/python docs/bench/formats/bench-s12/costk12/diag_decisions.py [tokens] [warm]``
Prints every warm-up decision, then the taught controller's cost model, acceptance counts and
candidates for code-prime, and dumps the learned state as JSON (for unit tests of the decision).
"""
import json
import sys
import time

import torch

from benchmarks.inprocess_adaptive import new_controller, record, run_adaptive, warm_prompts
from benchmarks.inprocess_prompts import chat_request, select_prompts
from specdec.engine.engine import SpeculativeEngine
from specdec.models.loader import load_pair
from specdec.models.spec import ModelPairSpec, parse_model_spec
from specdec.request import GenerationRequest

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 128
warm = int(sys.argv[2]) if len(sys.argv) > 2 else 4
torch.set_num_threads(1)
pair = ModelPairSpec(target=parse_model_spec("demo:target"), draft=parse_model_spec("demo:draft"))
target, draft = load_pair(pair, device="cpu", draft_vocab_subset=65536)
engine = SpeculativeEngine(target, draft)
enc = lambda text: engine.encode(GenerationRequest(messages=[{"role": "user", "content": text}], max_tokens=1))
ctl = new_controller()
out = {"warm": []}
with torch.inference_mode():
    for i, text in enumerate(warm_prompts("code")[:warm]):
        t0 = time.perf_counter()
        timed, d = run_adaptive(engine, ctl, "code", enc(text), tokens, 0.4)
        wall = time.perf_counter() - t0
        record(ctl, "code", timed)
        st = timed.result.stats
        row = {"k": d.k, "reason": d.reason, "alpha": round(d.alpha, 3), "best_k": d.best_k,
               "pred": round(d.predicted_speedup, 3), "wall_s": round(wall, 2), "tokens": timed.tokens,
               "k_counts": dict(st.k_counts), "costs": timed.costs.as_dict(),
               "cands": [(c.k, round(c.expected_tokens, 2), round(c.step_time_s, 4), round(c.speedup, 3)) for c in d.candidates]}
        out["warm"].append(row)
        print(json.dumps(row), flush=True)
    ids = engine.encode(chat_request(select_prompts(["code-prime"])[0]))
    d = ctl.decide("code", "draft", {"k_min": 0, "k_max": 8, "adaptive": True, "fixed_k": None}, requested_k=8)
    print("taught decision for code-prime:", d.k, d.reason, "alpha", round(d.alpha, 3), "pos", [round(a, 3) for a in d.position_alphas])
    for c in d.candidates:
        print("  K", c.k, "E[N] %.2f step %.1f ms speedup %.3f" % (c.expected_tokens, c.step_time_s * 1e3, c.speedup))
    print("cost model:", json.dumps(ctl.cost_model("draft").snapshot()))
    print("acceptance:", json.dumps(ctl.estimator.snapshot(("code", "draft")).as_dict()))
    out["learned"] = ctl.export_learned()
    out["cost"] = ctl.cost_model("draft").export_observations()
    out["acceptance"] = ctl.estimator.snapshot(("code", "draft")).as_dict()
    json.dump(out, open(f"docs/bench/formats/bench-s12/costk12/diag-{tokens}.json", "w"), indent=1)
