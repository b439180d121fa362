"""client_pair.py with each request's start and end (unix seconds) in its line and in PHASES (a file, the
environment's ``PHASES``: ``reqN START`` lines for cpu_summary_s12.py); ``SETTLE_S`` seconds of idle first."""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

phases = open(os.environ["PHASES"], "a") if os.environ.get("PHASES") else None
settle = float(os.environ.get("SETTLE_S", "0"))
if settle:
    if phases:
        phases.write(f"settle {time.time():.3f}\n"); phases.flush()
    time.sleep(settle)
from deployments.client import SpecDecClient, build_request  # noqa: E402
from deployments.cli import DEMO_MESSAGE  # noqa: E402


def one(client, proposer, n, max_tokens=128):
    req = build_request(messages=[{"role": "user", "content": DEMO_MESSAGE}], max_tokens=max_tokens, proposer=proposer)
    t_start = time.time()
    if phases:
        phases.write(f"req{n}-{proposer or 'default'} {t_start:.3f}\n"); phases.flush()
    t0 = time.perf_counter(); tokens = 0; last = None; ids = []
    for chunk in client.stream_proto(req, timeout=600):
        tokens += len(chunk.token_ids); ids += list(chunk.token_ids); last = chunk
    wall = time.perf_counter() - t0
    s = last.stats
    return {"proposer": proposer or "default", "tokens": tokens, "tok_s": round(tokens / wall, 2),
            "start": round(t_start, 1), "wall_s": round(wall, 2),
            "steps": s.steps, "target_compute_ms": round(s.target_compute_s * 1000), "ids_hash": hash(tuple(ids)),
            "k_counts": dict(sorted(s.k_counts.items())),
            "acc": round(s.acceptance_rate, 3) if s.HasField("acceptance_rate") else None,
            "draft_s": round(s.draft_time_s, 2), "verify_s": round(s.verify_time_s, 2),
            "round_trip_ms": round(s.round_trip_s * 1000), "cost_draft_s": round(s.cost_draft_s, 2),
            "cost_drafted": s.cost_drafted}


PROPOSERS = [None if p == "default" else p for p in os.environ.get("PROPOSERS", "default,none,default,none").split(",")]
with SpecDecClient("localhost:9000", application="specdec") as c:
    for n, proposer in enumerate(PROPOSERS, 1):
        print(json.dumps(one(c, proposer, n)), flush=True)
    if phases:
        phases.write(f"end {time.time():.3f}\n"); phases.flush()
