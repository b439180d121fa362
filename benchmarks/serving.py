"""Serving benchmark: gRPC + Ray Serve against the in-process engine, and concurrency scaling.

    python -m benchmarks.serving                          # demo pair, local-cpu preset
    python -m benchmarks.serving --tokens 32 --clients 1,4,8 --out docs/bench/serving.json

In one run, on the same prompts and parameters (greedy, proposer ``draft``, the same K):

1. **in-process**: :class:`specdec.engine.engine.SpeculativeEngine` in this process, one request at a
   time; tokens/s = generated tokens / wall seconds;
2. **served, one client**: the same requests one at a time through the real gRPC port (Serve's
   gRPC proxy -> Router -> Draft -> Target with TP workers); the ratio served / in-process is the
   serving overhead (target: >= 0.9). In-process and served requests are *interleaved*
   (prompt 1 in process, prompt 1 served, prompt 2 ...) so that both see the same machine load
   on a shared box; the in-process models are freed before the concurrency runs;
3. **concurrency**: N clients at once (N = 1, 4, 8), each sending one request per prompt;
   aggregate tokens/s = all tokens / wall seconds of the whole batch.

Outputs JSON (stdout and ``--out``). The served outputs are checked to be identical to the
in-process ones (greedy).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import socket
import sys
import threading
import time

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a JavaScript function that reverses a string.",
    "Write a Python class for a stack with push, pop and peek.",
]


#: API key of the bench tenant (set by main).
API_KEY: str | None = None


def run_clients(worker, clients: int) -> float:
    """Run ``worker(i)`` for i in 0..clients-1, each in its own thread, all started together;
    the wall-clock seconds until the last one ends."""
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _requests(prompts, tokens: int, k: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": p}], "max_tokens": tokens,
             "speculation": {"proposer": "draft", "k": k}} for p in prompts]


def build_engine(cfg):
    from specdec.engine.engine import SpeculativeEngine
    from specdec.models.loader import load_model
    from specdec.models.spec import parse_model_spec
    from specdec.models.vocab import check_pair_compatible

    target = load_model(parse_model_spec(cfg.target_model), weight_format=cfg.target_format())
    draft = load_model(parse_model_spec(cfg.draft_model), weight_format=cfg.draft_format())
    check_pair_compatible(draft, target)
    return SpeculativeEngine(target, draft)


def in_process_one(engine, r: dict):
    from specdec.request import parse_request

    t0 = time.perf_counter()
    res = engine.generate(parse_request(r))
    return res.token_ids, time.perf_counter() - t0


def _served_one(client, r: dict):
    from deployments.client import build_request

    t0 = time.perf_counter()
    resp = client.generate_proto(
        build_request(messages=r["messages"], max_tokens=r["max_tokens"], proposer="draft", max_k=r["speculation"]["k"]),
        timeout=1800,
    )
    return resp, time.perf_counter() - t0


def run_interleaved(engine, address: str, app: str, requests: list[dict]) -> tuple[dict, dict]:
    """Each request in process, then served (one client); returns (in_process, served) summaries."""
    from deployments.client import SpecDecClient

    in_outs, in_tokens, in_wall = [], 0, 0.0
    with SpecDecClient(address, application=app, api_key=API_KEY) as client:
        in_process_one(engine, {**requests[0], "max_tokens": 4})  # warm-ups
        _served_one(client, {**requests[0], "max_tokens": 4})
        outs, tokens, wall, rtt, tgt, wire, steps, acc, prop = [], 0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0
        for r in requests:
            ids, dt = in_process_one(engine, r)
            in_wall += dt
            in_tokens += len(ids)
            in_outs.append(list(ids))
            resp, dt = _served_one(client, r)
            wall += dt
            tokens += len(resp.token_ids)
            outs.append(list(resp.token_ids))
            s = resp.stats
            steps += s.steps
            acc += s.accepted
            prop += s.proposed
            rtt += s.round_trip_s * s.steps
            tgt += s.target_compute_s * s.steps
            wire += s.wire_bytes_per_step * s.steps
    inproc = {"requests": len(requests), "tokens": in_tokens, "wall_s": in_wall,
              "tokens_per_s": in_tokens / in_wall, "outputs": in_outs}
    return inproc, {
        "requests": len(requests), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "acceptance_rate": acc / prop if prop else None, "steps": steps,
        "wire_bytes_per_step": wire / steps, "round_trip_ms": 1000 * rtt / steps,
        "target_compute_ms": 1000 * tgt / steps, "transport_ms": 1000 * (rtt - tgt) / steps, "outputs": outs,
    }


def serving_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process's live descendants: the local Ray
    cluster this benchmark started (raylet, GCS, the Serve proxy, router, draft and target
    replicas, TP workers), not the clients in this process. On a machine shared with other
    jobs, tokens per CPU second of the server is the figure robust to their load (wall time
    is not)."""
    import psutil
    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        try:
            t = proc.cpu_times()
        except psutil.Error:  # exited meanwhile
            continue
        total += t.user + t.system
    return total


