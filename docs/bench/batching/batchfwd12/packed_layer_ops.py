import sys, time; sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import torch
from transformers.models.qwen2 import Qwen2Config
from specdec.engine import kv_store, invariant
from specdec.engine.kv_store import new_cache
from specdec.engine.kv_cache import _PackedCacheView, _packed_mask
cfg = Qwen2Config(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, num_hidden_layers=1, vocab_size=100)
cfg._attn_implementation = "sdpa"
R, H, Hkv, D = 8, 12, 2, 128
lens = [40 + 5 * i for i in range(R)]
caches = []
for L in lens:
    c = new_cache(cfg, torch.float32)
    c.update(torch.randn(1, Hkv, L, D, dtype=torch.bfloat16), torch.randn(1, Hkv, L, D, dtype=torch.bfloat16), 0)
    caches.append(c)
class FM:
    config = cfg
    def parameters(self): yield torch.zeros(1, dtype=torch.bfloat16)
q = torch.randn(1, H, R, D, dtype=torch.bfloat16); kn = torch.randn(1, Hkv, R, D, dtype=torch.bfloat16)
with torch.inference_mode():
    mask = _packed_mask(lens, [1] * R, FM(), "cpu")
    view = _PackedCacheView(caches, [1] * R, parts=True)
    view.update(kn, kn, 0); [c.crop(-1) for c in caches]
    invariant.rowwise_attention(None, q, *view.update(kn, kn, 0), mask, scaling=0.1); [c.crop(-1) for c in caches]
    with torch.profiler.profile() as p1:
        k, v = view.update(kn, kn, 0)
    with torch.profiler.profile() as p2:
        invariant.rowwise_attention(None, q, k, v, mask, scaling=0.1)
for name, p in (("update", p1), ("attention", p2)):
    ev = p.key_averages()
    print(name, "ops:", sum(e.count for e in ev), {e.key: e.count for e in ev})
    # python-side timing
