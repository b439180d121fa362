"""Where a w8a8 decode step and a verify step go, target and draft (issue 9; helper w8a8speed).

usage: python w8a8_step.py [ROLES] [THREADS]     e.g.  python w8a8_step.py target,draft,draft:vocab32768 1,2
env: STEPS (timed forwards per shape, default 10), PROFILE=1 (torch.profiler table of 3 forwards
     per shape), AB=1 (instead of the floor: the forward before this session's changes and after,
     alternating: "before" = QLINEAR_MIN_OUT 1024, the old quantization ops, every W8A8Linear
     behind invariant.py's chunking wrapper; "after" = today's code)

Per model (the demo pair in w8a8, loaded by specdec's loader: fused, invariant) and torch thread
count, on the code-prime prompt's cache: wall and process CPU seconds (min and median) of a
1-position forward + argmax (decode) and a 5-position forward (verify 5), and the floor: the same
step's int8 matmuls alone (every W8A8Linear's kernel called on a pre-quantized input of the
step's rows, in model order), so step - floor = everything outside the int8 matmuls.
Run under the heavy lock.
"""
import sys, os, time, json, statistics
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import text_ids  # noqa: F401,E402  (sets offline env, silences warnings)
import torch
from transformers import DynamicCache
from specdec.models.loader import load_model
from specdec.models.spec import DemoModelSpec
from specdec.models.formats import W8A8Linear


def timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def floor_fn(model, m):
    """The int8 matmuls of one forward over m rows, alone."""
    calls = []
    for mod in model.modules():
        if isinstance(mod, W8A8Linear):
            q, _ = W8A8Linear.quantize_rows(torch.randn(m, mod.in_features).bfloat16())
            calls.append((mod, q))

    def run():
        for mod, q in calls:
            packed = mod._prepacked() if mod.out_features >= mod.QLINEAR_MIN_OUT or mod.prepacked else False
            if packed is not False:
                torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, packed, mod.scale, mod._zero_points, None,
                                                   1.0, 0, torch.float32, "none", [], "")
            else:
                torch._int_mm(q, mod.qweight.t())
    return run, len(calls)


def _old_quantize_rows(x):
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).div_(127.0).clamp_min_(W8A8Linear.EPS)
    return torch.round(xf / s).clamp_(-127, 127).to(torch.int8), s


def variant(model, name):
    """Switch the loaded model's w8a8 forward to "before" or "after" (see module doc)."""
    import types
    from specdec.engine.invariant import _invariant_forward
    before = name == "before"
    W8A8Linear.QLINEAR_MIN_OUT = 1024 if before else 384
    W8A8Linear.quantize_rows = staticmethod(_old_quantize_rows if before else ORIG_QUANTIZE)
    for mod in model.modules():
        if isinstance(mod, W8A8Linear):
            if before:
                mod.forward = types.MethodType(_invariant_forward, mod)
            else:
                mod.__dict__.pop("forward", None)


ORIG_QUANTIZE = W8A8Linear.quantize_rows


def measure_ab(loaded, ids, threads, steps):
    torch.set_num_threads(threads)
    model = loaded.model
    res = {"threads": threads, "load": round(os.getloadavg()[0], 1)}
    with torch.inference_mode():
        x = torch.tensor([ids])
        cache = DynamicCache(config=model.config)
        model(input_ids=x, past_key_values=cache, use_cache=True)
        nxt = ids[-8:]
        for m in (1, 5):
            def st():
                out = model(input_ids=torch.tensor([nxt[:m]]), past_key_values=cache, use_cache=True).logits
                cache.crop(-m)
                return out
            acc, logits = {"before": [], "after": []}, {}
            for v in acc:
                variant(model, v); logits[v] = st()
            for _ in range(steps):
                for v in acc:
                    variant(model, v)
                    _, w, c = timed(st); acc[v].append((w, c))
            variant(model, "after")
            res[f"rows{m}"] = {v: {"wall_min": round(min(w for w, _ in a), 4),
                                   "wall_med": round(statistics.median([w for w, _ in a]), 4),
                                   "cpu_min": round(min(c for _, c in a), 4),
                                   "cpu_med": round(statistics.median([c for _, c in a]), 4)} for v, a in acc.items()}
            res[f"rows{m}"]["logits_equal"] = bool(torch.equal(logits["before"], logits["after"]))
    return res


def measure(loaded, ids, threads, steps):
    torch.set_num_threads(threads)
    model = loaded.model
    res = {"threads": threads, "load": round(os.getloadavg()[0], 1)}
    with torch.inference_mode():
        x = torch.tensor([ids])
        cache = DynamicCache(config=model.config)
        model(input_ids=x, past_key_values=cache, use_cache=True)
        nxt = ids[-8:]

        def step(m):
            def f():
                model(input_ids=torch.tensor([nxt[:m]]), past_key_values=cache, use_cache=True).logits[0, -1].argmax()
                cache.crop(-m)
            return f
        for m in (1, 5):
            fl, n = floor_fn(model, m)
            st = step(m)
            st(); fl()
            a, b = [], []
            for _ in range(steps):  # alternate step and floor
                _, w, c = timed(st); a.append((w, c))
                _, w, c = timed(fl); b.append((w, c))
            med = lambda v: statistics.median(v)  # noqa: E731
            res[f"rows{m}"] = {
                "step_wall_min": round(min(w for w, _ in a), 4), "step_wall_med": round(med([w for w, _ in a]), 4),
                "step_cpu_min": round(min(c for _, c in a), 4),
                "int8mm_wall_min": round(min(w for w, _ in b), 4), "int8mm_cpu_min": round(min(c for _, c in b), 4),
                "linears": n}
            if os.environ.get("PROFILE"):
                from torch.profiler import profile, ProfilerActivity
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(3):
                        st()
                print(f"--- profile: {threads} threads, {m} rows")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=45))
    return res


def main():
    from benchmarks.inprocess import PROMPTS, _chat_request
    roles = sys.argv[1].split(",") if len(sys.argv) > 1 else ["target", "draft"]
    threads = [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,2").split(",")]
    steps = int(os.environ.get("STEPS", "10"))
    prompt = next(p for p in PROMPTS if p["name"] == "code-prime")
    for role in roles:
        name, _, opt = role.partition(":")
        vocab = int(opt[5:]) if opt.startswith("vocab") else None
        t0 = time.perf_counter()
        if os.environ.get("AB"):
            W8A8Linear.KEEP_INT8 = True  # "before" runs the draft's narrow layers on _int_mm
        loaded = load_model(DemoModelSpec(role=name), weight_format="w8a8", vocab_subset=vocab)
        from specdec.engine.engine import SpeculativeEngine
        ids = SpeculativeEngine(loaded, None).encode(_chat_request(prompt))
        print(f"== {role}: loaded in {time.perf_counter() - t0:.1f} s, prompt {len(ids)} tokens", flush=True)
        for th in threads:
            fn = measure_ab if os.environ.get("AB") else measure
            print(json.dumps({"role": role, **fn(loaded, ids, th, steps)}), flush=True)
        del loaded
        import gc; gc.collect()


if __name__ == "__main__":
    main()
