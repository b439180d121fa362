import cProfile, pstats, time, io, torch
torch.set_num_threads(1)
from benchmarks.inprocess_methods import Runner, Method
from benchmarks.inprocess_prompts import select_prompts, chat_request
from benchmarks.inprocess_args import add_bench_arguments, resolve_args
import argparse
a = resolve_args(add_bench_arguments(argparse.ArgumentParser()).parse_args(["--tokens","32"]))
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec
t = load_model(parse_model_spec("demo:target"))
r = Runner(t, None, a)
for name in ("code-prime", "poem-sea"):
    p = select_prompts([name])[0]
    ids = r.engine.encode(chat_request(p))
    T, O = Method("target","target"), Method("ours-none","ours","none",0)
    r.run(T, ids, 32); r.run(O, ids, 32)
    for i in range(3):
        for m in ((T, O) if i % 2 == 0 else (O, T)):
            o = r.run(m, ids, 32)
            print(name, m.label, len(o.token_ids), f"cpu {o.cpu_s:.3f} wall {o.seconds:.3f} ttft {o.ttft_s}", flush=True)
p = select_prompts(["code-prime"])[0]; ids = r.engine.encode(chat_request(p))
for m in (O, T):
    pr = cProfile.Profile(); pr.enable(); r.run(m, ids, 32); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(m.label, s.getvalue()[:6000])
