"""Tiny-model A/B of the K = 0 path: transformers' generate (the bench's "target alone") against
our plain loop (the adaptive arm at K = 0), same loaded model, same process.

usage: python tiny_ab.py [format] [rounds] [profile]
"""
import cProfile, pstats, statistics, sys, time
from pathlib import Path

import torch

from specdec.control.adaptive import run_timed
from specdec.engine.engine import SpeculativeEngine
from specdec.models.loader import load_model
from specdec.models.spec import HFModelSpec
from specdec.request import GenerationRequest
from specdec.testing.tiny import build_tiny_model

torch.set_num_threads(1)
FMT = sys.argv[1] if len(sys.argv) > 1 else "w8a8"
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
root = Path("/tmp/creative-s15-models")
t = root / "t"
if not t.exists():
    build_tiny_model(t, seed=0, max_positions=1024, vocab_rows=151936, hidden_size=256, num_layers=4)
target = load_model(HFModelSpec(kind="hf", path=t), weight_format=FMT)
eng = SpeculativeEngine(target, None)
P = [5, 9, 13, 17, 21, 7, 3, 11, 2] * 5
N = 32


def hf():
    with torch.inference_mode():
        ids = torch.tensor([P])
        out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                    min_new_tokens=N, do_sample=False, pad_token_id=target.tokenizer.pad_token_id)
    return out[0, len(P):].tolist()


def ours():
    req = GenerationRequest(prompt_token_ids=P, max_tokens=N, ignore_eos=True, speculation={"proposer": "none", "k": 0})
    with torch.inference_mode():
        return run_timed(eng.start(req)).result.token_ids


a, b = hf(), ours()
print("identical:", a == b, a[:8], b[:8])
if "profile" in sys.argv:
    for name, f in (("hf", hf), ("ours", ours)):
        pr = cProfile.Profile(); pr.enable()
        for _ in range(3):
            f()
        pr.disable()
        print("=====", name)
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    sys.exit()
T = {"hf": [], "ours": []}
fns = {"hf": hf, "ours": ours}
for r in range(ROUNDS):
    order = list(fns) if r % 2 == 0 else list(fns)[::-1]
    for name in order:
        c0 = time.process_time(); fns[name](); T[name].append((time.process_time() - c0) / N * 1e3)
for k, v in T.items():
    print(f"{FMT} {k:5s} CPU ms/token median {statistics.median(v):.3f} {[round(x, 3) for x in v]}")
