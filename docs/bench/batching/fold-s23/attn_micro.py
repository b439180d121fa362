import torch, time, torch.nn.functional as F
torch.set_num_threads(1)
H, Hkv, d = 12, 2, 128
G = H // Hkv
def bench(f, n=400):
    for _ in range(20): f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e6
for L in (64, 150, 300, 600, 1200):
    q = torch.randn(1, H, 1, d); k = torch.randn(1, Hkv, L, d); v = torch.randn(1, Hkv, L, d)
    a = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    qf = q.view(1, Hkv, G, d)
    b = lambda: F.scaled_dot_product_attention(qf, k, v)
    s = d ** -0.5
    def c():
        w = torch.matmul(qf, k.transpose(-1, -2)).mul_(s)
        return torch.matmul(torch.softmax(w, -1), v)
    ke = k.repeat_interleave(G, 1); ve = v.repeat_interleave(G, 1)
    e = lambda: F.scaled_dot_product_attention(q, ke, ve)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        m = bench(lambda: F.scaled_dot_product_attention(qf, k, v))
    print(f"L={L}: gqa {bench(a):.1f} us, folded {bench(b):.1f}, manual {bench(c):.1f}, expanded-kv {bench(e):.1f}, folded-math {m:.1f}")
