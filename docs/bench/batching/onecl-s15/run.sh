#!/bin/bash
# Issue 10, served one client (Ray workers at nice 0, RAY_worker_niceness: Ray starts them at 15, level with niced helpers): the batched app and the unbatched app deployed ONE AT A TIME (session 14's onecl
# deployed both at once), alternating batched, unbatched, batched, unbatched; each a fresh Ray with one app, start-up
# calibration, one warm-up request, then ROUNDS requests of 128 greedy tokens (docs/bench/served-w8a8/one_client_modes.py).
#   NETNS=ns-X RAY_TMPDIR=/tmp/ray-X flock -w 1800 /tmp/specdec-heavy.lock bash docs/bench/batching/onecl-s15/run.sh TAG
tag=${1:?TAG}; d=docs/bench/batching/onecl-s15; out=$d/onecl-$tag.txt
py="ip netns exec ${NETNS:?} env RAY_worker_niceness=${RAY_worker_niceness:-0} RAY_TMPDIR=${RAY_TMPDIR:?} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD .venv/bin/python"
: > $out
for mode in ${ORDER:-batched unbatched batched unbatched}; do
  echo "== $mode $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) at $(git log --oneline -1 | cut -c1-60)" >> $out
  MODES=$mode timeout 330 $py docs/bench/served-w8a8/one_client_modes.py ${ROUNDS:-2} 128 2>&1 | grep -E '^==|^\{|^warmup|Error' >> $out
done
cat $out
