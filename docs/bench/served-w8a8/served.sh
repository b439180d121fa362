#!/bin/bash
# usage: served.sh LABEL CFG [ENV=VAL...]; runs one served main job, prints the stats line
label=$1; cfg=$2; shift 2
SRC=${SRC:-$(pwd)}; cd $SRC
t0=$(date +%s)
out=$(ip netns exec ${NETNS:-ns-servedw8a8} env RAY_TMPDIR=${RAY_TMPDIR:-/tmp/ray-servedw8a8} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$SRC "$@" timeout 300 .venv/bin/specdec serve --config $cfg --demo-request --max-tokens 128 2>&1)
echo "== $label ($*) $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg) wall $(( $(date +%s) - t0 )) s"
echo "$out" | grep -E "^-- |Error|error" | tail -3
