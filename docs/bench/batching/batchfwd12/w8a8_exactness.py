import sys; sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import torch
torch.set_num_threads(1)
from specdec.models.quant_linear import W8A8Linear
torch.manual_seed(0)
with torch.inference_mode():
    i, o = 1536, 2048
    w = torch.randint(-127, 128, (o, i), dtype=torch.int8); s = torch.full((o,), 0.01)
    lq = W8A8Linear(w.clone(), s, None); lq.KERNEL = "qlinear"
    li = W8A8Linear(w.clone(), s, None); li.KERNEL = "int_mm"
    x = torch.randn(4, i, dtype=torch.bfloat16)
    yq, yi = lq.forward_rows(x).float(), li.forward_rows(x).float()
    q, sx = W8A8Linear.quantize_rows(x)
    exact = (q.int() @ w.int().t()).float() * s * sx
    print("qlinear vs exact max rel", float(((yq - exact).abs().max() / exact.abs().max())),
          "int_mm vs exact max rel", float(((yi - exact).abs().max() / exact.abs().max())))
    print("qlinear rows == alone:", all(torch.equal(lq.forward_rows(x[r:r+1]), lq.forward_rows(x)[r:r+1]) for r in range(4)))
