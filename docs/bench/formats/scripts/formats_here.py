"""The demo target's forward cost per weight format and positions per forward, all formats loaded
in one process and timed in interleaved rounds (PROFILE.md section 11: which format is the
default on this CPU).

usage: python formats_here.py [FORMATS]      e.g.  python formats_here.py float32,int4,w8a8,int8
env: ROUNDS (default 5), MS (positions per forward, default 1,3,5,9,17), THREADS (default 1),
     PROMPT (bench prompt name, default code-prime)

Per format: the demo target loaded by specdec's loader (as ``specdec bench`` does), the bench
prompt prefilled once into its own cache; then ROUNDS rounds, each running every format (order
rotated per round) through one forward of M new positions for every M of MS on that cache
(cropped back after each), process CPU seconds (= wall at one thread). Prints per format and M
the min and median over rounds, and per M the ratio of float32's min to the format's min (how
many times cheaper a forward is).
Run under the heavy lock: flock -w 1800 /tmp/specdec-heavy.lock timeout 330 python formats_here.py
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import text_ids  # noqa: F401,E402  (sets offline env, silences warnings)
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from specdec.models.loader import load_model  # noqa: E402
from specdec.models.spec import DemoModelSpec  # noqa: E402


def main():
    from benchmarks.inprocess import PROMPTS, chat_request
    from specdec.engine.engine import SpeculativeEngine

    fmts = (sys.argv[1] if len(sys.argv) > 1 else "float32,int4,w8a8,int8").split(",")
    rounds = int(os.environ.get("ROUNDS", "5"))
    ms = [int(m) for m in os.environ.get("MS", "1,3,5,9,17").split(",")]
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    prompt = next(p for p in PROMPTS if p["name"] == os.environ.get("PROMPT", "code-prime"))
    models, caches, ids = {}, {}, None
    with torch.inference_mode():
        for f in fmts:
            t0 = time.perf_counter()
            models[f] = load_model(DemoModelSpec(role="target"), weight_format=f)
            if ids is None:
                ids = SpeculativeEngine(models[f], None).encode(chat_request(prompt))
            caches[f] = DynamicCache(config=models[f].model.config)
            models[f].model(input_ids=torch.tensor([ids]), past_key_values=caches[f], use_cache=True)
            print(f"{f}: loaded and prefilled {len(ids)} positions in {time.perf_counter() - t0:.1f} s", flush=True)
        new = torch.tensor([ids[-max(ms):]])  # any ids: the cost does not depend on them
        for f in fmts:  # warm: one forward per M
            for m in ms:
                models[f].model(input_ids=new[:, :m], past_key_values=caches[f], use_cache=True)
                caches[f].crop(-m)
        cpu = {(f, m): [] for f in fmts for m in ms}
        loads = []
        for r in range(rounds):
            loads.append(os.getloadavg()[0])
            for f in fmts[r % len(fmts):] + fmts[:r % len(fmts)]:
                for m in ms:
                    c0 = time.process_time()
                    models[f].model(input_ids=new[:, :m], past_key_values=caches[f],
                                    use_cache=True).logits[0, -1].argmax()
                    cpu[(f, m)].append(time.process_time() - c0)
                    caches[f].crop(-m)
    print(f"{time.strftime('%H:%M UTC', time.gmtime())}, {torch.get_num_threads()} thread(s), {rounds} rounds, "
          f"load {min(loads):.1f}-{max(loads):.1f}, cache {len(ids)} positions; CPU s per forward, min / median")
    print("| format | " + " | ".join(f"{m} pos" for m in ms) + " | " + " | ".join(f"x f32 @{m}" for m in ms) + " |")
    print("|---|" + "---:|" * (2 * len(ms)))
    base = fmts[0]
    for f in fmts:
        cells = [f"{min(cpu[(f, m)]):.3f} / {statistics.median(cpu[(f, m)]):.3f}" for m in ms]
        ratio = [f"{min(cpu[(base, m)]) / min(cpu[(f, m)]):.2f}x" for m in ms]
        print(f"| {f} | " + " | ".join(cells) + " | " + " | ".join(ratio) + " |", flush=True)


if __name__ == "__main__":
    main()