def run_concurrent(address: str, app: str, requests: list[dict], clients: int, batch_stats_fn=None) -> dict:
    """``clients`` threads, each with its own channel, each sending one request (prompts round-robin).

    ``batch_stats_fn``: returns the target replica's ``BatchStats`` dict (rows and positions per
    batched forward); called before and after to report this group's forwards.
    """
    from deployments.client import SpecDecClient

    tokens = [0] * clients
    errors: list[str] = []

    outputs: list = [None] * clients
    stats: list = [None] * clients

    def worker(i: int) -> None:
        try:
            with SpecDecClient(address, application=app, api_key=API_KEY) as client:
                resp, _ = _served_one(client, requests[i % len(requests)])
                tokens[i] = len(resp.token_ids)
                outputs[i] = list(resp.token_ids)
                stats[i] = resp.stats
        except Exception as e:  # reported, not raised
            errors.append(repr(e))

    before = batch_stats(batch_stats_fn)
    cpu0, load0 = serving_cpu_s(), os.getloadavg()[0]
    wall = run_clients(worker, clients)
    cpu1, load1 = serving_cpu_s(), os.getloadavg()[0]
    after = batch_stats(batch_stats_fn)
    cpu = cpu1 - cpu0
    return {"clients": clients, "requests": clients, "tokens": sum(tokens), "wall_s": wall,
            "aggregate_tokens_per_s": sum(tokens) / wall, "server_cpu_s": cpu,
            "tokens_per_server_cpu_s": sum(tokens) / cpu if cpu else None, "load_avg_1min": [load0, load1],
            "errors": errors, "outputs": outputs,
            **step_stats([s for s in stats if s is not None]), "batch": batch_delta(before, after)}


def step_stats(stats: list) -> dict:
    """Per speculation step, pooled over the requests' ``SpeculationStats``: steps, mean target
    compute (the target replica's forward the step ran in, seconds), mean draft <-> target round
    trip, mean drafting seconds, acceptance rate."""
    steps = sum(s.steps for s in stats)
    if not steps:
        return {"steps": 0}
    prop = sum(s.proposed for s in stats)
    return {
        "steps": steps,
        "target_compute_s_per_step": sum(s.target_compute_s * s.steps for s in stats) / steps,
        "round_trip_s_per_step": sum(s.round_trip_s * s.steps for s in stats) / steps,
        "draft_s_per_step": sum(s.draft_time_s for s in stats) / steps,
        "acceptance_rate": sum(s.accepted for s in stats) / prop if prop else None,
    }


def batch_stats(fn) -> dict | None:
    """The target replica's ``BatchStats`` (None when ``fn`` is None or the call fails)."""
    if fn is None:
        return None
    try:
        return fn()
    except Exception:  # best effort: the unbatched path may keep none
        return None


def batch_delta(before: dict | None, after: dict | None) -> dict | None:
    """Batched forwards between two ``BatchStats`` snapshots: count, mean rows, mean positions.

    Exact while the target's window (its last 1000 forwards) has not wrapped; None otherwise or
    when a snapshot is missing.
    """
    if before is None or after is None or after["forwards"] >= 1000:
        return None
    n = after["forwards"] - before["forwards"]
    if n <= 0:
        return {"forwards": 0, "mean_rows": 0.0, "mean_positions": 0.0}
    rows = after["mean_rows"] * after["forwards"] - before["mean_rows"] * before["forwards"]
    pos = after["mean_positions"] * after["forwards"] - before["mean_positions"] * before["forwards"]
    return {"forwards": n, "mean_rows": rows / n, "mean_positions": pos / n}


#: AppConfig fields a ``--modes`` entry may set (``batched:batch_window_s=0.05``).
MODE_FIELDS = {"batch_window_s": float, "batch_fill_wait_s": float, "max_batch_positions": int, "cpu_threads": int, "draft_cpu_threads": int,
               "admission_slots": int}


