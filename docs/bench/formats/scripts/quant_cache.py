"""Cold vs warm load of the demo pair in int8/int4 (quantized-weight cache), one process per load.

Run under the heavy lock: flock -w 1800 /tmp/specdec-heavy.lock python docs/bench/formats/scripts/quant_cache.py int4
Each load runs in a fresh subprocess, printing: role, format, cache status, load seconds, peak RSS (GB),
RSS after load (GB). A first run builds ~/.cache/specdec/demo/<role>-<format>; the second reads it.
"""
import json
import resource
import subprocess
import sys
import time

CHILD = r"""
import json, os, resource, sys, time, torch
torch.set_num_threads(2)
from specdec.models.loader import load_model
from specdec.models.spec import DemoModelSpec
role, fmt = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
m = load_model(DemoModelSpec(role=role), weight_format=fmt)
dt = time.perf_counter() - t0
rss = int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 1e9
print(json.dumps({"role": role, "format": fmt, "cache": m.quant_cache, "load_s": round(dt, 1),
                  "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
                  "rss_gb": round(rss, 2)}))
"""

fmts = sys.argv[1:] or ["int4"]
for fmt in fmts:
    for role in ("target", "draft"):
        for attempt in ("first", "second"):
            out = subprocess.run([sys.executable, "-c", CHILD, role, fmt], capture_output=True, text=True)
            line = [l for l in out.stdout.splitlines() if l.startswith("{")]
            print(attempt, line[-1] if line else out.stderr[-2000:], flush=True)
