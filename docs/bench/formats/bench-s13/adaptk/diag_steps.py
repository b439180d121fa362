"""Diagnostic: the in-process adaptive controller's decisions and every step it runs on code-prime
(w8a8 pair, 65,536-id draft subset, early stop 0.4, one thread), cold and taught by W code requests.

Run under the heavy lock from the repository root:
``.venv/bin/python docs/bench/formats/bench-s13/adaptk/diag_steps.py TOKENS[,TOKENS] [W] [OUT.json]``
Per timed request: the decision (K, reason, α̂, predicted speedup, candidates), the per-step K asked
(GuardedK.ks), per step (K run, accepted, draft s, verify s), the request's CPU seconds; and the
target alone's CPU seconds for the same prompt (our plain loop, K = 0), before and after.
"""
import copy
import json
import sys
import time

import torch

from benchmarks.inprocess_adaptive import POLICY, apply_decision, new_controller, record, warm_prompts
from benchmarks.inprocess_prompts import chat_request, select_prompts
from specdec.control.adaptive import run_timed
from specdec.engine.engine import SpeculativeEngine
from specdec.models.loader import load_pair
from specdec.models.spec import ModelPairSpec, parse_model_spec
from specdec.request import GenerationRequest

tokens_list = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "32").split(",")]
warm = int(sys.argv[2]) if len(sys.argv) > 2 else 4
out_path = sys.argv[3] if len(sys.argv) > 3 else None
torch.set_num_threads(1)
pair = ModelPairSpec(target=parse_model_spec("demo:target"), draft=parse_model_spec("demo:draft"))
target, draft = load_pair(pair, device="cpu", weight_format="w8a8", draft_vocab_subset=65536)
engine = SpeculativeEngine(target, draft)


def enc(text):
    return engine.encode(GenerationRequest(messages=[{"role": "user", "content": text}], max_tokens=1))


class StepLog:
    def __init__(self, gen):
        self.gen, self.rows, self.prev = gen, [], None

    def step(self):
        s = self.gen.stats
        before = (s.steps, s.proposed, s.accepted, s.draft_time_s, s.verify_time_s)
        chunk = self.gen.step()
        after = (s.steps, s.proposed, s.accepted, s.draft_time_s, s.verify_time_s)
        if after[0] == before[0] + 1:
            self.rows.append([after[1] - before[1], after[2] - before[2], round(after[3] - before[3], 4),
                              round(after[4] - before[4], 4)])
        return chunk

    def __getattr__(self, name):
        return getattr(self.gen, name)


def run(ctl, ids, tokens, timed_label):
    base = GenerationRequest(prompt_token_ids=list(ids), max_tokens=tokens,
                             speculation={"proposer": "draft", "k": POLICY["k_max"], "draft_min_confidence": 0.4})
    c0, w0 = time.process_time(), time.perf_counter()
    d = ctl.decide("code", "draft", POLICY, requested_k=POLICY["k_max"], tokens=tokens)
    req, k = apply_decision(base, d)
    if d.k > 0:
        k = ctl.guarded_k("code", "draft", d)
    gen = engine.start(req, k=k)
    if d.k > 0:
        k.attach(gen.stats)
    log = StepLog(gen)
    timed = run_timed(log)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    record(ctl, "code", timed)
    row = {"label": timed_label, "tokens": timed.tokens, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
           "decision": {"k": d.k, "reason": d.reason, "alpha": round(d.alpha, 3), "best_k": d.best_k,
                        "pred": round(d.predicted_speedup, 3), "probe": d.probe,
                        "cands": [(c.k, round(c.expected_tokens, 2), round(c.step_time_s * 1e3, 1), round(c.speedup, 3))
                                  for c in d.candidates]},
           "asked": list(getattr(k, "ks", [])), "steps": log.rows,
           "k_counts": {int(a): b for a, b in timed.result.stats.k_counts.items()},
           "hazards": [round(h, 3) for h in ctl.stop_hazards("code", "draft", 8)],
           "cost": ctl.cost_model("draft").snapshot(), "ids": list(timed.result.token_ids)}
    print(json.dumps({k2: v for k2, v in row.items() if k2 not in ("cost", "ids")}), flush=True)
    return row


def alone(ids, tokens):
    req = GenerationRequest(prompt_token_ids=list(ids), max_tokens=tokens, speculation={"proposer": "draft", "k": 0})
    c0 = time.process_time()
    res = engine.start(req).run()
    cpu = time.process_time() - c0
    print(json.dumps({"label": "target alone", "tokens": len(res.token_ids), "cpu_s": round(cpu, 3)}), flush=True)
    return {"cpu_s": cpu, "ids": list(res.token_ids)}


out = {}
with torch.inference_mode():
    prime = engine.encode(chat_request(select_prompts(["code-prime"])[0]))
    for tokens in tokens_list:
        run(new_controller(), enc(warm_prompts("code")[0]), tokens, "warm-up (discarded)")
        a0 = alone(prime, tokens)
        cold = run(new_controller(), prime, tokens, f"cold {tokens}")
        ctl = new_controller()
        for i, text in enumerate(warm_prompts("code")[:warm]):
            run(ctl, enc(text), tokens, f"teach {i + 1}/{warm}")
        print("taught cost model:", json.dumps(ctl.cost_model("draft").snapshot()), flush=True)
        print("taught acceptance:", json.dumps(ctl.estimator.snapshot(("code", "draft")).as_dict()), flush=True)
        taught = run(copy.deepcopy(ctl), prime, tokens, f"taught w{warm} {tokens}")
        a1 = alone(prime, tokens)
        for name, r in (("cold", cold), ("taught", taught)):
            print(f"{tokens} tokens {name}: cpu {r['cpu_s']:.2f} s vs target alone {a0['cpu_s']:.2f} / {a1['cpu_s']:.2f}"
                  f" -> {a0['cpu_s'] / r['cpu_s']:.2f}x / {a1['cpu_s'] / r['cpu_s']:.2f}x; identical {r['ids'] == a0['ids']}",
                  flush=True)
        out[tokens] = {"alone": [a0["cpu_s"], a1["cpu_s"]], "cold": cold, "taught": taught,
                       "learned": ctl.export_learned()}
if out_path:
    json.dump(out, open(out_path, "w"), indent=1, default=str)
