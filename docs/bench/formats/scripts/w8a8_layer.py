"""One linear layer of the demo target's shape (1536 -> 8960, the MLP up/gate projection) by
number of rows M: bfloat16 nn.Linear, int4 (torchao, the CPU default's kernel) and w8a8
(specdec W8A8Linear, both kernels), microseconds per call, minimum of N calls (robust on a shared
machine; the minimum is the call least disturbed by other jobs).

usage: python w8a8_layer.py [N]      env THREADS (default 2)
"""
import os, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from torch import nn
from specdec.models.formats import W8A8Linear, quantize

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
N = int(sys.argv[1]) if len(sys.argv) > 1 else 20
W8A8Linear.KEEP_INT8 = True


def best(fn):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(N):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e6


torch.manual_seed(0)
k, n = 1536, 8960
lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
m4 = nn.Sequential(nn.Linear(k, n, bias=False).to(torch.bfloat16))
quantize(m4, "int4")
m8 = nn.Sequential(nn.Linear(k, n, bias=False).to(torch.bfloat16))
quantize(m8, "w8a8")
q = m8[0]
print(f"{time.strftime('%H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f}, {torch.get_num_threads()} threads, min of {N}")
print("| M | bf16 nn.Linear | int4 | w8a8 qlinear | w8a8 int_mm |")
print("|---:|---:|---:|---:|---:|")
with torch.inference_mode():
    for m in (1, 2, 5, 9, 16, 32, 64):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        r = [best(lambda: lin(x)), best(lambda: m4(x))]
        for kern in ("qlinear", "int_mm"):
            W8A8Linear.KERNEL = kern
            r.append(best(lambda: q(x)))
        print(f"| {m} | " + " | ".join(f"{v:.0f}" for v in r) + " |", flush=True)
