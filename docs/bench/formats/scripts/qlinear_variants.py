"""The w8a8 int8 matmul on the demo target's shapes, the current kernel against library variants,
interleaved in one process (PROFILE.md section 11).

Per shape (in -> out) and row count M, ``COPIES`` distinct random int8 weights (so every call
streams its weight from memory, as a decode step does: the target's 1.55 GB of int8 weights do
not fit any cache), each variant prepacked its own way and put on 2 MiB pages like
``W8A8Linear``; then ``ROUNDS`` rounds, each timing every variant once (order rotated per
round) as the mean per call over the copies, process CPU time (= wall at one thread). Prints per
variant min and median over rounds (µs per call), the weight bytes per second at the minimum,
and whether its output equals ``float32(int32 sums) * w_scale`` (``aten._int_mm``'s, the layer's
definition) bitwise at that M (``exact``).

Variants (all int8 x int8 -> int32 sums; scales as the layer applies them):
- ``cur``: today's ``W8A8Linear`` call: ``onednn.qlinear_pointwise.default`` on
  ``qlinear_prepack(w, None)``, x scale 1.0, float32 out (then ``* s_x``, outside the timing).
- ``u8``: the same prepacked weight fed ``q + 128`` as uint8 with x zero point 128 (the integer
  sums are the same: oneDNN subtracts ``128 * sum(w)``); oneDNN's VNNI/AMX kernels take u8 x s8,
  and on a CPU without AMX-INT8 (this AMD EPYC) an s8 source falls to its reference ``ref_int8``.
- ``tensor``: ``qlinear_pointwise.tensor`` (x scale / zero point as tensors), same prepack, u8.
  ``hintM``, ``hint1``, ``bf16out`` are u8 too.
- ``hintM``: prepacked with the input-shape hint ``x_shape=[M, in]`` of the measured M.
- ``hint1``: prepacked with ``x_shape=[1, in]`` (a decode-step layout), called at every M.
- ``int_mm``: ``aten._int_mm`` (int32) ``* w_scale`` on the plain int8 weight.
- ``bf16out``: qlinear with bfloat16 output (reference: not the current rounding, never exact).
- ``f32mm`` / ``bf16mm``: ``F.linear`` of float32 / bfloat16 weights of the same shape (memory
  bandwidth references: 4x / 2x the bytes).

usage: THREADS=1 ROUNDS=9 COPIES=6 SHAPES=1536x17920,8960x1536,1536x151936 MS=1,5,9,17 \\
           VARIANTS=cur,tensor,hintM,hint1,int_mm python qlinear_variants.py
"""
import os
import statistics
import time
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specdec.models.hugepages import anon_huge_bytes, collapse  # noqa: E402

torch.set_num_threads(int(os.environ.get("THREADS", "1")))
ROUNDS = int(os.environ.get("ROUNDS", "9"))
COPIES = int(os.environ.get("COPIES", "6"))
SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get(
    "SHAPES", "1536x17920,8960x1536,1536x151936").split(",")]
MS = [int(m) for m in os.environ.get("MS", "1,5,9,17").split(",")]
VARIANTS = os.environ.get("VARIANTS", "cur,u8,tensor,hintM,hint1,int_mm,bf16out,f32mm,bf16mm").split(",")
HUGE = os.environ.get("HUGE", "1") == "1"
qlin = torch.ops.onednn.qlinear_pointwise


def u8(q):
    """int8 codes -> the same codes + 128 as uint8 (what W8A8Linear's u8 path feeds oneDNN)."""
    return q.to(torch.int16).add_(128).to(torch.uint8)


def pack(w, shape=None):
    p = torch.ops.onednn.qlinear_prepack(w, shape)
    if HUGE:
        collapse(torch.ops.mkldnn.data_ptr(p), torch.ops.mkldnn._nbytes(p))
    return p


def huge_share(p):
    n = torch.ops.mkldnn._nbytes(p)
    return anon_huge_bytes(torch.ops.mkldnn.data_ptr(p), n) / n


