"""Benchmark: served aggregate tokens/s at 1, 2, 4 and 8 concurrent clients, batched against
unbatched, both deployed at once and measured interleaved in one run.

    python -m benchmarks.served_clients --clients 1,2,4,8 --tokens 32 --rounds 2 \\
        --out docs/bench/batching/served-s11/clients-1248.json

The local-cpu preset (gRPC -> Router -> Draft -> Target, the demo pair, start-up calibration) is
deployed twice in one Ray, as application ``batched`` (continuous batching on: target_batching,
draft_batching) and ``unbatched`` (both off, batch size 1), each calibrated before the first
request. After one warm-up group per mode (the largest client count, half the tokens; not
counted), every round runs, for each client count N, N concurrent requests (one thread and
channel each, the code prompts of :data:`benchmarks.serving.PROMPTS` round-robin, greedy,
proposer draft, K at most ``--k``: the default tenant's K under load) on each mode in turn;
the mode order alternates from group to group and round to round, so both modes see the same
machine load. Per group: aggregate tokens/s = all tokens / wall seconds of the group, server CPU
seconds (every process of the local Ray cluster: the idle application's share is its idle
polling), tokens per server CPU second, steps and K per step, the target's batched forwards.
``--variant KEY=VALUE`` deploys every mode a second time with that AppConfig override (app
``MODE-v``, e.g. ``--variant omp_spin_count=0``), measured interleaved with the others.
Per mode and N: the median over the rounds; the table gives batched / unbatched at each N and
each mode's N clients / its one client. Greedy outputs must be the same for a prompt in every
group of every mode: checked (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks.serving import PROMPTS, _free_port, _requests, run_concurrent

#: the two applications: name -> AppConfig overrides
MODES = {"batched": {"target_batching": True, "draft_batching": True},
         "unbatched": {"target_batching": False, "draft_batching": False}}


def table(summary: dict, clients: list[int], modes: list[str]) -> list[str]:
    """Markdown rows: per N, each mode's median tokens/s (and per server CPU s), batched / unbatched,
    and each mode's N clients / its 1 client (when 1 was measured)."""
    head = "| clients | " + " | ".join(f"{m} tok/s (tok/CPU-s)" for m in modes)
    rows = [head + " | batched / unbatched | batched N / unbatched 1 | batched N / batched 1 |",
            "|---:|" + "---:|" * len(modes) + "---:|---:|---:|"]
    for n in clients:
        cells = [f"{summary[m][n]['tok_per_s']:.2f} ({summary[m][n]['tok_per_cpu_s']:.2f})" for m in modes]
        b, u = summary.get("batched", {}), summary.get("unbatched", {})
        ratio = f"{b[n]['tok_per_s'] / u[n]['tok_per_s']:.3f}" if n in b and n in u else "-"
        vs_u1 = f"{b[n]['tok_per_s'] / u[1]['tok_per_s']:.2f}x" if n in b and 1 in u else "-"
        vs_b1 = f"{b[n]['tok_per_s'] / b[1]['tok_per_s']:.2f}x" if n in b and 1 in b else "-"
        rows.append(f"| {n} | " + " | ".join(cells) + f" | {ratio} | {vs_u1} | {vs_b1} |")
    return rows


