"""The K controller's prediction against measurement, per K, on the bench's prompts.

``python -m benchmarks.k_prediction [--prompts code-prime,poem-sea] [--ks 1,2,4,8] [--min-confidence 0.4]
[--tokens 32] [--repeats 2] [--threads 1] [--draft-vocab-subset 65536] [--out DIR]``

For every prompt, our engine runs plain decoding (K = 0) and every fixed K (with the draft's early
stop at ``--min-confidence``), ``--repeats`` times interleaved (order reversed every other repeat)
after one untimed call of each, and records every step: tokens drafted and accepted, draft and
verify wall seconds, process CPU seconds. Then, per K, side by side:

- **the model**: a :class:`specdec.control.cost_model.CostModel` fed every run's steps the way
  :meth:`KController.record` feeds it (first step out, a drafting step after a K = 0 step counts
  its verify only) and the run's geometric α (accepted / (accepted + steps with a rejection),
  what the estimator computes): E[N(K)], step_time(K) = K · draft_s + verify_s(K + 1), and the
  predicted speedup E[N(K)] · step_time(0) / step_time(K);
- **the model, blocks and early stop** (session 12): a cost model also fed every drafting
  step's draft seconds by block length (the first draft forward of a block dearer than the
  later ones: :meth:`CostModel.draft_block_s`) and the draft's prompt prefill (the first step's
  draft seconds beyond a block of its length), the early-stop hazards per draft position learned
  from every run's block lengths under its cap (:meth:`KController.record_stops`), and each K
  evaluated as a cap over the block lengths they give (:func:`early_stop_lengths`,
  :func:`evaluate_variable_k`): E[N(K)], E[step s], the predicted steady speedup, and the
  predicted request speedup with the draft's prefill spread over the request's tokens
  (:meth:`CostModel.request_speedup`);
- **the steps**: measured tokens per step, seconds per step (draft + verify), drafted tokens per
  step, and the steady-state ratio (tokens per step-second of steps 2.. over K = 0's);
- **the request**: tokens per CPU-second over the same repeat's K = 0 (prefills, catch-up and
  everything outside the steps included).

``--replay DIR`` recomputes the tables from a stored ``DIR/k-prediction.json`` (no models loaded).

Outputs are checked token for token against K = 0 (greedy). Writes ``<out>/k-prediction.json``
(every step) and ``<out>/k-prediction.md`` (the tables). Heavy: run it under the heavy lock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def measure(engine, prompt_ids: list[int], ks: list[int], min_confidence: float, tokens: int, repeats: int) -> list[dict]:
    """Every (repeat, K) run of one prompt with its per-step record ``[drafted, accepted, draft_s,
    verify_s, cpu_s]`` (K = 0 first in the list of ``ks`` it is given)."""
    import torch

    from specdec.request import GenerationRequest

    def run(k: int) -> dict:
        req = GenerationRequest(prompt_token_ids=list(prompt_ids), max_tokens=tokens,
                                speculation={"proposer": "draft" if k else "none", "k": k,
                                             "draft_min_confidence": min_confidence if k else 0.0})
        gen = engine.start(req)
        steps = []
        c0 = time.process_time()
        while True:
            st = gen.stats
            s0 = (st.steps, st.proposed, st.accepted, st.draft_time_s, st.verify_time_s)
            a = time.process_time()
            chunk = gen.step()
            b = time.process_time()
            st = gen.stats
            if st.steps > s0[0]:
                steps.append([st.proposed - s0[1], st.accepted - s0[2], st.draft_time_s - s0[3],
                              st.verify_time_s - s0[4], b - a])
            if chunk is not None and chunk.finish_reason is not None:
                break
        cpu = time.process_time() - c0
        return {"k": k, "token_ids": gen.result().token_ids, "cpu_s": cpu, "steps": steps}

    out = []
    with torch.inference_mode():
        for k in ks:
            run(k)  # untimed: first-call costs
        for rep in range(repeats):
            for k in (ks if rep % 2 == 0 else list(reversed(ks))):
                r = run(k)
                r["repeat"] = rep
                out.append(r)
    return out


def cost_model_from(runs: list[dict]):
    """A default :class:`CostModel` fed every run's steps as :meth:`KController.record` would."""
    from specdec.control.cost_model import CostModel

    cm = CostModel()
    for r in runs:
        prev = None
        for i, (drafted, _, draft_s, verify_s, _) in enumerate(r["steps"]):
            if i > 0:
                cm.observe_verify(drafted + 1, verify_s)
                if drafted > 0 and prev != 0:
                    cm.observe_draft(drafted, draft_s)
            prev = drafted
    return cm


