"""A/B in one process: the demo target's w8a8 layers on oneDNN qlinear vs aten._int_mm, real forwards."""
import random, statistics as st, time
import torch
torch.set_num_threads(2)
from specdec.models.quant_linear import W8A8Linear
W8A8Linear.KEEP_INT8 = True
from sessions import cached_sessions, timed_forward  # this folder's shared setup
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec
target = load_model(parse_model_spec("demo:target"))
layers = [m for m in target.model.modules() if isinstance(m, W8A8Linear)]
print(len(layers), "w8a8 layers", sum(m.qweight.numel() > 0 for m in layers), "keep int8", flush=True)
def use(kind):
    for m in layers:
        m.KERNEL = "qlinear" if kind == "qlinear" else "int_mm"
        if kind == "int_mm":
            m._saved = m._packed; m._packed = False
        elif getattr(m, "_saved", None) is not None:
            m._packed = m._saved
rng = random.Random(0)
seqs = cached_sessions(target.model, rng)
def run(items):
    return timed_forward(items)
shapes = {"1x1": (1, 1), "1x5": (1, 5), "2x1": (2, 1), "8x1": (8, 1)}
res = {(n, v): [] for n in shapes for v in ("qlinear", "int_mm")}
for r in range(9):
    for n, (rows, p) in shapes.items():
        toks = [[rng.randrange(1000, 30000) for _ in range(p)] for _ in range(rows)]
        outs = {}
        for v in (("qlinear", "int_mm") if r % 2 else ("int_mm", "qlinear")):
            use(v); w, o = run([(s, t, p) for s, t in zip(seqs, toks)]); outs[v] = o
            if r: res[(n, v)].append(w)
        assert all(torch.equal(a, b) for a, b in zip(outs["qlinear"], outs["int_mm"])), n
print("shape  qlinear median/min ms   int_mm median/min   int_mm/qlinear; logits equal: yes")
for n in shapes:
    a, b = res[(n, "qlinear")], res[(n, "int_mm")]
    print(f"{n}  {1000*st.median(a):7.1f} / {1000*min(a):6.1f}   {1000*st.median(b):7.1f} / {1000*min(b):6.1f}   {st.median(b)/st.median(a):.3f}", flush=True)
