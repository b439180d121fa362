"""What one drafted token costs, against one target forward (demo pair, one process).

usage: python draft_cost.py [FORMAT] [ROUNDS]     e.g.  python draft_cost.py int4 6
env: THREADS (default 2), PROFILE=0 skips the torch.profiler / cProfile part,
     VARIANTS (default "after"): comma-separated, each its own copy of the pair, rows alternating
     in every round: "after" (the loader's defaults: fused q/k/v and gate/up, one-thread
     attention rows), "unfused" (fuse=False), "before" (fuse=False and every attention row on all
     threads, as before 1 Dec 22:10 UTC; approximately: a block's first, two-row forward ran its
     rows on one thread already then),
     KS (default "4,8"): the K of the proposer rows.

Loads the demo pair with specdec's loader (default format: int4 on this CPU; both forwards
shape-invariant, as served), then per round, alternating so every row sees the same load:
  - proposer K: ``DraftModelSession.propose(K)`` (what the engine's draft-model proposer does
    end to end per block: feed the uncached tail = last draft + bonus token, K - 1 one-position
    forwards, logits, argmax), then ``commit`` of the drafted tokens and one more text token, as
    after a fully accepted step; seconds per drafted token;
  - draft forward: the bare draft model over 1 new position on a 64-token DynamicCache (then
    cropped back), logits of that position only (logits_to_keep=1, as the engine asks);
  - target forward: the same for the target;
  - target step: ``TargetSession.verify`` of an empty block (plain decoding step);
  - for "after" also the bare draft forward on one intra-op thread.
Prints per row the median and minimum wall seconds and the median process CPU seconds, and
c = draft cost per token / target forward (from the medians; at the largest K also from the minima,
which filter out the time the process waited for a CPU on a shared machine). Then torch.profiler
(self CPU time per op) and cProfile (Python functions) over a few proposer blocks at K = 8.
Run under the heavy lock: flock -w 1800 /tmp/specdec-heavy.lock python draft_cost.py int4
"""
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import text_ids  # noqa: E402  (sets offline env, silences warnings)
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from specdec.engine import invariant  # noqa: E402
from specdec.engine.proposers.draft_model import DraftModelProposer  # noqa: E402
from specdec.engine.verifier import TargetVerifier  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.models.spec import ModelPairSpec  # noqa: E402
from specdec.request import SamplingParams  # noqa: E402
from specdec.types import DraftBlock  # noqa: E402

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
GREEDY = SamplingParams(temperature=0.0)


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def bare_forward(model, cache, token):
    with torch.inference_mode():
        t0, c0 = time.perf_counter(), time.process_time()
        model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        dt = (time.perf_counter() - t0, time.process_time() - c0)
    cache.crop(-1)
    return dt


@contextlib.contextmanager
def variant_mode(name):
    """"before": attention rows on all threads (SINGLE_THREAD_MAX_KEYS 0) while the variant runs."""
    saved = invariant.SINGLE_THREAD_MAX_KEYS
    if name == "before":
        invariant.SINGLE_THREAD_MAX_KEYS = 0
    try:
        yield
    finally:
        invariant.SINGLE_THREAD_MAX_KEYS = saved


def setup(fuse, fmt, ks, prompt):
    """One variant: the demo pair loaded with or without fused projections, its proposer
    sessions (one per K), a target session and bare caches, all prefilled with ``prompt``."""
    t0 = time.perf_counter()
    pair = ModelPairSpec.demo()
    target = load_model(pair.target, weight_format=fmt, fuse=fuse)
    draft = load_model(pair.draft, weight_format=fmt, fuse=fuse)
    print(f"loaded {target.weight_format}/{draft.weight_format} fuse={fuse} in {time.perf_counter() - t0:.1f} s, "
          f"invariant {target.invariant}/{draft.invariant}, threads {torch.get_num_threads()}", flush=True)
    proposer = DraftModelProposer(draft)
    v = {"target": target, "draft": draft, "sessions": {k: proposer.open_session(list(prompt), GREEDY, seed=0) for k in ks}}
    for s in v["sessions"].values():
        s.propose(1)  # prefill
    v["tsess"] = TargetVerifier(target).open_session(list(prompt), GREEDY, seed=0)
    v["tsess"].verify(DraftBlock.empty())
    v["caches"] = {}
    with torch.inference_mode():
        for name, m in (("draft", draft.model), ("target", target.model)):
            v["caches"][name] = DynamicCache(config=m.config)
            m(input_ids=torch.tensor([prompt]), past_key_values=v["caches"][name], use_cache=True, logits_to_keep=1)
    v["pos"] = {k: 0 for k in ks}
    return v


