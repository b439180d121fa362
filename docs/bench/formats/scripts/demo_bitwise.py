"""Demo target: logits bitwise equal between plain decoding (1 position per forward), one
16-position block, a 80-position prefill, and the row-wise attention of an older invariant.py.

usage: BEFORE=/tmp/invariant_before.py flock -w 1800 /tmp/specdec-heavy.lock python demo_bitwise.py bfloat16,int4
(BEFORE optional: git show 7ff207f:specdec/engine/invariant.py > /tmp/invariant_before.py)
"""
import gc, json, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import before_mode  # noqa: E402
from common import text_ids  # noqa: E402
import contextlib  # noqa: E402
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.models.spec import DemoModelSpec  # noqa: E402


def logits(model, ids, first, chunk):
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = [model(input_ids=torch.tensor([ids[:first]]), past_key_values=cache, use_cache=True,
                     logits_to_keep=1).logits[0].float()]
        for s in range(first, len(ids), chunk):
            out.append(model(input_ids=torch.tensor([ids[s:s + chunk]]), past_key_values=cache,
                             use_cache=True).logits[0].float())
    return torch.cat(out)  # rows predicting positions first .. len(ids)


for fmt in sys.argv[1].split(","):
    target = load_model(DemoModelSpec(role="target"), weight_format=fmt, invariant=True)
    ids = text_ids(target.tokenizer, 80)
    ref = logits(target.model, ids, 64, 1)
    res = {"fmt": fmt}
    for name, first, chunk, ctx in (("block16", 64, 16, None), ("blocks5", 64, 5, None), ("before_block16", 64, 16, "before")):
        if ctx == "before" and not os.environ.get("BEFORE"):
            continue
        with (before_mode(target.model) if ctx else contextlib.nullcontext()):
            got = logits(target.model, ids, first, chunk)
        res[name] = "exact" if torch.equal(got, ref) else f"max |d| {(got - ref).abs().max().item():.3g}"
    with torch.inference_mode():  # an 80-position prefill: rows 63..79 against plain decoding
        full = target.model(input_ids=torch.tensor([ids])).logits[0, 63:].float()
    res["prefill80"] = "exact" if torch.equal(full, ref) else f"max |d| {(full - ref).abs().max().item():.3g}"
    print(json.dumps(res), flush=True)
    del target
    gc.collect()
