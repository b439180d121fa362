"""Vocabulary-subset draft (FR-Spec) on the demo pair: draft cost per token and acceptance, one run.

    flock -w 1800 /tmp/specdec-heavy.lock python docs/bench/vocab/bench_vocab.py \
        --sizes 16384,32768,65536 --prompts code-prime,poem-sea --tokens 48 -k 4 --threads 1

Loads the demo pair once (``--format``, default float32, the CPU default). The draft's output
layer is sliced once per N with the library's own :func:`specdec.models.vocab_subset.slice_output_layer`
(the load path's function) and swapped in, so every variant shares the same weights otherwise.

1. Draft forward per token: after a prefill of the code prompt, single-token decode forwards
   (``CachedSequence.feed``, logits of the last position), variants interleaved per repeat,
   median wall and process-CPU seconds; also the output layer alone.
2. Speculation: per prompt (chat template) and variant, greedy, K, ``--tokens`` new tokens:
   acceptance rate, mean accepted length, draft seconds per drafted token, tokens/s, the share of
   the target's tokens inside the subset, and whether the output equals the full draft's (it
   must: greedy output is the target's).

Writes ``results.json`` and ``results.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16384,32768,65536")
    ap.add_argument("--prompts", default="code-prime,poem-sea")
    ap.add_argument("--format", default="float32")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="decode-timing repeats (each: --steps forwards per variant)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent))
    ap.add_argument("--skip-forward", action="store_true", help="keep the forward timings of an earlier run in --out")
    ap.add_argument("--skip-spec", action="store_true", help="only the forward timings")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from benchmarks.inprocess import PROMPTS
    from specdec.engine.engine import SpeculativeEngine
    from specdec.engine.kv_cache import CachedSequence
    from specdec.models.loader import load_model
    from specdec.models.spec import DemoModelSpec
    from specdec.models.vocab_subset import FrequencyTable, slice_output_layer, subset_ids
    from specdec.request import GenerationRequest

    t0 = time.perf_counter()
    target = None if a.skip_spec else load_model(DemoModelSpec(role="target"), weight_format=a.format)
    draft = load_model(DemoModelSpec(role="draft"), weight_format=a.format)
    load_s = time.perf_counter() - t0
    table = FrequencyTable.load()
    full_head = draft.model.get_output_embeddings()
    variants: dict[str, tuple[torch.nn.Module, torch.Tensor | None]] = {"full": (full_head, None)}
    drafts = {"full": draft}
    shared = a.format in ("float32", "bfloat16", "float16")
    for n in (int(s) for s in a.sizes.split(",")):
        if shared:  # slice the loaded float layer (the load path's own function), swap it in per variant
            ids = subset_ids(table, draft.tokenizer, n, draft.emittable_vocab, always=draft.eos_token_ids,
                             model_name=draft.name)
            draft.model.set_output_embeddings(full_head)
            variants[str(n)] = (slice_output_layer(draft.model, ids), ids.to(draft.device))
            drafts[str(n)] = draft
        else:  # int8/int4: slice before quantizing, i.e. load the draft once per N (the load path)
            d = load_model(DemoModelSpec(role="draft"), weight_format=a.format, vocab_subset=n)
            variants[str(n)] = (d.model.get_output_embeddings(), d.vocab_subset)
            drafts[str(n)] = d
    draft.model.set_output_embeddings(full_head)

    def use(name):
        head, ids = variants[name]
        d = drafts[name]
        if shared:
            d.model.set_output_embeddings(head)
            d.vocab_subset = ids
        return d

    def size(m):
        return m.in_features * m.out_features

    heads = {id(h) for h, _ in variants.values()}
    linear = sum(size(m) for m in draft.model.modules()
                 if hasattr(m, "in_features") and hasattr(m, "out_features") and id(m) not in heads)
    weights = {name: linear + size(h) for name, (h, _) in variants.items()}

    prompts = {p["name"]: p for p in PROMPTS}
    chosen = [prompts[n] for n in a.prompts.split(",")]
    tok = draft.tokenizer

    def encode(p):
        text = tok.apply_chat_template([{"role": "user", "content": p["content"]}], add_generation_prompt=True,
                                       tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    old = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    meta = {"format": a.format, "threads": a.threads, "k": a.k, "tokens": a.tokens, "load_s": load_s,
            "table": table.name, "table_source": table.source, "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg": os.getloadavg()}
    runs = old.get("runs", []) + [meta]
    forward = old.get("forward", {}) if a.skip_forward else {}
    spec: dict[str, dict[str, dict]] = old.get("speculation", {})

    def save():
        (out / "results.json").write_text(json.dumps({"runs": runs, "forward": forward, "speculation": spec}, indent=1))
        write_md(out, runs, forward, spec)

    if not a.skip_forward:
        forward.update(time_forwards(a, draft, variants, use, encode(chosen[0]), weights))
        save()
    if a.skip_spec:
        return 0

    # 2. speculation
    for p in chosen:
        ids = encode(p)
        spec[p["name"]] = {}
        ref = None
        engine = SpeculativeEngine(target, use("full"))  # warm-up: first-call costs off the first variant
        engine.generate(GenerationRequest(prompt_token_ids=ids, max_tokens=4, speculation={"proposer": "draft", "k": a.k}))
        for name in variants:
            engine = SpeculativeEngine(target, use(name))
            req = GenerationRequest(prompt_token_ids=ids, max_tokens=a.tokens,
                                    speculation={"proposer": "draft", "k": a.k})
            w0, c0 = time.perf_counter(), time.process_time()
            res = engine.generate(req)
            w, c = time.perf_counter() - w0, time.process_time() - c0
            s = res.stats
            sub = variants[name][1]
            inside = (1.0 if sub is None else
                      sum(t in set(sub.tolist()) for t in res.token_ids) / max(1, len(res.token_ids)))
            ref = res.token_ids if ref is None else ref
            spec[p["name"]][name] = {
                "tokens": len(res.token_ids), "acceptance_rate": s.acceptance_rate,
                "mean_accepted_length": s.mean_accepted_length, "steps": s.steps, "proposed": s.proposed,
                "draft_ms_per_drafted_token": 1e3 * s.draft_time_s / max(1, s.proposed),
                "verify_s": s.verify_time_s, "wall_s": w, "cpu_s": c, "tokens_per_s": len(res.token_ids) / w,
                "tokens_per_cpu_s": len(res.token_ids) / c, "target_tokens_in_subset": inside,
                "same_output_as_full": res.token_ids == ref,
                "outside_subset": [] if sub is None else
                [tok.convert_ids_to_tokens(t) for t in res.token_ids if t not in set(sub.tolist())],
            }
            print(p["name"], name, json.dumps(spec[p["name"]][name]), flush=True)
            save()
    use("full")
    return 0


def time_forwards(a, draft, variants, use, prompt_ids, weights) -> dict:
    from specdec.engine.kv_cache import CachedSequence

    # 1. per-token draft forward
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    head_s: dict[str, list[float]] = {v: [] for v in variants}
    hidden = torch.randn(1, 1, draft.model.config.hidden_size, dtype=draft.model.get_input_embeddings().weight.dtype)
    with torch.inference_mode():
        for r in range(a.repeats):
            for name in variants:
                draft = use(name)
                seq = CachedSequence(draft.model, list(prompt_ids))
                seq.feed(prompt_ids, keep=1)
                nxt = 13
                for _ in range(a.steps):
                    w0, c0 = time.perf_counter(), time.process_time()
                    logits = seq.feed([nxt], keep=1)
                    w1, c1 = time.perf_counter(), time.process_time()
                    if r > 0:  # the first repeat warms up
                        wall[name].append(w1 - w0)
                        cpu[name].append(c1 - c0)
                    nxt = int(draft.full_logits(logits)[0].argmax())
                head = variants[name][0]
                for _ in range(a.steps):
                    h0 = time.perf_counter()
                    head(hidden)
                    if r > 0:
                        head_s[name].append(time.perf_counter() - h0)
    return {v: {"wall_ms": 1e3 * statistics.median(wall[v]), "cpu_ms": 1e3 * statistics.median(cpu[v]),
                   "output_layer_ms": 1e3 * statistics.median(head_s[v]), "linear_weights": weights[v]}
               for v in variants}



def write_md(out, runs, forward, spec) -> None:
    meta = runs[-1]
    lines = [f"# Vocabulary-subset draft (FR-Spec), demo pair, {meta['format']}, {meta['threads']} thread(s)", ""]
    lines += [f"- `{r['command']}` at {r['date']} (load average {r['loadavg'][0]:.1f})" for r in runs]
    if forward:
        full = forward["full"]
        lines += ["", "| draft output layer | linear weights / token | draft forward / token, wall ms | CPU ms "
                  "| vs full (CPU) | output layer alone, ms |", "|---|---:|---:|---:|---:|---:|"]
        for v, f in forward.items():
            lines.append(f"| {'full (151,936)' if v == 'full' else v} | {f['linear_weights'] / 1e6:.0f} M | "
                         f"{f['wall_ms']:.1f} | {f['cpu_ms']:.1f} | {f['cpu_ms'] / full['cpu_ms']:.2f}x | "
                         f"{f['output_layer_ms']:.2f} |")
    lines += ["", f"Greedy, K={meta['k']}, {meta['tokens']} new tokens (chat template):", "",
              "| prompt | draft vocabulary | acceptance rate | mean accepted length | draft ms / drafted token "
              "| tokens/s (wall) | tokens / CPU s | target tokens in subset | output = full draft's |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for p, rows in spec.items():
        for v, r in rows.items():
            lines.append(f"| {p} | {v} | {r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} | "
                         f"{r['draft_ms_per_drafted_token']:.1f} | {r['tokens_per_s']:.2f} | {r['tokens_per_cpu_s']:.2f} | "
                         f"{r['target_tokens_in_subset']:.3f} | {r['same_output_as_full']} |")
    (Path(out) / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
