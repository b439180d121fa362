import torch, time
import torch.nn.functional as F
torch.set_num_threads(1)
torch.manual_seed(0)
H, Hkv, D = 12, 2, 128
res = {}
for L in (10, 200, 400):
    q = torch.randn(1, H, 1, D); k = torch.randn(1, Hkv, L, D); v = torch.randn(1, Hkv, L, D)
    s = D ** -0.5
    a = F.scaled_dot_product_attention(q, k, v, scale=s, enable_gqa=True)
    try:
        b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=None, scale=s)[0]
        eq = torch.equal(a, b)
    except Exception as e:
        eq = repr(e)[:200]
    def tm(f, n=300):
        ts = []
        for _ in range(n):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        return sorted(ts)[n // 2] * 1e6
    ta = tm(lambda: F.scaled_dot_product_attention(q, k, v, scale=s, enable_gqa=True))
    tb = tm(lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=None, scale=s))
    print(L, "equal", eq, f"F.sdpa {ta:.1f} us, op {tb:.1f} us")
with torch.profiler.profile() as p:
    F.scaled_dot_product_attention(q, k, v, scale=s, enable_gqa=True)
print(p.key_averages().table(row_limit=10))
