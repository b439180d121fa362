import os, sys, time, resource, warnings, logging, json
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
import transformers; transformers.utils.logging.disable_progress_bar()

FOLDER = os.path.expanduser("~/.cache/specdec/demo/")

def rss_gb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"): return int(line.split()[1]) / 2**20
def peak_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

def load(role, fmt, attn="sdpa"):
    t0 = time.perf_counter()
    folder = FOLDER + role
    tok = AutoTokenizer.from_pretrained(folder)
    dt = {"float32": torch.float32, "float16": torch.float16}.get(fmt, torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dt, attn_implementation=attn).eval()
    if fmt.startswith("int"):
        from torchao.quantization import quantize_
        if fmt == "int8":
            from torchao.quantization import Int8WeightOnlyConfig as C; cfg = C()
        elif fmt == "int4":
            from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig as C; cfg = C(group_size=128)
        elif fmt == "int8aten":
            cfg = None
            swap_int8_aten(model)
        if cfg is not None:
            quantize_(model, cfg)
    return model, tok, time.perf_counter() - t0

class Int8PackLinear(torch.nn.Module):
    def __init__(self, lin):
        super().__init__()
        w = lin.weight.detach().float()
        scale = w.abs().amax(1).clamp_min(1e-12) / 127
        self.register_buffer("q", torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("s", scale.to(lin.weight.dtype))
        self.bias = lin.bias
    def forward(self, x):
        shp = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shp[-1]), self.q, self.s)
        y = y.reshape(*shp[:-1], y.shape[-1])
        return y + self.bias if self.bias is not None else y

def swap_int8_aten(model):
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(mod, cname, Int8PackLinear(child))

def text_ids(tok, n):
    code = open(__import__("os").path.join(__import__("os").path.dirname(__import__("os").path.abspath(__file__)), "text_code.py.txt")).read()
    prose = open(__import__("os").path.join(__import__("os").path.dirname(__import__("os").path.abspath(__file__)), "text_prose.md")).read()
    ids = tok.encode(code[:3000]) [:n//2] + tok.encode(prose[2000:6000])[:n - n//2]
    return ids
