"""Session 25's checks of the adaptive arm against fixed K, in one process on the demo pair.

    PYTHONPATH=$PWD python docs/bench/batching/checks-s25/adaptive_checks.py MODE [TOKENS]

One engine (w8a8 target, int4 draft, 2 threads, prefix caching on), warmed like
``benchmarks.batching_goal`` (a group of 2 at K = 4, then the controller's warm-up groups of 8 and 1 clients).
MODE:
- ``controller`` (TOKENS 32): 3 rounds of one client K = 4 and adaptive, 8 clients K = 0 and adaptive (order
  reversed every other round), with the controller's calls timed (decide, step_k, observe_*, the goodput guards);
- ``ticks`` (32): 3 rounds of 8 clients K = 0 and adaptive; each group's first verify forwards and its median
  8 x 1 tick;
- ``order`` (128): one client K = 4 / adaptive after 8-client groups of every arm (does an arm slow the next?);
- ``tail`` (128): 8 clients K = 0, adaptive, adaptive, K = 0: ticks by rows, seconds by rows, tokens per request,
  Python's garbage collections per group. ``SPECDEC_BATCH_K_TRACE=FILE`` traces the controller (as the goal run).
"""
import collections
import functools
import gc
import os
import statistics
import sys
import time

import torch

torch.set_num_threads(2)
from benchmarks.batching import _prompts, batch_controller, demo_engine, run_group  # noqa: E402
from benchmarks.batching_goal import guard_of, trace_controller, warm_controller  # noqa: E402
import specdec.engine.batch_adaptive as batch_adaptive  # noqa: E402

SEQUENCES = {
    "controller": [[(1, "K=4"), (1, "adaptive"), (8, "K=0"), (8, "adaptive")][::1 if r % 2 == 0 else -1] for r in range(3)],
    "ticks": [[(8, "K=0"), (8, "adaptive")][::1 if r % 2 == 0 else -1] for r in range(3)],
    "order": [[(1, "K=4"), (1, "adaptive"), (8, "K=0"), (1, "K=4"), (1, "K=4"), (1, "adaptive"), (8, "K=4"), (1, "K=4"),
               (1, "adaptive"), (8, "adaptive"), (1, "adaptive"), (1, "K=4")]],
    "tail": [[(8, "K=0"), (8, "adaptive"), (8, "adaptive"), (8, "K=0")]],
}


class Settings:  # what benchmarks.batching.batch_controller and batching_goal's helpers read
    budget, k, guard, clients, proposer = 128, 4, True, 8, "draft"


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "controller"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else (32 if mode in ("controller", "ticks") else 128)
    a = Settings()
    engine = demo_engine()
    controller = batch_controller(a)
    if os.environ.get("SPECDEC_BATCH_K_TRACE"):
        trace_controller(controller, os.environ["SPECDEC_BATCH_K_TRACE"])
    spent, calls = collections.defaultdict(float), collections.Counter()

    def timed(obj, name, key):
        f = getattr(obj, name)

        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t
                calls[key] += 1
        setattr(obj, name, wrapper)

    for name in ("decide", "step_k", "observe_row", "observe_tick"):
        timed(controller, name, name)
    timed(batch_adaptive.TenantGuards, "record_tick", "guard.record_tick")
    collections_ = [0, 0, 0]
    gc_s = [0.0]
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections_[info["generation"]] += 1
            gc_s[0] += time.perf_counter() - started[0]
    gc.callbacks.append(on_gc)
    warm_controller(engine, controller, a)
    for rnd, arms in enumerate(SEQUENCES[mode]):
        for clients, arm in arms:
            spent.clear()
            calls.clear()
            collections_[:] = [0, 0, 0]
            gc_s[0] = 0.0
            adaptive = arm == "adaptive"
            k = 4 if adaptive else int(arm[2:])
            r = run_group(engine, _prompts(clients), batched=True, k=k, proposer="draft", max_tokens=tokens,
                          budget=128, controller=controller if adaptive else None,
                          guard=guard_of(a) if adaptive else None, keep=(schedulers := []))
            print(f"r{rnd} {clients} {arm:9s} {r['tok_per_s']:6.2f} tok/s wall {r['wall_s']:.3f} verify "
                  f"{r['verify_s_total']:.3f} draft {r['draft_s_total']:.3f} ticks {r['ticks']} K {r['k_counts']} "
                  f"load {os.getloadavg()[0]:.2f} ctl "
                  + " ".join(f"{n}={spent[n] * 1000:.1f}ms/{calls[n]}" for n in sorted(spent)), flush=True)
            trace = schedulers[0].trace
            if mode == "ticks" and clients == 8:
                print("   first ticks (positions, verify ms):", [(t.positions_fed, round(t.verify_s * 1000))
                                                               for t in trace[:4]],
                      "median after them", round(1000 * statistics.median(t.verify_s for t in trace[4:])), flush=True)
            if mode == "tail":
                by_rows = collections.Counter(len(t.answered) for t in trace)
                seconds = collections.defaultdict(float)
                for t in trace:
                    seconds[len(t.answered)] += t.verify_s + t.draft_s
                print("   rows->ticks", dict(sorted(by_rows.items())),
                      "rows->s", {n: round(v, 2) for n, v in sorted(seconds.items())}, flush=True)
                print("   gc", collections_, f"{gc_s[0] * 1000:.0f} ms;",
                      "per-request tokens", [len(o) for o in r["outputs"]], flush=True)


if __name__ == "__main__":
    main()
