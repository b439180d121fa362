import time, torch, sys, warnings
warnings.filterwarnings("ignore")
torch.set_num_threads(1)
from specdec.models.quant_linear import W8A8Linear
W8A8Linear.KEEP_INT8 = True
g = torch.Generator().manual_seed(0)
for K, N in [(1536, 2048), (8960, 1536), (896, 128), (1536, 151936)]:
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    wq[0] = -128; wq[1] = 127
    sc = torch.rand(N, generator=g) * 0.01
    lin = W8A8Linear(wq, sc, None)
    for M in [1, 5, 17]:
        x = torch.randn(M, K, generator=g).bfloat16()
        x[0, ::2] = 10.0  # max codes 127 -> halves 63/64
        x[0, 1::2] = -10.0
        y = lin.forward_rows(x)
        q, s = W8A8Linear.quantize_rows(x)
        ref = (torch._int_mm(q, wq.t()) if M > 16 else (q.int() @ wq.int().t())).float().mul_(lin.scale).mul_(s).to(torch.bfloat16)
        rows = torch.cat([lin.forward_rows(x[i:i+1]) for i in range(M)])
        print(K, N, M, lin._kind, 'bitwise int_mm', torch.equal(y, ref), 'row-invariant', torch.equal(y, rows))
    def bench(fn, reps=20):
        fn(); fn(); ts=[]
        for _ in range(reps):
            t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
        ts.sort(); return ts[len(ts)//2]*1e3
    print('  ms', " ".join(f"{M}:{bench(lambda: lin.forward_rows(torch.randn(M, K).bfloat16())):.2f}" for M in [1,2,3,5,9,17,33]))
