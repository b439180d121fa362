"""Teacher-forced draft agreement on code prompts per vocabulary-subset size, per-forward costs, kernel micro-probes (spec11).
usage: PYTHONPATH=. flock -w 1800 /tmp/specdec-heavy.lock timeout 330 python docs/bench/formats/bench-s11/spec11/sim.py
The draft (w8a8, 65,536-id subset, as specdec bench --formats w8a8 --draft-vocab-subset 65536) is run over prompt +
the target's 128 greedy tokens in one forward (bitwise its incremental logits: shape-invariant forward); a smaller
subset N is the 65,536 columns restricted to the N most frequent ids. agree = share of positions whose draft argmax
is the target's token."""
import os, sys, time, argparse, json
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch
torch.set_num_threads(1)
from transformers import DynamicCache
from benchmarks.inprocess import load_models
from benchmarks.inprocess_prompts import PROMPTS
from specdec.request import GenerationRequest
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.sampling import mask_unemittable

subset = int(os.environ.get("SUBSET", "65536")) or None
ns = argparse.Namespace(target="demo", draft="demo", draft_vocab_subset=subset, hf=[], skip_hf=True,
                        device="cpu", draft_vocab_table=None)
target, draft, _ = load_models(ns, os.environ.get("FMT", "w8a8"))
eng = SpeculativeEngine(target, draft)
TOK = int(os.environ.get("TOKENS", "128"))
out = {"agree": {}, "cost": {}}

def ids_of(name):
    p = next(p for p in PROMPTS if p["name"] == name)
    return eng.encode(GenerationRequest(messages=[{"role": "user", "content": p["content"]}], max_tokens=1))

with torch.inference_mode():
    for name in os.environ.get("PROMPTS", "code-prime,code-merge").split(","):
        ids = ids_of(name)
        req = GenerationRequest(prompt_token_ids=ids, max_tokens=TOK, speculation={"proposer": "draft", "k": 4})
        toks = list(eng.start(req).run().token_ids)
        full = ids + toks
        lg = draft.model(input_ids=torch.tensor([full]), use_cache=False).logits[0]  # [n, N]
        from specdec.models.vocab_subset import FrequencyTable, subset_ids
        table = FrequencyTable.load(None)
        sub_ids = draft.vocab_subset
        for nsub in (65536, 49152, 32768, 24576, 16384):
            keep_ids = torch.tensor(sorted(subset_ids(table, draft.tokenizer, nsub, draft.emittable_vocab, always=draft.eos_token_ids, model_name="d").tolist()))
            colmask = torch.isin(sub_ids, keep_ids)
            rows = []
            for p in range(len(ids) - 1, len(full) - 1):  # logits at p predict token p+1
                lrow = lg[p:p + 1].float().masked_fill(~colmask, float("-inf"))
                l = mask_unemittable(draft.full_logits(lrow), draft.emittable_vocab)[0]
                t = int(torch.argmax(l))
                conf = float(torch.softmax(l.float(), dim=-1)[t])
                rows.append((t, conf, full[p + 1]))
            out["agree"][f"{name}/{nsub}"] = {"prompt_len": len(ids), "rows": rows}
            print(name, nsub, "agree", sum(a == b for a, _, b in rows) / len(rows), flush=True)
        out["agree"][name] = out["agree"][f"{name}/65536"]
        print(name, "prompt tokens", len(ids), flush=True)

    def fwd_cost(model, ctx, n, reps):
        cache = DynamicCache()
        model(input_ids=torch.tensor([ctx]), cache=cache, use_cache=True, logits_to_keep=1)
        base = cache.get_seq_length()
        ts = []
        for r in range(reps):
            x = torch.tensor([ctx[-n:]])
            c0 = time.process_time()
            model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=n if model is target.model else 1)
            ts.append(time.process_time() - c0)
            cache.crop(-n)
        return ts
    ctx = out["agree"]["code-prime"]["rows"]
    base_ids = ids_of("code-prime") + [r[2] for r in ctx][:40]
    res = {}
    for rnd in range(int(os.environ.get("ROUNDS", "3"))):
        for key, model, n in [("d1", draft.model, 1), ("d2", draft.model, 2)] + [(f"t{n}", target.model, n) for n in (1, 2, 3, 5, 7, 9, 11)]:
            res.setdefault(key, []).extend(fwd_cost(model, base_ids, n, 3))
        for key, model in (("dpre", draft.model), ("tpre", target.model)):
            c0 = time.process_time(); model(input_ids=torch.tensor([ids_of("code-prime")]), use_cache=True, logits_to_keep=1)
            res.setdefault(key, []).append(time.process_time() - c0)
    for k, v in res.items():
        v = sorted(v); out["cost"][k] = {"min": v[0], "med": v[len(v) // 2]}
        print(k, "min %.4f med %.4f" % (v[0], v[len(v) // 2]), flush=True)
json.dump(out, open(os.environ.get("OUT", "/tmp/spec11/sim.json"), "w"))

# --- micro: qlinear rows scaling at the target's shapes; SDPA direct op vs F.sdpa for one row
from specdec.models.quant_linear import W8A8Linear
import torch.nn.functional as F
g = torch.Generator().manual_seed(0)
for (i, o) in [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536), (1536, 151936)]:
    lin = W8A8Linear(torch.randint(-127, 128, (o, i), dtype=torch.int8, generator=g), torch.rand(o) * 0.01 + 1e-3, None)
    xs = torch.randn(16, i, generator=g).to(torch.bfloat16)
    row = []
    for m in (1, 2, 5, 9):
        ts = []
        for _ in range(7):
            c0 = time.perf_counter(); lin.forward_rows(xs[:m]); ts.append(time.perf_counter() - c0)
        row.append(f"M{m} {sorted(ts)[1]*1000:.2f}ms")
    print("qlinear", i, o, " ".join(row), flush=True)
    del lin
q = torch.randn(1, 12, 1, 128); k = torch.randn(1, 2, 100, 128); v = torch.randn(1, 2, 100, 128)
a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
try:
    b = op(q, k, v, 0.0, False, attn_mask=None, scale=None)[0]
    print("direct op equal", torch.equal(a, b))
except Exception as e:
    print("direct op fails", type(e).__name__, str(e)[:200])
kr = k.repeat_interleave(6, dim=1); vr = v.repeat_interleave(6, dim=1)
b2 = op(q, kr, vr, 0.0, False, attn_mask=None, scale=None)[0]
print("direct op on repeated kv equal", torch.equal(a, b2))
for name, fn in [("F.sdpa gqa", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
                 ("op repeated", lambda: op(q, kr, vr, 0.0, False, attn_mask=None, scale=None)[0]),
                 ("F.sdpa repeated", lambda: F.scaled_dot_product_attention(q, kr, vr))]:
    ts = []
    for _ in range(200):
        c0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - c0)
    ts.sort(); print("sdpa", name, f"min {ts[0]*1e6:.1f}us med {ts[100]*1e6:.1f}us")
