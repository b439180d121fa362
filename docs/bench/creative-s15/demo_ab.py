"""Demo pair A/B of the creative prompt's K = 0 path, one process, interleaved (run under the heavy lock).

Loads the pair as ``specdec bench --formats w8a8 --draft-vocab-subset 65536 --threads 1`` does
(:func:`benchmarks.inprocess.load_models`), encodes poem-sea with the bench's chat template, and
times (``time.process_time`` around the call only, after one untimed call of each arm), per round
in a rotated order:

- ``hf``: the bench's "target alone": transformers' ``generate`` (same kwargs as the bench);
- ``ours``: our plain loop through the engine, lean target decode off (main before this change);
- ``ours_lean``: the same with the lean one-position target forward (this change's default);
- ``adaptive``: the bench's ours-adaptive-w4 arm as it runs (the controller taught by the four
  creative warm-up requests, deep-copied per run; decide + run timed), lean on.

usage: python demo_ab.py [rounds]
"""
import argparse, copy, statistics, sys, time

import torch

from benchmarks.inprocess import load_models
from benchmarks.inprocess_args import add_bench_arguments, resolve_args
from benchmarks.inprocess_adaptive import AdaptiveState, run_adaptive
from benchmarks.inprocess_prompts import chat_request, select_prompts
from specdec.control.adaptive import run_timed
from specdec.engine.engine import SpeculativeEngine
from specdec.models import lean_decode
from specdec.request import GenerationRequest

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
a = resolve_args(add_bench_arguments(argparse.ArgumentParser()).parse_args(
    ["--draft-vocab-subset", "65536", "--threads", "1", "--skip-hf"]))
torch.set_num_threads(1)
t0 = time.perf_counter()
import os
if os.environ.get("MIMIC"):  # a dry run of this script on a small folder (not the demo pair)
    from specdec.models.loader import load_model
    from specdec.models.spec import HFModelSpec
    target = load_model(HFModelSpec(kind="hf", path=os.environ["MIMIC"]), weight_format="w8a8")
    draft = load_model(HFModelSpec(kind="hf", path=os.environ["MIMIC"]), weight_format="w8a8")
else:
    target, draft, _ = load_models(a, "w8a8")
print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
eng = SpeculativeEngine(target, draft, lean_target=False)
lean_decode.uninstall(target.model)
p = [q for q in select_prompts(["poem-sea"])][0]
P = eng.encode(chat_request(p))
N = 32
eos = target.eos_token_ids
pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else eos[0]


def hf():
    ids = torch.tensor([P])
    out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                do_sample=False, eos_token_id=eos, pad_token_id=pad)
    return out[0, len(P):].tolist(), None


def _ours(lean):
    if lean:
        lean_decode.install(target.model)
    try:
        req = GenerationRequest(prompt_token_ids=P, max_tokens=N, speculation={"proposer": "none", "k": 0})
        t = run_timed(eng.start(req))
        return t.result.token_ids, t
    finally:
        lean_decode.uninstall(target.model)


state = AdaptiveState(eng, lambda text: eng.encode(GenerationRequest(messages=[{"role": "user", "content": text}],
                                                                     max_tokens=1)))


def adaptive():
    lean_decode.install(target.model)
    try:
        ctl = state.controller(4, "creative", N, 0.4)
        t, d = run_adaptive(eng, ctl, "creative", P, N, 0.4)
        return t.result.token_ids, t
    finally:
        lean_decode.uninstall(target.model)


fns = {"hf": hf, "ours": lambda: _ours(False), "ours_lean": lambda: _ours(True), "adaptive": adaptive}
with torch.inference_mode():
    ref = None
    for name, f in fns.items():  # untimed warm-up call of each (teaches the adaptive controller too)
        ids, _ = f()
        ref = ids if ref is None else ref
        print(f"warm {name}: identical to hf: {ids == ref}", flush=True)
    T = {k: [] for k in fns}
    V = {k: [] for k in fns}
    K = {}
    names = list(fns)
    for r in range(ROUNDS):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            c0 = time.process_time()
            ids, t = fns[name]()
            T[name].append(time.process_time() - c0)
            assert ids == ref, (name, ids, ref)
            if t is not None:
                V[name].append(t.result.stats.verify_time_s)
                K[name] = dict(t.result.stats.k_counts)
        print(f"round {r}: " + ", ".join(f"{k} {T[k][-1]:.3f}" for k in names), flush=True)
for k in names:
    v = T[k]
    print(f"{k:9s} CPU s / {N} tokens: median {statistics.median(v):.3f} min {min(v):.3f} {[round(x, 3) for x in v]}"
          + (f"  verify wall median {statistics.median(V[k]):.3f}" if V[k] else "") + (f" K {K.get(k)}" if k in K else ""))
for k in names[1:]:
    rs = [h / o for h, o in zip(T["hf"], T[k])]
    print(f"{k:9s} x target alone (hf time / its time) per round {[round(x, 3) for x in rs]} median {statistics.median(rs):.3f}")
