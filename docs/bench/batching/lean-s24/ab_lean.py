"""A/B: the lean forward (specdec/models/lean_decode.py, MULTI_POSITION) against transformers' forward for
the demo target's multi-position forwards (one block, packed sessions, a prefill chunk), interleaved in one
process over the same ragged caches and tokens; asserts bitwise-equal logits. Session 24."""
import os, random, statistics as st, sys
import torch
torch.set_num_threads(2)
from specdec.models import lean_decode
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fold-s23"))
from sessions import cached_sessions, timed_forward  # session 23's shared setup
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec
target = load_model(parse_model_spec(os.environ.get("SPEC", "demo:target")))
lean_decode.install(target.model)
rng = random.Random(0)
seqs = cached_sessions(target.model, rng)
shapes = {"1x1": (1, 1), "1x5": (1, 5), "8x1": (8, 1), "8x5": (8, 5), "1x36": (1, 36)}
res = {(n, v): [] for n in shapes for v in ("hf", "lean")}
for r in range(int(os.environ.get("REPS", "9"))):
    for n, (rows, p) in shapes.items():
        toks = [[rng.randrange(1000, 30000) for _ in range(p)] for _ in range(rows)]
        outs = {}
        for v in (("hf", "lean") if r % 2 else ("lean", "hf")):
            lean_decode.MULTI_POSITION = v == "lean"
            w, o = timed_forward([(s, t, p) for s, t in zip(seqs, toks)])
            outs[v] = o
            if r: res[(n, v)].append(w)
        assert all(torch.equal(a, b) for a, b in zip(outs["hf"], outs["lean"])), n
for n in shapes:
    a, b = res[(n, "hf")], res[(n, "lean")]
    print(f"{n} hf {1000*st.median(a):7.1f}/{1000*min(a):6.1f}  lean {1000*st.median(b):7.1f}/{1000*min(b):6.1f}  ratio {st.median(b)/st.median(a):.3f}", flush=True)
