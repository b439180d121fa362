import sys, time; sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import torch
torch.set_num_threads(2)
from specdec.models.quant_linear import W8A8Linear
def tmin(f, n=5):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return 1e3 * min(ts)
with torch.inference_mode():
  for (i, o) in ((1536, 8960), (8960, 1536), (1536, 2048), (1536, 151936 // 8)):
    w = torch.randint(-127, 128, (o, i), dtype=torch.int8)
    s = torch.rand(o) * 0.01
    lq = W8A8Linear(w.clone(), s, None); lq.KERNEL = "qlinear"
    li = W8A8Linear(w.clone(), s, None); li.KERNEL = "int_mm"
    row = []
    for m in (1, 2, 5, 8, 16):
        x = torch.randn(m, i, dtype=torch.bfloat16)
        yq = lq.forward_rows(x); yi = li.forward_rows(x)
        row.append(f"M={m}: qlinear {tmin(lambda: lq.forward_rows(x)):.2f} int_mm {tmin(lambda: li.forward_rows(x)):.2f} eq {torch.equal(yq, yi)}")
    print(f"{i}->{o}: " + "; ".join(row), flush=True)
