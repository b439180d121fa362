#!/bin/bash
# usage: flock -w 1800 /tmp/specdec-heavy.lock timeout 300 docs/bench/served-w8a8/run_s12_first12.sh TAG [ENV=VAL...]
# Two fresh servers (deployments/local-cpu.yaml) one after the other with served_pair_s12.sh (PROPOSERS
# default,none,default; a CPU sampler): TAG-a sends its first request at once when ready, TAG-b after SETTLE_B
# (default 40) idle seconds (RUNS="a:0" for the first only); each with its K trace's step breakdown; -> run-TAG.txt. BUDGET_S bounds each server.
set -u
cd "$(dirname "$0")/../../.."
tag=$1; shift
export NETNS=${NETNS:-ns-first12} RAY_TMPDIR=${RAY_TMPDIR:-/tmp/ray-first12} PROPOSERS=${PROPOSERS:-default,none,default}
export BUDGET_S=${BUDGET_S:-140}
d=docs/bench/served-w8a8; out=$d/run-$tag.txt
{ echo "== start $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) at $(git log --oneline -1 | cut -c1-70) $*"
  for run in ${RUNS:-a:0 b:${SETTLE_B:-40}}; do
    t=$tag-${run%%:*}; export SETTLE_S=${run#*:}; tr=$PWD/$d/trace-$t.jsonl; rm -f $tr
    echo "=== $t: SETTLE_S=$SETTLE_S BUDGET_S=$BUDGET_S PROPOSERS=$PROPOSERS"
    bash $d/served_pair_s12.sh $t deployments/local-cpu.yaml SPECDEC_BATCH_K_TRACE=$tr "$@"
    python3 $d/step_breakdown.py $tr; gzip -f $tr
  done
  echo "== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"; } > $out 2>&1
cat $out
