# One-position and five-position forwards of a demo model (w7a8, THREADS threads (default 2), 25 each after a 120-token prefill) under the
# OpenMP settings of the environment, e.g.:
#   WHICH=draft TAGV=passive OMP_WAIT_POLICY=PASSIVE python docs/bench/served-w8a8/omp_spin_probe.py
#   WHICH=draft TAGV=spin OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=30000 python docs/bench/served-w8a8/omp_spin_probe.py
# (session 19, README "OpenMP threads of the model processes")
import os, time, statistics as st, torch
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
from transformers import DynamicCache
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec
from specdec.models.lean_decode import install
which = os.environ.get("WHICH", "draft")
lm = load_model(parse_model_spec(f"demo:{which}"), weight_format="w7a8")
m = lm.model; install(m)
ids = torch.randint(1000, 30000, (1, 120))
with torch.inference_mode():
    c = DynamicCache(); m(input_ids=ids, cache=c, use_cache=True)
    for n in (1, 5):
        ts = []
        for i in range(25):
            t = time.perf_counter(); m(input_ids=torch.tensor([[1000 + i] * n]), cache=c, use_cache=True); ts.append(time.perf_counter() - t)
            c.crop(-n)
        print(f"{which} {os.environ.get('TAGV')} {n} pos: median {st.median(ts)*1000:.1f} min {min(ts)*1000:.1f} ms", flush=True)
