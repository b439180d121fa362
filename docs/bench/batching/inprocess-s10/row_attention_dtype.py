import torch, torch.nn.functional as F, time
torch.set_num_threads(1)
torch.manual_seed(0)
H, Hkv, d = 12, 2, 128
for L in (60, 150, 400, 1000):
    q = torch.randn(1, H, 1, d, dtype=torch.bfloat16); k = torch.randn(1, Hkv, L, d, dtype=torch.bfloat16); v = torch.randn(1, Hkv, L, d, dtype=torch.bfloat16)
    kf, vf = k.float(), v.float()
    fs = {"bf16": lambda: F.scaled_dot_product_attention(q, k, v, scale=0.088, enable_gqa=True),
          "f32_pre": lambda: F.scaled_dot_product_attention(q.float(), kf, vf, scale=0.088, enable_gqa=True).to(torch.bfloat16),
          "f32_conv": lambda: F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.088, enable_gqa=True).to(torch.bfloat16)}
    res = dict.fromkeys(fs, 0.0)
    for rep in range(100):
        for n, f in fs.items():
            t = time.process_time(); f(); res[n] += time.process_time() - t
    a, b = fs["bf16"](), fs["f32_pre"]()
    print(L, {n: f"{s / 100 * 1e6:.0f}us" for n, s in res.items()}, "max diff", (a.float() - b.float()).abs().max().item(), "equal frac", (a == b).float().mean().item())