def main():
    fmt = sys.argv[1] if len(sys.argv) > 1 else None
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    ks = [int(k) for k in os.environ.get("KS", "4,8").split(",")]
    names = os.environ.get("VARIANTS", "after").split(",")
    tok = load_model(ModelPairSpec.demo().draft, weight_format=fmt).tokenizer
    ids = text_ids(tok, 400)
    prompt, more = ids[:64], ids[64:]
    variants = {name: setup(name == "after", fmt, ks, prompt) for name in names}
    rows: dict[str, list[float]] = {}
    for r in range(rounds + 1):  # round 0 warms up
        for vname, v in variants.items():
            with variant_mode(vname):
                for k in ks:
                    s = v["sessions"][k]
                    t, c = time.perf_counter(), time.process_time()
                    block = s.propose(k)
                    dt = (time.perf_counter() - t, time.process_time() - c)
                    n = max(len(block.token_ids), 1)
                    s.commit(block.token_ids.tolist() + [more[v["pos"][k] % len(more)]])
                    v["pos"][k] += 1
                    if r:
                        rows.setdefault(f"{vname}: proposer K={k} (s/token)", []).append((dt[0] / n, dt[1] / n))
                for name in ("draft", "target"):
                    dt = bare_forward(v[name].model, v["caches"][name], more[r])
                    if r:
                        rows.setdefault(f"{vname}: {name} forward, 1 position (s)", []).append(dt)
                if vname == "after":  # the draft on one intra-op thread (no parallel regions)
                    threads = torch.get_num_threads()
                    torch.set_num_threads(1)
                    dt = bare_forward(v["draft"].model, v["caches"]["draft"], more[r])
                    torch.set_num_threads(threads)
                    if r:
                        rows.setdefault(f"{vname}: draft forward, 1 position, 1 thread (s)", []).append(dt)
                t, c = time.perf_counter(), time.process_time()
                v["tsess"].verify(DraftBlock.empty())
                if r:
                    rows.setdefault(f"{vname}: target engine step (s)", []).append(
                        (time.perf_counter() - t, time.process_time() - c))
    table = {name: {"wall median": round(med([w for w, _ in v]), 4), "wall min": round(min(w for w, _ in v), 4),
                     "CPU median": round(med([c for _, c in v]), 4)} for name, v in rows.items()}
    for name, row in table.items():
        print(f"{name:48s} wall median {row['wall median']:.4f}  min {row['wall min']:.4f}  "
              f"CPU median {row['CPU median']:.4f}", flush=True)
    res = {name: row["wall median"] for name, row in table.items()}
    res_min = {name: row["wall min"] for name, row in table.items()}
    for vname in variants:
        tf = res[f"{vname}: target forward, 1 position (s)"]
        for k in ks:
            res[f"{vname}: c at K={k} (proposer token / target forward)"] = round(
                res[f"{vname}: proposer K={k} (s/token)"] / tf, 3)
        res[f"{vname}: c bare (draft forward / target forward)"] = round(
            res[f"{vname}: draft forward, 1 position (s)"] / tf, 3)
        res[f"{vname}: c at K={ks[-1]} from the minima"] = round(
            res_min[f"{vname}: proposer K={ks[-1]} (s/token)"] / res_min[f"{vname}: target forward, 1 position (s)"], 3)
    res["load average (1 min) at the end"] = os.getloadavg()[0]
    print(json.dumps(res, indent=1), flush=True)
    v = next(iter(variants.values()))
    sessions, pos = v["sessions"], v["pos"]
    if os.environ.get("PROFILE", "1") == "0":
        return
    from torch.profiler import ProfilerActivity, profile
    s = sessions[ks[-1]]

    def blocks(n):
        for _ in range(n):
            b = s.propose(ks[-1])
            s.commit(b.token_ids.tolist() + [more[pos[ks[-1]] % len(more)]])
            pos[ks[-1]] += 1

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        blocks(2)
    print(f"-- torch.profiler: 2 proposer blocks at K={ks[-1]} (self CPU)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    pr = cProfile.Profile()
    pr.enable()
    blocks(2)
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
    print(f"-- cProfile: 2 proposer blocks at K={ks[-1]} (tottime)")
    print(out.getvalue()[-9000:], flush=True)


if __name__ == "__main__":
    main()
