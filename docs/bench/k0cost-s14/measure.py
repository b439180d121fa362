import sys, time, statistics, torch, gc
from pathlib import Path
from specdec.testing.tiny import build_tiny_model
from specdec.models.loader import load_model
from specdec.models.spec import HFModelSpec
from specdec.engine.engine import SpeculativeEngine
from specdec.request import GenerationRequest
from specdec.control.adaptive import run_timed
from specdec.control.batch_k import BatchKController
from specdec.control.goodput_guard import GoodputGuard
from specdec.engine.batch import BatchScheduler
from transformers import Qwen2ForCausalLM
torch.set_num_threads(1)
root = Path("/tmp/k0cost-models"); VR = int(sys.argv[1]) if len(sys.argv) > 1 else 320
t = root / f"t{VR}"; d = root / f"d{VR}"
if not t.exists():
    build_tiny_model(t, seed=0, max_positions=1024, vocab_rows=VR)
    build_tiny_model(d, seed=1, base=Qwen2ForCausalLM.from_pretrained(t), noise=0.03, max_positions=1024, vocab_rows=VR)
target = load_model(HFModelSpec(kind="hf", path=t)); draft = load_model(HFModelSpec(kind="hf", path=d))
eng = SpeculativeEngine(target, draft)
P = [5, 9, 13, 17, 21, 7, 3, 11, 2]; N = 64

def hf():
    with torch.inference_mode():
        ids = torch.tensor([P])
        out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N,
                                    do_sample=False, pad_token_id=target.tokenizer.pad_token_id)
    return out[0, len(P):].tolist()

def ours(k, proposer="none"):
    req = GenerationRequest(prompt_token_ids=P, max_tokens=N, ignore_eos=True, speculation={"proposer": proposer, "k": k})
    with torch.inference_mode():
        return run_timed(eng.start(req)).result.token_ids

def ours_held():  # a draft proposer session opened, per-step K callable answering 0
    req = GenerationRequest(prompt_token_ids=P, max_tokens=N, ignore_eos=True, speculation={"proposer": "draft", "k": 3})
    with torch.inference_mode():
        return run_timed(eng.start(req, k=lambda: 0)).result.token_ids

def held_ctl():
    ctl = BatchKController(budget=64, k_ranges={"code": (0, 3), "creative": (0, 3)})
    for rows in (1, 2, 4, 8):
        for positions in range(rows, 4 * rows + 1):
            ctl.cost.observe_verify(rows, positions, 0.01)
        ctl.cost.observe_draft(rows, 1.0)
    return ctl

def batch(adaptive):
    ctl = held_ctl() if adaptive else None
    s = BatchScheduler(eng, max_batch_positions=64, controller=ctl, clock=time.process_time, guard=GoodputGuard() if adaptive else None)
    hs = [s.submit(GenerationRequest(prompt_token_ids=P[i % 3:], max_tokens=N, ignore_eos=True,
                                     speculation={"proposer": "draft", "k": 3 if adaptive else 0}),
                   tenant=("code", "creative")[i % 2], adaptive=adaptive) for i in range(8)]
    with torch.inference_mode():
        s.run_until_idle()
    vs = sum(r.verify_s for r in s.trace)
    return [h.result().token_ids for h in hs], vs

if __name__ == "__main__" and "profile" not in sys.argv:
    ref = hf()
    assert ours(0) == ref and ours_held() == ref, "ids differ"
    b0 = batch(False); b1 = batch(True); assert b0[0] == b1[0]
    fns = {"hf": hf, "ours_k0": lambda: ours(0), "ours_held": ours_held}
    T = {k: [] for k in fns}; B = {"fixed": [], "adaptive": []}; V = {"fixed": [], "adaptive": []}
    for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 7):
        for name, f in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
            t0 = time.perf_counter(); f(); T[name].append((time.perf_counter() - t0) / N * 1e3)
        for name, a in ((("fixed", False), ("adaptive", True)) if r % 2 == 0 else (("adaptive", True), ("fixed", False))):
            t0 = time.perf_counter(); _, vs = batch(a); B[name].append((time.perf_counter() - t0) / N * 1e3); V[name].append(vs / N * 1e3)
    for k, v in T.items(): print(f"{k:10s} ms/token median {statistics.median(v):.3f}  {[round(x, 3) for x in v]}")
    for k, v in B.items(): print(f"batch8 {k:9s} ms/tick median {statistics.median(v):.3f} verify {statistics.median(V[k]):.3f}")
