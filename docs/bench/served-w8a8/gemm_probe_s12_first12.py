"""One linear layer of the demo target's MLP shape (1536 -> 8960) on this session's AVX2-only EPYC, one thread,
min of 25 interleaved reps per (kernel, positions M): float32 (MKL, what the float32 default runs), fbgemm
dynamic int8 (per-tensor activation scale), fbgemm fp16 weights. Light (55 MB); run without the heavy lock:
noisy, ratios only. Output: gemm-probe-s12-first12.txt."""
import torch, time, warnings
warnings.filterwarnings("ignore")
torch.manual_seed(0)
torch.backends.quantized.engine = "fbgemm"
lin = torch.nn.Linear(1536, 8960, bias=True).eval()
p16 = torch.ops.quantized.linear_prepack_fp16(lin.weight.detach(), lin.bias.detach())
q = torch.ao.nn.quantized.dynamic.Linear(1536, 8960)
res = {}
torch.set_num_threads(1)
fs = (("mkl-fp32", lin), ("fbgemm-int8-dyn(per-tensor act)", q), ("fbgemm-fp16-weights", lambda x: torch.ops.quantized.linear_dynamic_fp16(x, p16)))
with torch.no_grad():
    for rep in range(25):
        for m in (1, 2, 5):
            x = torch.randn(m, 1536)
            for name, f in fs:
                t = time.perf_counter(); f(x); d = time.perf_counter() - t
                k = (name, m); res[k] = min(res.get(k, 9), d)
    x = torch.randn(5, 1536)
    rowwise = torch.cat([torch.ops.quantized.linear_dynamic_fp16(x[i:i + 1], p16) for i in range(5)])
    print("fp16 weights: 5 rows at once == one row at a time (bitwise):", torch.equal(torch.ops.quantized.linear_dynamic_fp16(x, p16), rowwise))
for name, _ in fs:
    print(f"{name:32s} 1 thread", " ".join(f"M{m} {res[(name, m)]*1e3:.2f}ms" for m in (1, 2, 5)))
