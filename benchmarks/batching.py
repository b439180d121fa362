"""Benchmark: continuous batching against the unbatched path, in one run, in process.

    python -m benchmarks.batching --clients 1,2,4,8 --max-tokens 32,128 --k 4 --adaptive --out docs/bench/batching

For each request length (``--max-tokens``, a comma list: short requests are dominated by their
prompt's prefill, long ones by decoding) and number of concurrent clients c, c chat requests
(different prompts, code and creative mixed, greedy) start together and run to the end under a
:class:`specdec.engine.batch.BatchScheduler`, once batched and once with ``batched=False`` (every
draft and verify alone, as sessions queued behind each other were served before), and with
``--adaptive`` once more batched with K per tenant chosen under the current load (at most
``--k``) by a :class:`specdec.control.batch_k.BatchKController` warmed up once per format, like a
server that has been running; the arms alternate per client count. Aggregate tokens/s = all
completion tokens / wall seconds of the whole group. Outputs of all arms are compared token
for token (they must be identical).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from benchmarks.adaptive_k import CODE_PROMPTS, CREATIVE_PROMPTS
from benchmarks.report import write_bench_json


def _prompts(n: int) -> list[tuple[str, str]]:
    mixed = [p for pair in zip(CODE_PROMPTS, CREATIVE_PROMPTS) for p in pair]
    tenants = [t for _ in zip(CODE_PROMPTS, CREATIVE_PROMPTS) for t in ("code", "creative")]
    return [(tenants[i % len(mixed)], mixed[i % len(mixed)]) for i in range(n)]


def run_group(engine, prompts, *, batched: bool, k: int, proposer: str, max_tokens: int, budget: int,
              controller=None, guard=None, keep=None) -> dict:
    """Run the requests of one group together; wall seconds, tokens, outputs, batch shape.

    With a ``controller`` the requests are adaptive (K per tenant under load, at most ``k``);
    with a ``guard`` too (a :class:`specdec.control.goodput_guard.GoodputGuard`), per-tenant
    goodput guards overrule the controller as served (``BatchScheduler(guard=...)``). ``keep``:
    a list the group's scheduler is appended to (its ``trace`` has every tick).
    """
    from specdec.engine.batch import BatchScheduler
    from specdec.request import GenerationRequest

    prefix_warm(engine, sorted({t for t, _ in prompts}))
    sched = BatchScheduler(engine, batched=batched, max_batch_positions=budget, controller=controller, guard=guard)
    if keep is not None:
        keep.append(sched)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    handles = [
        sched.submit(GenerationRequest(messages=[{"role": "user", "content": c}], max_tokens=max_tokens,
                                       speculation={"proposer": proposer, "k": k}), tenant=t,
                     adaptive=controller is not None)
        for t, c in prompts
    ]
    sched.run_until_idle()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    results = [h.result() for h in handles]
    tokens = sum(len(r.token_ids) for r in results)
    rows = [len(t.answered) for t in sched.trace if t.answered]
    return {
        **forward_stats(sched.trace, k),
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens": tokens,
        "tok_per_s": tokens / wall,
        "tok_per_cpu_s": tokens / cpu if cpu > 0 else None,
        "ticks": len(sched.trace),
        "mean_rows_per_forward": sum(rows) / len(rows) if rows else 0.0,
        "mean_positions_per_forward": sum(t.positions_fed for t in sched.trace) / max(1, len(sched.trace)),
        "acceptance_rate": (sum(r.stats.accepted for r in results) / max(1, sum(r.stats.proposed for r in results))),
        "outputs": [r.token_ids for r in results],
        "tok_per_s_by_tenant": {
            t: sum(len(r.token_ids) for (tt, _), r in zip(prompts, results) if tt == t) / wall
            for t in sorted({t for t, _ in prompts})
        },
        "k_counts": _merge_counts([r.stats.k_counts for r in results]),
        "guards": sched.guards.snapshot() if sched.guards is not None else None,
    }


#: the request that leaves a prefix-cached engine holding only what every prompt shares (the chat
#: template's opening) before each measured group; not one of the measured prompts
WARM_PROMPT = "Say hello."


def demo_engine():
    """The demo pair in process (its default formats) with prefix caching, warmed by a group of 2 at K = 4
    (allocator, kernels) as ``benchmarks.batching_goal`` warms it: what the session check scripts start from."""
    from specdec.engine.engine import SpeculativeEngine
    from specdec.engine.prefix_cache import enable_prefix_cache
    from specdec.models.loader import load_pair
    from specdec.models.spec import ModelPairSpec, parse_model_spec

    target, draft = load_pair(ModelPairSpec(target=parse_model_spec("demo:target"),
                                            draft=parse_model_spec("demo:draft")), device="cpu")
    engine = SpeculativeEngine(target, draft)
    enable_prefix_cache(target.model, entries=8)
    enable_prefix_cache(draft.model, entries=8)
    run_group(engine, _prompts(2), batched=True, k=4, proposer="draft", max_tokens=4, budget=128)
    return engine


def prefix_warm(engine, tenants: Sequence[str] | None = None) -> None:
    """With prefix caching on (:mod:`specdec.engine.prefix_cache`): forget the closed sequences and
    run :data:`WARM_PROMPT` for one token, so a group finds the shared chat-template opening held,
    as on a server that has answered other requests, but not its own prompts (which an earlier arm
    or group of the same benchmark ran).

    Args:
        engine: the engine whose target and draft models' prefix caches are reset.
        tenants: the group's tenants: the warm request runs once per tenant, in that tenant's
            prefix cache scope (a :class:`specdec.engine.batch.BatchScheduler`'s default
            ``prefix_cache_scope`` "tenant" shares cached prefixes only within a tenant). None:
            once, unscoped (:meth:`specdec.engine.engine.SpeculativeEngine.generate`'s scope).
    """
    from specdec.engine.prefix_cache import prefix_cache_of
    from specdec.request import GenerationRequest

    stores = [s for s in (prefix_cache_of(m.model) for m in (engine.target, engine.draft) if m is not None) if s]
    if not stores:
        return
    for s in stores:
        s.clear()
    for tenant in ([""] if tenants is None else tenants):
        engine.start(GenerationRequest(messages=[{"role": "user", "content": WARM_PROMPT}], max_tokens=2,
                                       speculation={"proposer": "draft", "k": 1}), prefix_tenant=tenant).run()


def forward_stats(trace, k: int) -> dict:
    """Per target forward of a scheduler's ``trace`` (:class:`specdec.engine.batch.TickRecord`).

    Returns mean verify seconds per forward (ticks that answered a row) and mean draft seconds
    per tick, their totals, and for the decode forwards (positions fed ≤ rows × (``k`` + 1):
    no prompt prefill in them), per number of rows answered, the count, mean positions fed and
    mean verify seconds: how the target's cost grows with the rows of a batch. Unbatched
    (``batched=False``) a tick verifies its rows one after another, so its verify seconds are
    the sum of those forwards.
    """
    fwd = [t for t in trace if t.answered]
    decode = [t for t in fwd if t.positions_fed <= len(t.answered) * (k + 1)]
    by_rows: dict[int, list] = {}
    for t in decode:
        by_rows.setdefault(len(t.answered), []).append(t)
    return {
        "mean_verify_s_per_forward": sum(t.verify_s for t in fwd) / len(fwd) if fwd else 0.0,
        "mean_draft_s_per_tick": sum(t.draft_s for t in trace) / len(trace) if trace else 0.0,
        "verify_s_total": sum(t.verify_s for t in trace),
        "draft_s_total": sum(t.draft_s for t in trace),
        "decode_forwards_by_rows": {
            n: {"forwards": len(ts), "mean_positions": sum(t.positions_fed for t in ts) / len(ts),
                "mean_verify_s": sum(t.verify_s for t in ts) / len(ts)}
            for n, ts in sorted(by_rows.items())
        },
    }


def _merge_counts(counts: list[dict]) -> dict:
    out: dict[int, int] = {}
    for c in counts:
        for k, n in c.items():
            out[int(k)] = out.get(int(k), 0) + n
    return dict(sorted(out.items()))


def run_tenants(engine, a) -> dict:
    """Two tenants (code, creative) at ``a.tenant_clients`` clients: adaptive K under load vs
    fixed K (``a.fixed_ks``, K=0 included), batched, one run; the adaptive arm learns on a
    warm-up group first (costs and α̂), like a server that has been running."""
    from specdec.control.batch_k import BatchKController

    prompts = _prompts(a.tenant_clients)
    ctl = BatchKController(budget=a.budget, weights={"code": 1.0, "creative": 1.0},
                           k_ranges={"code": (0, a.k_max), "creative": (0, a.k_max)})
    warm = _prompts(a.tenant_clients + 2)[2:]
    run_group(engine, warm, batched=True, k=a.k_max, proposer=a.proposer, max_tokens=a.max_tokens // 2,
              budget=a.budget, controller=ctl)
    arms = {}
    for k in a.fixed_ks:
        arms[f"K={k}"] = run_group(engine, prompts, batched=True, k=k, proposer=a.proposer,
                                   max_tokens=a.max_tokens, budget=a.budget)
        print(f"tenants K={k}: {arms[f'K={k}']['tok_per_s']:.2f} tok/s", file=sys.stderr, flush=True)
    arms["adaptive"] = run_group(engine, prompts, batched=True, k=a.k_max, proposer=a.proposer,
                                 max_tokens=a.max_tokens, budget=a.budget, controller=ctl)
    arms["adaptive"]["controller"] = {k: v for k, v in ctl.stats().items() if k != "cost"}
    print(f"tenants adaptive: {arms['adaptive']['tok_per_s']:.2f} tok/s, K {ctl.stats()['k_by_tenant']}",
          file=sys.stderr, flush=True)
    ref = arms["K=0"]["outputs"] if "K=0" in arms else None
    for r in arms.values():
        r["identical_to_k0"] = None if ref is None else r["outputs"] == ref
        del r["outputs"]
    return arms


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected token counts >= 1 like '32' or '16,128', got {text!r}")
    return out


def batch_controller(a):
    """A fresh :class:`specdec.control.batch_k.BatchKController` for the adaptive arm (K per
    tenant under load, 0..``a.k``, code and creative weighted equally)."""
    from specdec.control.batch_k import BatchKController

    return BatchKController(budget=a.budget, weights={"code": 1.0, "creative": 1.0},
                            k_ranges={"code": (0, a.k), "creative": (0, a.k)})


def client_rows(engines: dict, controllers: dict, a) -> list[dict]:
    """Per request length, client count and format: the arms alternating (``--adaptive`` adds
    the K-under-load arm); one row each with every arm's numbers and the ratios to the format's
    own 1-client row at the same length."""
    arms_order = ["unbatched", "batched"] + (["adaptive"] if a.adaptive else [])
    rows = []
    for n in a.lengths:
        for c in a.client_counts:
            for fmt, engine in engines.items():
                arms = {}
                shift = (c + n) % len(arms_order)
                for arm in arms_order[shift:] + arms_order[:shift]:
                    r = run_group(engine, _prompts(c), batched=arm != "unbatched", k=a.k, proposer=a.proposer,
                                  max_tokens=n, budget=a.budget, controller=controllers.get(fmt) if arm == "adaptive"
                                  else None)
                    arms[arm] = r
                    print(f"{fmt} {n} tokens clients={c} {arm}: {r['tok_per_s']:.2f} tok/s "
                          f"({r['tokens']} tokens in {r['wall_s']:.1f}s, {r['tok_per_cpu_s']:.2f} tok/CPU s, "
                          f"{r['mean_rows_per_forward']:.1f} rows/forward, {r['mean_positions_per_forward']:.1f} "
                          f"positions/tick, verify {r['mean_verify_s_per_forward']:.3f} s/forward, draft "
                          f"{r['mean_draft_s_per_tick']:.3f} s/tick, K steps {r['k_counts']}; decode forwards by rows "
                          f"{r['decode_forwards_by_rows']}; load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
                ref = arms["batched"]["outputs"]
                rows.append({"format": fmt, "max_tokens": n, "clients": c,
                             "identical_outputs": all(r["outputs"] == ref for r in arms.values()),
                             "load_avg": os.getloadavg()[0],
                             **{f"{arm}_{key}": v for arm, r in arms.items() for key, v in r.items() if key != "outputs"}})
                if a.out:  # partial results survive a timeout
                    Path(a.out).mkdir(parents=True, exist_ok=True)
                    (Path(a.out) / "batching.partial.json").write_text(json.dumps(rows, indent=2))
    for r in rows:
        first = next(x for x in rows if x["format"] == r["format"] and x["max_tokens"] == r["max_tokens"])
        r["batched_vs_unbatched"] = r["batched_tok_per_s"] / r["unbatched_tok_per_s"]
        for arm in arms_order:
            r[f"{arm}_vs_1_client"] = r[f"{arm}_tok_per_s"] / first[f"{arm}_tok_per_s"]
            r[f"{arm}_vs_1_client_per_cpu_s"] = r[f"{arm}_tok_per_cpu_s"] / first[f"{arm}_tok_per_cpu_s"]
        if a.adaptive:
            r["adaptive_vs_batched"] = r["adaptive_tok_per_s"] / r["batched_tok_per_s"]
    return rows


def pair_name(a) -> str:
    """The models the header names: "demo pair" for the defaults, else ``target TARGET, draft DRAFT``."""
    if (a.target, a.draft) == ("demo:target", "demo:draft"):
        return "demo pair"
    return f"target {a.target}, draft {a.draft}"


def clients_table(rows: list[dict], a) -> list[str]:
    """The markdown lines of the client-count comparison."""
    ad = a.adaptive
    lines = [
        f"In-process, {pair_name(a)} (target/draft formats: {', '.join(a.formats)}), greedy, {a.proposer} K={a.k}, "
        f"{', '.join(map(str, a.lengths))} tokens per request, positions budget {a.budget}, {a.threads} torch threads, "
        f"prefix cache {'on' if a.prefix_cache else 'off'}; "
        f"one run: per request length and client count the formats in turn, the arms alternating. 'vs 1 client' = "
        f"the arm's tokens/s (and per CPU s) over its own 1-client row (same format and length)."
        + (f" adaptive = batched with K per tenant under load (0..{a.k}, BatchKController warmed up once)."
           if ad else "")
        + " Verify s: one batched forward (batched) or the tick's separate forwards together (unbatched); draft s: "
          "per tick.",
        "",
        "| format | tokens | clients | unbatched tok/s | batched tok/s | batched / unbatched | batched vs 1 client | "
        + ("adaptive tok/s | adaptive vs 1 client | adaptive K steps | " if ad else "")
        + "tok per CPU s unbatched / batched | batched vs 1 client, per CPU s | rows per forward | positions per "
        "forward | verify s unbatched / batched | draft s unbatched / batched | load | identical |",
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---|" if ad else "") + "---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['max_tokens']} | {r['clients']} | {r['unbatched_tok_per_s']:.2f} | "
            f"{r['batched_tok_per_s']:.2f} | {r['batched_vs_unbatched']:.2f}x | {r['batched_vs_1_client']:.2f}x | "
            + (f"{r['adaptive_tok_per_s']:.2f} | {r['adaptive_vs_1_client']:.2f}x | {r['adaptive_k_counts']} | "
               if ad else "")
            + f"{r['unbatched_tok_per_cpu_s']:.2f} / {r['batched_tok_per_cpu_s']:.2f} | "
            f"{r['batched_vs_1_client_per_cpu_s']:.2f}x | "
            f"{r['batched_mean_rows_per_forward']:.1f} | {r['batched_mean_positions_per_forward']:.1f} | "
            f"{r['unbatched_mean_verify_s_per_forward']:.3f} / {r['batched_mean_verify_s_per_forward']:.3f} | "
            f"{r['unbatched_mean_draft_s_per_tick']:.3f} / {r['batched_mean_draft_s_per_tick']:.3f} | "
            f"{r['load_avg']:.1f} | {'yes' if r['identical_outputs'] else 'NO'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="demo:target")
    p.add_argument("--draft", default="demo:draft")
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--proposer", default="draft")
    p.add_argument("--max-tokens", type=_lengths, default=[32],
                   help="completion tokens per request; a comma list (e.g. 16,128) runs every length in this one run")
    p.add_argument("--adaptive", action="store_true",
                   help="a third arm per client count: batched, K per tenant under load (0..--k)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="prefix caching of both models (specdec.engine.prefix_cache), warmed by the warm-up groups")
    p.add_argument("--budget", type=int, default=128, help="positions budget of a batched forward")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--format", default=None,
                   help="weight format of the target (and of the draft unless --draft-format): float32, bfloat16, "
                        "float16, int8, int4 (default: the device's default)")
    p.add_argument("--draft-format", default=None, help="weight format of the draft (default: --format's)")
    p.add_argument("--out", default=None, help="folder for batching.json / batching.md")
    p.add_argument("--tenants", action="store_true", help="also the two-tenant adaptive-K-under-load comparison")
    p.add_argument("--tenant-clients", type=int, default=8)
    p.add_argument("--fixed-ks", default="0,1,2,4")
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--skip-clients", action="store_true", help="only the two-tenant comparison")
    p.add_argument("--formats", default=None,
                   help="comma list of formats measured in this one run, each TARGET or TARGET/DRAFT (e.g. "
                        "int4,bfloat16,w8a8/int4): every pair is loaded once, and for each client count the formats "
                        "run one after another (the arms alternating within each); overrides --format/--draft-format")
    p.add_argument("--device", default="cpu",
                   help="device of both models, e.g. cuda (default cpu; --threads sets the CPU threads)")
    a = p.parse_args(argv)
    a.lengths, a.max_tokens = a.max_tokens, a.max_tokens[0]  # the two-tenant comparison runs the first length
    torch.set_num_threads(a.threads)
    from specdec.engine.engine import SpeculativeEngine
    from specdec.models.loader import load_pair
    from specdec.models.spec import ModelPairSpec, parse_model_spec

    wanted = ([tuple((f.split("/") + [None])[:2]) for f in a.formats.split(",") if f.strip()] if a.formats
              else [(a.format, a.draft_format)])
    engines: dict[str, object] = {}
    controllers: dict[str, object] = {}
    for tf, df in wanted:
        t0 = time.perf_counter()
        target, draft = load_pair(ModelPairSpec(target=parse_model_spec(a.target), draft=parse_model_spec(a.draft)),
                                  weight_format=tf, draft_format=df, device=a.device)
        engine = SpeculativeEngine(target, draft)
        if a.prefix_cache:
            from specdec.engine.prefix_cache import enable_prefix_cache

            enable_prefix_cache(target.model, entries=8)
            enable_prefix_cache(draft.model, entries=8)
        name = f"{target.weight_format}/{draft.weight_format}"
        engines[name] = engine
        print(f"{name} loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        # warm-up (allocator, kernels): one short batched and unbatched group
        for batched in (True, False):
            run_group(engine, _prompts(2), batched=batched, k=a.k, proposer=a.proposer, max_tokens=4, budget=a.budget)
        if a.adaptive and not a.skip_clients:  # costs and acceptance learned first, as a running server has
            controllers[name] = batch_controller(a)
            run_group(engine, _prompts(6)[2:], batched=True, k=a.k, proposer=a.proposer, max_tokens=8,
                      budget=a.budget, controller=controllers[name])
    a.format, a.draft_format = list(engines)[0].split("/")
    a.formats = list(engines)
    a.fixed_ks = [int(x) for x in a.fixed_ks.split(",")]
    a.client_counts = [] if a.skip_clients else [int(x) for x in a.clients.split(",")]
    rows = client_rows(engines, controllers, a)
    engine = engines[list(engines)[0]]
    tenants = run_tenants(engine, a) if a.tenants else None
    report = {"settings": {k: v for k, v in vars(a).items() if k != "out"},
              "torch_threads": torch.get_num_threads(), "rows": rows, "tenants": tenants}
    lines = clients_table(rows, a)
    if tenants:
        lines += [
            "",
            f"Two tenants (code, creative), {a.tenant_clients} clients, batched, {a.proposer}, greedy, "
            f"{a.max_tokens} tokens each; adaptive = K per tenant under load (at most {a.k_max}).",
            "",
            "| arm | total tok/s | code tok/s | creative tok/s | K steps (K: count) | identical to K=0 |",
            "|---|---:|---:|---:|---|---|",
        ]
        for name, r in tenants.items():
            by = r["tok_per_s_by_tenant"]
            lines.append(f"| {name} | {r['tok_per_s']:.2f} | {by.get('code', 0):.2f} | {by.get('creative', 0):.2f} | "
                         f"{r['k_counts']} | {'yes' if r['identical_to_k0'] else 'NO'} |")
        if "controller" in tenants["adaptive"]:
            lines.append("")
            lines.append(f"Controller at the end: {json.dumps(tenants['adaptive']['controller'])}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        write_bench_json(out / "batching.json", report, indent=2)
        (out / "batching.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
