"""Can a single sequence's prefill use one causal SDPA call and keep the decode path's bits? (spec11)

Row-wise attention (specdec/engine/invariant.py) computes every query row in float32 with its own
call over exactly its keys. Here: random bfloat16-valued q/k/v (12/2 heads, d = 128, the demo
target's attention), n rows: one causal call vs n per-row calls; rows equal in float32 and after
rounding to bfloat16 (what the layer keeps), and the time of both (one thread).
usage: python causal_vs_rows.py
"""
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
for n in (8, 64, 256):
    q, k, v = (torch.randn(1, h, n, 128, generator=g).bfloat16().float() for h in (12, 2, 2))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    rows = torch.cat([F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], enable_gqa=True)
                      for i in range(n)], dim=2)
    eq32 = sum(torch.equal(full[:, :, i], rows[:, :, i]) for i in range(n))
    eq16 = sum(torch.equal(full[:, :, i].bfloat16(), rows[:, :, i].bfloat16()) for i in range(n))
    t0 = time.perf_counter()
    for _ in range(5):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    t1 = time.perf_counter()
    for _ in range(5):
        torch.cat([F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], enable_gqa=True)
                   for i in range(n)], dim=2)
    t2 = time.perf_counter()
    print(f"{n} rows: equal in float32 {eq32}, after rounding to bfloat16 {eq16} of {n}; "
          f"one causal call {(t1 - t0) / 5e-3:.2f} ms, per-row calls {(t2 - t1) / 5e-3:.2f} ms per layer")
