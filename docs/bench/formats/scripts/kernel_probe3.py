"""For each linear shape and format: the set of M (1..80) whose last row differs from the M=1
result, and whether a row's result depends on its index inside an M-row call (fixed M)."""
import sys, warnings, logging; warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import torch, torch.nn as nn
torch.manual_seed(0); torch.set_num_threads(2)
from common import Int8PackLinear
shapes = [(1536, 256, True), (1536, 8960, False), (8960, 1536, False)]
fmts = sys.argv[1].split(",")
for fmt in fmts:
    for i, o, b in shapes:
        lin = nn.Linear(i, o, bias=b)
        dt = torch.float32 if fmt == "float32" else torch.float16 if fmt == "float16" else torch.bfloat16
        lin = lin.to(dt)
        if fmt == "int8aten": lin = Int8PackLinear(lin)
        if fmt == "int4":
            from torchao.quantization import quantize_
            from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig as C
            quantize_(lin, C(group_size=128))
        X = torch.randn(1, 80, i).to(dt)
        with torch.inference_mode():
            ref = lin(X[:, -1:])[0, -1]
            bad = [m for m in range(1, 81) if not torch.equal(lin(X[:, 80 - m:])[0, -1], ref)]
            # fixed M: row r of an M-row call vs the same input at row 0 of another M-row call
            slot = {}
            for m in (2, 4, 16, 32, 64):
                Y = X[:, :m].clone(); r0 = lin(Y)[0, 0]
                diffs = 0
                for r in range(1, m):
                    Z = torch.randn(1, m, i).to(dt); Z[0, r] = Y[0, 0]
                    diffs += not torch.equal(lin(Z)[0, r], r0)
                slot[m] = diffs
        print(fmt, (i, o, b), "M differing from M=1:", bad[:12], f"({len(bad)} of 80)", "slot-dependence:", slot, flush=True)
