"""Summarise a SPECDEC_BATCH_K_TRACE file (specdec.control.batch_k.BatchKSessions trace): per arm and K the
measured draft and verify wall seconds per step against the target forward that verified it (rows, positions,
seconds), then sampled decisions (predicted step seconds, cost terms, guard state).

    python docs/bench/batching/scripts/batch_k_trace.py trace.jsonl
"""
import json, sys, collections
recs=[json.loads(l) for l in open(sys.argv[1])]
steps=[r for r in recs if "step" in r]; decs=[r for r in recs if "decision" in r]
print("records", len(recs), "steps", len(steps), "decisions", len(decs))
t0=recs[0]["t"]
# per tenant-arm: K distribution, wall per step, forward shapes
agg=collections.defaultdict(lambda: [0,0.0,0.0,0,0,0,0.0])  # n, draft_s, verify_wall, tokens, rows, pos, fwd_s
for s in steps:
    arm=(s["tenant"] or "?").split("-")[-1]; k=s["k"]
    a=agg[(arm, k)]
    a[0]+=1; a[1]+=s["draft_s"] or 0; a[2]+=s["verify_wall_s"] or 0; a[3]+=s["accepted"]+1
    if s["batch"]: a[4]+=s["batch"][1]; a[5]+=s["batch"][2]; a[6]+=s["batch"][3]
for (arm,k),a in sorted(agg.items()):
    n=a[0]; print(f"{arm:10s} K={k} steps={n:4d} draft_s/step={a[1]/n:.3f} verify_wall/step={a[2]/n:.3f} fwd_s/step={a[6]/n:.3f} rows/fwd={a[4]/n:.2f} pos/fwd={a[5]/n:.1f} tok/step={a[3]/n:.2f} tok/(step s)={a[3]/(a[1]+a[2]):.2f}")
print("decisions (sampled):")
for d in decs[:: max(1, len(decs)//25)]:
    c=d["cost"]; v=c["verify_s_by_positions"]
    print(f"t={d['t']-t0:6.1f} ks={d['decision']} pred_step_s={d['step_s']:.3f} pred_tok/s={d['tokens_per_s']:.2f} rows={d['rows']} pos={d['positions']} loads={ {k.split(chr(0))[0]:[x if not isinstance(x,float) else round(x,2) for x in l] for k,l in d['loads'].items()} } verify={ {p: round(s,3) for p,s in sorted(v.items(), key=lambda x:int(x[0]))} } row_s={c['verify_row_s']:.3f} draft={ {p: round(s,3) for p,s in c['draft_s_by_rows'].items()} } guard={d.get('guard')}")
