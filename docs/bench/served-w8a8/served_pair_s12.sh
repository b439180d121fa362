#!/bin/bash
# usage: served_pair_s12.sh LABEL CFG [ENV=VAL...]: served_pair.sh plus a per-process CPU sampler (every 0.5 s,
# from the serve command's start to the last request's end) and its per-phase summary (serve start, ready, an
# optional idle SETTLE_S, each request); PROPOSERS as served_pair.sh. Outputs: serve-LABEL.log,
# cpu-LABEL.jsonl.gz (samples), phases-LABEL.txt.
label=$1; cfg=$2; shift 2
SRC=${SRC:-$(pwd)}; cd $SRC
d=docs/bench/served-w8a8
log=$d/serve-$label.log; ph=$d/phases-$label.txt; cpu=$d/cpu-$label.jsonl
NS="ip netns exec ${NETNS:-ns-servedw8a8} env RAY_TMPDIR=${RAY_TMPDIR:-/tmp/ray-servedw8a8} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$SRC $*"
python3 $d/cpu_sampler_s12.py $cpu 0.5 & spid=$!
t0=$(date +%s); echo "serve $(date +%s.%N)" > $ph
deadline=$(( t0 + ${BUDGET_S:-270} ))  # the client is cut at this time: the server stops inside the lock's 300 s
$NS .venv/bin/specdec serve --config $cfg --keep-running > $log 2>&1 &
pid=$!
stop() { kill $spid 2>/dev/null; kill -INT $pid 2>/dev/null; sleep 8; kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; }
trap 'stop; exit 1' TERM INT
while [ $(date +%s) -lt $deadline ]; do grep -q "serving; Ctrl-C" $log && break; sleep 1; done
echo "ready $(date +%s.%N)" >> $ph
ready=$(( $(date +%s) - t0 ))
rss=$(python3 $d/rss.py $pid)
echo "== $label ($*) $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg) ready in ${ready}s, replicas+ranks RSS ${rss}"
timeout $(( deadline - $(date +%s) )) $NS PHASES=$PWD/$ph .venv/bin/python $d/client_pair_s12.py 2>&1 | grep -E '^\{|Error'
rss=$(python3 $d/rss.py $pid)
echo "   after: replicas+ranks RSS ${rss}, load $(cut -d' ' -f1 /proc/loadavg)"
stop
python3 $d/cpu_summary_s12.py $cpu $ph 10
gzip -f $cpu
