#!/bin/bash
# in-process draft/target forward cost, as served (PASSIVE, OMP_NUM_THREADS=2) vs 1 thread vs default wait policy
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$PWD PROFILE=0 VARIANTS=after KS=4
echo "== load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%H:%M:%S)"
for cfg in "OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2 THREADS=2" "OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 THREADS=1" "OMP_NUM_THREADS=2 THREADS=2"; do
  echo "== $cfg"
  env $cfg timeout 100 .venv/bin/python docs/bench/formats/scripts/draft_cost.py w8a8 4 2>&1 | grep -v "^\s*$" | tail -15
done
echo "== load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%H:%M:%S)"