def block_cost_model_from(runs: list[dict]):
    """A default :class:`CostModel` fed as :func:`cost_model_from` plus every drafting step's
    draft seconds by block length and each run's draft prefill (session 12's terms)."""
    from specdec.control.adaptive import StepCosts
    from specdec.control.controller_feedback import RequestFeedback
    from specdec.control.cost_model import CostModel

    cm = CostModel()

    class _Feed(RequestFeedback):  # observe_costs of the controller on this one cost model
        def cost_model(self, proposer):
            return cm

    for r in runs:
        costs, prev = StepCosts(), None
        for i, (drafted, _, draft_s, verify_s, _) in enumerate(r["steps"]):
            if i == 0:
                costs.first_draft_s, costs.first_drafted = draft_s, drafted
            else:
                costs.add(drafted, draft_s, verify_s, count_draft=prev != 0)
            prev = drafted
        _Feed().observe_costs("draft", costs.as_dict())
    return cm


def stop_hazards_from(runs: list[dict], n: int) -> list[float]:
    """The controller's early-stop hazards for positions 1..n from every K > 0 run's block
    lengths (steps 2..), the run's K as the cap."""
    from specdec.control.controller import KController

    ctl = KController()
    for r in runs:
        if r["k"] > 0:
            counts: dict[int, int] = {}
            for s in r["steps"][1:]:
                counts[s[0]] = counts.get(s[0], 0) + 1
            ctl.record_stops(("bench", "draft"), counts, r["k"])
    return ctl.stop_hazards("bench", "draft", n)


def compare(runs: list[dict]) -> list[dict]:
    """Per K > 0: the model's prediction and what the steps and the requests measured (module
    docstring), means over repeats; ratios paired with the same repeat's K = 0.

    Raises:
        ValueError: no K = 0 run for a repeat.
    """
    from specdec.control.objective import early_stop_lengths, evaluate_variable_k, expected_tokens_per_step

    cm = cost_model_from(runs)
    cm2 = block_cost_model_from(runs)
    hazards = stop_hazards_from(runs, max(r["k"] for r in runs))
    base = {r["repeat"]: r for r in runs if r["k"] == 0}
    rows = []
    for k in sorted({r["k"] for r in runs if r["k"] > 0}):
        acc = []
        for r in (x for x in runs if x["k"] == k):
            b = base.get(r["repeat"])
            if b is None:
                raise ValueError(f"no K = 0 run in repeat {r['repeat']}")
            st, bst = r["steps"][1:], b["steps"][1:]
            if not st or not bst:
                continue
            accepted = sum(s[1] for s in st)
            rejected = sum(1 for s in st if s[1] < s[0])
            alpha = accepted / (accepted + rejected) if accepted + rejected else 0.0
            e = expected_tokens_per_step(min(alpha, 1.0), k)
            c2 = evaluate_variable_k(min(alpha, 1.0), cm2, k, early_stop_lengths(hazards, k))
            toks, secs = sum(s[1] + 1 for s in st), sum(s[2] + s[3] for s in st)
            btoks, bsecs = sum(s[1] + 1 for s in bst), sum(s[2] + s[3] for s in bst)
            acc.append({
                "alpha": alpha, "model_tokens_per_step": e, "model_step_s": cm.step_time(k),
                "predicted": e * cm.step_time(0) / cm.step_time(k),
                "model2_tokens_per_step": c2.expected_tokens, "model2_step_s": c2.step_time_s,
                "predicted2": c2.speedup,
                "predicted2_request": cm2.request_speedup(c2.expected_tokens, c2.step_time_s, len(r["token_ids"])),
                "tokens_per_step": toks / len(st), "step_s": secs / len(st),
                "drafted_per_step": sum(s[0] for s in st) / len(st),
                "steady": (toks / secs) / (btoks / bsecs),
                "request": (len(r["token_ids"]) / r["cpu_s"]) / (len(b["token_ids"]) / b["cpu_s"]),
                "identical": r["token_ids"] == b["token_ids"],
            })
        if acc:
            row = {key: statistics.mean(a[key] for a in acc) for key in acc[0] if key != "identical"}
            row.update(k=k, identical=all(a["identical"] for a in acc), repeats=len(acc))
            rows.append(row)
    return rows


