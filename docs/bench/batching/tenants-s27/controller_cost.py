"""Session 27: the K-under-load controller's work per tick as the tenants in the batch grow.

    PYTHONPATH=$PWD python docs/bench/batching/tenants-s27/controller_cost.py [EVIDENCE]

A :class:`specdec.control.batch_k.BatchKController` learns its costs from the first 400 forwards
of a goal run's K trace (``inprocess-s26-final2``: the demo pair's measured 1-8 row forwards and
draft forwards), then decides over T tenants (T x sessions = 8 rows, then 16 and 32 tenants of one
session), 60 decisions, each followed by one ``step_k`` per session (what a tick asks) and the next
traced forward; every tenant at acceptance 1.0 or 0.5 with EVIDENCE records of 4 drafts
(default 20; 1: tenants of barely measured acceptance, whose probes are asked for more often).
Prints the median and the largest milliseconds per tick (a tick where the held tenants' probes
come due is the largest).
"""
import gzip
import json
import os
import statistics
import sys
import time

from specdec.control.batch_k import BatchKController

TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "inprocess-s26-final2", "k-trace.jsonl.gz")


def main() -> None:
    evidence = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    ticks = [r for r in map(json.loads, gzip.open(TRACE)) if "tick" in r]
    print("tenants x sessions  median ms/tick  largest ms/tick  K chosen")
    for tenants, per in ((2, 4), (4, 2), (8, 1), (16, 1), (32, 1)):
        names = [f"t{i}" for i in range(tenants)]
        ctl = BatchKController(budget=128, k_ranges={t: (0, 4) for t in names})
        for r in ticks[:400]:
            rows, pos, s, ctx = r["tick"]
            ctl.observe_tick(rows, pos, s, [tuple(x) for x in r["drafts"]], context=ctx)
        for i, t in enumerate(names):
            for _ in range(evidence):
                ctl.estimator.record((t, "draft"), 4, 4 if i % 2 == 0 else 2)
        times = []
        for j, r in enumerate(ticks[400:460]):
            t0 = time.perf_counter()
            ctl.decide({(t, "draft"): per for t in names}, behind={t: 100 + j for t in names},
                       tokens_left={t: 100.0 - j for t in names}, context=120.0 + j)
            for t in names:
                for _ in range(per):
                    ctl.step_k(t, 4)
            times.append(time.perf_counter() - t0)
            rows, pos, s, ctx = r["tick"]
            ctl.observe_tick(rows, pos, s, [tuple(x) for x in r["drafts"]], context=ctx)
        print(f"{tenants:7d} x {per}  {statistics.median(times) * 1e3:14.2f}  {max(times) * 1e3:15.2f}  "
              f"{sorted(set(ctl.last.ks.values()))}", flush=True)


if __name__ == "__main__":
    main()
