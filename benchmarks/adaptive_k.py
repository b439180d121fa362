"""The adaptive-K benchmark: two tenants, fixed K = 0..8 against the controller, in one run.

``python -m benchmarks.adaptive_k [--out docs/bench] [--max-tokens 40] [--requests 4]``

Workload: tenant ``code`` sends code prompts (Python functions, JSON) and tenant ``creative``
sends open creative writing (poems, stories), all as chat messages rendered with the target's
chat template, greedy, ``--max-tokens`` new tokens each, interleaved code/creative. Every arm
runs the same timed requests in the same order on the same in-process engine (draft proposer):

- ``K=k`` for k = 0..8: every request at that fixed K (K = 0: plain decoding, no draft);
- ``adaptive``: :class:`specdec.control.controller.KController` decides K per request and tenant
  (``decide``), the request runs with it (:func:`benchmarks.inprocess_adaptive.apply_decision`) and its
  counters and per-step timings are fed back (``record``): acceptance and costs are learned
  online, from the run's own measurements. The controller is the one ``specdec bench --adaptive``
  builds (:func:`new_controller`): its steps run under the tenant's in-request goodput guard
  (:meth:`KController.guarded_k`, :mod:`specdec.control.step_guard`), which holds the tenant at
  K = 0 while speculation measures slower than plain decoding (``--no-step-guard``: the decided
  K for every step, as before session 12).

Fairness and noise: arms are interleaved per request (request i runs under every arm before
request i + 1, arm order rotated each time), so slow drifts of the machine hit all arms alike.
Before timing: one process warm-up; a cost calibration (:func:`specdec.control.adaptive.calibrate`:
two real speculation steps at every K = 0..8, about half a minute, like a server would do at
start; only the controller uses it); and a warm-up phase of ``--warmup`` requests per tenant
(other prompts, ``--warmup-tokens`` tokens), untimed, run by the adaptive arm (by every arm with
``--warmup-all``; the fixed arms have nothing to learn, and all arms share the process warm-up).
The controller learns its tenants' acceptance there and keeps learning during the timed run
(probes included).

Timed: wall seconds of ``engine.start`` + the whole generation (prompt prefill included) per
request; every (request, arm) runs ``--repeats`` times (default 2, arm order reversed on the
second pass) and the fastest run is kept, because on a shared machine noise only adds time
(the adaptive arm decides and learns on every run). Tokens/s = completion tokens / those seconds, per tenant and in total. Every arm's
output is compared token for token with the K = 0 arm's (greedy: must be identical).

Writes ``<out>/adaptive-k.json`` (after every request round) and ``<out>/adaptive-k.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import platform
import sys
import time
from pathlib import Path

import torch

from benchmarks.inprocess_adaptive import apply_decision
from benchmarks.report import write_bench_json

CODE_PROMPTS = [
    "Write a Python function `is_prime(n: int) -> bool` that returns True when n is prime. Include a docstring.",
    "Return only a JSON object describing a book with the fields title, author, year, isbn and genres "
    "(a list of strings).",
    "Write a Python function `merge_sorted(a: list[int], b: list[int]) -> list[int]` that merges two sorted "
    "lists in linear time. Include type hints and a docstring.",
    "Return only a JSON object for a user profile with the fields id, name, email, roles (a list) and "
    "address (an object with street, city and zip).",
    "Write a Python function `word_count(text: str) -> dict[str, int]` that counts how often each word "
    "occurs, case-insensitively. Include a docstring.",
    "Write a Python class `Stack` with methods push, pop, peek and is_empty, with type hints and docstrings.",
]
CREATIVE_PROMPTS = [
    "Write a short poem about the sea at night, in free verse, full of unusual images.",
    "Tell the beginning of a surprising story about a lighthouse keeper who finds a door in the rock.",
    "Write a whimsical poem about a cat who wants to become the moon.",
    "Begin a dreamlike short story set in a city where it rains upward.",
    "Write a poem about autumn from the point of view of an old oak tree.",
    "Start a story about a clockmaker whose clocks each run on a different person's memories.",
]
TENANTS = ("code", "creative")
FIXED_KS = tuple(range(0, 9))


def _messages(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def _workload(n: int, offset: int) -> list[tuple[str, str]]:
    out = []
    for i in range(n):
        out.append(("code", CODE_PROMPTS[offset + i]))
        out.append(("creative", CREATIVE_PROMPTS[offset + i]))
    return out


def new_controller(step_guard: bool = True):
    """The adaptive arm's controller: :func:`benchmarks.inprocess_adaptive.new_controller` (as a
    fresh server builds it, with the in-request goodput guard of ``specdec bench --adaptive``), or
    with ``step_guard=False`` the same controller without the guard."""
    from benchmarks.inprocess_adaptive import new_controller as bench_controller

    controller = bench_controller()
    if not step_guard:
        controller.step_guard = None
    return controller


class Arm:
    """One configuration: fixed K or the adaptive controller."""

    def __init__(self, name: str, k: int | None, controller=None):
        self.name = name
        self.k = k
        self.controller = controller
        self.policy = {"k_min": 0, "k_max": 8, "adaptive": True, "fixed_k": None}

    def run(self, engine, tenant: str, content: str, max_tokens: int) -> dict:
        from specdec.control.adaptive import run_timed
        from specdec.request import GenerationRequest

        base = GenerationRequest(messages=_messages(content), max_tokens=max_tokens,
                                 speculation={"proposer": "draft", "k": 8})
        decision, guarded = None, None
        t0 = time.perf_counter()
        if self.controller is None:
            req, k = apply_decision(base, {"k": self.k})
        else:
            decision = self.controller.decide(tenant, "draft", self.policy, requested_k=8)
            req, k = apply_decision(base, decision)
            if decision.k > 0:  # per step: the decided K unless the tenant's goodput guard forces K = 0
                k = guarded = self.controller.guarded_k(tenant, "draft", decision)
        gen = engine.start(req, k=k)
        if guarded is not None:
            guarded.attach(gen.stats)
        timed = run_timed(gen, started=t0)
        if self.controller is not None:
            self.controller.record(tenant, "draft", timed.result.stats, timed.costs.as_dict())
        st = timed.result.stats
        return {
            "arm": self.name,
            "tenant": tenant,
            "k": None if decision is None else decision.k,
            "probe": None if decision is None else decision.probe,
            "probe_steps": None if decision is None else decision.probe_steps,
            "reason": None if decision is None else decision.reason,
            "alpha": None if decision is None else decision.alpha,
            "predicted_speedup": None if decision is None else decision.predicted_speedup,
            "tokens": timed.tokens,
            "seconds": timed.wall_s,
            "ttft_s": timed.ttft_s,
            "inter_token_s": timed.inter_token_s,
            "steps": st.steps,
            "proposed": st.proposed,
            "accepted": st.accepted,
            "k_counts": {int(a): b for a, b in st.k_counts.items()},
            "step_ks": None if guarded is None else list(guarded.ks),
            "token_ids": timed.result.token_ids,
        }


def _summarize(rows: list[dict], arms: list[str]) -> dict:
    out = {}
    for a in arms:
        rs = [r for r in rows if r["arm"] == a]
        if not rs:
            continue
        s = {"tokens": sum(r["tokens"] for r in rs), "seconds": sum(r["seconds"] for r in rs)}
        s["tokens_per_s"] = s["tokens"] / s["seconds"] if s["seconds"] else None
        for t in TENANTS:
            tr = [r for r in rs if r["tenant"] == t]
            tok, sec = sum(r["tokens"] for r in tr), sum(r["seconds"] for r in tr)
            s[t] = {
                "tokens": tok,
                "seconds": sec,
                "tokens_per_s": tok / sec if sec else None,
                "acceptance": (sum(r["accepted"] for r in tr) / sum(r["proposed"] for r in tr))
                if sum(r["proposed"] for r in tr) else None,
                "ttft_s_mean": sum(r["ttft_s"] or 0 for r in tr) / len(tr) if tr else None,
            }
        out[a] = s
    return out


def _identity(rows: list[dict]) -> dict:
    ref = {(r["tenant"], r["round"]): r["token_ids"] for r in rows if r["arm"] == "K=0"}
    bad = [f'{r["arm"]}/{r["tenant"]}/{r["round"]}' for r in rows
           if (r["tenant"], r["round"]) in ref and r["token_ids"] != ref[(r["tenant"], r["round"])]]
    return {"compared": sum(1 for r in rows if (r["tenant"], r["round"]) in ref), "mismatches": bad}


def _predicted_fixed(controller, summary: dict) -> dict:
    """The controller's final model's predicted speedup at each fixed K, per tenant, vs measured."""
    from specdec.control.objective import evaluate_k

    out = {}
    for t in TENANTS:
        key = (t, "draft")
        alpha = controller.estimator.alpha(key)
        pos = tuple(controller.estimator.position_alphas(key, controller.position_min_reached or 1e18))
        cands = {c.k: c for c in evaluate_k(alpha, controller.cost_model("draft"), 0, 8, pos)}
        base = summary.get("K=0", {}).get(t, {}).get("tokens_per_s")
        out[t] = {}
        for k in FIXED_KS:
            meas = summary.get(f"K={k}", {}).get(t, {}).get("tokens_per_s")
            out[t][f"K={k}"] = {
                "predicted": cands[k].speedup,
                "measured": meas / base if (meas and base) else None,
            }
    return out


def _markdown(doc: dict) -> str:
    s = doc["summary"]
    arms = [a for a in doc["arms"] if a in s]
    lines = [
        "# Adaptive K vs fixed K on the demo pair",
        "",
        f"{doc['machine']['cpu_count']} CPUs, torch {doc['machine']['torch']}, {doc['date']}. "
        f"Workload: {doc['config']['requests_per_tenant']} code + {doc['config']['requests_per_tenant']} creative "
        f"requests interleaved, greedy, {doc['config']['max_tokens']} new tokens each, chat template; every arm "
        f"runs the same requests, arms interleaved per request, each (request, arm) run {doc['config']['repeats']}x in "
        f"ABBA order keeping the fastest (the controller learns from every run). Untimed before: cost calibration and "
        f"{doc['config']['warmup_per_tenant']} warm-up request(s) per tenant of {doc['config']['warmup_tokens']} tokens "
        f"({'every arm' if doc['config']['warmup_all'] else 'adaptive arm only; fixed arms have nothing to learn'}). "
        f"The controller keeps learning during the timed run. Command: `{doc['command']}`.",
        "",
        "| arm | total tok/s | vs K=0 | code tok/s | creative tok/s | creative vs K=0 | code acceptance | creative acceptance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    b = s.get("K=0", {})
    for a in arms:
        r = s[a]
        def f(x, p=2):
            return "–" if x is None else f"{x:.{p}f}"
        rel = r["tokens_per_s"] / b["tokens_per_s"] if b else None
        crel = r["creative"]["tokens_per_s"] / b["creative"]["tokens_per_s"] if b else None
        name = f"**{a}**" if a == "adaptive" else a
        lines.append(
            f"| {name} | {f(r['tokens_per_s'])} | {f(rel)}x | {f(r['code']['tokens_per_s'])} | "
            f"{f(r['creative']['tokens_per_s'])} | {f(crel)}x | {f(r['code']['acceptance'])} | "
            f"{f(r['creative']['acceptance'])} |"
        )
    ad = doc.get("adaptive", {})
    lines += ["", "## Adaptive K: what the controller did", ""]
    lines += ["| tenant | K per timed request | final K | α̂ | predicted speedup (mean over requests) | measured speedup vs K=0 |",
              "|---|---|---|---|---|---|"]
    for t in TENANTS:
        a = ad.get(t, {})
        ks = ", ".join(f"{k}{'p' if p else ''}" for k, p in a.get("ks", []))
        def f(x, p=2):
            return "–" if x is None else f"{x:.{p}f}"
        lines.append(f"| {t} | {ks} | {a.get('final_k')} | {f(a.get('alpha'))} | {f(a.get('predicted_speedup'))} | "
                     f"{f(a.get('measured_speedup'))} |")
    lines += ["", "(`p` = a probe: K for its first few steps, then plain decoding.)", ""]
    pf = doc.get("predicted_fixed", {})
    if pf:
        lines += ["## Cost model's predicted speedup at each fixed K (final estimates) vs measured", "",
                  "| tenant | " + " | ".join(f"K={k}" for k in FIXED_KS) + " |",
                  "|---|" + "---|" * len(FIXED_KS)]
        for t in TENANTS:
            cells = []
            for k in FIXED_KS:
                c = pf[t][f"K={k}"]
                m = "–" if c["measured"] is None else f"{c['measured']:.2f}"
                cells.append(f"{c['predicted']:.2f} / {m}")
            lines.append(f"| {t} (pred / meas) | " + " | ".join(cells) + " |")
        lines.append("")
    cm = doc.get("cost_model_final", {})
    if cm:
        v = ", ".join(f"{p}: {t:.3f}" for p, t in cm.get("verify_s", {}).items())
        lines += [f"Measured costs (final): draft {cm.get('draft_s_per_token', 0):.3f} s/token; verify s by positions {{{v}}}.", ""]
    chk = doc.get("checks", {})
    lines += ["## Checks", ""]
    for k, v in chk.items():
        lines.append(f"- {k}: {v}")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.adaptive_k", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/bench")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--requests", type=int, default=4, help="timed requests per tenant")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up requests per tenant")
    p.add_argument("--warmup-all", action="store_true",
                   help="run the warm-up under every arm (default: the adaptive arm only; fixed arms learn nothing)")
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--arms", default="0,1,2,3,4,5,6,7,8,adaptive", help="comma list of fixed K and/or 'adaptive'")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-step-guard", dest="step_guard", action="store_false",
                   help="run the adaptive arm's decided K for every step (no in-request goodput guard)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of every (request, arm), in ABBA order; the fastest is kept (noise only adds time)")
    args = p.parse_args(argv)
    if args.requests + args.warmup > len(CODE_PROMPTS):
        p.error(f"--requests + --warmup must be <= {len(CODE_PROMPTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    from specdec.control.adaptive import calibrate
    from specdec.engine.engine import SpeculativeEngine
    from specdec.models.loader import load_pair
    from specdec.models.spec import ModelPairSpec

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    target, draft = load_pair(ModelPairSpec.demo())
    engine = SpeculativeEngine(target, draft)
    print(f"loaded pair in {time.perf_counter() - t_start:.1f} s", flush=True)

    arms: list[Arm] = []
    controller = None
    for a in args.arms.split(","):
        a = a.strip()
        if a == "adaptive":
            controller = new_controller(step_guard=args.step_guard)
            arms.append(Arm("adaptive", None, controller))
        else:
            arms.append(Arm(f"K={int(a)}", int(a)))

    # process warm-up (allocator, kernels), both models
    from specdec.request import GenerationRequest

    engine.generate(GenerationRequest(prompt="def f(x):", max_tokens=6, speculation={"k": 3}))
    t_cal = time.perf_counter()
    cal = calibrate(engine, controller, max_k=8) if controller is not None else None
    cal_s = time.perf_counter() - t_cal
    print(f"calibration {cal_s:.1f} s: {cal}", flush=True)

    doc = {
        "benchmark": "adaptive-k",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.adaptive_k " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu_count": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform()},
        "config": {"max_tokens": args.max_tokens, "requests_per_tenant": args.requests,
                   "warmup_per_tenant": args.warmup, "repeats": args.repeats, "warmup_tokens": args.warmup_tokens, "warmup_all": args.warmup_all,
                   "threads": torch.get_num_threads(), "step_guard": args.step_guard,
                   "proposer": "draft", "greedy": True, "k_range": [0, 8]},
        "arms": [a.name for a in arms],
        "calibration": {"seconds": cal_s, "cost_model": cal},
    }

    warm = _workload(args.warmup, 0)
    timed = _workload(args.requests, args.warmup)
    warm_rows = []
    warm_arms = arms if (args.warmup_all or controller is None) else [a for a in arms if a.controller is not None]
    for i, (tenant, content) in enumerate(warm):
        for arm in warm_arms:
            r = arm.run(engine, tenant, content, args.warmup_tokens)
            r["round"] = i
            warm_rows.append({k: v for k, v in r.items() if k != "token_ids"})
        print(f"warm-up {i + 1}/{len(warm)} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    doc["warmup"] = warm_rows

    rows: list[dict] = []
    for i, (tenant, content) in enumerate(timed):
        order = arms[i % len(arms):] + arms[: i % len(arms)]
        kept: dict[str, dict] = {}
        for rep in range(args.repeats):
            for arm in (order if rep % 2 == 0 else order[::-1]):
                gc.collect()
                r = arm.run(engine, tenant, content, args.max_tokens)
                r["round"] = i
                prev = kept.get(arm.name)
                all_s = (prev["seconds_all"] if prev else []) + [r["seconds"]]
                if prev is None or r["seconds"] < prev["seconds"]:
                    kept[arm.name] = r
                kept[arm.name]["seconds_all"] = all_s
        rows.extend(kept[a.name] for a in order)
        ad = [r for r in rows if r["arm"] == "adaptive" and r["round"] == i]
        print(f"round {i + 1}/{len(timed)} ({tenant}) done at {time.perf_counter() - t_start:.0f} s; "
              + " ".join(f"{r['arm']}:{r['tokens'] / r['seconds']:.2f}" for r in rows if r["round"] == i)
              + (f" | adaptive K={ad[0]['k']} ({ad[0]['reason']})" if ad else ""), flush=True)
        doc["rows"] = [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]
        doc["summary"] = _summarize(rows, doc["arms"])
        write_bench_json(out / "adaptive-k.json", doc, indent=1, default=str)

    summary = doc["summary"]
    doc["identity"] = _identity(rows)
    if controller is not None:
        ad = {}
        for t in TENANTS:
            tr = [r for r in rows if r["arm"] == "adaptive" and r["tenant"] == t]
            tok = sum(r["tokens"] for r in tr)
            base = summary.get("K=0", {}).get(t, {}).get("tokens_per_s")
            ad[t] = {
                "ks": [(r["k"], r["probe"]) for r in tr],
                "final_k": controller.current_k(t, "draft"),
                "alpha": controller.estimator.alpha((t, "draft")),
                "predicted_speedup": sum(r["predicted_speedup"] * r["tokens"] for r in tr) / tok if tok else None,
                "measured_speedup": summary["adaptive"][t]["tokens_per_s"] / base if base else None,
                "controller": controller.tenant_stats(t),
            }
        doc["adaptive"] = ad
        doc["predicted_fixed"] = _predicted_fixed(controller, summary)
        doc["cost_model_final"] = controller.cost_model("draft").snapshot()
    checks = {}
    if "adaptive" in summary:
        fixed = {a: s["tokens_per_s"] for a, s in summary.items() if a != "adaptive"}
        best_fixed = max(fixed, key=fixed.get) if fixed else None
        checks["adaptive highest total tokens/s"] = (
            f"{all(summary['adaptive']['tokens_per_s'] > v for v in fixed.values())} "
            f"(adaptive {summary['adaptive']['tokens_per_s']:.3f}, best fixed {best_fixed} "
            f"{fixed.get(best_fixed, float('nan')):.3f})"
        )
        if "K=0" in summary:
            c = summary["adaptive"]["creative"]["tokens_per_s"] / summary["K=0"]["creative"]["tokens_per_s"]
            checks["creative not slower than K=0 by more than 5%"] = f"{c >= 0.95} (ratio {c:.3f})"
    checks["outputs identical to K=0 (greedy)"] = (
        f"{not doc['identity']['mismatches']} ({doc['identity']['compared']} compared"
        + (f"; mismatches {doc['identity']['mismatches']}" if doc["identity"]["mismatches"] else "") + ")"
    )
    doc["checks"] = checks
    doc["total_seconds"] = time.perf_counter() - t_start
    write_bench_json(out / "adaptive-k.json", doc, indent=1, default=str)
    md = _markdown(doc)
    (out / "adaptive-k.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
