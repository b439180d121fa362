"""Where a spec run's CPU seconds go: every target and draft forward timed by positions (process CPU), the rest = the loop (spec11).
usage: PYTHONPATH=. flock -w 1800 /tmp/specdec-heavy.lock timeout 330 python docs/bench/formats/bench-s11/spec11/breakdown.py
env: PROMPT (code-prime), TOKENS (128), CONFIGS (K:c,... default 4:0.4,8:0.4), ROUNDS (2), SUBSET (65536), FMT (w8a8)
Loads the pair as specdec bench --formats w8a8 --draft-vocab-subset 65536 does, one thread; target alone = transformers generate."""
import os, sys, time, argparse, collections
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch
torch.set_num_threads(1)
from benchmarks.inprocess import load_models
from benchmarks.inprocess_prompts import PROMPTS
from specdec.request import GenerationRequest
from specdec.engine.engine import SpeculativeEngine
from specdec.control.adaptive import run_timed

subset = int(os.environ.get("SUBSET", "65536")) or None
ns = argparse.Namespace(target="demo", draft="demo", draft_vocab_subset=subset, hf=[], skip_hf=True,
                        device="cpu", draft_vocab_table=None)
t0 = time.time()
target, draft, _ = load_models(ns, os.environ.get("FMT", "w8a8"))
print("loaded", time.time() - t0, "draft vocab_subset", draft.vocab_subset is not None, flush=True)
eng = SpeculativeEngine(target, draft)
rec = collections.defaultdict(lambda: [0, 0.0])
ON = [False]
def wrap(model, name):
    orig = model.forward
    def fwd(*a, **k):
        if not ON[0]:
            return orig(*a, **k)
        ids = k.get("input_ids", a[0] if a else None)
        n = ids.shape[-1] if ids is not None else -1
        c0 = time.process_time()
        out = orig(*a, **k)
        key = (name, n if n <= 9 else "prefill")
        rec[key][0] += 1; rec[key][1] += time.process_time() - c0
        return out
    model.forward = fwd
wrap(target.model, "target"); wrap(draft.model, "draft")

def ids_of(name):
    p = next(p for p in PROMPTS if p["name"] == name)
    return eng.encode(GenerationRequest(messages=[{"role": "user", "content": p["content"]}], max_tokens=1))

def spec(ids, tokens, k, c):
    req = GenerationRequest(prompt_token_ids=list(ids), max_tokens=tokens,
                            speculation={"proposer": "draft" if k else "none", "k": k, "draft_min_confidence": c})
    c0 = time.process_time()
    timed = run_timed(eng.start(req))
    return timed, time.process_time() - c0

def alone(ids, tokens):
    x = torch.tensor([ids])
    c0 = time.process_time()
    with torch.inference_mode():
        out = target.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False,
                                    eos_token_id=target.eos_token_ids, pad_token_id=target.eos_token_ids[0])
    return out[0, len(ids):].tolist(), time.process_time() - c0

ids = ids_of(os.environ.get("PROMPT", "code-prime"))
print("prompt tokens", len(ids))
tokens = int(os.environ.get("TOKENS", "128"))
configs = [tuple(float(v) if "." in v else int(v) for v in s.split(":")) for s in os.environ.get("CONFIGS", "4:0.4,8:0.4").split(",")]
with torch.inference_mode():
    alone(ids, tokens)
    for k, c in configs:
        spec(ids, tokens, k, c)
for rnd in range(int(os.environ.get("ROUNDS", "2"))):
    rec.clear(); ON[0] = True
    ref, ca = alone(ids, tokens)
    ON[0] = False
    print(f"round {rnd} alone cpu {ca:.3f}", {str(k): (v[0], round(v[1], 3)) for k, v in sorted(rec.items(), key=str)})
    for k, c in configs:
        rec.clear(); ON[0] = True
        timed, cs = spec(ids, tokens, k, c)
        ON[0] = False
        s = timed.result.stats
        fw = sum(v[1] for v in rec.values())
        print(f"round {rnd} K{k} c{c} cpu {cs:.3f} ratio {ca/cs:.3f} same {timed.result.token_ids == ref} steps {s.steps} "
              f"prop {s.proposed} acc {s.accepted} draft_s {s.draft_time_s:.3f} verify_s {s.verify_time_s:.3f} "
              f"fwd {fw:.3f} other {cs-fw:.3f}", {str(kk): (v[0], round(v[1], 3), round(v[1]/v[0]*1000, 1)) for kk, v in sorted(rec.items(), key=str)}, flush=True)
