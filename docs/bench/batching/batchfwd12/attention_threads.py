import torch, time, torch.nn.functional as F
from concurrent.futures import ThreadPoolExecutor
torch.manual_seed(0)
H, Hkv, D = 12, 2, 128
R = 8
rows = []
for i in range(R):
    L = 150 + 20 * i
    rows.append((torch.randn(1, H, 1, D), torch.randn(1, Hkv, L + 64, D)[:, :, :L], torch.randn(1, Hkv, L + 64, D)[:, :, :L]))
s = D ** -0.5
def run(rs): return [F.scaled_dot_product_attention(q, k, v, scale=s, enable_gqa=True) for q, k, v in rs]
ex = ThreadPoolExecutor(1)
def one_thread(rs):
    torch.set_num_threads(1); return run(rs)
def med(x): return sorted(x)[len(x) // 2] * 1e3
with torch.inference_mode():
  ref = run(rows)
  for rnd in range(4):
    a, b, c = [], [], []
    for _ in range(40):
        torch.set_num_threads(1); t = time.perf_counter(); o1 = run(rows); a.append(time.perf_counter() - t)
        torch.set_num_threads(2); t = time.perf_counter(); o2 = run(rows); b.append(time.perf_counter() - t)
        torch.set_num_threads(1); t = time.perf_counter(); f = ex.submit(one_thread, rows[R // 2:]); o3 = run(rows[:R // 2]) + f.result(); c.append(time.perf_counter() - t)
    eq = all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(o1, o2, o3))
    print(f"round {rnd}: 1 thread {med(a):.3f} ms, 2 threads {med(b):.3f} ms, row worker {med(c):.3f} ms (8 rows 150..290 keys), equal {eq}")
