"""Session 26: where the adaptive arm's extra verify seconds go at 8 clients x 128 tokens (demo pair, in process).

    PYTHONPATH=$PWD python docs/bench/batching/context-s26/goal_ticks.py [ROUNDS] [GC]

The goal run's neighbourhood of the two arms (one client K = 4, 8 clients K = 0, 8 clients adaptive, one client
adaptive; the order reversed every other round), warmed like ``benchmarks.batching_goal``. Both 8-client arms run
K = 0 on every step (the adaptive one by its controller's choice), so their ticks pair one to one (same rows, same
contexts, identical outputs): prints per round the arms' tokens/s, the median paired tick ratio (adaptive / K = 0),
the share of ticks where adaptive is slower, and the seconds between forwards (scheduler + controller). GC=1 runs
``gc.collect()`` and freezes before every group (rules out the collector).
"""
import gc
import os
import statistics
import sys
import time

import torch

torch.set_num_threads(2)
from benchmarks.batching import _prompts, batch_controller, demo_engine, run_group  # noqa: E402
from benchmarks.batching_goal import guard_of, warm_controller  # noqa: E402


class Settings:  # what benchmarks.batching_goal's helpers read
    budget, k, guard, clients, proposer = 128, 4, True, 8, "draft"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "order":
        return order_check()
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    freeze = len(sys.argv) > 2 and sys.argv[2] == "1"
    a = Settings()
    engine = demo_engine()
    controller = batch_controller(a)
    warm_controller(engine, controller, a)
    order = [(1, "K=4"), (8, "K=0"), (8, "adaptive"), (1, "adaptive")]
    for rnd in range(rounds):
        ticks = {}
        for clients, arm in (order if rnd % 2 == 0 else order[::-1]):
            if freeze:
                gc.collect()
                gc.freeze()
            adaptive = arm == "adaptive"
            r = run_group(engine, _prompts(clients), batched=True, k=4 if adaptive else int(arm[2:]), proposer="draft",
                          max_tokens=128, budget=128, controller=controller if adaptive else None,
                          guard=guard_of(a) if adaptive else None, keep=(scheds := []))
            trace = scheds[0].trace
            between = r["wall_s"] - sum(t.verify_s + t.draft_s for t in trace)
            print(f"r{rnd} {clients} {arm:9s} {r['tok_per_s']:6.2f} tok/s verify {r['verify_s_total']:.3f} "
                  f"between {between:.3f} ticks {len(trace)} K {r['k_counts']} load {os.getloadavg()[0]:.2f}", flush=True)
            if clients == 8:
                ticks[arm] = [(len(t.answered), t.context, t.verify_s) for t in trace]
        k0, ad = ticks["K=0"], ticks["adaptive"]
        same = [(x, y) for x, y in zip(k0, ad) if x[:2] == y[:2]]
        if not same or ticks["K=0"][-1][:2] != ticks["adaptive"][-1][:2]:
            print("   the arms' ticks differ (a probe ran K > 0): not paired", flush=True)
            continue
        ratios = [y[2] / x[2] for x, y in same if x[2] > 0]
        decode = [y[2] / x[2] for x, y in same if x[2] > 0 and x[0] >= 5]
        print(f"   paired ticks {len(same)}/{len(k0)}: median adaptive/K=0 {statistics.median(ratios):.3f}, "
              f"slower in {sum(q > 1 for q in ratios) / len(ratios):.0%}; decode ticks (>= 5 rows) median "
              f"{statistics.median(decode):.3f}; first 4 ticks {[round(q, 2) for q in ratios[:4]]}; "
              f"sum K=0 {sum(x[2] for x, _ in same):.3f} s, adaptive {sum(y[2] for _, y in same):.3f} s", flush=True)
        time.sleep(0)


def order_check() -> None:
    """``order``: 8-client K = 0 groups only (no controller), two in a row after a one-client K = 4 group, three
    times: is the first group after a one-client group faster than the second?"""
    engine = demo_engine()
    for rnd in range(3):
        got = []
        for clients, k in ((1, 4), (8, 0), (8, 0)):
            r = run_group(engine, _prompts(clients), batched=True, k=k, proposer="draft", max_tokens=128, budget=128)
            got.append(r)
            print(f"r{rnd} {clients} K={k} {r['tok_per_s']:6.2f} tok/s verify {r['verify_s_total']:.3f} "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
        print(f"   second / first 8-client group verify seconds: {got[2]['verify_s_total'] / got[1]['verify_s_total']:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