def format_table(name: str, runs: list[dict]) -> str:
    """One prompt's markdown table (:func:`compare`) with the cost model's terms."""
    cm = cost_model_from(runs)
    cm2 = block_cost_model_from(runs)
    snap, snap2 = cm.snapshot(), cm2.snapshot()
    hazards = stop_hazards_from(runs, max(r["k"] for r in runs))
    lines = [f"### {name}", "",
             f"Cost model fed with every run's steps: draft {cm.draft_s_per_token * 1e3:.1f} ms per drafted token, "
             "verify by positions " + ", ".join(f"{p}: {t * 1e3:.1f}" for p, t in snap["verify_s"].items()) + " ms.",
             "Blocks and early stop (session 12): draft block by tokens drafted "
             + ", ".join(f"{d}: {t * 1e3:.1f}" for d, t in snap2["draft_block_s"].items())
             + f" ms; draft prefill {snap2['draft_prefill_s'] * 1e3:.0f} ms per request; early-stop hazard by position "
             + ", ".join(f"{h:.2f}" for h in hazards) + ".",
             "",
             "| K | α (geometric) | E[N(K)] model | E[N(K)] blocks+stop | tokens/step measured | step s model "
             "| step s blocks+stop | step s measured | drafted/step | predicted x K=0 | predicted x K=0 blocks+stop "
             "| steady x K=0 (steps 2..) | predicted request x K=0 (blocks+stop+prefill) | request x K=0 (CPU) | identical |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in compare(runs):
        lines.append(f"| {r['k']} | {r['alpha']:.2f} | {r['model_tokens_per_step']:.2f} | {r['model2_tokens_per_step']:.2f} "
                     f"| {r['tokens_per_step']:.2f} | {r['model_step_s']:.3f} | {r['model2_step_s']:.3f} | {r['step_s']:.3f} "
                     f"| {r['drafted_per_step']:.2f} | {r['predicted']:.2f}x | {r['predicted2']:.2f}x | {r['steady']:.2f}x "
                     f"| {r['predicted2_request']:.2f}x | {r['request']:.2f}x | {r['identical']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="demo:target")
    p.add_argument("--draft", default="demo:draft")
    p.add_argument("--prompts", default="code-prime,poem-sea")
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--min-confidence", type=float, default=0.4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--draft-vocab-subset", type=int, default=65536)
    p.add_argument("--out", default="docs/bench/formats/k-prediction")
    p.add_argument("--replay", default=None, help="recompute the tables from DIR/k-prediction.json (no models)")
    a = p.parse_args(argv)
    if a.replay is not None:
        stored = json.loads((Path(a.replay) / "k-prediction.json").read_text())
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        tables = [format_table(name, rec["runs"]) for name, rec in stored["prompts"].items()]
        print("\n".join(tables), flush=True)
        (out / "k-prediction.md").write_text("# The K controller's prediction against measurement (replayed)\n\n"
                                             f"`python -m benchmarks.k_prediction {' '.join(argv or sys.argv[1:])}` "
                                             f"replaying the steps of `{stored['args']}`\n\n" + "\n".join(tables))
        return 0
    import torch

    from benchmarks.inprocess_prompts import chat_request, select_prompts
    from specdec.engine.engine import SpeculativeEngine
    from specdec.models.loader import load_pair
    from specdec.models.spec import ModelPairSpec, parse_model_spec

    ks = [0] + sorted({int(x) for x in a.ks.split(",") if int(x) > 0})
    if a.tokens < 2 or a.repeats < 1:
        p.error("--tokens must be >= 2 and --repeats >= 1")
    torch.set_num_threads(a.threads)
    pair = ModelPairSpec(target=parse_model_spec(a.target), draft=parse_model_spec(a.draft))
    target, draft = load_pair(pair, device="cpu", draft_vocab_subset=a.draft_vocab_subset)
    engine = SpeculativeEngine(target, draft)
    report, tables = {"args": vars(a), "prompts": {}}, []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for prompt in select_prompts(a.prompts.split(",")):
        ids = engine.encode(chat_request(prompt))
        runs = measure(engine, ids, ks, a.min_confidence, a.tokens, a.repeats)
        report["prompts"][prompt["name"]] = {"runs": runs, "rows": compare(runs)}
        tables.append(format_table(prompt["name"], runs))
        print(tables[-1], flush=True)
        # written after every prompt: a run cut by a time limit keeps what it measured
        (out / "k-prediction.json").write_text(json.dumps(report))
        (out / "k-prediction.md").write_text("# The K controller's prediction against measurement\n\n"
                                             f"`python -m benchmarks.k_prediction {' '.join(argv or sys.argv[1:])}`\n\n"
                                             + "\n".join(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
