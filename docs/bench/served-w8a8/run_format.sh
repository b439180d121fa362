#!/bin/bash
# usage: run_format.sh FORMAT TAG: under the heavy lock, the served pair in FORMAT (local-cpu-FORMAT.yaml):
# served_pair.sh (speculation / plain / speculation / plain, RSS, controller view) then the main job
# (served.sh: specdec serve --demo-request, 128 tokens). The draft replica's batch-K decisions go to
# docs/bench/served-w8a8/trace-TAG-FORMAT.jsonl.
fmt=$1; tag=$2
cd "$(dirname "$0")/../../.."
export SPECDEC_BATCH_K_TRACE=$PWD/docs/bench/served-w8a8/trace-$tag-$fmt.jsonl
rm -f $SPECDEC_BATCH_K_TRACE
flock -w 1800 /tmp/specdec-heavy.lock bash -c "
  echo \"== lock taken \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg)\"
  bash docs/bench/served-w8a8/served_pair.sh $tag-${fmt}pair docs/bench/served-w8a8/local-cpu-$fmt.yaml SPECDEC_BATCH_K_TRACE=$SPECDEC_BATCH_K_TRACE
  bash docs/bench/served-w8a8/served.sh $tag-${fmt}-mainjob docs/bench/served-w8a8/local-cpu-$fmt.yaml
  echo \"== lock released \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg)\""
