"""w8a8 against int4 on the demo pair, one process, one run: forward cost by positions, target
alone tokens/s, greedy speculation per (target format, draft format) and K, and agreement with
the bfloat16 target.

usage: flock -w 1800 /tmp/specdec-heavy.lock python w8a8.py [PARTS]
PARTS: comma list of quality,forward,spec (default all three, in that order) and kernels
(the w8a8 target's two kernels: oneDNN's prepacked qlinear vs aten._int_mm).
env: THREADS (default 2), ROUNDS (forward timing rounds, default 3), TOKENS (default 64),
     KS (default 2,4,8), PAIRS (default int4/int4,w8a8/int4,w8a8/w8a8: target/draft formats),
     NS (positions per forward, default 1,2,5,9,16,32,64), KNS (the same for kernels, default 1,16).

forward: the demo target's invariant forward (the engine's own) over n new positions on a
  64-token cache, formats alternating inside each round; median wall and process CPU seconds.
spec: the engine (SpeculativeEngine) on the code-prime prompt of `specdec bench` (chat
  template), greedy, TOKENS new tokens: target alone (proposer none) per target format, then the
  draft at each K; tokens/s = tokens / wall seconds of the call (after one warm-up call per
  pair); acceptance rate = accepted / proposed; every output checked equal to its target alone.
quality: teacher-forced top-1 agreement with the bfloat16 target on the bfloat16 target's own
  greedy continuation (prompt + TOKENS positions), and the first TOKENS greedy tokens' text.
"""
import gc, json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import text_ids  # noqa: E402  (sets offline env, silences warnings)
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402
from specdec.engine.engine import SpeculativeEngine  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.models.spec import DemoModelSpec  # noqa: E402
from specdec.request import GenerationRequest  # noqa: E402

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
PARTS = (sys.argv[1] if len(sys.argv) > 1 else "quality,forward,spec").split(",")
TOKENS = int(os.environ.get("TOKENS", "64"))
KS = [int(k) for k in os.environ.get("KS", "2,4,8").split(",")]
PAIRS = [tuple(p.split("/")) for p in os.environ.get("PAIRS", "int4/int4,w8a8/int4,w8a8/w8a8").split(",")]
NS = [int(n) for n in os.environ.get("NS", "1,2,5,9,16,32,64").split(",")]
ROUNDS = int(os.environ.get("ROUNDS", "3"))
PROMPT = ("Write a Python function `is_prime(n: int) -> bool` that returns True when n is a prime number. "
          "Include a docstring and handle n < 2.")

_models: dict = {}


def model(role, fmt):
    if (role, fmt) not in _models:
        t0 = time.perf_counter()
        _models[(role, fmt)] = load_model(DemoModelSpec(role=role), weight_format=fmt)
        m = _models[(role, fmt)]
        print(f"# loaded {role} {fmt} in {time.perf_counter() - t0:.1f} s (cache {m.quant_cache})", flush=True)
    return _models[(role, fmt)]


