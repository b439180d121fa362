"""Where the demo target's time goes when it decodes alone (issue 9: target alone >= 3x float32).

usage: python target_alone.py FORMATS [THREADS]     e.g.  python target_alone.py int4,w8a8,w8a8:nofuse 1,2
(a format with ":nofuse": its q/k/v and gate/up projections left unfused)
env: TOKENS (new tokens of the generate call, default 16), STEPS (decode steps timed, default 8),
     PROFILE=1 (torch.profiler of 3 decode steps), PROFILE_THREADS (only at this thread count),
     PLAIN=1 (decode steps through the invariant and the plain forward alternating, min CPU s),
     PROMPT (bench prompt name, default code-prime)

Per format (the demo target loaded by specdec's loader, as `specdec bench` does) and per torch
thread count, wall (perf_counter) and process CPU seconds of:
  - generate: the bench's "target alone" (transformers' generate on the model, greedy, the bench
    prompt with its chat template), TOKENS new tokens;
  - prefill: one forward over the prompt;
  - decode: STEPS one-position forwards on that cache (min and median);
  - verify 2 / 5: a forward over 2 and 5 new positions (min of 3).
Run under the heavy lock: flock -w 1800 /tmp/specdec-heavy.lock python target_alone.py int4 1,2
"""
import sys, os, time, json, contextlib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import text_ids  # noqa: F401,E402  (sets offline env, silences warnings)
import torch
from transformers import DynamicCache
from specdec.models.loader import load_model
from specdec.models.spec import DemoModelSpec


def timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def measure(target, ids, threads, tokens, steps):
    torch.set_num_threads(threads)
    model = target.model
    res = {"threads": threads, "load": round(os.getloadavg()[0], 1)}
    with torch.inference_mode():
        x = torch.tensor([ids])
        kw = dict(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False,
                  eos_token_id=target.eos_token_ids, pad_token_id=target.eos_token_ids[0])
        model.generate(**{**kw, "max_new_tokens": 2})  # warm-up
        out, w, c = timed(lambda: model.generate(**kw))
        n = out.shape[1] - len(ids)
        res["generate"] = {"new_tokens": n, "wall_s": round(w, 3), "cpu_s": round(c, 3),
                           "tok_per_s": round(n / w, 2), "tok_per_cpu_s": round(n / c, 2)}
        cache = DynamicCache(config=model.config)
        _, w, c = timed(lambda: model(input_ids=x, past_key_values=cache, use_cache=True))
        res["prefill"] = {"positions": len(ids), "wall_s": round(w, 3), "cpu_s": round(c, 3)}
        nxt = out[0, len(ids):].tolist()
        ws, cs = [], []
        for i in range(steps):
            _, w, c = timed(lambda: model(input_ids=torch.tensor([[nxt[i % len(nxt)]]]), past_key_values=cache,
                                          use_cache=True).logits[0, -1].argmax())
            ws.append(w); cs.append(c)
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        res["decode"] = {"wall_min_s": round(min(ws), 4), "wall_med_s": round(med(ws), 4),
                         "cpu_min_s": round(min(cs), 4), "cpu_med_s": round(med(cs), 4)}
        for m in (2, 5):
            best = (9e9, 9e9)
            for _ in range(3):
                _, w, c = timed(lambda: model(input_ids=torch.tensor([nxt[:m]]), past_key_values=cache, use_cache=True))
                cache.crop(-m)
                best = (min(best[0], w), min(best[1], c))
            res[f"verify{m}"] = {"wall_min_s": round(best[0], 4), "cpu_min_s": round(best[1], 4)}
        if os.environ.get("PLAIN"):  # the same decode step through the plain forward, alternating
            from profile_step import plain_mode
            inv, pl = [], []
            for i in range(steps):
                for mode, acc in (("invariant", inv), ("plain", pl)):
                    ctx = plain_mode(model) if mode == "plain" else contextlib.nullcontext()
                    with ctx:
                        _, w, c = timed(lambda: model(input_ids=torch.tensor([[nxt[i % len(nxt)]]]),
                                                      past_key_values=cache, use_cache=True).logits[0, -1].argmax())
                    cache.crop(-1)
                    acc.append(c)
            res["decode_cpu_min_s invariant/plain"] = [round(min(inv), 4), round(min(pl), 4)]
        if os.environ.get("PROFILE") and threads == int(os.environ.get("PROFILE_THREADS", threads)):
            from torch.profiler import profile, ProfilerActivity
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(3):
                    model(input_ids=torch.tensor([[nxt[i]]]), past_key_values=cache, use_cache=True).logits[0, -1].argmax()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=55))
    return res


def main():
    from benchmarks.inprocess import PROMPTS, _chat_request
    fmts = sys.argv[1].split(",")
    threads = [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,2").split(",")]
    tokens, steps = int(os.environ.get("TOKENS", "16")), int(os.environ.get("STEPS", "8"))
    prompt = next(p for p in PROMPTS if p["name"] == os.environ.get("PROMPT", "code-prime"))
    for fmt in fmts:
        t0 = time.perf_counter()
        name, _, opt = fmt.partition(":")  # "w8a8:nofuse": load_model(fuse=False)
        target = load_model(DemoModelSpec(role="target"), weight_format=name, fuse=opt != "nofuse")
        from specdec.engine.engine import SpeculativeEngine
        ids = SpeculativeEngine(target, None).encode(_chat_request(prompt))
        print(f"== {fmt}: loaded in {time.perf_counter() - t0:.1f} s, prompt {len(ids)} tokens", flush=True)
        for th in threads:
            print(json.dumps({"format": fmt, **measure(target, ids, th, tokens, steps)}), flush=True)
        del target
        import gc; gc.collect()


if __name__ == "__main__":
    main()
