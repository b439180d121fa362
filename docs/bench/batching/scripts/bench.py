"""Time one forward of rows x positions: separate vs packed vs padded. argv: model folder, threads."""
import sys, time, torch, random, copy, json
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))  # run with the project installed
from proto import *
from transformers import AutoModelForCausalLM
folder = sys.argv[1]; torch.set_num_threads(int(sys.argv[2]))
configs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
rng = random.Random(0)
V = model.config.vocab_size
def make(L):
    c = DynamicCache(config=model.config)
    if L:
        with torch.inference_mode():
            single_forward(model, c, [rng.randrange(3, min(V, 1000)) for _ in range(L)], 1)
    return c
def clone(c):
    d = DynamicCache(config=model.config)
    for li, layer in enumerate(c.layers):
        d.update(layer.keys.clone(), layer.values.clone(), li)
    return d
def timed(fn, reps):
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t)
    return best
configs = configs or [[64, 1, 1], [64, 2, 1], [64, 4, 1], [64, 8, 1], [64, 1, 5], [64, 2, 5], [64, 4, 5], [64, 8, 5], [64, 8, 3], [300, 8, 1], [300, 8, 5]]
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 3
for L, n, q in configs:
    base = [make(L) for _ in range(n)]
    toks = [[rng.randrange(3, min(V, 1000)) for _ in range(q)] for _ in range(n)]
    with torch.inference_mode():
        def sep():
            for c, t in zip(base, toks):
                cc = clone(c); single_forward(model, cc, t, q)
        def pk():
            packed_forward(model, [(clone(c), L, t, q) for c, t in zip(base, toks)])
        def pd():
            padded_forward(model, [(clone(c), L, t, q) for c, t in zip(base, toks)])
        def cl():
            [clone(c) for c in base]
        sep(); pk(); pd()
        r = dict(L=L, rows=n, pos_per_row=q, separate=timed(sep, reps), packed=timed(pk, reps), padded=timed(pd, reps), clone=timed(cl, reps))
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
