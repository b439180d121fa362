"""Against a running `specdec serve`: what automatic prefix caching saves a tenant whose requests share a long
system prompt (a support bot's instructions, a copilot's file). ROUNDS rounds of QUESTIONS requests, each the same
~SYSTEM_TOKENS-token system message and a different short question, 8 greedy tokens each, one at a time; per request
the time to the first streamed token (TTFT) and the whole request. The first request of round 1 fills the cache;
every later one can start from it. Printed as JSON lines, then medians of requests 2.. (cache warm).

    PYTHONPATH=$PWD python docs/bench/prefix-s15/ttft.py [ROUNDS]
"""
import json, statistics, sys, time
from deployments.client import SpecDecClient, build_request

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
with open("deployments/config.py") as f:  # ~ a few hundred tokens of this repository's own code as the shared context
    SYSTEM = "You answer questions about this Python module. Module source:\n" + f.read()[:1800]
QUESTIONS = ["What does AppConfig hold?", "Name one preset.", "What is max_batch_positions?", "Which port is gRPC?"]

def one(c, q):
    req = build_request(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], max_tokens=8)
    t0 = time.perf_counter(); first = None; ids = []; last = None
    for chunk in c.stream_proto(req, timeout=600):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
        ids += list(chunk.token_ids); last = chunk
    return {"q": q, "ttft_ms": round(first * 1000), "total_ms": round((time.perf_counter() - t0) * 1000),
            "prompt_tokens": last.usage.prompt_tokens if last.HasField("usage") else None, "ids": ids}

rows = []
with SpecDecClient("localhost:9000", application="specdec") as c:
    for r in range(ROUNDS):
        for q in QUESTIONS:
            row = {"round": r + 1, **one(c, q)}; rows.append(row); print(json.dumps(row), flush=True)
warm = rows[1:]
print(json.dumps({"median_ttft_ms_warm": statistics.median(x["ttft_ms"] for x in warm),
                  "median_total_ms_warm": statistics.median(x["total_ms"] for x in warm),
                  "first_ttft_ms": rows[0]["ttft_ms"]}), flush=True)