def parse_mode(text: str) -> tuple[bool, dict]:
    """``"batched"``, ``"unbatched"``, or either followed by ``:field=value`` settings of
    :data:`MODE_FIELDS` (e.g. ``"batched:batch_window_s=0.05:cpu_threads=1"``).

    Returns:
        (batched, AppConfig overrides: the batching switches and the settings).

    Raises:
        ValueError: another name, an unknown field, a setting without ``=``, or a value of the wrong type.
    """
    name, *settings = text.strip().split(":")
    if name not in ("batched", "unbatched"):
        raise ValueError(f"mode {text!r}: expected batched or unbatched, then optional :field=value")
    batched = name == "batched"
    over: dict = {"target_batching": batched, "draft_batching": batched}
    for item in settings:
        field, eq, value = item.partition("=")
        if not eq or field not in MODE_FIELDS:
            raise ValueError(f"mode {text!r}: {item!r} is not field=value with a field of {sorted(MODE_FIELDS)}")
        try:
            over[field] = MODE_FIELDS[field](value)
        except ValueError:
            raise ValueError(f"mode {text!r}: {field} needs a {MODE_FIELDS[field].__name__}, got {value!r}") from None
    return batched, over


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="target model spec (default: the preset's, demo:target)")
    parser.add_argument("--draft", default=None, help="draft model spec (default: the preset's, demo:draft)")
    parser.add_argument("--tp", type=int, default=None, help="target TP degree (default: the preset's)")
    parser.add_argument("--tokens", type=int, default=32, help="max_tokens per request")
    parser.add_argument("--k", type=int, default=4, help="K (draft tokens per step)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts in the served-vs-in-process comparison")
    parser.add_argument("--clients", default="1,4,8", help="concurrency levels")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--modes", default="batched",
                        help="comma list of unbatched/batched, each optionally with :field=value settings "
                        "(batch_window_s, batch_fill_wait_s, max_batch_positions, cpu_threads, draft_cpu_threads, admission_slots; e.g. "
                        "batched:batch_window_s=0.05): the concurrency runs are repeated per mode in this run (the app "
                        "is redeployed with target_batching/draft_batching and the settings); the in-process "
                        "comparison runs with the first mode only")
    parser.add_argument("--skip-in-process", action="store_true", help="only the concurrency runs")
    parser.add_argument("--target-format", default=None,
                        help="weight format of the target (target_dtype; default: the device's default)")
    parser.add_argument("--draft-format", default=None,
                        help="weight format of the draft (draft_dtype; default: the device's default)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch threads per model process (AppConfig.cpu_threads; default: the preset's)")
    parser.add_argument("--draft-cpu-threads", type=int, default=None,
                        help="torch threads of the draft replica (AppConfig.draft_cpu_threads; default: the preset's)")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        mode_over = {m: parse_mode(m)[1] for m in modes}
    except ValueError as e:
        parser.error(str(e))
    if not modes:
        parser.error("--modes takes batched and/or unbatched")

    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from deployments.app import build_app
    from deployments.config import HEALTH_SERVICER, PRESETS, SPECDEC_SERVICER, AppConfig

    # One bench tenant with a fixed K equal to --k: served and in-process run the same K (the
    # adaptive controller would otherwise choose its own K for the served side).
    import tempfile

    import yaml

    from specdec.control.tenants import generate_api_key, hash_api_key

    global API_KEY
    API_KEY = generate_api_key()
    tenants = {"tenants": [{
        "id": "bench", "api_key_hashes": [hash_api_key(API_KEY)],
        "limits": {"max_concurrent_requests": 64, "max_tokens": 4096, "max_prompt_tokens": 8192},
        "speculation": {"allowed_proposers": ["draft", "ngram", "none"], "k_min": 0, "k_max": 16,
                        "adaptive": False, "fixed_k": args.k},
    }]}
    tenants_file = os.path.join(tempfile.mkdtemp(prefix="specdec-bench-"), "tenants.yaml")
    with open(tenants_file, "w") as f:
        yaml.safe_dump(tenants, f)
    over = {"grpc_port": _free_port(), "http_port": _free_port(), "tenants_file": tenants_file,
            "default_max_k": max(args.k, 1)}
    if args.target:
        over["target_model"] = args.target
    if args.draft:
        over["draft_model"] = args.draft
    if args.tp:
        over["target_tp"] = args.tp
    if args.target_format:
        over["target_dtype"] = args.target_format
    if args.draft_format:
        over["draft_dtype"] = args.draft_format
    if args.cpu_threads is not None:
        over["cpu_threads"] = args.cpu_threads
    if args.draft_cpu_threads is not None:
        over["draft_cpu_threads"] = args.draft_cpu_threads
    base = {**PRESETS["local-cpu.yaml"].model_dump(), **over}
    cfg = AppConfig.model_validate({**base, **mode_over[modes[0]]})
    requests = _requests(PROMPTS[: args.prompts], args.tokens, args.k)
    out: dict = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_at_start": os.getloadavg()},
        "config": {"target": cfg.target_model, "draft": cfg.draft_model, "target_tp": cfg.target_tp,
                   "target_format": cfg.target_format(), "draft_format": cfg.draft_format(),
                   "cpu_threads": cfg.cpu_threads, "draft_cpu_threads": cfg.draft_cpu_threads,
                   "tokens_per_request": args.tokens, "k": args.k, "prompts": PROMPTS[: args.prompts]},
    }
    engine = None
    if not args.skip_in_process:
        print("[bench_serving] loading the in-process engine ...", file=sys.stderr, flush=True)
        engine = build_engine(cfg)
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options=HTTPOptions(port=cfg.http_port),
                    grpc_options=gRPCOptions(port=cfg.grpc_port, grpc_servicer_functions=[SPECDEC_SERVICER, HEALTH_SERVICER],
                                             request_timeout_s=3600))
        t0 = time.perf_counter()
        serve.run(build_app(cfg), name=cfg.app_name, route_prefix=f"/{cfg.app_name}")
        out["deploy_s"] = time.perf_counter() - t0
        address = f"localhost:{cfg.grpc_port}"
        target = serve.get_deployment_handle("Target", app_name=cfg.app_name)

        def target_batch_stats() -> dict:
            return target.BatchStats.remote().result(timeout_s=30)
        if engine is not None:
            print("[bench_serving] in-process vs served (one client), interleaved ...", file=sys.stderr, flush=True)
            inproc, served = run_interleaved(engine, address, cfg.app_name, requests)
            del engine
            gc.collect()
            out["identical_outputs"] = served["outputs"] == inproc["outputs"]
            out["in_process"] = {k: v for k, v in inproc.items() if k != "outputs"}
            out["served_one_client"] = {k: v for k, v in served.items() if k != "outputs"}
            out["served_over_in_process"] = served["tokens_per_s"] / inproc["tokens_per_s"]
        out["concurrency"] = []
        out["modes"] = {}
        for i, mode in enumerate(modes):
            if i > 0:  # redeploy with the other batching setting
                cfg = AppConfig.model_validate({**base, **mode_over[mode]})
                t0 = time.perf_counter()
                serve.run(build_app(cfg), name=cfg.app_name, route_prefix=f"/{cfg.app_name}")
                out.setdefault("redeploy_s", []).append(time.perf_counter() - t0)
            # untimed warm-up after each (re)deploy, so no mode's first group pays the replicas' cold start
            t0 = time.perf_counter()
            run_concurrent(address, cfg.app_name, [{**requests[0], "max_tokens": 4}], 1)
            out.setdefault("warmup_s", []).append(time.perf_counter() - t0)
            runs = []
            for n in [int(x) for x in args.clients.split(",") if x]:
                print(f"[bench_serving] {mode}: {n} concurrent clients ...", file=sys.stderr, flush=True)
                runs.append(run_concurrent(address, cfg.app_name, requests, n, target_batch_stats))
                r = runs[-1]
                print(f"[bench_serving]   {r['aggregate_tokens_per_s']:.2f} tok/s, "
                      f"{r['tokens_per_server_cpu_s'] or 0:.3f} tok per server CPU s, load {r['load_avg_1min']}, "
                      f"{r['steps']} steps, target "
                      f"{r.get('target_compute_s_per_step', 0):.3f} s/step, round trip "
                      f"{r.get('round_trip_s_per_step', 0):.3f} s/step, draft {r.get('draft_s_per_step', 0):.3f} s/step, "
                      f"batch {r['batch']}", file=sys.stderr, flush=True)
                if args.out:  # what is measured so far survives a run cut short (the heavy lock's time)
                    with open(args.out + ".partial", "w") as f:
                        json.dump({**out, "modes": {**out["modes"], mode: runs}}, f, indent=2, default=str)
            out["modes"][mode] = runs
            if i == 0:
                out["concurrency"] = runs
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    if len(out.get("modes", {})) > 1:
        per_mode = [[r["outputs"] for r in runs] for runs in out["modes"].values()]
        out["modes_identical_outputs"] = all(p == per_mode[0] for p in per_mode)
    for runs in out.get("modes", {}).values():
        for r in runs:  # a digest of the outputs instead, so that separate runs can be compared
            r["outputs_sha256"] = hashlib.sha256(json.dumps(r.pop("outputs", None)).encode()).hexdigest()
    out["machine"]["load_avg_at_end"] = os.getloadavg()
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
