import os, sys, time, torch, statistics
from transformers import DynamicCache
from specdec.models.loader import load_model
from specdec.models.spec import DemoModelSpec
torch.set_num_threads(1)
with torch.inference_mode():
    tgt = load_model(DemoModelSpec(role="target"), weight_format="w8a8")
    m = tgt.model
    ids = list(range(1000, 1080))
    cache = DynamicCache(config=m.config)
    m(input_ids=torch.tensor([ids[:64]]), past_key_values=cache, use_cache=True)
    def step(n=1):
        m(input_ids=torch.tensor([ids[64:64+n]]), past_key_values=cache, use_cache=True); cache.crop(-n)
    for _ in range(3): step()
    for n in (1,3,1,3,1):
        ts=[]
        for _ in range(5):
            t=time.perf_counter(); step(n); ts.append(time.perf_counter()-t)
        print(n, f"{statistics.median(ts)*1e3:.1f} ms", flush=True)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(5): step(1)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
