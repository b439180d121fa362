"""Prefill cost of the invariant forward: a P-token prompt (logits of the last position only),
invariant vs plain on the same weights, alternating, median of 3.

usage: flock -w 1800 /tmp/specdec-heavy.lock python prefill_cost.py bfloat16,int4 [P]
"""
import contextlib, gc, json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import plain_mode  # noqa: E402
from common import text_ids  # noqa: E402
import torch  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.models.spec import DemoModelSpec  # noqa: E402

P = int(sys.argv[2]) if len(sys.argv) > 2 else 400
for fmt in sys.argv[1].split(","):
    target = load_model(DemoModelSpec(role="target"), weight_format=fmt, invariant=True)
    ids = torch.tensor([text_ids(target.tokenizer, P + 40)[:P]])
    times = {}
    with torch.inference_mode():
        for _ in range(3):
            for mode in ("invariant", "plain"):
                with (plain_mode(target.model) if mode == "plain" else contextlib.nullcontext()):
                    t0 = time.perf_counter()
                    target.model(input_ids=ids, logits_to_keep=1)
                    times.setdefault(mode, []).append(time.perf_counter() - t0)
    print(json.dumps({"fmt": fmt, "prompt": int(ids.shape[1]), "load": round(os.getloadavg()[0], 1),
                      **{m: round(sorted(v)[1], 3) for m, v in times.items()}}), flush=True)
    del target
    gc.collect()
