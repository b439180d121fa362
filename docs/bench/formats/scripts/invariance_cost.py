"""Cost of the shape-invariant forward per weight format: plain vs invariant forward of the demo
target over 1 / 4 / 16 new positions on a 64-token cache, same weights, alternating, one run.

usage: flock -w 1800 /tmp/specdec-heavy.lock python invariance_cost.py bfloat16,int8,int4
env: THREADS (default 2), ROUNDS (default 3: median of 3 alternating rounds).
Prints one JSON line per format and a markdown table at the end (docs/history/weight-formats.md,
"Cost of invariance").
"""
import gc, json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import forward_times  # noqa: E402  (sets threads, offline env)
from common import text_ids  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.models.spec import DemoModelSpec  # noqa: E402

rows = []
for fmt in sys.argv[1].split(","):
    t0 = time.perf_counter()
    target = load_model(DemoModelSpec(role="target"), weight_format=fmt, invariant=True)
    load_s = time.perf_counter() - t0
    times = forward_times(target.model, text_ids(target.tokenizer, 96))
    print(json.dumps({"fmt": fmt, "load_s": round(load_s, 1), "forward_s [median wall, median CPU]": times}), flush=True)
    rows.append((fmt, times))
    del target
    gc.collect()
print(f"\n{time.strftime('%H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f}")
print("| format | plain, 1 / 4 / 16 positions (s wall) | invariant, 1 / 4 / 16 (s wall) | invariant / plain at 16 |")
print("|---|---|---|---:|")
for fmt, t in rows:
    p = [t[f"plain n={n}"][0] for n in (1, 4, 16)]
    i = [t[f"invariant n={n}"][0] for n in (1, 4, 16)]
    print(f"| {fmt} | {' / '.join(f'{x:.3f}' for x in p)} | {' / '.join(f'{x:.3f}' for x in i)} | {i[2] / p[2]:.2f}x |")
