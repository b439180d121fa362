"""Against a running `specdec serve`: the demo request with speculation and with plain decoding (proposer none),
alternated; per request its speculation counters (K per step, acceptance, draft/verify seconds), and at the end
the default tenant's controller view (GetTenantStats: alpha, K, cost terms, K under load per draft replica)."""
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
            "steps": s.steps, "target_compute_ms": round(s.target_compute_s * 1000), "ids_hash": hash(tuple(ids)),
            "k_counts": dict(sorted(s.k_counts.items())),
            "acc": round(s.acceptance_rate, 3) if s.HasField("acceptance_rate") else None,
            "draft_s": round(s.draft_time_s, 2), "verify_s": round(s.verify_time_s, 2),
            "round_trip_ms": round(s.round_trip_s * 1000), "cost_draft_s": round(s.cost_draft_s, 2),
            "cost_drafted": s.cost_drafted}

import os
PROPOSERS = [None if p == "default" else p for p in os.environ.get("PROPOSERS", "default,none,default,none").split(",")]
with SpecDecClient("localhost:9000", application="specdec") as c:
    for proposer in PROPOSERS:
        print(json.dumps(one(c, proposer)), flush=True)
    from google.protobuf.json_format import MessageToDict
    try:
        ts = MessageToDict(c.tenant_stats(), preserving_proto_field_name=True)
        ts.pop("usage", None)
        print("tenant_stats " + json.dumps(ts), flush=True)
    except Exception as e:  # noqa: BLE001 - a diagnostic line only
        print(f"tenant_stats unavailable: {type(e).__name__}: {e}", flush=True)
