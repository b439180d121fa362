"""Session 12 (batchfwd12): one layer of a packed 8 x 1 forward (packed cache update + row-wise attention),
main before this session's changes (568f940, source from git) against this tree, interleaved call by call.

    python docs/bench/batching/batchfwd12/layer_ab.py

Synthetic tensors of the demo target's attention shape (12/2 heads, d 128, bfloat16 activations, float32
caches), 8 sequences of CTX..CTX+7*STEP cached keys; outputs compared bitwise. No model is loaded (no lock).
"""
import os, sys, time, subprocess, types
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
import torch
torch.set_num_threads(2)
from transformers.models.qwen2 import Qwen2Config
from specdec.engine import kv_store, invariant, kv_cache
from specdec.engine.kv_store import new_cache
BASE = os.environ.get("BASE", "568f940")
def module_from(path, name):
    src = subprocess.run(["git", "show", f"{BASE}:{path}"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    m = types.ModuleType(name); m.__file__ = path; sys.modules[name] = m
    exec(compile(src, path, "exec"), m.__dict__)
    return m
old_inv = module_from("specdec/engine/invariant.py", "old_invariant")
old_kvc = module_from("specdec/engine/kv_cache.py", "old_kv_cache")
cfg = Qwen2Config(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, num_hidden_layers=1, vocab_size=100)
cfg._attn_implementation = invariant.ATTENTION_NAME
R, H, Hkv, D = 8, 12, 2, 128
CTX, STEP = int(os.environ.get("CTX", 30)), int(os.environ.get("STEP", 20))
lens = [CTX + STEP * i for i in range(R)]
g = torch.Generator().manual_seed(0)
class FM:
    config = cfg
    def parameters(self): yield torch.zeros(1, dtype=torch.bfloat16)
arms = {"main": (False, old_inv.rowwise_attention, old_kvc._PackedCacheView), "new": (True, invariant.rowwise_attention, kv_cache._PackedCacheView)}
caches = {}
for name in arms:
    g.manual_seed(0)
    cs = []
    for L in lens:
        c = new_cache(cfg, torch.float32)
        c.update(torch.randn(1, Hkv, L, D, generator=g).to(torch.bfloat16), torch.randn(1, Hkv, L, D, generator=g).to(torch.bfloat16), 0)
        cs.append(c)
    caches[name] = cs
q = torch.randn(1, H, R, D, generator=g).to(torch.bfloat16)
kn = torch.randn(1, Hkv, R, D, generator=g).to(torch.bfloat16)
vn = torch.randn(1, Hkv, R, D, generator=g).to(torch.bfloat16)
mask = kv_cache._packed_mask(lens, [1] * R, FM(), "cpu")
def call(name):
    fast, attn, view_cls = arms[name]
    kv_store.FAST_APPEND = fast
    t = time.perf_counter()
    k, v = view_cls(caches[name], [1] * R, parts=True).update(kn, vn, 0)
    out, _ = attn(None, q, k, v, mask, scaling=D ** -0.5)
    wall = time.perf_counter() - t
    for c in caches[name]:
        c.crop(-1)
    return wall, out
REPS = int(os.environ.get("REPS", 300))
res = {n: [] for n in arms}
with torch.inference_mode():
    for n in arms:
        call(n)
    same = True
    for r in range(REPS):
        outs = {}
        for n in (arms if r % 2 == 0 else list(arms)[::-1]):
            w, outs[n] = call(n)
            res[n].append(w)
        same &= torch.equal(outs["main"], outs["new"])
med = lambda v: sorted(v)[len(v) // 2] * 1e3
pairs = sorted(m / n for m, n in zip(res["main"], res["new"]))
print(f"one layer, 8 rows of {lens} cached keys, {REPS} interleaved pairs, load {os.getloadavg()[0]:.1f}: "
      f"main {BASE} median {med(res['main']):.3f} ms (min {1e3 * min(res['main']):.3f}), new median {med(res['new']):.3f} ms "
      f"(min {1e3 * min(res['new']):.3f}); paired main/new median {pairs[len(pairs) // 2]:.3f}; outputs bitwise equal: {same}")
