"""Where the w8a8 target alone spends a decode step outside weight reading (issue 9; helper alone3x).

usage: python alone_step.py [THREADS]      e.g.  python alone_step.py 1,2
env: STEPS (timed decode steps, default 12), PROFILE=1 (torch.profiler op table), GEN=1 (also
     time transformers' generate of 32 tokens and the sum of its forwards)

Loads the demo target in w8a8 (specdec's loader: fused, invariant), prefills the code-prime
prompt, then per torch thread count:
  - decode step: one position forward + argmax (process CPU s, min/median of STEPS);
  - the same step's int8 matmuls alone (every W8A8Linear's kernel on pre-quantized rows);
  - per module class, the inclusive CPU time of one step (forward pre/post hooks; hooks add
    ~2 us a call) and per op category from torch.profiler (self CPU);
  - with GEN: generate(32 tokens) CPU s and the part spent inside model.forward.
Run under the heavy lock.
"""
import sys, os, time, json, statistics, collections
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import text_ids  # noqa: F401,E402  (sets offline env, silences warnings)
import torch
from transformers import DynamicCache
from specdec.models.loader import load_model
from specdec.models.spec import DemoModelSpec
from specdec.models.formats import W8A8Linear


def cpu(fn):
    c0 = time.process_time()
    out = fn()
    return out, time.process_time() - c0


def floor_fn(model):
    calls = []
    for mod in model.modules():
        if isinstance(mod, W8A8Linear):
            q, _ = W8A8Linear.quantize_rows(torch.randn(1, mod.in_features).bfloat16())
            calls.append((mod, q))

    def run():
        for mod, q in calls:
            packed = mod._prepacked() if mod.out_features >= mod.QLINEAR_MIN_OUT or mod.prepacked else False
            if packed is not False:
                torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, packed, mod.scale, mod._zero_points, None,
                                                   1.0, 0, torch.float32, "none", [], "")
            else:
                torch._int_mm(q, mod.qweight.t())
    return run


def module_times(model, step, n=3):
    """Inclusive process CPU s per module class name per step (nested classes overlap)."""
    acc = collections.defaultdict(float)
    cnt = collections.Counter()
    stack = {}
    hs = []
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if name.endswith("lm_head"):
            cls = "lm_head"
        def pre(m, a, cls=cls):
            stack[id(m)] = time.process_time()
        def post(m, a, o, cls=cls):
            acc[cls] += time.process_time() - stack.pop(id(m))
            cnt[cls] += 1
        hs.append(mod.register_forward_pre_hook(pre))
        hs.append(mod.register_forward_hook(post))
    try:
        for _ in range(n):
            step()
    finally:
        for h in hs:
            h.remove()
    return {k: (round(v / n * 1000, 2), cnt[k] // n) for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}


CATS = [("qlinear", ("qlinear",)), ("int_mm", ("_int_mm",)), ("sdpa", ("scaled_dot", "_flash", "sdpa")),
        ("quantize", ("abs", "amax", "round", "div", "clamp")),
        ("copy/to", ("aten::to", "copy_", "_to_copy", "contiguous", "clone")),
        ("mul/add", ("aten::mul", "aten::add", "aten::neg", "aten::rsqrt", "aten::pow", "aten::mean", "aten::silu", "aten::cat", "aten::cos", "aten::sin")),
        ("view/slice", ("view", "slice", "transpose", "reshape", "select", "unsqueeze", "expand", "as_strided", "permute", "empty", "t", "narrow", "alias", "detach", "resolve")),
        ]


def categorize(prof, n):
    out = collections.defaultdict(float)
    total = 0.0
    for e in prof.key_averages():
        t = e.self_cpu_time_total / n / 1000
        total += t
        for cat, keys in CATS:
            if any(k in e.key for k in keys):
                out[cat] += t
                break
        else:
            out["other:" + e.key] += t
    return {"total_ms": round(total, 2), **{k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0.05}}


def main():
    from benchmarks.inprocess import PROMPTS, _chat_request
    threads = [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "1,2").split(",")]
    steps = int(os.environ.get("STEPS", "12"))
    prompt = next(p for p in PROMPTS if p["name"] == "code-prime")
    t0 = time.perf_counter()
    loaded = load_model(DemoModelSpec(role="target"), weight_format="w8a8")
    model = loaded.model
    from specdec.engine.engine import SpeculativeEngine
    ids = SpeculativeEngine(loaded, None).encode(_chat_request(prompt))
    print(f"== target w8a8: loaded in {time.perf_counter() - t0:.1f} s, prompt {len(ids)} tokens", flush=True)
    for th in threads:
        torch.set_num_threads(th)
        res = {"threads": th, "load": round(os.getloadavg()[0], 1)}
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            _, res["prefill_cpu"] = cpu(lambda: model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True))
            tok = ids[-1]

            def step():
                model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits[0, -1].argmax()
                cache.crop(-1)
            fl = floor_fn(model)
            step(); fl()
            a, b = [], []
            for _ in range(steps):
                a.append(cpu(step)[1]); b.append(cpu(fl)[1])
            res.update(step_min=round(min(a), 4), step_med=round(statistics.median(a), 4),
                       int8mm_min=round(min(b), 4), int8mm_med=round(statistics.median(b), 4))
            res["modules_ms"] = module_times(model, step)
            if os.environ.get("PROFILE"):
                from torch.profiler import profile, ProfilerActivity
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(3):
                        step()
                res["ops_ms"] = categorize(prof, 3)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))
            if os.environ.get("GEN"):
                x = torch.tensor([ids])
                kw = dict(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                          eos_token_id=loaded.eos_token_ids, pad_token_id=loaded.eos_token_ids[0])
                model.generate(**kw, max_length=None) if False else model.generate(**{**kw, "max_new_tokens": 4})
                fwd = [0.0]
                orig = model.forward

                def timed_forward(*args, **kwargs):
                    c0 = time.process_time()
                    try:
                        return orig(*args, **kwargs)
                    finally:
                        fwd[0] += time.process_time() - c0
                model.forward = timed_forward
                try:
                    out, g = cpu(lambda: model.generate(**kw))
                finally:
                    del model.forward
                res.update(gen32_cpu=round(g, 3), gen32_forward_cpu=round(fwd[0], 3),
                           gen32_new=int(out.shape[1] - x.shape[1]))
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
