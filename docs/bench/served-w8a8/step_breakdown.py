"""Where a served step's wall time goes, per request, from a draft replica's K-under-load trace
(``SPECDEC_BATCH_K_TRACE``, one JSON line per step and per decision; ``.gz`` read too).

    python docs/bench/served-w8a8/step_breakdown.py docs/bench/served-w8a8/trace-s9-default.jsonl.gz

A request starts at a step whose verify forward holds its prompt (positions > K + 1 + 8); the
start-up calibration's steps (``"calibration"`` lines) are one group of their own. Per request:
steps, K per step, and the mean seconds per step of

- draft forwards: the batched draft forwards' own seconds (``draft_forwards``; empty on a first
  drafting step, whose catch-up is then in "draft, other");
- draft, other: the drafting seconds outside them (combiner window, catch-up, Python);
- target forward: the target's batched forward (``batch`` seconds, the Target replica's measure);
- exchange: the verify round trip outside the target's forward (serialization, Serve handle,
  the target's batch window);
- between steps: the wall time from one step's end to the next's, less its drafting and verify
  (the step loop, streaming the chunk, the next step's scheduling);

and the draft forward per drafted token, the target forward per positions count.
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def groups(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    out: list[tuple[str, list[dict]]] = []
    for r in rows:
        if "calibration" in r:
            if not out or out[-1][0] != "calibration":
                out.append(("calibration", []))
            out[-1][1].append(r)
            continue
        if "step" not in r:
            continue
        b = r.get("batch") or [0, 1, 1, 0.0]
        if b[2] > r["k"] + 1 + 8 or not out or out[-1][0] == "calibration":
            out.append((f"request {sum(1 for g in out if g[0] != 'calibration') + 1}", []))
        out[-1][1].append(r)
    return out


def summary(name: str, steps: list[dict]) -> str:
    ks = [s["k"] for s in steps]
    counts = {k: ks.count(k) for k in sorted(set(ks))}
    fwd = [sum(x for _, x in s.get("draft_forwards") or []) for s in steps]
    draft = [s.get("draft_s") or 0.0 for s in steps]
    tgt = [(s.get("batch") or [0, 0, 0, 0.0])[3] for s in steps]
    vwall = [s.get("verify_wall_s") or 0.0 for s in steps]
    ts = [s.get("t") for s in steps]
    gaps = [b - a - d - v for a, b, d, v in zip(ts, ts[1:], draft[1:], vwall[1:]) if a and b]
    n = len(steps)
    per_tok = [x / len(s["draft_forwards"]) for s, x in zip(steps, fwd) if s.get("draft_forwards")]
    by_pos: dict[int, list[float]] = {}
    for s in steps[1:]:
        b = s.get("batch")
        if b:
            by_pos.setdefault(b[2], []).append(b[3])
    if name == "calibration":  # its trace lines hold its forwards only
        line = f"{name}: {n} steps, K {counts}"
        if per_tok:
            line += f"; draft forward {1000 * statistics.median(per_tok):.1f} ms (median per step)"
        return line + "; target forward by positions (median ms): " + ", ".join(
            f"{p}: {1000 * statistics.median(v):.0f}" for p, v in sorted(by_pos.items()) if p <= 9)
    line = (f"{name}: {n} steps, K {counts}; per step (ms): draft forwards {1000 * sum(fwd) / n:.0f}, "
            f"draft other {1000 * (sum(draft) - sum(fwd)) / n:.0f}, target forward {1000 * sum(tgt) / n:.0f}, "
            f"exchange {1000 * (sum(vwall) - sum(tgt)) / n:.0f}, between steps "
            f"{1000 * statistics.mean(gaps) if gaps else 0:.0f}")
    if per_tok:
        line += f"; draft forward {1000 * statistics.median(per_tok):.1f} ms (median per step)"
    line += "; target forward by positions (median ms): " + ", ".join(
        f"{p}: {1000 * statistics.median(v):.0f}" for p, v in sorted(by_pos.items()) if p <= 9)
    return line


def main() -> int:
    for path in sys.argv[1:]:
        print(f"== {path}")
        for name, steps in groups(load(path)):
            if steps:
                print(summary(name, steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
