"""Served demo pair with the default preset (local-cpu) and the default weight format, in one run:

1. RSS: the sum of RSS of the Ray worker processes that hold the router, the draft, the target
   replica and its TP ranks (psutil), sampled every 0.5 s while the application deploys (peak)
   and after the requests (steady);
2. speed: code prompts, greedy, through gRPC, one client; each prompt once with K = 0 (the
   request's k is a ceiling: plain decoding through the same deployment) and once adaptive (no
   k: the default tenant's controller chooses), interleaved so both see the same machine load.
   Tokens/s per side, their ratio, and the K the controller used per adaptive request (k_counts).

Run under the heavy lock:
    flock -w 1800 /tmp/specdec-heavy.lock python docs/bench/formats/scripts/served.py [--tokens 32] [--prompts 3] [--min-confidence 0.4] [--max-k 8]
Prints JSON.
"""
import argparse
import json
import os
import socket
import sys
import threading
import time

import psutil

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a Python function that merges two sorted lists.",
]
ROLES = ("Router", "Draft", "Target", "TPWorker")


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def model_processes():
    """{pid: (title, rss bytes)} of the Ray worker processes holding router/draft/target/TP ranks
    (titles get the pid appended: two TP ranks share a title)."""
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            title = " ".join(p.info["cmdline"] or [])
            if title.startswith("ray::") and any(r in title for r in ROLES):
                out[p.pid] = (f"{title.split()[0]}[{p.pid}]", p.memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tp", type=int, default=None, help="target TP degree (default: the preset's)")
    ap.add_argument("--min-confidence", type=float, default=None,
                    help="AppConfig.draft_min_confidence, the app's default early stop of drafting (default: the preset's)")
    ap.add_argument("--max-k", type=int, default=None, help="AppConfig.default_max_k (default: the preset's)")
    args = ap.parse_args()
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from deployments.app import build_app
    from deployments.client import SpecDecClient, build_request
    from deployments.config import HEALTH_SERVICER, PRESETS, SPECDEC_SERVICER, AppConfig

    cfg = AppConfig.model_validate({**PRESETS["local-cpu.yaml"].model_dump(), "grpc_port": _free_port(),
                                    "http_port": _free_port(), **({"target_tp": args.tp} if args.tp else {}),
                                    **({"draft_min_confidence": args.min_confidence} if args.min_confidence is not None else {}),
                                    **({"default_max_k": args.max_k} if args.max_k is not None else {})})
    out = {"target_format": cfg.target_format(), "draft_format": cfg.draft_format(), "target_tp": cfg.target_tp,
           "draft_min_confidence": cfg.draft_min_confidence, "default_max_k": cfg.default_max_k,
           "load_avg_at_start": os.getloadavg()}
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    peak = {"sum": 0, "per_process": {}}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            procs = model_processes()
            peak["sum"] = max(peak["sum"], sum(r for _, r in procs.values()))
            for _, (t, r) in procs.items():
                peak["per_process"][t] = max(peak["per_process"].get(t, 0), r)
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        serve.start(http_options=HTTPOptions(port=cfg.http_port),
                    grpc_options=gRPCOptions(port=cfg.grpc_port, grpc_servicer_functions=[SPECDEC_SERVICER, HEALTH_SERVICER],
                                             request_timeout_s=3600))
        sampler.start()
        t0 = time.perf_counter()
        serve.run(build_app(cfg), name=cfg.app_name, route_prefix=f"/{cfg.app_name}")
        out["deploy_s"] = round(time.perf_counter() - t0, 1)
        procs = model_processes()
        out["rss_after_deploy_gb"] = {t: round(r / 1e9, 2) for t, r in procs.values()}
        out["rss_after_deploy_sum_gb"] = round(sum(r for _, r in procs.values()) / 1e9, 2)
        print(json.dumps(out), file=sys.stderr, flush=True)
        sides = {"k0": {"tokens": 0, "wall": 0.0, "outputs": []}, "adaptive": {"tokens": 0, "wall": 0.0, "outputs": [], "k_counts": []}}
        with SpecDecClient(f"localhost:{cfg.grpc_port}", application=cfg.app_name) as client:
            msgs = [{"role": "user", "content": PROMPTS[0]}]
            client.generate_proto(build_request(messages=msgs, max_tokens=4, k=0), timeout=1800)  # warm-up
            client.generate_proto(build_request(messages=msgs, max_tokens=4), timeout=1800)
            for p in PROMPTS[: args.prompts]:
                msgs = [{"role": "user", "content": p}]
                for side, k in (("k0", 0), ("adaptive", None)):
                    t0 = time.perf_counter()
                    resp = client.generate_proto(build_request(messages=msgs, max_tokens=args.tokens, k=k), timeout=1800)
                    dt = time.perf_counter() - t0
                    s = sides[side]
                    s["tokens"] += len(resp.token_ids)
                    s["wall"] += dt
                    s["outputs"].append(list(resp.token_ids))
                    if side == "adaptive":
                        s["k_counts"].append(dict(resp.stats.k_counts))
                        s.setdefault("acceptance", []).append(round(resp.stats.acceptance_rate, 2)
                                                             if resp.stats.HasField("acceptance_rate") else None)
                    print(side, len(resp.token_ids), round(dt, 1), dict(resp.stats.k_counts), file=sys.stderr, flush=True)
            try:  # the router's K controller: acceptance estimate, measured costs, last decision
                from google.protobuf import json_format
                out["controller"] = json_format.MessageToDict(client.tenant_stats("draft"))
            except Exception as e:  # statistics only; the measurement stands without them
                out["controller"] = f"unavailable: {e!r}"
        procs = model_processes()
        out["rss_after_requests_gb"] = {t: round(r / 1e9, 2) for t, r in procs.values()}
        out["rss_after_requests_sum_gb"] = round(sum(r for _, r in procs.values()) / 1e9, 2)
        stop.set()
        out["peak_rss_sum_gb"] = round(peak["sum"] / 1e9, 2)
        out["peak_rss_per_process_gb"] = {t: round(r / 1e9, 2) for t, r in peak["per_process"].items()}
        for side, s in sides.items():
            out[side] = {"tokens": s["tokens"], "wall_s": round(s["wall"], 1), "tokens_per_s": round(s["tokens"] / s["wall"], 2),
                         **({"k_counts": s["k_counts"], "acceptance": s.get("acceptance")} if side == "adaptive" else {})}
        out["adaptive_over_k0"] = round(out["adaptive"]["tokens_per_s"] / out["k0"]["tokens_per_s"], 2)
        out["identical_outputs"] = sides["k0"]["outputs"] == sides["adaptive"]["outputs"]
    finally:
        stop.set()
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    out["load_avg_at_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
