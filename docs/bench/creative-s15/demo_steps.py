"""Demo target, where a K = 0 step's time goes: transformers' generate (the bench's "target
alone") against our plain loop, with and without the lean target forward. Run under the heavy lock.

Loads only the w8a8 demo target (as the bench's pair loads it), encodes poem-sea with the chat
template, and per round (rotated order) runs each arm once for 32 tokens, with the model's
forward wrapped by a timer (process CPU seconds per forward call): per arm the whole call's CPU
seconds, the forwards' sum (the first one is the prompt's prefill) and the rest (the loop: for
generate its logits processors, stopping criteria and input preparation; for ours the session,
the decision and the output assembler).

usage: python demo_steps.py [rounds]
"""
import statistics, sys, time

import torch

from specdec.control.adaptive import run_timed
from specdec.engine.engine import SpeculativeEngine
from specdec.models import lean_decode
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec
from specdec.request import GenerationRequest
from benchmarks.inprocess_prompts import chat_request, select_prompts

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
torch.set_num_threads(1)
target = load_model(parse_model_spec("demo:target"), weight_format="w8a8")
eng = SpeculativeEngine(target, None, lean_target=False)
P = eng.encode(chat_request(select_prompts(["poem-sea"])[0]))
N = 32
eos = target.eos_token_ids
pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else eos[0]
model = target.model
fwd_times: list[float] = []


def timed_forward():
    inner = model.forward

    def forward(*args, **kwargs):
        c0 = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            fwd_times.append(time.process_time() - c0)

    model.forward = forward


def hf():
    ids = torch.tensor([P])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                         eos_token_id=eos, pad_token_id=pad)
    return out[0, len(P):].tolist()


def ours():
    req = GenerationRequest(prompt_token_ids=P, max_tokens=N, speculation={"proposer": "none", "k": 0})
    return run_timed(eng.start(req)).result.token_ids


ARMS = {"hf": (hf, False), "ours": (ours, False), "ours_lean": (ours, True)}


def run(name):
    f, lean = ARMS[name]
    if lean:
        lean_decode.install(model)
    else:
        lean_decode.uninstall(model)
    timed_forward()  # on top of the lean wrapper when installed
    fwd_times.clear()
    try:
        c0 = time.process_time()
        ids = f()
        total = time.process_time() - c0
    finally:
        del model.forward  # drops the timer (and the lean wrapper, re-installed below when needed)
        model._specdec_lean_decode = False
    return ids, total, list(fwd_times)


with torch.inference_mode():
    ref = None
    for name in ARMS:
        ids, total, f = run(name)
        ref = ids if ref is None else ref
        print(f"warm {name}: {len(f)} forwards, identical to hf: {ids == ref}", flush=True)
    R = {k: [] for k in ARMS}
    names = list(ARMS)
    for r in range(ROUNDS):
        for name in names[r % 3:] + names[: r % 3]:
            ids, total, f = run(name)
            assert ids == ref, name
            R[name].append((total, f[0], sum(f[1:]), total - sum(f)))
        print(f"round {r} " + "  ".join(f"{k} {R[k][-1][0]:.3f}" for k in names), flush=True)
print(f"prompt {len(P)} tokens, {N} new; CPU s: median (min) over {ROUNDS} rounds")
print("| arm | whole call | prefill forward | 31 decode forwards | per decode forward | outside forwards |")
print("|---|---|---|---|---|---|")
for k in names:
    cols = list(zip(*R[k]))
    med = [statistics.median(c) for c in cols]
    mn = [min(c) for c in cols]
    print(f"| {k} | {med[0]:.3f} ({mn[0]:.3f}) | {med[1]:.3f} ({mn[1]:.3f}) | {med[2]:.3f} ({mn[2]:.3f}) | "
          f"{med[2] / (N - 1) * 1e3:.1f} ms ({mn[2] / (N - 1) * 1e3:.1f}) | {med[3]:.3f} ({mn[3]:.3f}) |")
for k in names[1:]:
    rs = [h[0] / o[0] for h, o in zip(R["hf"], R[k])]
    print(f"{k}: hf whole / its whole per round {[round(x, 3) for x in rs]}, median {statistics.median(rs):.3f}")
