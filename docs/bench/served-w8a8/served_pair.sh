#!/bin/bash
# usage: served_pair.sh LABEL CFG [ENV=VAL...]: serve, then spec/plain/spec/plain requests
label=$1; cfg=$2; shift 2
SRC=${SRC:-$(pwd)}; cd $SRC
log=docs/bench/served-w8a8/serve-$label.log
NS="ip netns exec ${NETNS:-ns-servedw8a8} env RAY_worker_niceness=${RAY_worker_niceness:-0} RAY_TMPDIR=${RAY_TMPDIR:-/tmp/ray-servedw8a8} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$SRC $*"
t0=$(date +%s)
$NS .venv/bin/specdec serve --config $cfg --keep-running > $log 2>&1 &
pid=$!
for i in $(seq 1 150); do grep -q "serving; Ctrl-C" $log && break; sleep 2; done
ready=$(( $(date +%s) - t0 ))
rss=$(python3 docs/bench/served-w8a8/rss.py $pid)
echo "== $label ($*) $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg) ready in ${ready}s, replicas+ranks RSS ${rss}"
python3 docs/bench/served-w8a8/rss.py $pid env | tail -n +2
timeout 400 $NS .venv/bin/python docs/bench/served-w8a8/client_pair.py 2>&1 | grep -E '^\{|^tenant_stats|Error'
rss=$(python3 docs/bench/served-w8a8/rss.py $pid)
echo "   after: replicas+ranks RSS ${rss}, load $(cut -d' ' -f1 /proc/loadavg)"
kill -INT $pid; sleep 8; kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null
