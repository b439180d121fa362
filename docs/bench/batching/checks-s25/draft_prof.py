import os, random, time
import torch
torch.set_num_threads(2)
from specdec.engine.kv_cache import CachedSequence, feed_many
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec
m = load_model(parse_model_spec("demo:draft"), weight_format=os.environ.get("FMT", "int4"))
rng = random.Random(0)
ids = [rng.randrange(1000, 30000) for _ in range(140)]
s = CachedSequence(m.model, ids); feed_many([(s, ids, 1)])
def one():
    b = len(s.cached); feed_many([(s, [rng.randrange(1000, 30000)], 1)]); s._crop(b)
for _ in range(10): one()
t = time.perf_counter()
for _ in range(20): one()
print("wall per forward ms", (time.perf_counter() - t) / 20 * 1000)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as p:
    for _ in range(20): one()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=50))
