"""Per served step of one request: the target and draft forward milliseconds (K trace) beside the
machine's steal and idle over the same seconds (CPU sampler, /proc/stat), to tell a slow stretch
caused by the hypervisor (steal: time our vCPUs were runnable but the host ran something else) or
by other work from one of our own.

    python docs/bench/served-s13/steal_by_step.py TRACE.jsonl.gz CPU.jsonl.gz [REQUEST=1]
"""
import gzip
import json
import sys

sys.path.insert(0, "docs/bench/served-w8a8")
from step_breakdown import groups, load  # noqa: E402


def stat_at(samples, t):
    """/proc/stat's cpu line (USER_HZ ticks) of the last sample at or before t."""
    prev = samples[0]
    for s in samples:
        if s["t"] > t:
            break
        prev = s
    return prev["cpu"]


trace, cpu = sys.argv[1], sys.argv[2]
want = f"request {sys.argv[3] if len(sys.argv) > 3 else 1}"
with gzip.open(cpu, "rt") as f:
    samples = [json.loads(line) for line in f if line.strip()]
steps = dict(groups(load(trace)))[want]
print(f"{want}: step, positions, target ms, draft forwards ms, window s, steal cores, idle cores, others")
for i in range(0, len(steps), 4):  # 4-step windows (~1 s): the sampler ticks every 0.5 s
    chunk = steps[i:i + 4]
    t0 = chunk[0]["t"] - (chunk[0].get("draft_s") or 0) - ((chunk[0].get("batch") or [0, 0, 0, 0])[3])
    t1 = chunk[-1]["t"]
    a, b = stat_at(samples, t0), stat_at(samples, t1)
    dt = max(t1 - t0, 1e-9)
    hz = 100.0
    steal = (b[7] - a[7]) / hz / dt
    idle = (b[3] - a[3]) / hz / dt
    tgt = [round((s.get("batch") or [0, 0, 0, 0])[3] * 1000) for s in chunk]
    dr = [round(sum(x for _, x in s.get("draft_forwards") or []) * 1000) for s in chunk]
    print(f"  steps {i + 1:2d}-{i + len(chunk):2d}  target {tgt}  draft {dr}  {dt:4.1f} s  steal {steal:.2f}  idle {idle:.2f}")
