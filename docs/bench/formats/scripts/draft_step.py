"""One drafted token of the demo draft, variants side by side in one process (PROFILE.md section 12).

usage: python draft_step.py [ROUNDS]       (run under the heavy lock; ~3-4 min)
env: VARIANTS (default "w8a8-plain,w8a8,w8a8-v65536,int4-plain,int4,int4-v65536"): drafts loaded
         side by side, each FORMAT[-vN][-plain] (N: vocabulary subset size, FR-Spec; -plain:
         transformers' forward for every call, without specdec/models/lean_decode.py's one-position path);
     THREADS (default "1,2"): intra-op thread counts, every row measured at each;
     KS (default 4): the K of the proposer rows;
     PROFILE=0 skips the per-module breakdown; ACCEPT=0 skips the acceptance part;
     TOKENS (default 48): target-alone tokens per bench prompt for the acceptance part.

Per round, variants and thread counts interleaved so every row sees the same load:
  - proposer: ``DraftModelSession.propose(K)`` end to end (the uncached tail = last draft + bonus
    token, K - 1 one-position forwards, logits, argmax), then ``commit`` of the drafted tokens
    plus one text token (a fully accepted step); process CPU s and wall s per drafted token;
  - bare forward: the draft model over 1 new position on a 64-token DynamicCache (cropped back),
    logits of that position only, as the engine asks;
  - the w8a8 target's bare forward over 1 and 5 positions (for c).
Then, one thread, first variant: inclusive time per module class (forward hooks), the int8 /
int4 matmuls called alone on the inputs captured in one forward, torch.profiler op classes.
Acceptance: per bench prompt the target alone's greedy tokens (TOKENS), then each draft
teacher-forced over prompt + those tokens in one forward; greedy speculation at K is exact to
simulate from that: at a position the draft proposes its argmax while its earlier proposals
were the target's tokens, so accepted = leading run of agreements (at most K), and the step
advances by accepted + 1. Reports agreement rate, tokens per step at K, and the predicted
tokens per CPU second of speculation = tokens per step / (K * draft token + target 5 positions).
"""
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import text_ids  # noqa: E402  (sets offline env, silences warnings)
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from specdec.engine.proposers.draft_model import DraftModelProposer  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.models.spec import ModelPairSpec  # noqa: E402
from specdec.request import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def bare(model, cache, tokens):
    with torch.inference_mode():
        _, w, c = timed(lambda: model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True,
                                      logits_to_keep=1))
    cache.crop(-len(tokens))
    return w, c


def load_variant(name):
    fmt, _, v = name.replace("-plain", "").partition("-v")
    t0 = time.perf_counter()
    m = load_model(ModelPairSpec.demo().draft, weight_format=fmt, vocab_subset=int(v) if v else None)
    print(f"loaded draft {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return m


def prefilled_cache(model, prompt):
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def module_breakdown(loaded, prompt, more, reps=6):
    """One thread: inclusive seconds per module class per forward (hooks), and the quantized
    matmuls alone on the inputs one forward gave them."""
    model = loaded.model
    torch.set_num_threads(1)
    cache = prefilled_cache(model, prompt)
    acc = defaultdict(float)
    starts = {}
    captured = []
    capture = [False]

    def pre(mod, args):
        starts[id(mod)] = time.perf_counter()
        if capture[0] and hasattr(mod, "forward_rows"):
            captured.append((mod, args[0].detach().reshape(-1, args[0].shape[-1]).clone()))

    def post(mod, args, out):
        name = type(mod).__name__
        if mod is model.lm_head or (hasattr(model, "lm_head") and mod is getattr(model.lm_head, "_orig", None)):
            name = "lm_head (" + name + ")"
        acc[name] += time.perf_counter() - starts.pop(id(mod))

    hooks = []
    for mod in model.modules():
        hooks.append(mod.register_forward_pre_hook(pre))
        hooks.append(mod.register_forward_hook(post))
    with torch.inference_mode():
        capture[0] = True
        bare(model, cache, [more[0]])
        capture[0] = False
        acc.clear()
        for r in range(reps):
            bare(model, cache, [more[r + 1]])
    for h in hooks:
        h.remove()
    out = {k: v / reps for k, v in acc.items()}
    # the same forward without hooks
    walls = [bare(model, cache, [more[r]])[1] for r in range(reps)]
    out["forward without hooks (CPU s, min)"] = min(walls)
    # quantized matmuls alone on the captured inputs (each weight read once per pass)
    with torch.inference_mode():
        for mod, x in captured:
            mod.forward_rows(x)
        ts = []
        for _ in range(reps):
            _, w, c = timed(lambda: [mod.forward_rows(x) for mod, x in captured])
            ts.append(c)
        out[f"{len(captured)} quantized linears alone, forward_rows (CPU s, min)"] = min(ts)
        head = [(m, x) for m, x in captured if m.out_features == model.lm_head.out_features] or captured[-1:]
        ts = [timed(lambda: [m.forward_rows(x) for m, x in head])[2] for _ in range(reps)]
        out["lm_head linear alone (CPU s, min)"] = min(ts)
    # torch.profiler op classes over 3 forwards
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for r in range(3):
            bare(model, cache, [more[r]])
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops)
    out["profiler: ops per forward"] = sum(e.count for e in ops) / 3
    out["profiler: top self-CPU ops (share, calls per forward)"] = [
        (e.key, round(e.self_cpu_time_total / total, 3), e.count / 3) for e in ops[:14]]
    return out


