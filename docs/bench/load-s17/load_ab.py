"""Session 17: the demo pair's load time before and after the load changes, each load in a fresh process.

    flock -w 1800 /tmp/specdec-heavy.lock python docs/bench/load-s17/load_ab.py [ROUNDS] > docs/bench/load-s17/run.txt

"before" undoes this session's three changes inside the process (monkeypatched, same code otherwise):
every w8a8 layer packed lazily one by one (``prepack_all`` with one worker), every fused q/k/v and
gate/up group checked (``fused._signature`` -> None), every layer shape probed at all of
``invariant.PROBE_ROWS``. "after" is the code as it is. Rounds alternate the order. Printed per load:
wall seconds of ``load_pair`` (target + draft, default formats, quantized cache warm), and the loader's
own split per model (read / quantize incl. fusion and prepacking / invariance plan).
"""
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r'''
import logging, re, sys, time, json
import torch
torch.set_num_threads(2)
records = []
class H(logging.Handler):
    def emit(self, r):
        m = r.getMessage()
        if m.startswith("loaded "):
            records.append(m)
logging.getLogger("specdec.models.loader").addHandler(H()); logging.getLogger("specdec.models.loader").setLevel(logging.INFO)
import specdec.models.quant_linear as ql, specdec.models.fused as fused, specdec.engine.invariant as inv
if sys.argv[1] == "before":
    real = ql.prepack_all
    ql.prepack_all = lambda layers, workers=None: real(layers, 1)
    fused._signature = lambda parts: None
    inv.ROW_EXACT_PROBE_ROWS = inv.PROBE_ROWS
from specdec.models.loader import load_pair
from specdec.models.spec import ModelPairSpec, parse_model_spec
t = time.perf_counter()
load_pair(ModelPairSpec(target=parse_model_spec("demo:target"), draft=parse_model_spec("demo:draft")))
print(json.dumps({"mode": sys.argv[1], "load_s": round(time.perf_counter() - t, 1),
                  "split": [re.sub(r" \(Qwen[^)]*\)|; \d+ positions.*", "", m) for m in records]}))
'''


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.getcwd())
    print(f"start {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()[0]:.2f}", flush=True)
    res: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(rounds):
        for mode in (("before", "after") if r % 2 == 0 else ("after", "before")):
            out = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, check=True)
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            res[mode].append(rec["load_s"])
            print(f"round {r} {mode:6s} {rec['load_s']:5.1f} s  |  " + "  |  ".join(rec["split"]), flush=True)
    b, a = statistics.median(res["before"]), statistics.median(res["after"])
    print(f"median before {b:.1f} s, after {a:.1f} s: {b / a:.2f}x faster; end load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
