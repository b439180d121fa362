"""Session 26: what a batched verify forward costs as its rows' contexts grow (demo pair, in process).

    PYTHONPATH=$PWD python docs/bench/batching/context-s26/forward_context.py [ROUNDS]

8 sessions (positions budget 4096: every prompt prefilled in one forward) whose prompts hold L tokens (L = 32, 160, 320, 480: real text ids, a different start per session),
decoded 24 tokens (EOS ignored) at fixed K = 0 and K = 4 (draft proposer), ROUNDS rounds interleaved. Prints the
median decode forward (8 rows, 8 or 40 positions) at each L, and the seconds per extra context token per row
and per query-key pair (positions x context) between the shortest and each longer L.
"""
import collections
import statistics
import sys

import torch

torch.set_num_threads(2)
from benchmarks.batching import _prompts  # noqa: E402
from specdec.engine.batch import BatchScheduler  # noqa: E402
from specdec.engine.engine import SpeculativeEngine  # noqa: E402
from specdec.models.loader import load_pair  # noqa: E402
from specdec.models.spec import ModelPairSpec, parse_model_spec  # noqa: E402
from specdec.request import GenerationRequest  # noqa: E402

LENGTHS = (32, 160, 320, 480)


def group(engine, ids: list[list[int]], k: int) -> list:
    sched = BatchScheduler(engine, batched=True, max_batch_positions=4096)
    for p in ids:
        sched.submit(GenerationRequest(prompt_token_ids=p, max_tokens=24, ignore_eos=True,
                                       speculation={"proposer": "draft", "k": k}))
    sched.run_until_idle()
    return [(len(t.answered), t.positions_fed, t.context, t.verify_s) for t in sched.trace
            if t.answered and t.context is not None]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    target, draft = load_pair(ModelPairSpec(target=parse_model_spec("demo:target"),
                                            draft=parse_model_spec("demo:draft")), device="cpu")
    engine = SpeculativeEngine(target, draft)
    tok = target.tokenizer
    text = " ".join(c for _, c in _prompts(8)) * 20
    base = tok(text)["input_ids"]
    seqs = {n: [base[7 * i: 7 * i + n] for i in range(8)] for n in LENGTHS}
    group(engine, seqs[32], 4)  # warm-up
    got = collections.defaultdict(list)  # (k, L) -> (context, seconds) of 8-row decode forwards
    for r in range(rounds):
        for n in (LENGTHS if r % 2 == 0 else LENGTHS[::-1]):
            for k in ((0, 4) if r % 2 == 0 else (4, 0)):
                for rows, pos, ctx, s in group(engine, seqs[n], k):
                    if rows == 8 and pos == 8 * (k + 1):
                        got[(k, n)].append((ctx, s))
    import json
    json.dump({f"{k},{n}": v for (k, n), v in got.items()}, open("/tmp/forward_context.json", "w"))
    print("K  L    forwards  mean_ctx  median_s  s/ctx-token/row(1e-6)  s/query-key(1e-6)")
    for k in (0, 4):
        c0, m0 = statistics.mean(c for c, _ in got[(k, 32)]), statistics.median(s for _, s in got[(k, 32)])
        for n in LENGTHS:
            c, m = statistics.mean(c for c, _ in got[(k, n)]), statistics.median(s for _, s in got[(k, n)])
            d = (m - m0) / (c - c0) if c != c0 else float("nan")
            print(f"{k}  {n:3d}  {len(got[(k, n)]):8d}  {c:8.1f}  {m:8.4f}  {d / 8 * 1e6:20.2f}  {d / (8 * (k + 1)) * 1e6:17.2f}")


if __name__ == "__main__":
    main()