def acceptance(target, drafts, names, k, tokens):
    """Per bench prompt: agreement and tokens per step of greedy speculation at ``k`` (exact
    simulation from teacher-forced draft argmaxes against the target alone's tokens)."""
    sys.path.insert(0, ROOT)
    from benchmarks.inprocess_prompts import PROMPTS, chat_request
    from specdec.engine.engine import SpeculativeEngine

    eng = SpeculativeEngine(target)
    res = {}
    for p in PROMPTS:
        from specdec.request import GenerationRequest, SpeculationParams

        req = GenerationRequest(messages=chat_request(p).messages, max_tokens=tokens,
                                speculation=SpeculationParams(proposer="none", k=0))
        prompt = eng.encode(req)
        out = eng.generate(req).token_ids
        seq = prompt + out
        row = {}
        for name, d in zip(names, drafts):
            with torch.inference_mode():
                logits = d.model(input_ids=torch.tensor([seq[:-1]]), use_cache=False).logits[0, len(prompt) - 1:]
            full = d.full_logits(logits.float())[:, : d.emittable_vocab]
            agree = (full.argmax(-1) == torch.tensor(out)).tolist()
            steps, i = 0, 0
            while i < len(out):
                a = 0
                while a < k and i + a < len(out) and agree[i + a]:
                    a += 1
                i += a + 1
                steps += 1
            in_subset = (sum(t in set(d.vocab_subset.tolist()) for t in out) / len(out)
                         if d.vocab_subset is not None else 1.0)
            row[name] = {"agreement": round(sum(agree) / len(agree), 3), f"tokens per step K={k}": round(len(out) / steps, 3),
                         "target tokens in the subset": round(in_subset, 3)}
        res[p["name"]] = row
        print(p["name"], row, flush=True)
    return res


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    names = os.environ.get("VARIANTS", "w8a8-plain,w8a8,w8a8-v65536,int4-plain,int4,int4-v65536").split(",")
    threads = [int(t) for t in os.environ.get("THREADS", "1,2").split(",")]
    k = int(os.environ.get("KS", "4"))
    print(f"start {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()}", flush=True)
    drafts = [load_variant(n) for n in names]
    t0 = time.perf_counter()
    target = load_model(ModelPairSpec.demo().target, weight_format="w8a8")
    print(f"loaded target w8a8 in {time.perf_counter() - t0:.1f} s", flush=True)
    ids = text_ids(drafts[0].tokenizer, 400)
    prompt, more = ids[:64], ids[64:]
    sessions = {}
    caches = {}
    for n, d in zip(names, drafts):
        prop = DraftModelProposer(d, lean="-plain" not in n)
        sessions[n] = prop.open_session(list(prompt), GREEDY, seed=0)
        sessions[n].propose(1)
        caches[n] = prefilled_cache(d.model, prompt)
    caches["target"] = prefilled_cache(target.model, prompt)
    pos = defaultdict(int)
    rows = defaultdict(list)
    for r in range(rounds + 1):  # round 0 warms up
        for th in (threads if r % 2 == 0 else threads[::-1]):
            torch.set_num_threads(th)
            for n in (names if r % 2 == 0 else names[::-1]):
                s = sessions[n]
                block, w, c = timed(lambda: s.propose(k))
                nt = max(len(block.token_ids), 1)
                s.commit(block.token_ids.tolist() + [more[pos[n] % len(more)]])
                pos[n] += 1
                if r:
                    rows[(n, th, f"propose({k}) per drafted token")].append((w / nt, c / nt))
                w, c = bare(drafts[names.index(n)].model, caches[n], [more[r]])
                if r:
                    rows[(n, th, "bare forward, 1 position")].append((w, c))
            for npos in (1, 5):
                w, c = bare(target.model, caches["target"], more[r:r + npos])
                if r:
                    rows[("target w8a8", th, f"bare forward, {npos} positions")].append((w, c))
    print(f"end of timing {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()}", flush=True)
    print(f"\n{'row':58s} {'threads':>7s} {'CPU s min':>10s} {'CPU s med':>10s} {'wall min':>9s} {'wall med':>9s}")
    table = {}
    for (n, th, what), v in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        cm, cmed = min(c for _, c in v), med([c for _, c in v])
        wm, wmed = min(w for w, _ in v), med([w for w, _ in v])
        table[(n, th, what)] = (cm, cmed, wm, wmed)
        print(f"{n + ': ' + what:58s} {th:7d} {cm:10.4f} {cmed:10.4f} {wm:9.4f} {wmed:9.4f}")
    for th in threads:
        t1 = table[("target w8a8", th, "bare forward, 1 positions")][1]
        t5 = table[("target w8a8", th, "bare forward, 5 positions")][1]
        for n in names:
            p = table[(n, th, f"propose({k}) per drafted token")][1]
            b = table[(n, th, "bare forward, 1 position")][1]
            print(f"threads {th}: {n:16s} c = propose token / target 1 pos (CPU medians) {p / t1:.3f}; "
                  f"bare {b / t1:.3f}; K={k} step CPU s = {k * p + t5:.4f}")
    # the lean path against transformers' forward on the real draft: 24 decode steps, logits bitwise
    torch.set_num_threads(1)
    for n, d in zip(names, drafts):
        if getattr(d.model, "_specdec_lean_decode", False):
            ca, cb = prefilled_cache(d.model, prompt), prefilled_cache(d.model, prompt)
            same = True
            with torch.inference_mode():
                for t in more[:24]:
                    ids = torch.tensor([[t]])
                    a = d.model(input_ids=ids, cache=ca, use_cache=True, logits_to_keep=1).logits  # lean
                    b = type(d.model).forward(d.model, input_ids=ids, cache=cb, use_cache=True, logits_to_keep=1).logits
                    same = same and torch.equal(a, b)
            print(f"{n}: lean decode logits bitwise transformers' forward over 24 steps: {same}", flush=True)
    if os.environ.get("PROFILE", "1") != "0":
        for n, d in zip(names, drafts):
            if n in os.environ.get("PROFILE_VARIANTS", ",".join(names[:2])).split(","):
                print(f"\n-- module breakdown, {n}, one thread (inclusive s per forward)")
                for key, val in module_breakdown(d, prompt, more).items():
                    print(f"  {key}: {val if not isinstance(val, float) else round(val, 5)}")
    if os.environ.get("ACCEPT", "1") != "0":
        torch.set_num_threads(1)
        tokens = int(os.environ.get("TOKENS", "48"))
        print(f"\n-- acceptance, greedy, K={k}, {tokens} target tokens per prompt")
        res = acceptance(target, drafts, names, k, tokens)
        t5 = table[("target w8a8", 1, "bare forward, 5 positions")][1]
        for n in names:
            p = table[(n, 1, f"propose({k}) per drafted token")][1]
            tps = [res[pr][n][f"tokens per step K={k}"] for pr in res]
            print(f"{n:16s} tokens per step per prompt {tps}; predicted tok/CPU-s at 1 thread "
                  f"{[round(t / (k * p + t5), 2) for t in tps]}")
    print(f"end {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
