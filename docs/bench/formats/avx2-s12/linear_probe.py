"""One 1536->8960 linear per weight format, through specdec.models.formats.quantize (the engine's
layers), one thread: median ms of 1/2/5/9 rows. Unlocked micro-probe (seconds) to size the locked run.
usage: .venv/bin/python docs/bench/formats/avx2-s12/linear_probe.py"""
import statistics, time, warnings
warnings.filterwarnings("ignore")
import torch
from torch import nn
from specdec.models import formats
torch.set_num_threads(1)
print("capability", torch.backends.cpu.get_cpu_capability(), open("/proc/loadavg").read().strip())
base = nn.Sequential(nn.Linear(1536, 8960, bias=False))
for fmt in ("float32", "bfloat16", "float16", "int8", "int4", "w8a8"):
    m = nn.Sequential(nn.Linear(1536, 8960, bias=False))
    m.load_state_dict(base.state_dict())
    m = m.to(formats.storage_dtype(fmt) if fmt != "float16" else torch.float16)
    if fmt != "float16":
        m = m.to(formats.compute_dtype(fmt))
    formats.quantize(m, fmt)
    res = []
    with torch.inference_mode():
        for r in (1, 2, 5, 9):
            x = torch.randn(r, 1536).to(formats.compute_dtype(fmt))
            m(x)
            ts = []
            for _ in range(7):
                t = time.perf_counter(); m(x); ts.append(time.perf_counter() - t)
            res.append(f"{r}:{statistics.median(ts)*1e3:.2f}")
    print(fmt, type(m[0]).__name__, " ".join(res), "ms", flush=True)
print(open("/proc/loadavg").read().strip())
