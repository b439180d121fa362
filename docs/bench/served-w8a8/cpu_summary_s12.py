"""Per-process CPU per phase of a served run: ``python cpu_summary_s12.py SAMPLES.jsonl PHASES.txt``.

SAMPLES: ``cpu_sampler_s12.py``'s output. PHASES: lines ``LABEL UNIX_SECONDS`` (phase starts, in order; the
last phase ends at the last sample): e.g. ``serve``, ``ready``, ``req1`` ... as served_pair_s12.sh writes them.
Per phase: its seconds, the CPU of our processes (those in the client's network namespace: the model
replicas and the rest of our Ray cluster, marked *) and of the others (the rest of the machine), the machine's CPU seconds used by all processes (2 cores: 2 per second at most), then
the processes (grouped by name) that used the most, with their share of one core, minor/major page faults.
"""
import json
import sys
from collections import defaultdict

samples = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
phases = [(l.split()[0], float(l.split()[1])) for l in open(sys.argv[2]) if l.strip()]
top = int(sys.argv[3]) if len(sys.argv) > 3 else 8
# ours: the processes in the client's network namespace (the served run's own netns)
ours_ns = {v[6] for smp in samples for v in smp["p"].values() if len(v) > 6 and v[6] and "client_pair_s12" in v[0]}
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
    # per pid: its values at the phase start (zero for a process born later) and at its last sample in the
    # phase (a process that exited inside the phase counts up to its last sample)
    first: dict = {}
    last: dict = {}
    for smp in samples:
        if smp["t"] < a["t"] or smp["t"] > b["t"]:
            continue
        for pid, v in smp["p"].items():
            if pid not in first or first[pid][0] != v[0] and not first[pid][0].startswith(("?", "/work/main/.venv/bin/python")):
                first[pid] = v if smp is a else [v[0], 0, 0, 0]
            last[pid] = v
    use = defaultdict(lambda: [0, 0, 0, 0])
    for pid, v in last.items():
        old = first[pid]
        cpu, mn, mj = v[1] - old[1], v[2] - old[2], v[3] - old[3]
        if cpu <= 0 and mn <= 0 and mj <= 0:
            continue
        g = use[("* " if len(v) > 6 and v[6] in ours_ns else "  ") + v[0].split(" --")[0][:60]]
        g[0] += cpu; g[1] += mn; g[2] += mj; g[3] += 1
    split = defaultdict(int)
    for pid, v in last.items():
        kind = "ours" if len(v) > 6 and v[6] in ours_ns else "others"
        if kind == "ours":
            kind = "ours-model" if any(k in v[0] for k in ("TPWorker", "Draft", "Target", "Router")) else "ours-ray"
        split[kind] += v[1] - first[pid][1]
    total = sum(g[0] for g in use.values()) / 100
    print(f"{label}: {dt:.1f} s, all processes {total:.1f} CPU s ({total / dt:.2f} cores), load {a['load']}->{b['load']}")
    if ours_ns:
        print("   " + ", ".join(f"{k} {split[k] / 100 / dt:.2f} cores" for k in ("ours-model", "ours-ray", "others")))
    if "cpu" in a:
        c = [(y - x) / 100 for x, y in zip(a["cpu"], b["cpu"])]
        vm = {k: b["vm"][k] - a["vm"].get(k, 0) for k in b["vm"] if b["vm"][k] != a["vm"].get(k, 0)}
        print(f"   machine: user {c[0] + c[1]:.1f} s system {c[2]:.1f} idle {c[3]:.1f} iowait {c[4]:.1f} irq+soft "
              f"{c[5] + c[6]:.1f} steal {c[7]:.1f}; vmstat {vm}")
    for name, g in sorted(use.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"   {g[0] / 100 / dt:5.2f} cores  {g[0] / 100:6.1f} s  minflt {g[1]:8d} majflt {g[2]:5d}  x{g[3]} {name}")

# ready -> settled: the first 2-second window after "ready" in which the rest of our Ray cluster (ours, not a
# model replica: raylet, GCS, dashboard and agents, Serve controller and proxy, idle workers) used < 0.1 cores
# and, separately, in which the other processes of the machine did (another user's work: outside our control)
ready = dict(phases).get("ready")
if ready is not None and ours_ns:
    def kind(v):
        if len(v) <= 6 or v[6] not in ours_ns:
            return "others"
        return "ours-model" if any(k in v[0] for k in ("TPWorker", "Draft", "Target", "Router")) else "ours-ray"

    found: dict = {}
    windows = []
    i = next(j for j, s in enumerate(samples) if s["t"] >= ready)
    while i + 4 < len(samples):
        a, b = samples[i], samples[i + 4]
        use = defaultdict(int)
        for pid, v in b["p"].items():
            old = a["p"].get(pid)
            use[kind(v)] += v[1] - (old[1] if old and old[0] == v[0] else 0)
        dt = b["t"] - a["t"]
        windows.append((a["t"] - ready, {k: use[k] / 100 / dt for k in ("ours-model", "ours-ray", "others")}))
        i += 4
    for k in ("ours-ray", "others"):
        found[k] = next((round(t, 1) for t, u in windows if u[k] < 0.1), None)
    print(f"ready -> settled (2-s window < 0.1 cores): ours-ray at ready+{found['ours-ray']} s, "
          f"others at ready+{found['others']} s; per 10 s after ready (ours-model/ours-ray/others cores): "
          + " ".join(f"{t:.0f}:{u['ours-model']:.2f}/{u['ours-ray']:.2f}/{u['others']:.2f}" for t, u in windows[::5][:12]))
