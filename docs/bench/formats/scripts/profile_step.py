"""Profile one decoding step of the demo target through the engine's own path.

usage: python profile_step.py FORMATS [STEPS]    e.g.  python profile_step.py int4,bfloat16 6
env: THREADS (default 2); BEFORE=path/to/older/invariant.py adds its row-wise attention to the
forward timings (git show <rev>:specdec/engine/invariant.py > /tmp/invariant_before.py)

Per format: load the demo target with specdec's loader (invariant forward on for every format
but float32), open a target session on a 64-token prompt, then
  - time STEPS engine steps (TargetSession.verify of an empty block = one plain decoding step:
    forward, logits, argmax, commit), wall and process CPU seconds;
  - time the bare model forward over 1, 4, 16 new positions on the same cache, invariant and
    plain (the linears' original forward and sdpa attention, swapped back on the same weights)
    alternating, median of $ROUNDS (default 3; wall and process CPU seconds);
  - torch.profiler over 3 engine steps (top ops by self CPU time) and cProfile (top functions).
Run under the heavy lock: flock -w 1800 /tmp/specdec-heavy.lock python profile_step.py int4
"""
import sys, os, time, cProfile, pstats, io, contextlib, json
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import text_ids  # noqa: E402  (sets offline env, silences warnings)
import torch
from transformers import DynamicCache
from specdec.models.loader import load_model
from specdec.models.spec import DemoModelSpec
from specdec.engine.verifier import TargetVerifier
from specdec.request import SamplingParams
from specdec.types import DraftBlock

torch.set_num_threads(int(os.environ.get("THREADS", "2")))


@contextlib.contextmanager
def plain_mode(model):
    """The model's plain forward (no row chunks, sdpa attention) on the same weights."""
    saved = []
    for m in model.modules():
        if "forward" in m.__dict__ and getattr(m, "_specdec_plan", None) is not None:
            saved.append((m, m.__dict__.pop("forward")))
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        for m, f in saved:
            m.forward = f
        model.set_attn_implementation(impl)


@contextlib.contextmanager
def before_mode(model):
    """The invariant forward with the row-wise attention of an older invariant.py ($BEFORE)."""
    import importlib.util
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    mod = sys.modules.get("invariant_before")
    if mod is None:
        spec = importlib.util.spec_from_file_location("invariant_before", os.environ["BEFORE"])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["invariant_before"] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
    AttentionInterface.register("specdec_rowwise_before", mod.rowwise_attention)
    AttentionMaskInterface.register("specdec_rowwise_before", sdpa_mask)
    impl = model.config._attn_implementation
    model.set_attn_implementation("specdec_rowwise_before")
    try:
        yield
    finally:
        model.set_attn_implementation(impl)


def forward_times(model, ids, ns=(1, 4, 16), rounds=int(os.environ.get("ROUNDS", "3"))):
    """Median (wall s, process CPU s) of a forward over n new positions on a 64-token cache,
    invariant and plain alternating within each round (same weights, same load); with
    $BEFORE (the path of an older invariant.py) also its row-wise attention ("before")."""
    out = {}
    modes = ("invariant", "plain") + (("before",) if os.environ.get("BEFORE") else ())
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids[:64]]), past_key_values=cache, use_cache=True)
        for _ in range(rounds):
            for n in ns:
                for mode in modes:
                    ctx = {"plain": plain_mode, "before": before_mode}.get(mode, lambda m: contextlib.nullcontext())(model)
                    with ctx:
                        w0, c0 = time.perf_counter(), time.process_time()
                        model(input_ids=torch.tensor([ids[64:64 + n]]), past_key_values=cache, use_cache=True)
                        out.setdefault((mode, n), []).append((time.perf_counter() - w0, time.process_time() - c0))
                    cache.crop(-n)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {f"{mode} n={n}": [round(med([w for w, _ in v]), 4), round(med([c for _, c in v]), 4)]
            for (mode, n), v in out.items()}


def main():
    fmts = sys.argv[1].split(",")
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    for fmt in fmts:
        t0 = time.perf_counter()
        target = load_model(DemoModelSpec(role="target"), weight_format=fmt)
        print(f"== {fmt}: loaded in {time.perf_counter() - t0:.1f} s, invariant={target.invariant}", flush=True)
        ids = text_ids(target.tokenizer, 96)
        verifier = TargetVerifier(target)
        sess = verifier.open_session(ids[:64], SamplingParams(temperature=0.0), seed=0)
        sess.verify(DraftBlock.empty())  # prefill + first token
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            sess.verify(DraftBlock.empty())
        w, c = (time.perf_counter() - w0) / steps, (time.process_time() - c0) / steps
        res = {"fmt": fmt, "engine_step_wall_s": round(w, 4), "engine_step_cpu_s": round(c, 4)}
        print(res, flush=True)
        res["forward_s [median wall, median CPU]"] = forward_times(target.model, ids)
        print(json.dumps(res), flush=True)
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                sess.verify(DraftBlock.empty())
        print("-- profile: 3 engine steps (1 position each)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with torch.inference_mode():
                cache = DynamicCache(config=target.model.config)
                target.model(input_ids=torch.tensor([ids[:64]]), past_key_values=cache, use_cache=True)
                target.model(input_ids=torch.tensor([ids[64:80]]), past_key_values=cache, use_cache=True)
        print("-- profile: 64-position prefill + one 16-position forward (invariant)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(3):
            sess.verify(DraftBlock.empty())
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        print(s.getvalue()[-6000:], flush=True)
        sess.close()
        del target, verifier, sess
        import gc; gc.collect()


if __name__ == "__main__":
    main()
