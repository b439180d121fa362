import torch, time, torch.nn.functional as F
torch.set_num_threads(1)
torch.manual_seed(0)
H, Hkv, D = 12, 2, 128
g = H // Hkv
def mm_attn(q, k, v, scale):
    # q [1, H, 1, D] -> [Hkv, g, D]; k,v [1, Hkv, L, D]
    qh = q.reshape(Hkv, g, D)
    s = torch.matmul(qh, k[0].transpose(-1, -2)) * scale  # [Hkv, g, L]
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v[0]).reshape(1, H, 1, D)
def mm_attn2(q, k, v, scale):
    qh = q.reshape(Hkv, g, D) * scale
    s = torch.baddbmm  # unused
    s = torch.bmm(qh, k[0].transpose(-1, -2))
    p = torch.softmax(s, dim=-1)
    return torch.bmm(p, v[0]).view(1, H, 1, D)
def tm(f, n=200):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e6
with torch.inference_mode():
  for L in (20, 100, 220, 400, 1000):
    q = torch.randn(1, H, 1, D); kb = torch.randn(1, Hkv, L + 64, D); vb = torch.randn(1, Hkv, L + 64, D)
    k, v = kb[:, :, :L], vb[:, :, :L]
    s = D ** -0.5
    ref = F.scaled_dot_product_attention(q, k, v, scale=s, enable_gqa=True)
    a = mm_attn(q, k, v, s); b = mm_attn2(q, k, v, s)
    print(L, f"flash {tm(lambda: F.scaled_dot_product_attention(q, k, v, scale=s, enable_gqa=True)):.1f} us, "
          f"mm {tm(lambda: mm_attn(q, k, v, s)):.1f} us, bmm {tm(lambda: mm_attn2(q, k, v, s)):.1f} us, "
          f"maxdiff {float((a - ref).abs().max()):.2e} {float((b - ref).abs().max()):.2e}")
