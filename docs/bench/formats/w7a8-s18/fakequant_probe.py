"""Session 18 probe (before w7a8 existed): which 7-bit variant costs less quality, fake-quantized.

    python docs/bench/formats/w7a8-s18/fakequant_probe.py   (output: fakequant.txt)

Quality of int8 variants on the demo target, fake-quantized in float32 against bfloat16:
w8a8 (127 levels both), w8a7 (activation codes -63..63), w7a8 (weight codes -63..63).
Top-1 agreement with bf16, mean KL(bf16 || variant), NLL of the text."""
import os, time, torch, glob
torch.set_num_threads(2)
import torch.nn.functional as F
from torch import nn
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec
lm = load_model(parse_model_spec(os.environ.get("M","demo:target")), weight_format="bfloat16", invariant=False, fuse=False)
m, tok = lm.model, lm.tokenizer
texts = [open("README.md").read()[20000:26000], open("specdec/engine/batch.py").read()[3000:9000],
         open("specdec/models/quant_linear.py").read()[9000:15000]]
N = int(os.environ.get("N", "400"))
ids = [tok(t, return_tensors="pt").input_ids[:, :N] for t in texts]
lins = [(n, mod) for n, mod in m.named_modules() if isinstance(mod, nn.Linear) and "lm_head" not in n]
print(len(lins), "linears", [x.shape for x in ids], flush=True)
orig = {n: mod.forward for n, mod in lins}
def qrow(t, levels):
    s = t.abs().amax(-1, keepdim=True).div(levels).clamp_min(torch.finfo(torch.float32).eps)
    return torch.round(t / s), s
def install(wl, al):
    for n, mod in lins:
        qw, sw = qrow(mod.weight.float(), wl)
        def f(x, mod=mod, qw=qw, sw=sw):
            xf = x.float(); qx, sx = qrow(xf, al)
            y = (qx @ qw.T) * sw.T * sx
            y = y.to(x.dtype)
            return y + mod.bias if mod.bias is not None else y
        mod.forward = f
def uninstall():
    for n, mod in lins:
        mod.forward = orig[n]
@torch.inference_mode()
def logits():
    return [m(input_ids=i).logits[0].float() for i in ids]
t = time.time(); ref = logits(); print("bf16", time.time() - t, flush=True)
def report(name, out):
    agree = kl = nll = n = 0
    for r, o, i in zip(ref, out, ids):
        agree += (r.argmax(-1) == o.argmax(-1)).sum().item()
        kl += F.kl_div(o.log_softmax(-1), r.log_softmax(-1), log_target=True, reduction="sum").item()
        nll += F.cross_entropy(o[:-1], i[0, 1:], reduction="sum").item()
        n += r.shape[0]
    print(f"{name}: top-1 agree with bf16 {agree / n:.4f}, mean KL {kl / n:.5f}, NLL/token {nll / n:.4f} ({n} positions)", flush=True)
report("bf16", ref)
for name, wl, al in (("w8a8", 127, 127), ("w8a7", 127, 63), ("w7a8", 63, 127), ("w8a6", 127, 31)):
    install(wl, al); t = time.time(); out = logits(); uninstall(); print(name, time.time() - t, flush=True)
    report(name, out)
