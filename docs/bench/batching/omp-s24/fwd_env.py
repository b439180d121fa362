"""One process, the demo target alone: forwards of 1x1 and 1x5 under this process's OpenMP environment
(OMP_WAIT_POLICY, GOMP_SPINCOUNT; GAP: seconds idle before each forward). Session 24 (README here)."""
import os, random, statistics as st, sys, time
import torch
torch.set_num_threads(2)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fold-s23"))  # session 23's setup
from specdec.models import lean_decode
from sessions import cached_sessions, timed_forward
from specdec.models.loader import load_model
from specdec.models.spec import parse_model_spec
m = load_model(parse_model_spec("demo:target"))
lean_decode.install(m.model)
seqs = cached_sessions(m.model, random.Random(0), (60,))
rng = random.Random(1)
for shape in ((1,1),(1,5)):
    ws=[]
    for r in range(12):
        toks=[rng.randrange(1000,30000) for _ in range(shape[1])]
        if os.environ.get("GAP"): time.sleep(float(os.environ["GAP"]))
        w,_=timed_forward([(seqs[0],toks,shape[1])]); ws.append(w)
    print(os.environ.get("OMP_WAIT_POLICY","default"), os.environ.get("GOMP_SPINCOUNT","-"), "gap", os.environ.get("GAP","0"), shape, "median %.1f ms min %.1f"%(1000*st.median(ws[2:]),1000*min(ws)), flush=True)
