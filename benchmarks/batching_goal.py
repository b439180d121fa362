"""Issue 10's in-process goal in one run: aggregate tokens/s of 8 clients against one client.

    python -m benchmarks.batching_goal --max-tokens 32,128 --out docs/bench/batching/inprocess-s10

Each side uses what specdec would do. **One client**: one request (the first prompt of
:func:`benchmarks.batching._prompts`, code), batched scheduler, draft model at fixed K = ``--k``
and adaptive (K under load from a warmed :class:`specdec.control.batch_k.BatchKController`); its
best arm is the reference. **Many clients** (``--clients``, default 8; code and creative
prompts alternating, the first one the one client's prompt): batched, at every fixed K of
``--ks`` (K = 0 is plain batched decoding: no draft) and adaptive, where the controller picks K
per tenant under the load, overruled per tenant by a goodput guard as served (``--no-guard``: the
controller alone; :class:`specdec.engine.batch_adaptive.TenantGuards`); the controller is warmed up first on one group of each load (other
prompts), like a server that has served both. Per request length the arms run interleaved (one-client arms between
the many-client ones) so drift hits both sides; one engine, prefix caching on both models (as
session 9's in-process numbers), the caches cleared before every group
(:func:`benchmarks.batching.prefix_warm`: the chat template's opening then held in each tenant's
scope, the scheduler's default ``prefix_cache_scope`` "tenant" sharing cached prefixes only
within a tenant, as served).

Printed per length and arm: tokens/s (wall), tokens per CPU second, the ratio to the one-client
best (both per wall second and per CPU second), the K steps, and where the group's wall seconds
went (draft forwards, verify forwards, the rest: scheduler, sampling, commits). Outputs: every
many-client arm gives the same tokens (greedy), and its first request the one client's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.batching import _lengths, _prompts, batch_controller, run_group
from specdec.engine.gc_freeze import freeze_startup_objects
from benchmarks.report import write_bench_json

#: the issue's goal: many clients' aggregate tokens/s over one client's
GOAL = 2.5


def _ks(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected K values >= 0 like '0,1,2,4', got {text!r}")
    return out


def warm_controller(engine, controller, a) -> None:
    """The controller learns costs and acceptance as a running server has, under both loads: ``a.clients``
    clients (8 tokens each), then one (16 tokens of a code prompt the one-client arms do not run)."""
    run_group(engine, _prompts(a.clients + 2)[2:], batched=True, k=a.k, proposer=a.proposer, max_tokens=8,
              budget=a.budget, controller=controller, guard=guard_of(a))
    run_group(engine, _prompts(3)[2:], batched=True, k=a.k, proposer=a.proposer, max_tokens=16, budget=a.budget,
              controller=controller, guard=guard_of(a))


def guard_of(a):
    """The goodput guard settings of the adaptive arms (``--no-guard``: None, the controller alone)."""
    from specdec.control.goodput_guard import GoodputGuard

    return GoodputGuard() if a.guard else None


#: the arm the adaptive controller is deciding for (a label in the decision trace)
_ARM = {"label": "warm-up"}


def trace_controller(controller, path: str) -> None:
    """Append one JSON line per decision and per tick of ``controller`` to ``path``
    (``SPECDEC_BATCH_K_TRACE``): the decision (K per tenant, predicted step seconds and tokens/s),
    what the same costs price every tenant at K = 0, the loads, the cost model's curves; per tick
    the measured verify forward (rows, positions, seconds) and batched draft forwards (rows,
    seconds). Diagnostics for issue 10 (why a warmed controller left K = 0 at 8 clients)."""
    from specdec.control.batch_choice import _evaluate

    out = open(path, "a", buffering=1)
    decide, observe_tick = controller.decide, controller.observe_tick

    def traced_decide(sessions, fixed=None, behind=None, tokens_left=None, context=None):
        d = decide(sessions, fixed=fixed, behind=behind, tokens_left=tokens_left, context=context)
        loads = {t: l for t, l in controller._loads.items() if l.sessions > 0}
        zero_tps, zero_step = _evaluate(loads, {t: (l.fixed_k if l.fixed_k is not None else 0) for t, l in loads.items()},
                                        controller.cost, controller.catchup_horizon)
        priced = {f"draft_s({r})": controller.cost.draft_s(r) for r in (1, 2, 4, 8)}
        priced.update({f"verify_s({d.rows},{p})": controller.cost.verify_s(d.rows, p)
                       for p in (d.rows, 2 * d.rows, 3 * d.rows)})
        out.write(json.dumps({"arm": _ARM["label"], "t": time.time(), "decision": d.ks, "step_s": d.step_s,
                              "tokens_per_s": d.tokens_per_s, "k0_step_s": zero_step, "k0_tokens_per_s": zero_tps,
                              "rows": d.rows, "positions": d.positions, "priced": priced,
                              "loads": {t: vars(l) for t, l in loads.items()}, "cost": controller.cost.snapshot(),
                              "verify_observations": controller.cost.verify.snapshot()["verify_observations"],
                              "probes": controller.probes}, default=str) + "\n")
        return d

    def traced_tick(rows, positions, verify_s, draft_forwards=(), *, context=None):
        out.write(json.dumps({"arm": _ARM["label"], "tick": [rows, positions, verify_s, context],
                              "drafts": [list(x) for x in draft_forwards]}) + "\n")
        return observe_tick(rows, positions, verify_s, draft_forwards, context=context)

    controller.decide, controller.observe_tick = traced_decide, traced_tick


def _summary(r: dict) -> dict:
    keep = ("guards", "wall_s", "cpu_s", "tokens", "tok_per_s", "tok_per_cpu_s", "ticks", "mean_rows_per_forward",
            "mean_positions_per_forward", "acceptance_rate", "k_counts", "verify_s_total", "draft_s_total",
            "decode_forwards_by_rows", "tok_per_s_by_tenant")
    out = {k: r[k] for k in keep}
    out["other_s"] = r["wall_s"] - r["verify_s_total"] - r["draft_s_total"]
    return out


def arm_order(one_arms: list[str], many_arms: list[str]) -> list[tuple[str, str]]:
    """The order of one round's arms, ``(side, arm)``: the many clients' fixed K > 0 arms, the
    first one-client arm, the many clients' K = 0 and adaptive arms next to each other, the
    second one-client arm. Each round runs it reversed from the last, so K = 0 and adaptive swap
    places every round and neither follows the dearest arm (many clients at the largest K):
    with the adaptive arm always right after it (session 10's order), its K = 0 forwards (the
    same forwards as the K = 0 arm's, tests/test_batch_adaptive_k0.py) measured 0.83-0.90x the
    K = 0 arm's tokens/s."""
    pos = [m for m in many_arms if m not in ("K=0", "adaptive")]
    pair = [m for m in many_arms if m in ("K=0", "adaptive")]
    return ([("many", m) for m in pos] + [("one", one_arms[0])] + [("many", m) for m in pair]
            + [("one", m) for m in one_arms[1:]])


def paired_ratios(runs: dict[tuple[str, str], list[dict]], fixed: list[str]) -> dict:
    """Per round, the many clients' adaptive arm over K = 0 and over that round's best fixed K
    (tokens/s, and tokens per CPU second), and their medians over the rounds: the arms of one
    round ran minutes apart at most, so drift between rounds cancels in the ratio."""
    many = {arm: rs for (side, arm), rs in runs.items() if side == "many"}
    rounds = len(many["adaptive"])
    out: dict[str, object] = {}
    for name, ref in (("k0", lambda i: "K=0" if "K=0" in many else None),
                      ("best_fixed", lambda i: max(fixed, key=lambda m: many[m][i]["tok_per_s"]))):
        per = [(many["adaptive"][i]["tok_per_s"] / many[ref(i)][i]["tok_per_s"],
                many["adaptive"][i]["tok_per_cpu_s"] / many[ref(i)][i]["tok_per_cpu_s"])
               for i in range(rounds) if ref(i) is not None]
        if per:
            out[f"adaptive_vs_{name}_rounds"] = [round(w, 4) for w, _ in per]
            out[f"adaptive_vs_{name}_paired"] = statistics.median(w for w, _ in per)
            out[f"adaptive_vs_{name}_paired_per_cpu_s"] = statistics.median(c for _, c in per)
    return out


def run_length(engine, controller, a, n: int) -> dict:
    """Both sides at request length ``n``: the arms interleaved; returns the row for the report."""
    one_arms = [f"K={a.k}", "adaptive"]
    many_arms = [f"K={k}" for k in a.ks] + ["adaptive"]
    order = arm_order(one_arms, many_arms)
    runs: dict[tuple[str, str], list[dict]] = {}
    outputs: dict[tuple[str, str], list] = {}
    same_across_rounds = True
    for rnd in range(a.rounds):  # the arms' order reversed every other round: no arm always runs later
        for side, arm in (order if rnd % 2 == 0 else order[::-1]):
            clients = 1 if side == "one" else a.clients
            adaptive = arm == "adaptive"
            k = a.k if adaptive else int(arm[2:])
            _ARM["label"] = f"{n} tokens {side} {arm} round {rnd + 1}"
            r = run_group(engine, _prompts(clients), batched=True, k=k, proposer=a.proposer, max_tokens=n,
                          budget=a.budget, controller=controller if adaptive else None,
                          guard=guard_of(a) if adaptive else None)
            same_across_rounds &= outputs.setdefault((side, arm), r["outputs"]) == r["outputs"]
            runs.setdefault((side, arm), []).append(_summary(r))
            print(f"{n} tokens, {clients} client(s), {arm}, round {rnd + 1}: {r['tok_per_s']:.2f} tok/s, "
                  f"{r['tok_per_cpu_s']:.2f} tok/CPU s ({r['tokens']} tokens in {r['wall_s']:.2f} s wall, "
                  f"{r['cpu_s']:.2f} CPU s; verify {r['verify_s_total']:.2f} s, draft {r['draft_s_total']:.2f} s; "
                  f"K steps {r['k_counts']}; load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    # each arm is reported by its median round (by tokens/s), with every round's tokens/s
    res: dict[str, dict] = {"one": {}, "many": {}}
    for side, arm in [("one", m) for m in one_arms] + [("many", m) for m in many_arms]:
        rs = sorted(runs[(side, arm)], key=lambda r: r["tok_per_s"])
        res[side][arm] = dict(rs[(len(rs) - 1) // 2], rounds_tok_per_s=[r["tok_per_s"] for r in runs[(side, arm)]])
    best_one = max(res["one"], key=lambda m: res["one"][m]["tok_per_s"])
    ref = res["one"][best_one]
    many_ref = outputs[("many", many_arms[0])]
    one_ref = outputs[("one", one_arms[0])]
    identical = same_across_rounds and (all(o == many_ref for (s, _), o in outputs.items() if s == "many")
                 and all(o == one_ref for (s, _), o in outputs.items() if s == "one")
                 and many_ref[0] == one_ref[0])
    for arm, r in res["many"].items():
        r["vs_one_client"] = r["tok_per_s"] / ref["tok_per_s"]
        r["vs_one_client_per_cpu_s"] = r["tok_per_cpu_s"] / ref["tok_per_cpu_s"]
    best_fixed = max((m for m in many_arms if m != "adaptive"), key=lambda m: res["many"][m]["tok_per_s"])
    paired = paired_ratios(runs, [m for m in many_arms if m != "adaptive"])
    return {**paired, "max_tokens": n, "clients": a.clients, "one_client": res["one"], "one_client_best": best_one,
            "many_clients": res["many"], "best_fixed": best_fixed, "identical_outputs": identical,
            "adaptive_vs_one_client": res["many"]["adaptive"]["vs_one_client"],
            "adaptive_vs_best_fixed": res["many"]["adaptive"]["tok_per_s"] / res["many"][best_fixed]["tok_per_s"],
            "load_avg": os.getloadavg()[0]}


def table(rows: list[dict], a, fmt: str) -> list[str]:
    lines = [
        f"In process, demo pair ({fmt}), greedy, batched scheduler, positions budget {a.budget}, {a.threads} torch "
        f"threads, prefix cache {'on' if a.prefix_cache else 'off'}. One client: the best of K={a.k} and adaptive. "
        f"{a.clients} clients: fixed K and adaptive (K under load, 0..{a.k}, "
        f"{'goodput guard per tenant' if a.guard else 'no goodput guard'}). 'x 1 client' = the arm's tokens/s over "
        f"the one-client best of the same length (per CPU s: tokens per CPU second over the same). Goal: "
        f"{a.clients} clients >= {GOAL}x one client.",
        "",
        "| tokens | clients | arm | tok/s | tok per CPU s | x 1 client | x 1 client per CPU s | K steps | "
        "verify s | draft s | other s | load |",
        "|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        for side, arms in (("one_client", row["one_client"]), ("many_clients", row["many_clients"])):
            for arm, r in arms.items():
                c = 1 if side == "one_client" else row["clients"]
                ratio = (f"{r['vs_one_client']:.2f}x | {r['vs_one_client_per_cpu_s']:.2f}x" if c > 1 else
                         ("(best) | " if arm == row["one_client_best"] else " | "))
                lines.append(f"| {row['max_tokens']} | {c} | {arm} | {r['tok_per_s']:.2f} | {r['tok_per_cpu_s']:.2f} | "
                             f"{ratio} | {r['k_counts']} | {r['verify_s_total']:.2f} | {r['draft_s_total']:.2f} | "
                             f"{r['other_s']:.2f} | {row['load_avg']:.1f} |")
    lines.append("")
    for row in rows:
        m = row["many_clients"]
        lines.append(
            f"**{row['max_tokens']} tokens: {row['clients']} clients adaptive = "
            f"{row['adaptive_vs_one_client']:.2f}x one client** (goal {GOAL}x: "
            f"{'met' if row['adaptive_vs_one_client'] >= GOAL else 'not met'}); best fixed K ({row['best_fixed']}) "
            f"{m[row['best_fixed']]['vs_one_client']:.2f}x; adaptive / best fixed {row['adaptive_vs_best_fixed']:.2f}x; "
            f"outputs identical: {'yes' if row['identical_outputs'] else 'NO'}.")
        if "adaptive_vs_best_fixed_paired" in row:
            k0 = (f"adaptive / K=0 {row['adaptive_vs_k0_paired']:.2f}x (per CPU s "
                  f"{row['adaptive_vs_k0_paired_per_cpu_s']:.2f}x; rounds {row['adaptive_vs_k0_rounds']}), "
                  if "adaptive_vs_k0_paired" in row else "")
            lines.append(
                f"  Paired within each round (median over {len(row['adaptive_vs_best_fixed_rounds'])}): {k0}"
                f"adaptive / that round's best fixed K {row['adaptive_vs_best_fixed_paired']:.2f}x (per CPU s "
                f"{row['adaptive_vs_best_fixed_paired_per_cpu_s']:.2f}x; rounds {row['adaptive_vs_best_fixed_rounds']}).")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="demo:target")
    p.add_argument("--draft", default="demo:draft")
    p.add_argument("--format", default=None, help="weight format of both models (default: the device's default)")
    p.add_argument("--draft-format", default=None,
                   help="weight format of the draft (default: --format, else the device's draft default)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--k", type=int, default=4, help="the one client's fixed K and the adaptive arms' largest K")
    p.add_argument("--ks", type=_ks, default=[0, 1, 2, 4], help="fixed K arms of the many clients")
    p.add_argument("--max-tokens", type=_lengths, default=[32, 128])
    p.add_argument("--proposer", default="draft")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false")
    p.add_argument("--no-guard", dest="guard", action="store_false",
                   help="adaptive arms without the per-tenant goodput guards (the served default has them)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every arm this many times, the order reversed every other round; an arm is "
                   "reported by its median round (the arms of one round run one after another)")
    p.add_argument("--out", default=None, help="folder for goal.json / goal.md")
    p.add_argument("--device", default="cpu",
                   help="device of both models, e.g. cuda (default cpu; --threads sets the CPU threads)")
    a = p.parse_args(argv)
    if a.clients < 2 or a.k < 1 or a.rounds < 1:
        p.error(f"--clients must be >= 2, --k >= 1 and --rounds >= 1, got {a.clients}, {a.k}, {a.rounds}")
    torch.set_num_threads(a.threads)
    from specdec.engine.engine import SpeculativeEngine
    from specdec.models.loader import load_pair
    from specdec.models.spec import ModelPairSpec, parse_model_spec

    t0 = time.perf_counter()
    target, draft = load_pair(ModelPairSpec(target=parse_model_spec(a.target), draft=parse_model_spec(a.draft)),
                              weight_format=a.format, draft_format=a.draft_format or a.format,
                              device=a.device)
    engine = SpeculativeEngine(target, draft)
    if a.prefix_cache and not (target.invariant and draft.invariant):
        # a float32 forward (the default on a CPU without AVX2 or AVX-512 kernels, or asked for) is not made
        # shape-invariant, and prefix caching refuses such a model
        print(f"prefix cache off: {target.weight_format}/{draft.weight_format} forwards are not shape-invariant",
              file=sys.stderr, flush=True)
        a.prefix_cache = False
    if a.prefix_cache:
        from specdec.engine.prefix_cache import enable_prefix_cache

        enable_prefix_cache(target.model, entries=8)
        enable_prefix_cache(draft.model, entries=8)
    fmt = f"{target.weight_format}/{draft.weight_format}"
    print(f"{fmt} loaded in {time.perf_counter() - t0:.1f}s; load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    # warm-up (allocator, kernels), then the controller learns costs and acceptance as a running server
    # has, under both loads: many clients, then one (a code prompt the one-client side does not run)
    run_group(engine, _prompts(2), batched=True, k=a.k, proposer=a.proposer, max_tokens=4, budget=a.budget)
    controller = batch_controller(a)
    _ARM["label"] = "warm-up"
    if os.environ.get("SPECDEC_BATCH_K_TRACE"):
        trace_controller(controller, os.environ["SPECDEC_BATCH_K_TRACE"])
    warm_controller(engine, controller, a)
    freeze_startup_objects()  # as a serving process does after its start-up (specdec.engine.gc_freeze)
    rows = []
    try:
        for n in a.max_tokens:
            rows.append(run_length(engine, controller, a, n))
            if a.out:  # partial results survive a timeout
                Path(a.out).mkdir(parents=True, exist_ok=True)
                (Path(a.out) / "goal.partial.json").write_text(json.dumps(rows, indent=2))
    finally:
        gc.unfreeze()  # main() also runs inside test processes (tests/test_batching_goal.py)
    text = "\n".join(table(rows, a, fmt))
    print(text)
    if a.out:
        out = Path(a.out)
        write_bench_json(out / "goal.json", {"settings": {k: v for k, v in vars(a).items() if k != "out"},
                                             "format": fmt, "rows": rows}, indent=2)
        (out / "goal.md").write_text(text + "\n")
        (out / "goal.partial.json").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
