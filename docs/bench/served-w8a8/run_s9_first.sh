#!/bin/bash
# usage: run_s9_first.sh TAG: under the heavy lock (at most 330 s), a fresh `specdec serve` of the
# default preset (deployments/local-cpu.yaml) and served_pair.sh's requests: speculation (the fresh
# server's first request), plain decoding, speculation (second), plain decoding; the draft replica's
# batch-K steps and decisions to docs/bench/served-w8a8/trace-TAG.jsonl. Own netns: NETNS / RAY_TMPDIR.
tag=$1
cd "$(dirname "$0")/../../.."
export SPECDEC_BATCH_K_TRACE=$PWD/docs/bench/served-w8a8/trace-$tag.jsonl
rm -f $SPECDEC_BATCH_K_TRACE
flock -w 1800 /tmp/specdec-heavy.lock timeout 330 bash -c "
  echo \"== lock taken \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg) at \$(git log --oneline -1 | cut -c1-70)\"
  bash docs/bench/served-w8a8/served_pair.sh $tag deployments/local-cpu.yaml SPECDEC_BATCH_K_TRACE=$SPECDEC_BATCH_K_TRACE
  echo \"== lock released \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg)\""
