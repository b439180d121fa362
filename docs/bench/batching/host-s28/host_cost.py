"""Session 28: the batch scheduler's host work per tick (outside the target and draft forwards) as
sessions and tenants grow, on the tiny pair (its forwards take a few ms, as a GPU's do).

    PYTHONPATH=$PWD python docs/bench/batching/host-s28/host_cost.py [ARMS [LOADS]]

ARMS: comma-separated of K=0, K=4, adaptive (default all); LOADS: comma-separated SESSIONSxTENANTS
(default 8x2,32x2,32x32,128x2,128x32). For each (sessions, tenants), the
sessions (12-token prompts, 24 tokens each, EOS ignored, draft proposer) run in one group on a
:class:`specdec.engine.batch.BatchScheduler` (positions budget 4096, one torch thread); adaptive:
a :class:`specdec.control.batch_k.BatchKController` (K 0..4 per tenant) with per-tenant goodput
guards, warmed by one group first (a server that has run: costs and acceptance learned), then the
measured group. Prints, over the ticks where every session stepped (the first two left out), the
median tick, its verify and draft forwards, and the host work = tick - verify - draft (the
scheduler's planning, verification bookkeeping, the controller's decisions and probes, the guards),
in ms and per row.
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
from transformers import Qwen2ForCausalLM  # noqa: E402

from specdec.control.batch_k import BatchKController  # noqa: E402
from specdec.control.goodput_guard import GoodputGuard  # noqa: E402
from specdec.engine.batch import BatchScheduler  # noqa: E402
from specdec.engine.engine import SpeculativeEngine  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.models.spec import HFModelSpec  # noqa: E402
from specdec.request import GenerationRequest  # noqa: E402
from specdec.testing.tiny import build_tiny_model  # noqa: E402

LOADS = ((8, 2), (32, 2), (32, 32), (128, 2), (128, 32))


def tiny_engine() -> SpeculativeEngine:
    root = Path(tempfile.mkdtemp())
    tf = build_tiny_model(root / "t", seed=0, max_positions=1024)
    df = build_tiny_model(root / "d", seed=1, base=Qwen2ForCausalLM.from_pretrained(tf), noise=0.03,
                          max_positions=1024)
    return SpeculativeEngine(load_model(HFModelSpec(kind="hf", path=tf), device="cpu"),
                             load_model(HFModelSpec(kind="hf", path=df), device="cpu"))


def group(engine, n: int, names: list[str], k: int, ctl) -> list[tuple[float, float, float, int]]:
    """(tick wall s, verify s, draft s, rows answered) per tick of one group of ``n`` sessions."""
    sched = BatchScheduler(engine, batched=True, max_batch_positions=4096, controller=ctl,
                           guard=GoodputGuard() if ctl is not None else None)
    for i in range(n):
        sched.submit(GenerationRequest(prompt_token_ids=[(7 * i + j) % 300 + 3 for j in range(12)], max_tokens=24,
                                       ignore_eos=True, speculation={"proposer": "draft", "k": k}),
                     tenant=names[i % len(names)], adaptive=ctl is not None)
    ticks = []
    t_prev = time.perf_counter()
    while sched.step() is not None:
        now = time.perf_counter()
        tr = sched.trace[-1]
        ticks.append((now - t_prev, tr.verify_s, tr.draft_s, len(tr.answered)))
        t_prev = now
    return ticks


def main() -> None:
    arms = sys.argv[1].split(",") if len(sys.argv) > 1 else ["K=0", "K=4", "adaptive"]
    loads = [tuple(int(x) for x in load.split("x")) for load in sys.argv[2].split(",")] if len(sys.argv) > 2 else LOADS
    engine = tiny_engine()
    print("sessions tenants arm        ticks  tick_ms  verify_ms  draft_ms  host_ms  host_us/row")
    for n, tenants in loads:
        for arm in arms:
            names = [f"t{i}" for i in range(tenants)]
            ctl = BatchKController(budget=4096, k_ranges={t: (0, 4) for t in names}) if arm == "adaptive" else None
            k = 0 if arm == "K=0" else 4
            group(engine, n, names, k, ctl)  # warm-up (adaptive: the controller learns)
            steady = [t for t in group(engine, n, names, k, ctl)[2:] if t[3] == n]
            host = statistics.median(w - v - d for w, v, d, _ in steady)
            print(f"{n:8d} {tenants:7d} {arm:9s} {len(steady):6d} {statistics.median(t[0] for t in steady) * 1e3:8.2f} "
                  f"{statistics.median(t[1] for t in steady) * 1e3:10.2f} "
                  f"{statistics.median(t[2] for t in steady) * 1e3:9.2f} {host * 1e3:8.2f} {host / n * 1e6:11.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