def med(xs):
    return sorted(xs)[len(xs) // 2]


def forward_part():
    fmts = sorted({t for t, _ in PAIRS})
    targets = {f: model("target", f) for f in fmts}
    ids = text_ids(targets[fmts[0]].tokenizer, 64 + max(NS))
    caches = {}
    out: dict = {}
    with torch.inference_mode():
        for f, t in targets.items():
            caches[f] = DynamicCache(config=t.model.config)
            t.model(input_ids=torch.tensor([ids[:64]]), past_key_values=caches[f], use_cache=True)
        for _ in range(ROUNDS):
            for n in NS:
                for f, t in targets.items():
                    w0, c0 = time.perf_counter(), time.process_time()
                    t.model(input_ids=torch.tensor([ids[64:64 + n]]), past_key_values=caches[f], use_cache=True)
                    out.setdefault((f, n), []).append((time.perf_counter() - w0, time.process_time() - c0))
                    caches[f].crop(-n)
    print(f"\n## forward of the demo target, n new positions on a 64-token cache (median of {ROUNDS}; "
          f"{time.strftime('%H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f})")
    print("| format | " + " | ".join(f"n={n}" for n in NS) + " | n=16 / n=1 |")
    print("|---|" + "---:|" * (len(NS) + 1))
    for f in fmts:
        w = [med([x for x, _ in out[(f, n)]]) for n in NS]
        ratio = f"{w[NS.index(16)] / w[0]:.2f}x" if 16 in NS else ""
        print(f"| {f} (wall s) | " + " | ".join(f"{x:.3f}" for x in w) + f" | {ratio} |")
    for f in fmts:
        c = [med([x for _, x in out[(f, n)]]) for n in NS]
        print(f"| {f} (CPU s) | " + " | ".join(f"{x:.3f}" for x in c) + " | |")
    print(json.dumps({f"{f} n={n}": [round(med([x for x, _ in v]), 4), round(med([x for _, x in v]), 4)]
                      for (f, n), v in out.items()}), flush=True)


def spec_part():
    rows = []
    alone: dict = {}
    for tf, df in PAIRS:
        target, draft = model("target", tf), model("draft", df)
        engine = SpeculativeEngine(target, draft)
        prompt = engine.encode(GenerationRequest(messages=[{"role": "user", "content": PROMPT}], max_tokens=1))

        def run(proposer, k):
            req = GenerationRequest(prompt_token_ids=prompt, max_tokens=TOKENS,
                                    speculation={"proposer": proposer, "k": k})
            t0 = time.perf_counter()
            res = engine.generate(req)
            return res, time.perf_counter() - t0

        run("draft", 2)  # warm-up (draft and target)
        if tf not in alone:
            res, s = run("none", 0)
            alone[tf] = res.token_ids
            rows.append((tf, "-", "alone", len(res.token_ids) / s, None, None, True))
            print(json.dumps({"target": tf, "alone_tok_s": round(len(res.token_ids) / s, 2),
                              "text": target.tokenizer.decode(res.token_ids)}), flush=True)
        for k in KS:
            res, s = run("draft", k)
            st = res.stats
            rate = st.accepted / st.proposed if st.proposed else 0.0
            mal = 1 + st.accepted / st.steps if st.steps else 0.0
            same = res.token_ids == alone[tf]
            rows.append((tf, df, f"K={k}", len(res.token_ids) / s, rate, mal, same))
            print(json.dumps({"target": tf, "draft": df, "k": k, "tok_s": round(len(res.token_ids) / s, 2),
                              "acceptance": round(rate, 3), "mean_accepted_len": round(mal, 2),
                              "equal_to_target_alone": same, "draft_s": round(st.draft_time_s, 2),
                              "verify_s": round(st.verify_time_s, 2)}), flush=True)
    base = {tf: tps for tf, _, what, tps, *_ in rows if what == "alone"}
    print(f"\n## greedy, code-prime, {TOKENS} tokens ({time.strftime('%H:%M UTC', time.gmtime())}, "
          f"load {os.getloadavg()[0]:.1f})")
    print("| target | draft | run | tokens/s | vs int4 target alone | acceptance | mean accepted length | = target alone |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    ref = base.get("int4") or next(iter(base.values()))
    for tf, df, what, tps, rate, mal, same in rows:
        print(f"| {tf} | {df} | {what} | {tps:.2f} | {tps / ref:.2f}x | "
              f"{'' if rate is None else f'{rate:.2f}'} | {'' if mal is None else f'{mal:.2f}'} | {same} |")


def quality_part():
    fmts = sorted({t for t, _ in PAIRS})
    ref = model("target", "bfloat16")
    engine = SpeculativeEngine(ref)
    prompt = engine.encode(GenerationRequest(messages=[{"role": "user", "content": PROMPT}], max_tokens=1))
    res = engine.generate(GenerationRequest(prompt_token_ids=prompt, max_tokens=TOKENS, speculation={"proposer": "none"}))
    seq = torch.tensor([prompt + res.token_ids])
    with torch.inference_mode():
        ref_top = ref.model(input_ids=seq).logits[0, len(prompt) - 1:-1].argmax(-1)
    print(json.dumps({"target": "bfloat16", "text": ref.tokenizer.decode(res.token_ids)}), flush=True)
    print(f"\n## top-1 agreement with the bfloat16 target, teacher-forced on its {TOKENS}-token greedy answer")
    print("| format | agreeing positions | first disagreement |")
    print("|---|---:|---:|")
    for f in fmts:
        m = model("target", f)
        with torch.inference_mode():
            top = m.model(input_ids=seq).logits[0, len(prompt) - 1:-1].argmax(-1)
        agree = (top == ref_top)
        first = int((~agree).nonzero()[0]) if not bool(agree.all()) else None
        print(f"| {f} | {int(agree.sum())} / {len(agree)} | {first} |", flush=True)
    del _models[("target", "bfloat16")]
    gc.collect()


def kernels_part():
    """The w8a8 target with its two kernels (W8A8Linear.KERNEL: oneDNN's prepacked qlinear, the
    default, and aten._int_mm), alternating; and whether their logits are bitwise equal and the
    same at every n (16 positions one at a time vs in one forward)."""
    from specdec.models.formats import W8A8Linear

    t = model("target", "w8a8")
    ns = [int(n) for n in os.environ.get("KNS", "1,16").split(",")]
    ids = text_ids(t.tokenizer, 64 + max(ns))
    out: dict = {}
    kernels = ("qlinear", "int_mm")
    with torch.inference_mode():
        cache = DynamicCache(config=t.model.config)
        t.model(input_ids=torch.tensor([ids[:64]]), past_key_values=cache, use_cache=True)
        logits = {}
        for kernel in kernels:
            W8A8Linear.KERNEL = kernel
            one = []
            for i in range(16):
                one.append(t.model(input_ids=torch.tensor([ids[64 + i:65 + i]]), past_key_values=cache, use_cache=True).logits[0])
            cache.crop(-16)
            alln = t.model(input_ids=torch.tensor([ids[64:80]]), past_key_values=cache, use_cache=True).logits[0]
            cache.crop(-16)
            logits[kernel] = alln
            print(f"# {kernel}: 16 positions alone vs in one forward bitwise equal: {torch.equal(torch.cat(one), alln)}", flush=True)
        print(f"# qlinear logits bitwise int_mm's: {torch.equal(logits['qlinear'], logits['int_mm'])}", flush=True)
        for _ in range(ROUNDS):
            for n in ns:
                for kernel in kernels:
                    W8A8Linear.KERNEL = kernel
                    w0 = time.perf_counter()
                    t.model(input_ids=torch.tensor([ids[64:64 + n]]), past_key_values=cache, use_cache=True)
                    out.setdefault((kernel, n), []).append(time.perf_counter() - w0)
                    cache.crop(-n)
    W8A8Linear.KERNEL = "qlinear"
    print(f"\n## w8a8 target forward by kernel, n new positions on a 64-token cache (median of {ROUNDS}, wall s; "
          f"{time.strftime('%H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f})")
    print("| kernel | " + " | ".join(f"n={n}" for n in ns) + " |")
    print("|---|" + "---:|" * len(ns))
    for kernel in kernels:
        print(f"| {kernel} | " + " | ".join(f"{med(out[(kernel, n)]):.3f}" for n in ns) + " |", flush=True)


if "kernels" in PARTS:  # keep the plain int8 weights next to the prepacked ones (before any load)
    from specdec.models.formats import W8A8Linear
    W8A8Linear.KEEP_INT8 = True
for part in PARTS:
    {"forward": forward_part, "spec": spec_part, "quality": quality_part, "kernels": kernels_part}[part]()
