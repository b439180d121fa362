"""Session 28: the draft replica's K-under-load work per tick (BatchKSessions: decisions, probes,
goodput guards, the cost model's prices) as tenants and the positions budget grow; no model.

    PYTHONPATH=$PWD python docs/bench/batching/host-s28/served_cost.py [BUDGET ...]

For each budget (default 64, the presets', and 512) and (tenants x sessions each): a
:class:`specdec.control.batch_k.BatchKSessions` with per-tenant goodput guards over a
:class:`specdec.control.batch_k.BatchKController` (K 0..4 per tenant) whose cost model has measured
a verify forward of the batch's rows at every positions count from the rows to the budget (0.1 s +
3 ms per position beyond the rows, 3 times each: the curve of a server that has run those shapes)
and draft forwards of 1..rows rows; then 300 ticks, each one ``k_for`` and one ``observe_step`` per
session with the tick's 0.1-s K = 0 forward (a new forward each tick, as served). Prints the median
and the largest milliseconds per tick over the last 250.
"""
import statistics
import sys
import time

from specdec.control.batch_cost import BatchCostModel
from specdec.control.batch_k import BatchKController, BatchKSessions
from specdec.control.goodput_guard import GoodputGuard
from specdec.types import BatchShape


def main() -> None:
    budgets = [int(b) for b in sys.argv[1:]] or [64, 512]
    print("budget  tenants x sessions  median ms/tick  largest ms/tick")
    for budget in budgets:
        for tenants, per in ((2, 16), (8, 4), (32, 1), (16, 4)):
            rows = tenants * per
            cost = BatchCostModel(max_positions=max(budget, rows))
            for positions in range(rows, max(rows, budget) + 1):
                for _ in range(3):
                    cost.observe_verify(rows, positions, 0.1 + 0.003 * (positions - rows))
            for r in range(1, rows + 1):
                cost.observe_draft(r, 0.003 * r)
            names = [f"t{i:02d}" for i in range(tenants)]
            live = BatchKSessions(BatchKController(budget=budget, cost=cost, k_ranges={t: (0, 4) for t in names}),
                                  guard=GoodputGuard())
            keys = [(t, j) for t in names for j in range(per)]
            for key in keys:
                live.join(key, key[0], "draft", k_range=(0, 4))
            times = []
            for step in range(300):
                shape = BatchShape(forward=step, rows=rows, positions=rows, seconds=0.1)
                t0 = time.perf_counter()
                for key in keys:
                    k = live.k_for(key[0], 4)
                    live.observe_step(key, k, min(k, 2), shape, draft_s=0.01 if k else 0.0005, verify_s=0.1)
                times.append(time.perf_counter() - t0)
            print(f"{budget:6d}  {tenants:7d} x {per:<9d}  {statistics.median(times[50:]) * 1e3:14.2f}  "
                  f"{max(times[50:]) * 1e3:15.2f}", flush=True)


if __name__ == "__main__":
    main()
