import torch, time
from specdec.models.quant_linear import W8A8Linear
def bench(f, n=500):
    for _ in range(20): f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e6
torch.set_num_threads(2)
for M in (8, 40, 128):
    for K in (1536, 8960):
        x = torch.randn(M, K).to(torch.bfloat16)
        print(f"M={M} K={K}: quantize_rows {bench(lambda: W8A8Linear.quantize_rows(x, 128)):.1f} us")
