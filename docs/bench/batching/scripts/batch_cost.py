"""Cost of one batched forward as rows are added: target verify (K + 1 positions per row) and a
batched draft step (1 position per row), per weight format, through the engine's own
``feed_many`` (the packed layout the batched verifier and drafter use).

usage: python batch_cost.py FORMATS [ROWS] [K] [ROUNDS]   e.g.  python batch_cost.py int4,bfloat16 1,2,4,8 4 3
env: THREADS (default 2), DRAFT_FORMATS (default: FORMATS), OUT (a .json path), PROFILE=1 (torch.profiler
of the largest target forward: self CPU seconds by op)

Per format: load the demo target (and draft) with specdec's loader (invariant forward), prefill
max(ROWS) sequences on different ~60-token prompts, then for each row count N time ROUNDS
forwards of N sequences x (K + 1) new positions (the target) and N x 1 (the draft), each cut
back after the forward; median wall seconds, and the ratio to N = 1. Run under the heavy lock:
    flock -w 1800 /tmp/specdec-heavy.lock python docs/bench/batching/scripts/batch_cost.py int4,bfloat16
"""
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch  # noqa: E402

from specdec.engine.kv_cache import CachedSequence, feed_many  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.models.spec import DemoModelSpec  # noqa: E402

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
PROMPTS = [
    "Write a Python function that checks whether a number is prime, with a docstring and tests.",
    "Write a short poem about the sea at night, the moon and a lonely lighthouse keeper.",
    "Write a SQL query that counts users by country and orders the result by the count.",
    "Tell a story about a dragon who learns to bake bread in a small mountain village.",
    "Write a JavaScript function that reverses a string without using the built-in reverse.",
    "Describe the autumn forest after rain in a few lines of free verse, slowly and quietly.",
    "Write a Python class for a stack with push, pop and peek, and explain each method.",
    "Write a letter from a sailor to his family, about the storm and the stars at sea.",
]


def sequences(model, tok, n):
    seqs = []
    for i in range(n):
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                      add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        s = CachedSequence(model, ids)
        s.feed(ids, keep=1)
        seqs.append(s)
    return seqs


def time_rows(model, seqs, rows, new, rounds):
    out = {}
    for n in rows:
        ts = []
        for _ in range(rounds):
            items = [(s, [100 + j for j in range(new)], new) for s in seqs[:n]]
            base = [len(s.cached) for s in seqs[:n]]
            t0 = time.perf_counter()
            feed_many(items)
            ts.append(time.perf_counter() - t0)
            for s, b in zip(seqs[:n], base):
                s._crop(b)
        out[n] = statistics.median(ts)
    return out


def profile(model, seqs, n, new):
    from torch.profiler import ProfilerActivity, profile as prof

    items = [(s, [100 + j for j in range(new)], new) for s in seqs[:n]]
    base = [len(s.cached) for s in seqs[:n]]
    with prof(activities=[ProfilerActivity.CPU]) as p:
        feed_many(items)
    for s, b in zip(seqs[:n], base):
        s._crop(b)
    total = sum(e.self_cpu_time_total for e in p.key_averages())
    top = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    return {e.key: {"self_cpu_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total, "calls": e.count}
            for e in top}


def main():
    fmts = sys.argv[1].split(",")
    rows = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,8").split(",")]
    k = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    dfmts = os.environ.get("DRAFT_FORMATS", ",".join(fmts)).split(",")
    res = {"threads": torch.get_num_threads(), "k": k, "rows": rows, "load_at_start": os.getloadavg(),
           "target": {}, "draft": {}}
    for role, fl in (("target", fmts), ("draft", dfmts)):
        for fmt in fl:
            m = load_model(DemoModelSpec(role=role), weight_format=fmt)
            seqs = sequences(m.model, m.tokenizer, max(rows))
            new = k + 1 if role == "target" else 1
            time_rows(m.model, seqs, rows[:1], new, 1)  # warm-up
            t = time_rows(m.model, seqs, rows, new, rounds)
            r = {"positions_per_row": new, "seconds": t, "vs_1_row": {n: t[n] / t[rows[0]] for n in rows},
                 "seconds_per_row": {n: t[n] / n for n in rows}}
            if os.environ.get("PROFILE") and role == "target":
                r["profile_largest"] = profile(m.model, seqs, max(rows), new)
            res[role][fmt] = r
            print(f"{role} {fmt}: " + ", ".join(f"{n} rows {t[n] * 1000:.0f} ms ({t[n] / t[rows[0]]:.2f}x)" for n in rows),
                  file=sys.stderr, flush=True)
            del m, seqs
    res["load_at_end"] = os.getloadavg()
    text = json.dumps(res, indent=1)
    print(text)
    if os.environ.get("OUT"):
        with open(os.environ["OUT"], "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
