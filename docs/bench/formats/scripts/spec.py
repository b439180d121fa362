"""Demo pair per format: target alone vs speculation (draft K=4 and K=8 with early stop 0.4), greedy,
32 new tokens of a code prompt: tokens/s (wall and CPU) and identity with the same format's target alone."""
import sys, time, json
import specdec  # first: silences torchao's import warnings
import transformers; transformers.utils.logging.disable_progress_bar()
import torch
from specdec.engine.engine import SpeculativeEngine
from specdec.models.loader import load_pair
from specdec.models.spec import ModelPairSpec
from specdec.request import GenerationRequest
torch.set_num_threads(2)
fmts, N = sys.argv[1].split(","), int(sys.argv[2])
msgs = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
ref_fp = None
for fmt in fmts:
    t0 = time.perf_counter()
    target, draft = load_pair(ModelPairSpec.demo(), weight_format=fmt)
    load_s = time.perf_counter() - t0
    eng = SpeculativeEngine(target, draft)
    eng.generate(GenerationRequest(messages=msgs, max_tokens=2, speculation={"proposer": "none", "k": 0}))
    out = {"fmt": fmt, "load_s": round(load_s, 1)}
    base = None
    for name, spec in (("target", {"proposer": "none", "k": 0}), ("draft-k4", {"proposer": "draft", "k": 4}),
                       ("draft-k8-c0.4", {"proposer": "draft", "k": 8, "draft_min_confidence": 0.4})):
        c0, w0 = time.process_time(), time.perf_counter()
        res = eng.generate(GenerationRequest(messages=msgs, max_tokens=N, ignore_eos=True, speculation=spec))
        w, c = time.perf_counter() - w0, time.process_time() - c0
        if base is None:
            base = res.token_ids
        if ref_fp is None:
            ref_fp = res.token_ids
        out[name] = {"tok_s": round(len(res.token_ids) / w, 2), "tok_s_cpu": round(len(res.token_ids) / c, 2),
                     "identical": res.token_ids == base, "acc": round(res.stats.accepted / max(1, res.stats.proposed), 2)}
        if name == "target":
            out["same_prefix_as_first_format"] = next((i for i, (a, b) in enumerate(zip(res.token_ids, ref_fp)) if a != b), len(ref_fp))
        print(json.dumps(out), flush=True)
    del eng, target, draft
