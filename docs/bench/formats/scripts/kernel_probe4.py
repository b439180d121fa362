"""Which M give the same row as M=2 (fp32/fp16), bf16 thresholds for every Qwen shape (both models),
and speed of candidate kernels per M."""
import sys, time, warnings, logging; warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import torch, torch.nn as nn
torch.manual_seed(0); torch.set_num_threads(2)
shapes = {"target": [(1536, 1536, True), (1536, 256, True), (1536, 1536, False), (1536, 8960, False), (8960, 1536, False), (1536, 151936, False)],
          "draft": [(896, 896, True), (896, 128, True), (896, 896, False), (896, 4864, False), (4864, 896, False), (896, 151936, False)]}
for fmt in sys.argv[1].split(","):
    dt = {"float32": torch.float32, "float16": torch.float16}.get(fmt, torch.bfloat16)
    for role, ss in shapes.items():
        for i, o, b in ss:
            lin = nn.Linear(i, o, bias=b).to(dt)
            X = torch.randn(1, 70, i).to(dt)
            with torch.inference_mode():
                r1 = lin(X[:, -1:])[0, -1]; r2 = lin(X[:, -2:])[0, -1]
                d1 = [m for m in range(1, 71) if not torch.equal(lin(X[:, 70 - m:])[0, -1], r1)]
                d2 = [m for m in range(1, 71) if not torch.equal(lin(X[:, 70 - m:])[0, -1], r2)]
            first = lambda d: d[0] if d else None
            print(fmt, role, (i, o, b), "first M differing from M=1:", first(d1), " from M=2:", first(d2), "n=", len(d1), len(d2), flush=True)
