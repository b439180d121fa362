#!/bin/bash
# usage (each under the heavy lock, at most 330 s; own network namespace and Ray temp dir):
#   NETNS=ns-X RAY_TMPDIR=/tmp/ray-X bash docs/bench/served-w8a8/run_s10.sh goal TAG
#       issue 9's served goal: a fresh `specdec serve` of deployments/local-cpu.yaml (start-up
#       calibration on), served_pair.sh's requests: speculation (the fresh server's first request),
#       plain decoding, speculation (second), plain decoding; the draft replica's batch-K trace to
#       docs/bench/served-w8a8/trace-TAG.jsonl, then where each request's step time went
#       (step_breakdown.py). Output: docs/bench/served-w8a8/run-TAG.txt
#   NETNS=ns-X RAY_TMPDIR=/tmp/ray-X bash docs/bench/served-w8a8/run_s10.sh onecl TAG
#       issue 10's one client batched vs unbatched: one_client_modes.py (both apps at once, calibrated,
#       one warm-up request each, 3 interleaved rounds of 128 tokens). Output: run-TAG.txt
what=$1; tag=$2
cd "$(dirname "$0")/../../.."
out=docs/bench/served-w8a8/run-$tag.txt
export NETNS=${NETNS:?set NETNS} RAY_TMPDIR=${RAY_TMPDIR:?set RAY_TMPDIR}
if [ "$what" = goal ]; then
  export SPECDEC_BATCH_K_TRACE=$PWD/docs/bench/served-w8a8/trace-$tag.jsonl
  rm -f $SPECDEC_BATCH_K_TRACE
  flock -w 1800 /tmp/specdec-heavy.lock timeout 330 bash -c "
    echo \"== lock taken \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg) at \$(git log --oneline -1 | cut -c1-70)\"
    PROPOSERS=default,none,default,none bash docs/bench/served-w8a8/served_pair.sh $tag deployments/local-cpu.yaml SPECDEC_BATCH_K_TRACE=$SPECDEC_BATCH_K_TRACE
    echo \"== lock released \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg)\"" > $out 2>&1
  python3 docs/bench/served-w8a8/step_breakdown.py $SPECDEC_BATCH_K_TRACE >> $out
elif [ "$what" = onecl ]; then
  flock -w 1800 /tmp/specdec-heavy.lock timeout 330 bash -c "
    echo \"== lock taken \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg) at \$(git log --oneline -1 | cut -c1-70)\"
    ip netns exec $NETNS env RAY_TMPDIR=$RAY_TMPDIR HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$PWD \
      .venv/bin/python docs/bench/served-w8a8/one_client_modes.py 3 128 2>&1 | grep -E '^==|^\{|^warmup|Error'
    echo \"== lock released \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg)\"" > $out 2>&1
else
  echo "usage: run_s10.sh goal|onecl TAG" >&2; exit 2
fi
cat $out
