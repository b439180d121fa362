"""Per-process CPU per phase of a served run: ``python cpu_summary_s12.py SAMPLES.jsonl PHASES.txt``.

SAMPLES: ``cpu_sampler_s12.py``'s output. PHASES: lines ``LABEL UNIX_SECONDS`` (phase starts, in order; the
last phase ends at the last sample): e.g. ``serve``, ``ready``, ``req1`` ... as served_pair_s12.sh writes them.
Per phase: its seconds, the machine's CPU seconds used by all processes (2 cores: 2 per second at most), then
the processes (grouped by name) that used the most, with their share of one core, minor/major page faults.
"""
import json
import sys
from collections import defaultdict

samples = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
phases = [(l.split()[0], float(l.split()[1])) for l in open(sys.argv[2]) if l.strip()]
top = int(sys.argv[3]) if len(sys.argv) > 3 else 8
ends = [t for _, t in phases[1:]] + [samples[-1]["t"]]


def at(t):
    """The sample nearest before-or-at t (the first one if t is earlier)."""
    best = samples[0]
    for s in samples:
        if s["t"] <= t:
            best = s
        else:
            break
    return best


for (label, t0), t1 in zip(phases, ends):
    a, b = at(t0), at(t1)
    dt = b["t"] - a["t"]
    if dt <= 0:
        continue
    use = defaultdict(lambda: [0, 0, 0, 0])
    for pid, v in b["p"].items():
        name, cpu, mn, mj = v[0], v[1], v[2], v[3]
        old = a["p"].get(pid)
        if old is not None and old[0] == name:
            cpu, mn, mj = cpu - old[1], mn - old[2], mj - old[3]
        if cpu <= 0 and mn <= 0 and mj <= 0:
            continue
        g = use[name.split(" --")[0][:60]]
        g[0] += cpu; g[1] += mn; g[2] += mj; g[3] += 1
    total = sum(g[0] for g in use.values()) / 100
    print(f"{label}: {dt:.1f} s, all processes {total:.1f} CPU s ({total / dt:.2f} cores), load {a['load']}->{b['load']}")
    if "cpu" in a:
        c = [(y - x) / 100 for x, y in zip(a["cpu"], b["cpu"])]
        vm = {k: b["vm"][k] - a["vm"].get(k, 0) for k in b["vm"] if b["vm"][k] != a["vm"].get(k, 0)}
        print(f"   machine: user {c[0] + c[1]:.1f} s system {c[2]:.1f} idle {c[3]:.1f} iowait {c[4]:.1f} irq+soft "
              f"{c[5] + c[6]:.1f} steal {c[7]:.1f}; vmstat {vm}")
    for name, g in sorted(use.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"   {g[0] / 100 / dt:5.2f} cores  {g[0] / 100:6.1f} s  minflt {g[1]:8d} majflt {g[2]:5d}  x{g[3]} {name}")
