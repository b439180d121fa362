"""Time the demo target's forward inside a Ray TP worker (built like start_tp_workers) and in process."""
import os, sys, time, threading, json
import torch

def probe_forward(model, ns=(1, 2, 5, 9), reps=7, threads=None):
    from transformers import DynamicCache
    from specdec.models.formats import W8A8Linear
    if threads:
        torch.set_num_threads(threads)
    facts = {"thread": threading.current_thread().name, "torch_threads": torch.get_num_threads(),
             "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "load": os.getloadavg()[0]}
    w8 = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    facts["w8a8_layers"] = len(w8)
    facts["w8a8_prepacked"] = sum(m.prepacked for m in w8)
    ids = list(range(1000, 1000 + 64 + max(ns)))
    out = {}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids[:64]]), past_key_values=cache, use_cache=True)
        for _ in range(reps):
            for n in ns:
                w0, c0 = time.perf_counter(), time.process_time()
                model(input_ids=torch.tensor([ids[64:64 + n]]), past_key_values=cache, use_cache=True)
                out.setdefault(n, []).append((time.perf_counter() - w0, time.process_time() - c0))
                cache.crop(-n)
        if w8:
            up = next(m for m in sorted(w8, key=lambda m: -m.out_features * (m.out_features < 100000)))
            x = torch.randn(2, up.in_features, dtype=torch.bfloat16)
            ts = []
            for _ in range(30):
                t = time.perf_counter(); up(x); ts.append(time.perf_counter() - t)
            facts["up_proj_2rows_ms min/med"] = (round(min(ts) * 1e3, 3), round(sorted(ts)[15] * 1e3, 3))
    facts["w8a8_prepacked_after"] = sum(m.prepacked for m in w8)
    facts["forward min/med wall, med cpu (s)"] = {
        n: (round(min(w for w, _ in v), 4), round(sorted(w for w, _ in v)[len(v) // 2], 4),
            round(sorted(c for _, c in v)[len(v) // 2], 4)) for n, v in out.items()}
    return facts

from deployments.tp_worker import TPWorker

class ProbeWorker(TPWorker):
    def probe(self, threads=None, **kw):
        return probe_forward(self.loaded.model, threads=threads, **kw)
    def probe_in_thread(self, threads=None, **kw):
        res = {}
        t = threading.Thread(target=lambda: res.update(probe_forward(self.loaded.model, threads=threads, **kw)))
        t.start(); t.join()
        return res

if __name__ == "__main__":
    import ray
    from specdec.models.loader import resolve_folder
    fmt = os.environ.get("FMT", "w8a8")
    folder = resolve_folder("demo:target", fmt)
    modes = os.environ.get("MODES", "ray,inproc").split(",")
    if "ray" in modes:
        ray.init(num_cpus=2, include_dashboard=False)
        cls = ray.remote(concurrency_groups={"health": 1})(ProbeWorker)
        w = cls.options(num_cpus=0).remote(0, 1)
        addr, port = ray.get(w.address.remote())
        t0 = time.time()
        info = ray.get(w.setup.remote(folder, addr, port, fmt, 2, 0))
        print("setup", round(time.time() - t0, 1), info, flush=True)
        print("ray default thread:", json.dumps(ray.get(w.probe.remote())), flush=True)
        print("ray default thread again:", json.dumps(ray.get(w.probe.remote())), flush=True)
        for extra in os.environ.get("EXTRA", "").split(","):
            if extra:
                print(f"ray {extra}:", json.dumps(ray.get(getattr(w, extra).remote())), flush=True)
        ray.kill(w)
        ray.shutdown()
    if "inproc" in modes:
        from deployments.tp_load import load_tp_model
        torch.set_num_threads(2)
        m = load_tp_model(folder, 0, 1, fmt)
        print("in process:", json.dumps(probe_forward(m.model)), flush=True)
