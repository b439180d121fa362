"""Benchmark: K under load, served: adaptive K vs fixed K (K = 0 included), two tenants, one run.

    python -m benchmarks.batching_served --clients 8 --max-tokens 24 --fixed-ks 0,1,4 \
        --out docs/bench/batching/served_tenants.json

The local-cpu preset (gRPC -> Router -> Draft -> Target, its TP size from the preset, continuous batching on) is
deployed once with a tenants file holding one pair of tenants per arm: ``code-<arm>`` and
``creative-<arm>``; arm ``K=k`` pins K (policy ``adaptive: false, fixed_k: k``), arm
``adaptive`` lets the draft replica's batch controller choose K per tenant under load (at most
``--k-max``). Each arm runs ``--clients`` concurrent requests (half code prompts as the code
tenant, half creative prompts as the creative tenant, greedy, proposer draft) and reports total
and per-tenant tokens/s = completion tokens / wall seconds of the group, the K per step the
requests used, and whether the outputs equal the K = 0 arm's (greedy: they must). A warm-up
group of the adaptive arm runs first (the controller learns α̂ and the batch's costs, as on a
server that has been running); the arms then alternate in the given order, then in reverse
(``--rounds 2``), and the table gives each arm's mean over its rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.adaptive_k import CODE_PROMPTS, CREATIVE_PROMPTS
from benchmarks.serving import run_clients


def _tenants(arms: list[str], k_max: int) -> tuple[dict, dict[str, str]]:
    from specdec.control.tenants import generate_api_key, hash_api_key

    keys: dict[str, str] = {}
    tenants = []
    for arm in arms:
        for kind in ("code", "creative"):
            tid = f"{kind}-{arm.replace('=', '')}"
            keys[tid] = generate_api_key()
            spec = {"allowed_proposers": ["draft", "ngram", "none"], "k_min": 0, "k_max": k_max}
            spec.update({"adaptive": True} if arm == "adaptive" else {"adaptive": False, "fixed_k": int(arm[2:])})
            tenants.append({"id": tid, "api_key_hashes": [hash_api_key(keys[tid])],
                            "limits": {"max_concurrent_requests": 64, "max_tokens": 4096, "max_prompt_tokens": 8192},
                            "speculation": spec})
    return {"tenants": tenants}, keys


def run_arm(address: str, app: str, arm: str, keys: dict[str, str], clients: int, max_tokens: int,
            k_max: int, kinds: tuple[str, ...] = ("code", "creative")) -> dict:
    """``clients`` concurrent requests of one arm, client i as tenant ``kinds[i % len(kinds)]``
    with that kind's prompts; tokens/s overall and per tenant, K counts, outputs."""
    from deployments.client import SpecDecClient, build_request

    prompts = {"code": CODE_PROMPTS, "creative": CREATIVE_PROMPTS}
    n = len(kinds)
    jobs = [(kinds[i % n], prompts[kinds[i % n]][i // n % len(prompts[kinds[i % n]])]) for i in range(clients)]
    outputs: list = [None] * clients
    stats: list = [None] * clients
    errors: list[str] = []

    def worker(i: int) -> None:
        kind, prompt = jobs[i]
        try:
            with SpecDecClient(address, application=app, api_key=keys[f"{kind}-{arm.replace('=', '')}"]) as c:
                resp = c.generate_proto(build_request(messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=max_tokens, proposer="draft", k=k_max), timeout=1800)
            outputs[i] = list(resp.token_ids)
            stats[i] = resp.stats
        except Exception as e:  # reported, not raised
            errors.append(repr(e))

    wall = run_clients(worker, clients)
    k_counts: dict[int, int] = {}
    for s in stats:
        if s is not None:
            for k, n in s.k_counts.items():
                k_counts[int(k)] = k_counts.get(int(k), 0) + int(n)
    tok = {kind: sum(len(o or []) for (kk, _), o in zip(jobs, outputs) if kk == kind) for kind in sorted(set(kinds))}
    return {"arm": arm, "wall_s": wall, "tokens": sum(tok.values()), "tok_per_s": sum(tok.values()) / wall,
            "tok_per_s_by_tenant": {k: v / wall for k, v in tok.items()},
            "k_counts": dict(sorted(k_counts.items())), "errors": errors, "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--fixed-ks", default="0,1,4")
    p.add_argument("--k-max", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--target", default=None, help="target model spec (default: the preset's, demo:target)")
    p.add_argument("--draft", default=None, help="draft model spec (default: the preset's, demo:draft)")
    p.add_argument("--target-format", default=None,
                   help="weight format of the target (target_dtype; default: the device's default)")
    p.add_argument("--draft-format", default=None,
                   help="weight format of the draft (draft_dtype; default: the device's default)")
    p.add_argument("--kinds", default="code,creative",
                   help="the tenants the clients alternate between (code, creative; e.g. 'code' for code prompts only)")
    p.add_argument("--out", default=None, help="JSON file for the results (a .md table is written beside it)")
    a = p.parse_args(argv)

    import ray
    import yaml
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from benchmarks.serving import _free_port
    from deployments.app import build_app
    from deployments.config import HEALTH_SERVICER, PRESETS, SPECDEC_SERVICER, AppConfig
    from deployments.client import SpecDecClient

    arms = [f"K={k}" for k in a.fixed_ks.split(",") if k] + ["adaptive"]
    kinds = tuple(k for k in a.kinds.split(",") if k)
    if not kinds or any(k not in ("code", "creative") for k in kinds):
        p.error(f"--kinds: code and/or creative, got {a.kinds!r}")
    tenants, keys = _tenants(arms, a.k_max)
    tenants_file = os.path.join(tempfile.mkdtemp(prefix="specdec-bench-"), "tenants.yaml")
    Path(tenants_file).write_text(yaml.safe_dump(tenants))
    over = {"grpc_port": _free_port(), "http_port": _free_port(), "tenants_file": tenants_file,
            "default_max_k": a.k_max}
    over.update({k: v for k, v in (("target_model", a.target), ("draft_model", a.draft),
                                   ("target_dtype", a.target_format), ("draft_dtype", a.draft_format)) if v})
    cfg = AppConfig.model_validate({**PRESETS["local-cpu.yaml"].model_dump(), **over})
    out: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                             "load_avg_at_start": os.getloadavg()},
                 "settings": {k: v for k, v in vars(a).items() if k != "out"}, "rounds": []}
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options=HTTPOptions(port=cfg.http_port),
                    grpc_options=gRPCOptions(port=cfg.grpc_port, request_timeout_s=3600,
                                             grpc_servicer_functions=[SPECDEC_SERVICER, HEALTH_SERVICER]))
        t0 = time.perf_counter()
        serve.run(build_app(cfg), name=cfg.app_name, route_prefix=f"/{cfg.app_name}")
        out["deploy_s"] = time.perf_counter() - t0
        address = f"localhost:{cfg.grpc_port}"
        print(f"[batching_served] deployed in {out['deploy_s']:.0f}s; warm-up ...", file=sys.stderr, flush=True)
        out["warm_up"] = {k: v for k, v in run_arm(address, cfg.app_name, "adaptive", keys, a.clients,
                                                    max(4, a.max_tokens // 2), a.k_max, kinds).items() if k != "outputs"}
        for rnd in range(a.rounds):
            order = arms if rnd % 2 == 0 else arms[::-1]
            results = {}
            for arm in order:
                r = run_arm(address, cfg.app_name, arm, keys, a.clients, a.max_tokens, a.k_max, kinds)
                results[arm] = r
                print(f"[batching_served] round {rnd} {arm}: {r['tok_per_s']:.2f} tok/s, K {r['k_counts']}",
                      file=sys.stderr, flush=True)
                if a.out:  # what has run so far, should the run be cut short
                    partial = {k: v for k, v in out.items() if k != "rounds"}
                    partial["rounds"] = out["rounds"] + [results]
                    Path(a.out).with_suffix(".partial.json").write_text(json.dumps(partial, indent=2, default=str) + "\n")
            out["rounds"].append(results)
        with SpecDecClient(address, application=cfg.app_name, api_key=keys["code-adaptive"]) as c:
            code = c.tenant_stats()
        with SpecDecClient(address, application=cfg.app_name, api_key=keys["creative-adaptive"]) as c:
            creative = c.tenant_stats()
        out["k_under_load"] = {
            name: {"k_under_load": s.batch.k_under_load if s.batch.HasField("k_under_load") else None,
                   "rows_per_step": s.batch.tenant_rows_per_step, "positions_per_step": s.batch.tenant_positions_per_step,
                   "steps": s.batch.tenant_steps, "acceptance_rate": s.acceptance_rate if s.HasField("acceptance_rate") else None}
            for name, s in (("code", code), ("creative", creative))}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    out["machine"]["load_avg_at_end"] = os.getloadavg()
    ref = [r["K=0"]["outputs"] for r in out["rounds"] if "K=0" in r]
    summary = {}
    for arm in arms:
        runs = [r[arm] for r in out["rounds"]]
        summary[arm] = {
            "tok_per_s": sum(r["tok_per_s"] for r in runs) / len(runs),
            "code_tok_per_s": sum(r["tok_per_s_by_tenant"].get("code", 0.0) for r in runs) / len(runs),
            "creative_tok_per_s": sum(r["tok_per_s_by_tenant"].get("creative", 0.0) for r in runs) / len(runs),
            "k_counts": runs[-1]["k_counts"],
            "identical_to_k0": None if not ref else all(r["outputs"] == ref[0] for r in runs),
            "errors": sum(len(r["errors"]) for r in runs),
        }
    out["summary"] = summary
    for rnd in out["rounds"]:
        for r in rnd.values():
            r.pop("outputs", None)
    lines = [f"Served (local-cpu preset, target TP={cfg.target_tp}, target {cfg.target_format()}, "
             f"draft {cfg.draft_format()}), tenants {' + '.join(kinds)}, {a.clients} clients, "
             f"{a.max_tokens} tokens each, greedy, draft proposer; adaptive = K per tenant under load "
             f"(at most {a.k_max}); mean of {a.rounds} round(s), arms alternating.", "",
             "| arm | total tok/s | code tok/s | creative tok/s | steps at K (last round) | identical to K=0 | errors |",
             "|---|---:|---:|---:|---|---|---:|"]
    for arm, s in summary.items():
        lines.append(f"| {arm} | {s['tok_per_s']:.2f} | {s['code_tok_per_s']:.2f} | {s['creative_tok_per_s']:.2f} | "
                     f"{s['k_counts']} | {'yes' if s['identical_to_k0'] else 'NO'} | {s['errors']} |")
    lines += ["", f"K under load at the end (GetTenantStats): {json.dumps(out.get('k_under_load'))}"]
    text = "\n".join(lines)
    print(json.dumps(out, indent=2))
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
        Path(a.out).with_suffix(".md").write_text(text + "\n")
        Path(a.out).with_suffix(".partial.json").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
