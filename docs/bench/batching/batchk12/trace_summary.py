"""Summarise a batching_goal decision trace (SPECDEC_BATCH_K_TRACE): per arm, every decision that left
K = 0 (predicted tokens/s at its K and at K = 0, the priced forwards, alpha), and the median measured
verify forward per (rows, positions) and draft forward per rows.

    python docs/bench/batching/batchk12/trace_summary.py trace.jsonl
"""
import collections
import json
import statistics
import sys

recs = [json.loads(l) for l in open(sys.argv[1])]
arms = list(dict.fromkeys(r["arm"] for r in recs))
for arm in arms:
    rs = [r for r in recs if r["arm"] == arm]
    decs = [r for r in rs if "decision" in r]
    ticks = [r for r in rs if "tick" in r]
    ks = collections.Counter(json.dumps(d["decision"], sort_keys=True) for d in decs)
    print(f"== {arm}: {len(decs)} decisions {dict(ks)}, {len(ticks)} ticks")
    for d in decs:
        if any(k > 0 for k in d["decision"].values()) and d["rows"] > 1:
            loads = {t: (l["sessions"], round(l["alpha"], 3), round(l["catchup_s"], 3), l["tokens_left"])
                     for t, l in d["loads"].items()}
            print(f"  K>0: {d['decision']} pred {d['tokens_per_s']:.1f} tok/s step {d['step_s']:.3f} s | K=0 "
                  f"{d['k0_tokens_per_s']:.1f} tok/s step {d['k0_step_s']:.3f} | loads (n, alpha, catchup_s, left) "
                  f"{loads} | priced { {k: round(v, 4) for k, v in d['priced'].items()} } | probes {d['probes']}")
            print(f"    curves: verify {d['cost']['verify_s_by_positions']} row_s {d['cost']['verify_row_s']:.4f} "
                  f"draft {d['cost']['draft_s_by_rows']} catchup/token {d['cost']['catchup_s_per_token']}")
    v = collections.defaultdict(list)
    dr = collections.defaultdict(list)
    for t in ticks:
        v[tuple(t["tick"][:2])].append(t["tick"][2])
        for r, s in t["drafts"]:
            dr[r].append(s)
    print("  measured verify (rows, positions): median s [n]",
          {k: f"{statistics.median(x):.3f} [{len(x)}]" for k, x in sorted(v.items()) if len(x) >= 1})
    print("  measured draft rows: median s [n]", {k: f"{statistics.median(x):.3f} [{len(x)}]" for k, x in sorted(dr.items())})
