import os, sys, time, warnings, logging
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch
from transformers import DynamicCache
from specdec.models.loader import load_model
from specdec.models.spec import DemoModelSpec
role = sys.argv[1]; fmt = sys.argv[2]
torch.set_num_threads(1)
with torch.inference_mode():
    t0 = time.perf_counter()
    m = load_model(DemoModelSpec(role=role), weight_format=fmt)
    print(role, fmt, "load_s", round(time.perf_counter() - t0, 1), m.quant_cache)
    model = m.model
    ids = m.tokenizer.encode(open("docs/bench/formats/scripts/text_code.py.txt").read()[:4000])[:80]
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([ids[:64]]), past_key_values=cache, use_cache=True)
    new = torch.tensor([ids[64:65]])
    for _ in range(5):
        model(input_ids=new, past_key_values=cache, use_cache=True); cache.crop(-1)
    ts = []
    for _ in range(15):
        t = time.perf_counter(); model(input_ids=new, past_key_values=cache, use_cache=True); ts.append(time.perf_counter() - t); cache.crop(-1)
    ts.sort(); print("step median s", round(ts[7], 4), "min", round(ts[0], 4))
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            model(input_ids=new, past_key_values=cache, use_cache=True); cache.crop(-1)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
