"""Session 18: what w7a8's 7-bit weights cost in quality, on the demo target, against float32.

    HF_HUB_OFFLINE=1 python docs/bench/formats/w7a8-s18/quality.py

Three texts the project ships (README prose, two Python modules), 400 tokens each, scored in one
forward (teacher forcing) by the demo target in float32 (the reference), bfloat16, int4, w8a8 and
w7a8, each loaded by the engine (``load_model``; the quantized formats on their real kernels).
Per format: top-1 agreement with float32 at every position, mean KL(float32 || format) per
position (nats), and the texts' negative log-likelihood per token.
"""
import gc
import os
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
from specdec.models.loader import load_model  # noqa: E402
from specdec.models.spec import parse_model_spec  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__)) + "/../../../.."
TEXTS = [("README.md", 20000), ("specdec/engine/batch.py", 3000), ("specdec/models/quant_linear.py", 9000)]
N = int(os.environ.get("N", "400"))
FORMATS = os.environ.get("FORMATS", "float32,bfloat16,int4,w8a8,w7a8").split(",")


@torch.inference_mode()
def score(fmt):
    lm = load_model(parse_model_spec("demo:target"), weight_format=fmt, invariant=fmt != "float32")
    ids = [lm.tokenizer(open(os.path.join(ROOT, p)).read()[o:o + 6000], return_tensors="pt").input_ids[:, :N]
           for p, o in TEXTS]
    t = time.perf_counter()
    out = [lm.model(input_ids=i).logits[0].float().log_softmax(-1) for i in ids]
    print(f"{fmt}: scored {sum(i.shape[1] for i in ids)} positions in {time.perf_counter() - t:.1f} s", flush=True)
    del lm
    gc.collect()
    return ids, out


ids, ref = score(FORMATS[0])
for fmt in FORMATS:
    _, out = (ids, ref) if fmt == FORMATS[0] else score(fmt)
    agree = kl = nll = n = 0
    for r, o, i in zip(ref, out, ids):
        agree += (r.argmax(-1) == o.argmax(-1)).sum().item()
        kl += F.kl_div(o, r, log_target=True, reduction="sum").item()
        nll += F.nll_loss(o[:-1], i[0, 1:], reduction="sum").item()
        n += r.shape[0]
    print(f"{fmt:9s} top-1 agreement with {FORMATS[0]} {agree / n:.4f}   mean KL {kl / n:.5f}   "
          f"NLL/token {nll / n:.4f}   ({n} positions)", flush=True)
