"""One client, served: two or more configurations of the local-cpu preset deployed at once in one
Ray (by default the batched path, continuous batching on, against the unbatched one,
target_batching and draft_batching off), the demo request (greedy, the default tenant's
adaptive K; optionally also plain decoding) sent to each in turn.

    ip netns exec ns-X env RAY_TMPDIR=/tmp/ray-X HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$PWD \\
        timeout 330 .venv/bin/python docs/bench/served-w8a8/one_client_modes.py [ROUNDS] [MAX_TOKENS]

env: MODES (default "batched,unbatched"; also "threads1": one torch thread per model process,
"draft1": one in the draft replica, two in the target's rank),
PROPOSERS (default "default"; "default,none" adds plain decoding per mode and round),
TARGET / DRAFT (other model specs, e.g. tiny models for a smoke test), FRESH=1 (no warm-up
requests: round 1 holds each fresh server's first requests, round 2 its second; the served goal).

Every app is calibrated at start-up, then one warm-up request per mode and proposer (not
counted), then ROUNDS (default 3) rounds of one request per mode and proposer, the mode order
alternating round by round, so all see the same machine load. Per request: tokens/s, steps, K
per step, target compute and round trip per step, drafting seconds; then per mode and proposer
the median tokens/s, and the ratios of the medians (first mode / each other mode; speculation
/ plain decoding per mode). Greedy outputs must be identical: checked.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
MAX_TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 128


def main() -> int:
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from deployments.app import build_app
    from deployments.cli import DEMO_MESSAGE
    from deployments.client import SpecDecClient, build_request
    from deployments.config import HEALTH_SERVICER, PRESETS, SPECDEC_SERVICER, AppConfig

    base = PRESETS["local-cpu.yaml"].model_dump()
    known = {"batched": {}, "unbatched": {"target_batching": False, "draft_batching": False},
             "threads1": {"cpu_threads": 1, "draft_cpu_threads": 1}, "draft1": {"draft_cpu_threads": 1}}
    names = os.environ.get("MODES", "batched,unbatched").split(",")
    proposers = os.environ.get("PROPOSERS", "default").split(",")
    for field, env in (("target_model", "TARGET"), ("draft_model", "DRAFT")):  # a smoke test on tiny models
        base[field] = os.environ.get(env) or base[field]
    modes = {m: AppConfig.model_validate({**base, "app_name": m, **known[m]}) for m in names}
    print(f"== {time.strftime('%H:%M:%S', time.gmtime())} UTC load {os.getloadavg()[0]:.2f}", flush=True)
    # two apps of fractional CPUs each (1.25 CPUs a pair): Ray's CPU count only admits them; torch threads as the preset's
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    port = base["grpc_port"]
    serve.start(grpc_options=gRPCOptions(port=port, grpc_servicer_functions=[SPECDEC_SERVICER, HEALTH_SERVICER]))
    t0 = time.perf_counter()
    for name, cfg in modes.items():
        serve.run(build_app(cfg), name=name, route_prefix=f"/{name}")
        serve.get_deployment_handle("Draft", app_name=name).calibrate.remote().result(timeout_s=300)
    print(f"== apps {names} ready and calibrated in {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.2f}",
          flush=True)

    def one(mode: str, proposer: str) -> dict:
        req = build_request(messages=[{"role": "user", "content": DEMO_MESSAGE}], max_tokens=MAX_TOKENS,
                            proposer=None if proposer == "default" else proposer)
        ids: list[int] = []
        last = None
        with SpecDecClient(f"localhost:{port}", application=mode) as c:
            t = time.perf_counter()
            for chunk in c.stream_proto(req, timeout=600):
                ids += list(chunk.token_ids)
                last = chunk
            wall = time.perf_counter() - t
        s = last.stats
        return {"mode": mode, "proposer": proposer, "tok_s": round(len(ids) / wall, 2), "tokens": len(ids), "steps": s.steps,
                "k_counts": dict(sorted(s.k_counts.items())),
                "target_compute_ms": round(s.target_compute_s * 1000), "round_trip_ms": round(s.round_trip_s * 1000),
                "draft_s": round(s.draft_time_s, 2), "load": round(os.getloadavg()[0], 2), "ids": ids}

    for mode in ([] if os.environ.get("FRESH") == "1" else modes):  # warm-up: not counted
        for p in proposers:
            r = one(mode, p)
            r.pop("ids")
            print("warmup " + json.dumps(r), flush=True)
    got: dict[tuple[str, str], list[dict]] = {(m, p): [] for m in modes for p in proposers}
    order = list(modes)
    for i in range(ROUNDS):
        for mode in (order if i % 2 == 0 else order[::-1]):
            for p in proposers:
                r = one(mode, p)
                got[(mode, p)].append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "ids"}), flush=True)
    same = len({tuple(r["ids"]) for rs in got.values() for r in rs}) == 1
    med = {key: statistics.median(r["tok_s"] for r in rs) for key, rs in got.items()}
    for (m, p), v in med.items():
        print(f"== {m} {p}: median {v:.2f} tok/s", flush=True)
    first = order[0]
    for p in proposers:
        for m in order[1:]:
            rounds = [round(a["tok_s"] / b["tok_s"], 3) for a, b in zip(got[(first, p)], got[(m, p)])]
            print(f"== {p}: {first} / {m} = {med[(first, p)] / med[(m, p)]:.3f} of the medians (per round {rounds})",
                  flush=True)
    if "none" in proposers:
        for m in order:
            for p in proposers:
                if p != "none":
                    rounds = [round(a["tok_s"] / b["tok_s"], 3) for a, b in zip(got[(m, p)], got[(m, "none")])]
                    print(f"== {m}: {p} / plain = {med[(m, p)] / med[(m, 'none')]:.3f} of the medians "
                          f"(per round {rounds})", flush=True)
    print(f"== outputs identical: {same}; load {os.getloadavg()[0]:.2f}, {time.strftime('%H:%M:%S', time.gmtime())} UTC",
          flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
