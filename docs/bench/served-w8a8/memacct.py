"""Where a model process's memory goes: ``python memacct.py draft|target [FORMAT] [TOKENS]``.

Loads the demo draft as the Draft replica does (``load_model``) or the demo target as a TP=1 rank
does (``deployments.tp_load.load_tp_model``), in FORMAT (default w8a8), then decodes TOKENS greedy
tokens (default 64) after a ~300-token prompt through :class:`specdec.engine.kv_cache.CachedSequence`,
and prints at each stage the process's RSS (anonymous and file-backed), glibc's heap (in use / free
but kept), the mappings by kind, and the model's tensors by kind (prepacked int8, int8 rows,
embeddings, norms, biases and scales) with how many of their bytes are file-backed.
Run under the heavy lock (it loads the real demo pair's weights)."""
from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import time


def status() -> dict[str, int]:
    """RssAnon / RssFile / VmRSS of this process in bytes."""
    out = {}
    for line in open("/proc/self/status"):
        k = line.split(":")[0]
        if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[k] = int(line.split()[1]) * 1024
    return out


class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap() -> dict[str, int]:
    """glibc malloc: bytes in use (arena + mmapped chunks) and free bytes kept in the arenas."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2
    m = libc.mallinfo2()
    return {"in_use": m.uordblks + m.hblkhd, "mmapped_chunks": m.hblkhd, "free_kept": m.fordblks}


def mappings() -> dict[str, int]:
    """RSS by mapping kind: [heap], anonymous (other), and per file suffix."""
    kinds: dict[str, int] = {}
    cur = None
    for line in open("/proc/self/smaps"):
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if path.startswith("["):
                cur = path
            elif not path:
                cur = "anon"
            elif path.endswith((".so", ".py")) or ".so." in path or ".so" in os.path.basename(path):
                cur = "libraries"
            else:
                cur = os.path.basename(path)
        elif head == "Rss:" and cur is not None:
            kinds[cur] = kinds.get(cur, 0) + int(line.split()[1]) * 1024
    return {k: v for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]) if v >= 1 << 20}


def mib(n: int) -> str:
    return f"{n / 1048576:.0f}"


def report(stage: str) -> None:
    s, h = status(), heap()
    print(f"== {stage}: RSS {mib(s['VmRSS'])} MiB (anon {mib(s['RssAnon'])}, file {mib(s['RssFile'])}; peak {mib(s['VmHWM'])}); "
          f"malloc in use {mib(h['in_use'])} MiB (mmapped chunks {mib(h['mmapped_chunks'])}), free kept {mib(h['free_kept'])} MiB")
    print("   mappings (MiB RSS): " + ", ".join(f"{k} {mib(v)}" for k, v in mappings().items()))
    sys.stdout.flush()


def tensors_by_kind(model) -> None:
    """The model's memory by kind, with the file-backed part of each."""
    import torch
    from torch import nn

    from specdec.models import formats, release

    maps = release.file_mappings()
    kinds: dict[str, list[int]] = {}
    seen: set[int] = set()

    def add(kind: str, t: torch.Tensor) -> None:
        if t is None or t.device.type == "meta":
            return
        key = t.untyped_storage().data_ptr()
        if key in seen or t.numel() == 0:
            return
        seen.add(key)
        n = t.untyped_storage().nbytes()
        row = kinds.setdefault(kind, [0, 0])
        row[0] += n
        row[1] += n if release._in_mapping(t, maps) else 0

    for name, m in model.named_modules():
        if isinstance(m, formats.W8A8Linear):
            if m.prepacked:
                row = kinds.setdefault("w8a8 prepacked (oneDNN)", [0, 0])
                row[0] += m.in_features * m.out_features
            add("w8a8 int8 rows", m.qweight)
            add("scales", m.scale)
            add("biases", m.bias)
            continue
        for pname, p in list(m._parameters.items()) + list(m._buffers.items()):
            if p is None:
                continue
            if isinstance(m, nn.Embedding):
                add(f"embedding {p.dtype}", p.data)
            elif "norm" in type(m).__name__.lower():
                add("norms", p.data)
            elif pname == "bias":
                add("biases", p.data)
            elif "rotary" in name or "inv_freq" in pname:
                add("rotary", p.data)
            else:
                add(f"other {type(m).__name__}.{pname} {p.dtype}", p.data)
    total = sum(v[0] for v in kinds.values())
    print(f"   tensors: {mib(total)} MiB: " + ", ".join(f"{k} {mib(v[0])} (file {mib(v[1])})" for k, v in kinds.items()))


def main() -> None:
    role = sys.argv[1]
    fmt = sys.argv[2] if len(sys.argv) > 2 else "w8a8"
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    report("start")
    import torch
    import transformers  # noqa: F401

    from specdec.models import release
    from specdec.models.loader import resolve_folder

    if os.environ.get("COPY_EMBEDDINGS") == "1":  # as before: the input embeddings copied to anonymous memory
        release.EMBEDDINGS_MAPPED = False
    torch.set_num_threads(2)
    text = open(os.path.join(os.path.dirname(__file__), "../../../specdec/models/release.py")).read()[:1200]
    # the prompt tokenized in a child process: a tokenizer loaded and freed here leaves ~130 MiB in the heap
    code = ("import json, sys; from transformers import AutoTokenizer; "
            f"print(json.dumps(AutoTokenizer.from_pretrained(sys.argv[1])(sys.argv[2])['input_ids']))")
    ids = json.loads(subprocess.check_output([sys.executable, "-c", code, resolve_folder(f"demo:{role}", fmt), text],
                                             stderr=subprocess.DEVNULL).decode().strip().splitlines()[-1])
    report(f"torch + transformers imported, prompt tokenized (embeddings mapped: {release.EMBEDDINGS_MAPPED})")
    t0 = time.perf_counter()
    if role == "draft":
        from specdec.models.loader import load_model
        from specdec.models.spec import parse_model_spec

        from specdec.models.loaded import TokenizerFacts

        loaded = load_model(parse_model_spec("demo:draft"), weight_format=fmt)
        loaded.tokenizer = TokenizerFacts.of(loaded.tokenizer)  # as deployments/draft.py does
        release.release_freed_memory()
    else:
        from deployments.tp_load import load_tp_model

        loaded = load_tp_model(resolve_folder("demo:target", fmt), 0, 1, fmt)
    gc.collect()
    report(f"{role} loaded in {time.perf_counter() - t0:.1f} s")
    tensors_by_kind(loaded.model)
    from specdec.engine.kv_cache import CachedSequence

    seq = CachedSequence(loaded.model, list(ids))
    t0 = time.perf_counter()
    out = []
    logits = seq.feed(ids, keep=1)
    for _ in range(tokens):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        seq.token_ids.append(nxt)
        logits = seq.feed([nxt])
    report(f"prompt {len(ids)} + {tokens} tokens decoded in {time.perf_counter() - t0:.1f} s (ids hash {hash(tuple(out))})")
    print("   first ids:", out[:16])
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    report("after malloc_trim(0)")


if __name__ == "__main__":
    main()
