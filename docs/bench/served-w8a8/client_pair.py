"""Against a running `specdec serve`: the demo request with speculation and with plain decoding (proposer none), alternated."""
import sys, time, json
from deployments.client import SpecDecClient, build_request
from deployments.cli import DEMO_MESSAGE

def one(client, proposer, max_tokens=128):
    req = build_request(messages=[{"role": "user", "content": DEMO_MESSAGE}], max_tokens=max_tokens, proposer=proposer)
    t0 = time.perf_counter(); tokens = 0; last = None; ids = []
    for chunk in client.stream_proto(req, timeout=600):
        tokens += len(chunk.token_ids); ids += list(chunk.token_ids); last = chunk
    wall = time.perf_counter() - t0
    s = last.stats
    return {"proposer": proposer or "default", "tokens": tokens, "tok_s": round(tokens / wall, 2),
            "steps": s.steps, "target_compute_ms": round(s.target_compute_s * 1000), "ids_hash": hash(tuple(ids))}

import os
PROPOSERS = [None if p == "default" else p for p in os.environ.get("PROPOSERS", "default,none,default,none").split(",")]
with SpecDecClient("localhost:9000", application="specdec") as c:
    for proposer in PROPOSERS:
        print(json.dumps(one(c, proposer)), flush=True)
