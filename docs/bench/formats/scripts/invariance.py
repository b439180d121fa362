"""Does the logits row of a position depend on how many positions one forward scores?

Reference: a 32-token prefill, then plain decoding (one position per forward) over N tokens of
real text. Variants: the same tokens fed M at a time (teacher forcing = verification of blocks
of M-1 drafts), and "big prefill" (the first 32+16 tokens in one forward, then one at a time:
what the first speculative step does). Reports max |dlogit| and argmax flips vs the reference.
Usage: invariance.py role fmt[,fmt] N Ms mode[,mode]   (mode: baseline | invariant)
"""
import sys; sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from common import *
role, fmts, N = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
Ms = [int(m) for m in sys.argv[4].split(",")]
modes = sys.argv[5].split(",")
torch.set_num_threads(2)
P = 32

def run(model, ids, m, first=P):
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([ids[:first]]), past_key_values=cache, use_cache=True)
    rows = [out.logits[0, P - 1:].float()]
    pos = first
    while pos < len(ids):
        chunk = ids[pos:pos + m]
        out = model(input_ids=torch.tensor([chunk]), past_key_values=cache, use_cache=True)
        rows.append(out.logits[0].float())
        pos += len(chunk)
    return torch.cat(rows)[:-1]

for fmt in fmts:
    for mode in modes:
        model, tok, _ = load(role, fmt)
        t0 = time.perf_counter()
        if mode == "invariant":
            import invariant
            plans = invariant.make_invariant(model)
            print("plans", {k[1:3]: (p.min_rows, p.max_rows) for k, p in plans.items()}, f"{time.perf_counter() - t0:.1f}s", flush=True)
        ids = text_ids(tok, P + N)
        with torch.inference_mode():
            t0 = time.perf_counter()
            ref = run(model, ids, 1)
            t_ref = time.perf_counter() - t0
            arg = ref.argmax(-1)
            res = {}
            for m in Ms + ["prefill48"]:
                got = run(model, ids, 1, first=P + 16) if m == "prefill48" else run(model, ids, m)
                res[m] = {"max_abs": float(f"{(got - ref).abs().max().item():.3g}"),
                          "flips": int((got.argmax(-1) != arg).sum()), "exact": bool(torch.equal(got, ref))}
                print(fmt, mode, m, res[m], flush=True)
        print(json.dumps({"role": role, "fmt": fmt, "mode": mode, "positions": len(ref), "ref_s": round(t_ref, 1),
                          "by_chunk": res}), flush=True)
        del model
