#!/bin/bash
# Prefix caching on (local-cpu.yaml, prefix_cache_entries 8) against off (the same with 0), one fresh server each,
# ttft.py's requests against each. Run from the repository root, under the heavy lock:
#   NETNS=ns-X RAY_TMPDIR=/tmp/ray-X flock -w 1800 /tmp/specdec-heavy.lock bash docs/bench/prefix-s15/run.sh TAG [on,off]
tag=${1:?TAG}; arms=${2:-on,off,on}
d=docs/bench/prefix-s15
NS="ip netns exec ${NETNS:?} env RAY_worker_niceness=${RAY_worker_niceness:-0} RAY_TMPDIR=${RAY_TMPDIR:?} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$PWD"
sed 's/^    prefix_cache_entries: .*/    prefix_cache_entries: 0/' deployments/local-cpu.yaml > /tmp/local-cpu-noprefix.yaml
grep -q "prefix_cache_entries: 0" /tmp/local-cpu-noprefix.yaml || { echo "no prefix_cache_entries in the preset"; exit 2; }
i=0
for arm in ${arms//,/ }; do
  i=$((i+1)); cfg=deployments/local-cpu.yaml; [ $arm = off ] && cfg=/tmp/local-cpu-noprefix.yaml
  log=$d/serve-$tag-$i-$arm.log
  t0=$(date +%s); $NS .venv/bin/specdec serve --config $cfg --keep-running > $log 2>&1 & pid=$!
  for s in $(seq 1 150); do grep -q "serving; Ctrl-C" $log && break; sleep 2; done
  echo "== arm $i $arm ($cfg) $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg) ready in $(( $(date +%s) - t0 ))s at $(git log --oneline -1 | cut -c1-60)"
  timeout 400 $NS .venv/bin/python $d/ttft.py ${ROUNDS:-2} 2>&1 | grep -E '^\{|Error'
  t1=$(date +%s.%N); kill -INT $pid; (sleep 90; kill -TERM $pid 2>/dev/null) & w=$!; wait $pid; kill $w 2>/dev/null; echo "   stopped in $(echo "$(date +%s.%N) - $t1" | bc) s after Ctrl-C (SIGINT)"
done