def build(k, n, m):
    """Per variant: a list of COPIES callables ``q, s -> [m, n] float32`` (or bf16)."""
    out, refs = {v: [] for v in VARIANTS}, []
    zp = torch.zeros(n, dtype=torch.int64)
    one, z128 = torch.tensor(1.0), torch.tensor(128, dtype=torch.int64)
    for c in range(COPIES):
        g = torch.Generator().manual_seed(1000 * c + n)
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        ws = torch.rand(n, generator=g) * 0.01 + 1e-3
        if c == 0:
            refs.append(lambda q, w=w, ws=ws: torch._int_mm(q, w.t()).to(torch.float32).mul_(ws))
        if "cur" in out or "u8" in out or "tensor" in out or "bf16out" in out:
            p = pack(w)
            if "u8" in out:
                out["u8"].append(lambda q, p=p, ws=ws: qlin(u8(q), 1.0, 128, p, ws, zp, None, 1.0, 0, torch.float32,
                                                           "none", [], ""))
            if "cur" in out:
                out["cur"].append(lambda q, p=p, ws=ws: qlin(q, 1.0, 0, p, ws, zp, None, 1.0, 0, torch.float32,
                                                            "none", [], ""))
            if "tensor" in out:
                out["tensor"].append(lambda q, p=p, ws=ws: qlin.tensor(u8(q), one, z128, p, ws, zp, None, 1.0, 0,
                                                                      torch.float32, "none", [], ""))
            if "bf16out" in out:
                out["bf16out"].append(lambda q, p=p, ws=ws: qlin(u8(q), 1.0, 128, p, ws, zp, None, 1.0, 0,
                                                                torch.bfloat16, "none", [], ""))
        if "hintM" in out:
            p = pack(w, [m, k])
            out["hintM"].append(lambda q, p=p, ws=ws: qlin(u8(q), 1.0, 128, p, ws, zp, None, 1.0, 0, torch.float32,
                                                          "none", [], ""))
        if "hint1" in out:
            p = pack(w, [1, k])
            out["hint1"].append(lambda q, p=p, ws=ws: qlin(u8(q), 1.0, 128, p, ws, zp, None, 1.0, 0, torch.float32,
                                                          "none", [], ""))
        if "int_mm" in out:
            wt = w.t()
            out["int_mm"].append(lambda q, wt=wt, ws=ws: torch._int_mm(q, wt).to(torch.float32).mul_(ws))
        if "f32mm" in out:
            wf = w.to(torch.float32)
            out["f32mm"].append(lambda q, wf=wf: F.linear(q.to(torch.float32), wf))
        if "bf16mm" in out:
            wb = w.to(torch.bfloat16)
            out["bf16mm"].append(lambda q, wb=wb: F.linear(q.to(torch.bfloat16), wb))
    return out, refs


def main():
    print(f"{time.strftime('%H:%M:%S UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f}, "
          f"{torch.get_num_threads()} thread(s), {ROUNDS} rounds, {COPIES} weights per shape, huge pages {HUGE}")
    print("| in -> out | M | variant | min µs | median µs | GB/s at min | exact |")
    print("|---|---:|---|---:|---:|---:|---|")
    with torch.inference_mode():
        for k, n in SHAPES:
            for m in MS:
                calls, refs = build(k, n, m)
                q = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=torch.Generator().manual_seed(m))
                ref = refs[0](q)  # float32(int32 sums) * w_scale: what every exact variant must give
                exact = {v: fs[0](q).dtype == ref.dtype and torch.equal(fs[0](q), ref) for v, fs in calls.items()}
                for fs in calls.values():  # warm: first-call costs (primitive creation) out of the timing
                    for f in fs:
                        f(q)
                times = {v: [] for v in calls}
                names = list(calls)
                for r in range(ROUNDS):
                    for v in names[r % len(names):] + names[:r % len(names)]:
                        c0 = time.process_time()
                        for f in calls[v]:
                            f(q)
                        times[v].append((time.process_time() - c0) / COPIES)
                for v in names:
                    lo, med = min(times[v]), statistics.median(times[v])
                    nbytes = k * n * {"f32mm": 4, "bf16mm": 2}.get(v, 1)
                    print(f"| {k} -> {n} | {m} | {v} | {lo * 1e6:.0f} | {med * 1e6:.0f} | "
                          f"{nbytes / lo / 1e9:.1f} | {exact[v]} |", flush=True)
                del calls


if __name__ == "__main__":
    main()