def parse_variant(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--variant``: an AppConfig field and its value read as YAML (``0`` an int,
    ``true`` a bool, ``w8a8`` a string), as the field would be written in a config file.

    Raises:
        ValueError: no ``=``, an empty value, or KEY not an AppConfig field.
    """
    import yaml

    from deployments.config import AppConfig

    key, sep, value = text.partition("=")
    if not sep or not value or key not in AppConfig.model_fields:
        raise ValueError(f"need KEY=VALUE with an AppConfig field as KEY, got {text!r}")
    return key, yaml.safe_load(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="1,2,4,8", help="concurrency levels")
    p.add_argument("--tokens", type=int, default=32, help="max_tokens per request")
    p.add_argument("--k", type=int, default=4, help="the requests' K (a ceiling: the default tenant is adaptive)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default="batched,unbatched", help="comma list of batched, unbatched")
    p.add_argument("--target", default=None, help="target model spec (default: the preset's, demo:target)")
    p.add_argument("--draft", default=None, help="draft model spec (default: the preset's, demo:draft)")
    p.add_argument("--variant", default=None, metavar="KEY=VALUE",
                   help="also deploy every mode with this AppConfig override (app MODE-v), e.g. omp_spin_count=0")
    p.add_argument("--no-warmup", action="store_true", help="no warm-up group (tests)")
    p.add_argument("--out", default=None, help="JSON file for the results (a .md table is written beside it; "
                   "while it runs, what has run so far in .partial.json)")
    a = p.parse_args(argv)
    clients = [int(c) for c in a.clients.split(",") if c]
    modes = [m for m in a.modes.split(",") if m]
    if not clients or min(clients) < 1 or not modes or any(m not in MODES for m in modes) or a.rounds < 1:
        p.error("need client counts >= 1, modes from batched/unbatched and --rounds >= 1")

    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from deployments.app import build_app
    from deployments.config import HEALTH_SERVICER, PRESETS, SPECDEC_SERVICER, AppConfig

    base = PRESETS["local-cpu.yaml"].model_dump()
    base.update({"grpc_port": _free_port(), "http_port": _free_port(), "default_max_k": a.k})
    base.update({k: v for k, v in (("target_model", a.target), ("draft_model", a.draft)) if v})
    cfgs = {m: AppConfig.model_validate({**base, "app_name": m, **MODES[m]}) for m in modes}
    if a.variant:
        try:
            key, value = parse_variant(a.variant)
            for m in list(modes):
                cfgs[f"{m}-v"] = AppConfig.model_validate({**base, "app_name": f"{m}-v", **MODES[m], key: value})
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            p.error(f"--variant: {e}")
        modes = [x for m in modes for x in (m, f"{m}-v")]
    requests = _requests(PROMPTS, a.tokens, a.k)
    out: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                             "load_avg_at_start": os.getloadavg()},
                 "settings": {k: v for k, v in vars(a).items() if k != "out"},
                 "started_utc": time.strftime("%H:%M:%S", time.gmtime()), "rounds": []}
    print(f"[served_clients] {out['started_utc']} UTC load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    # fractional CPUs per app (1.25 a pair): Ray's count only admits both; torch threads as the preset's
    ray.init(address="local", num_cpus=2 * len(cfgs), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    address = f"localhost:{base['grpc_port']}"
    outputs: dict[str, set] = {}  # prompt -> the distinct outputs seen
    try:
        serve.start(grpc_options=gRPCOptions(port=base["grpc_port"], request_timeout_s=3600,
                                             grpc_servicer_functions=[SPECDEC_SERVICER, HEALTH_SERVICER]))
        t0 = time.perf_counter()
        for m, cfg in cfgs.items():
            serve.run(build_app(cfg), name=m, route_prefix=f"/{m}")
            serve.get_deployment_handle("Draft", app_name=m).calibrate.remote().result(timeout_s=600)
        out["deploy_s"] = time.perf_counter() - t0
        print(f"[served_clients] {modes} deployed and calibrated in {out['deploy_s']:.0f} s", file=sys.stderr, flush=True)

        def stats_fn(m: str):
            handle = serve.get_deployment_handle("Target", app_name=m)
            return lambda: handle.BatchStats.remote().result(timeout_s=30)

        def group(m: str, n: int, reqs: list[dict]) -> dict:
            r = run_concurrent(address, m, reqs, n, stats_fn(m))
            for i, ids in enumerate(r.pop("outputs")):
                if ids is not None:
                    outputs.setdefault(reqs[i % len(reqs)]["messages"][0]["content"] + f"|{reqs[0]['max_tokens']}",
                                       set()).add(tuple(ids))
            return r

        if not a.no_warmup:
            warm = _requests(PROMPTS, max(4, a.tokens // 2), a.k)
            for m in modes:
                r = group(m, max(clients), warm)
                print(f"[served_clients] warm-up {m}: {r['aggregate_tokens_per_s']:.2f} tok/s", file=sys.stderr, flush=True)
        flip = False
        for rnd in range(a.rounds):
            results: dict = {m: {} for m in modes}
            for n in clients:
                for m in (modes[::-1] if flip else modes):
                    r = group(m, n, requests)
                    results[m][n] = r
                    print(f"[served_clients] round {rnd} {m} {n} clients: {r['aggregate_tokens_per_s']:.2f} tok/s, "
                          f"{r['tokens_per_server_cpu_s'] or 0:.2f} tok/CPU-s, steps {r.get('steps')}, "
                          f"batch {r.get('batch')}, errors {len(r['errors'])}, load {r['load_avg_1min'][1]:.2f}",
                          file=sys.stderr, flush=True)
                    if a.out:  # what has run so far, should the run be cut short
                        partial = {**out, "rounds": out["rounds"] + [results]}
                        Path(a.out).with_suffix(".partial.json").write_text(json.dumps(partial, indent=2, default=str) + "\n")
                flip = not flip
            out["rounds"].append(results)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    out["machine"]["load_avg_at_end"] = os.getloadavg()
    out["ended_utc"] = time.strftime("%H:%M:%S", time.gmtime())
    summary: dict = {}
    for m in modes:
        summary[m] = {}
        for n in clients:
            runs = [rnd[m][n] for rnd in out["rounds"]]
            summary[m][n] = {"tok_per_s": statistics.median(r["aggregate_tokens_per_s"] for r in runs),
                             "tok_per_cpu_s": statistics.median(r["tokens_per_server_cpu_s"] or 0.0 for r in runs),
                             "rounds_tok_per_s": [round(r["aggregate_tokens_per_s"], 2) for r in runs],
                             "errors": sum(len(r["errors"]) for r in runs)}
    same = all(len(v) == 1 for v in outputs.values())
    out["summary"] = summary
    out["outputs_identical"] = same
    c0 = cfgs[modes[0]]
    lines = [f"Served, local-cpu preset (target {c0.target_model} {c0.target_format()}, draft {c0.draft_model} "
             f"{c0.draft_format()}), {' and '.join(modes)} deployed at once; {a.tokens} tokens per "
             f"request, greedy, proposer draft, K <= {a.k} (K under load); median of {a.rounds} round(s), modes "
             f"interleaved per client count; {out['started_utc']}-{out['ended_utc']} UTC, load "
             f"{out['machine']['load_avg_at_start'][0]:.2f} -> {out['machine']['load_avg_at_end'][0]:.2f}.", "",
             *table(summary, clients, modes), "",
             f"Per round tok/s: {json.dumps({m: {n: s['rounds_tok_per_s'] for n, s in v.items()} for m, v in summary.items()})}",
             f"Outputs identical across modes and rounds: {same}; errors: "
             f"{sum(s['errors'] for v in summary.values() for s in v.values())}"]
    text = "\n".join(lines)
    print(json.dumps(out, indent=2, default=str))
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
        Path(a.out).with_suffix(".md").write_text(text + "\n")
        Path(a.out).with_suffix(".partial.json").unlink(missing_ok=True)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
