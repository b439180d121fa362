"""Session 28: full garbage collections per arm of the in-process goal benchmark.

    PYTHONPATH=$PWD python docs/bench/batching/host-s28/gc_probe.py [benchmarks.batching_goal arguments]

Runs ``benchmarks.batching_goal`` with a ``gc.callbacks`` hook that sums, per arm label (the
benchmark's ``_ARM``; "warm-up" covers loading and the warm-up, before the freeze), the count and
milliseconds of generation-2 (full) collections and of the others; printed to stderr at exit.
"""
import atexit
import collections
import gc
import runpy
import sys
import time

stats = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])  # label -> [gen2 n, gen2 s, other n, other s]
start = {}


def callback(phase, info):
    if phase == "start":
        start["t"] = time.perf_counter()
        return
    dt = time.perf_counter() - start.get("t", time.perf_counter())
    main = sys.modules.get("__main__")
    label = getattr(main, "_ARM", {}).get("label", "?") if main is not None else "?"
    s = stats[label]
    if info["generation"] == 2:
        s[0] += 1
        s[1] += dt
    else:
        s[2] += 1
        s[3] += dt


def report():
    print("GC per arm: label: gen2 n, gen2 ms, gen0/1 n, gen0/1 ms", file=sys.stderr)
    for k, v in stats.items():
        print(f"  {k}: {v[0]} {v[1] * 1e3:.1f} {v[2]} {v[3] * 1e3:.1f}", file=sys.stderr)


gc.callbacks.append(callback)
atexit.register(report)
sys.argv = ["batching_goal"] + sys.argv[1:]
runpy.run_module("benchmarks.batching_goal", run_name="__main__", alter_sys=True)
