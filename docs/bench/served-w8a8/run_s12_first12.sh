#!/bin/bash
# usage: flock -w 1800 /tmp/specdec-heavy.lock timeout 300 docs/bench/served-w8a8/run_s12_first12.sh TAG [ENV=VAL...]
# One fresh server (deployments/local-cpu.yaml) with served_pair_s12.sh (PROPOSERS default,none,default,none; a CPU
# sampler; SETTLE_S idle seconds after ready when exported), its K trace's step breakdown; -> run-TAG.txt.
set -u
cd "$(dirname "$0")/../../.."
tag=$1; shift
export NETNS=${NETNS:-ns-first12} RAY_TMPDIR=${RAY_TMPDIR:-/tmp/ray-first12} PROPOSERS=${PROPOSERS:-default,none,default,none}
d=docs/bench/served-w8a8; out=$d/run-$tag.txt; tr=$PWD/$d/trace-$tag.jsonl; rm -f $tr
{ echo "== start $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) at $(git log --oneline -1 | cut -c1-70) SETTLE_S=${SETTLE_S:-0} $*"
  bash $d/served_pair_s12.sh $tag deployments/local-cpu.yaml SPECDEC_BATCH_K_TRACE=$tr "$@"
  echo "== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  python3 $d/step_breakdown.py $tr; } > $out 2>&1
gzip -f $tr; cat $out
