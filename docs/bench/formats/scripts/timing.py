"""Forward time vs number of new positions on a 64-token cache, per format; RSS."""
import sys; sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from common import *
role, fmts = sys.argv[1], sys.argv[2].split(",")
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
torch.set_num_threads(threads)
NS = [1, 2, 3, 4, 5, 8, 16] if role == "target" else [1]
for fmt in fmts:
    model, tok, t_load = load(role, fmt)
    ids = text_ids(tok, 64 + 16)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([ids[:64]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        res = {}
        for n in NS + NS:  # two rounds; keep the min
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                model(input_ids=torch.tensor([ids[64:64 + n]]), past_key_values=cache, use_cache=True)
                ts.append(time.perf_counter() - t0)
                cache.crop(-n)
            res[n] = min(res.get(n, 9e9), min(ts))
    print(json.dumps({"role": role, "fmt": fmt, "threads": threads, "load_s": round(t_load, 1),
                      "rss_gb": round(rss_gb(), 2), "peak_gb": round(peak_gb(), 2),
                      "forward_s": {n: round(t, 4) for n, t in res.items()}}), flush=True)
    del model, cache, out
    import gc; gc.collect()
