"""A/B of the K = 0 path on a "mimic" of the demo target: the demo target's config and tokenizer
(Qwen2.5-Coder-1.5B: hidden 1536, 12/2 heads, vocabulary 151,936) with LAYERS decoder layers of
random bfloat16 weights (not the demo pair: no lock needed), loaded in w8a8 through
specdec.models.loader like the bench's target. Arms, same process, interleaved:

- hf: transformers' generate on the loaded model (the bench's "target alone");
- ours: our plain loop (the adaptive arm's K = 0 path: proposer none).

usage: python mimic_ab.py [layers] [rounds] [profile|torchprof]
"""
import cProfile, json, pstats, shutil, statistics, sys, time
from pathlib import Path

import torch


from specdec.control.adaptive import run_timed
from specdec.engine.engine import SpeculativeEngine
from specdec.models.loader import load_model
from specdec.models.spec import HFModelSpec
from specdec.request import GenerationRequest

torch.set_num_threads(1)
LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
SRC = Path("/root/.cache/specdec/demo/target-bfloat16")
root = Path(f"/tmp/creative-s15-mimic{LAYERS}")
if not (root / "model.safetensors").exists():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = json.loads((SRC / "config.json").read_text())
    cfg["num_hidden_layers"] = LAYERS
    cfg["layer_types"] = cfg["layer_types"][:LAYERS]
    cfg["max_window_layers"] = LAYERS
    config = Qwen2Config(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(SRC / f, root / f)
target = load_model(HFModelSpec(kind="hf", path=root), weight_format="w8a8")
eng = SpeculativeEngine(target, None)
text = ("Write a short poem about the sea at night, with vivid images of the moon, the waves and a "
        "lonely lighthouse.")
P = eng.encode(GenerationRequest(messages=[{"role": "user", "content": text}], max_tokens=1))
N = 32
eos = target.eos_token_ids


def hf():
    ids = torch.tensor([P])
    out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(P):].tolist()


def ours_lean():
    from specdec.models.lean_decode import install, uninstall
    install(target.model)
    try:
        return ours()
    finally:
        uninstall(target.model)


def ours():
    req = GenerationRequest(prompt_token_ids=P, max_tokens=N, ignore_eos=True, speculation={"proposer": "none", "k": 0})
    return run_timed(eng.start(req)).result.token_ids


with torch.inference_mode():
    a, b, c = hf(), ours(), ours_lean()
    print("prompt", len(P), "identical:", a == b == c, a[:6], b[:6], c[:6], flush=True)
    if "profile" in sys.argv:
        for name, f in (("hf", hf), ("ours", ours)):
            pr = cProfile.Profile(); pr.enable()
            for _ in range(2):
                f()
            pr.disable()
            print("=====", name)
            pstats.Stats(pr).sort_stats("tottime").print_stats(30)
        sys.exit()
    if "torchprof" in sys.argv:
        from torch.profiler import profile, ProfilerActivity
        for name, f in (("hf", hf), ("ours", ours)):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                f()
            print("=====", name)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            with open(f"/tmp/creative-ops-{name}.txt", "w") as fh:
                for e in sorted(prof.key_averages(), key=lambda e: e.key):
                    fh.write(f"{e.key} {e.count} {e.self_cpu_time_total / 1e3:.1f}\n")
        sys.exit()
    fns = {"hf": hf, "ours": ours, "ours_lean": ours_lean}
    T = {k: [] for k in fns}
    for r in range(ROUNDS):
        order = list(fns) if r % 2 == 0 else list(fns)[::-1]
        for name in order:
            c0 = time.process_time(); fns[name](); T[name].append(time.process_time() - c0)
    for k, v in T.items():
        print(f"layers {LAYERS} {k:9s} CPU s per {N} tokens median {statistics.median(v):.3f} min {min(v):.3f} "
              f"{[round(x, 3) for x in v]}")
    for k in T:
        print(f"hf/{k} speed ratio per round (>1: faster than hf):", [round(h / o, 3) for o, h in zip(T[k], T["hf"])],
              "median", round(statistics.median([h / o for o, h in zip(T[k], T["hf"])]), 3))
