#!/bin/bash
# Issue 10 served (session 11). Each run takes the heavy lock, at most 330 s, in a network namespace:
#   NETNS=ns-X RAY_TMPDIR=/tmp/ray-X bash docs/bench/batching/served-s11/run.sh onecl TAG
#       one client, batched vs unbatched (docs/bench/served-w8a8/one_client_modes.py: both apps at once,
#       calibrated, one warm-up request each, 3 interleaved rounds of 128 tokens); the batched draft
#       replica's K trace. Output: onecl-TAG.txt, k-trace-TAG.jsonl.gz
#   NETNS=ns-X RAY_TMPDIR=/tmp/ray-X bash docs/bench/batching/served-s11/run.sh clients TAG [CLIENTS] [TOKENS] [ROUNDS]
#       aggregate tok/s at 1,2,4,8 clients (default), batched vs unbatched deployed at once, interleaved
#       (python -m benchmarks.served_clients, 32 tokens, 1 round by default: 2 rounds ran past 330 s). Output: clients-TAG.{json,md,log},
#       the target replica's batch trace target-trace-TAG.jsonl.gz. CLIENTS_TIMEOUT_S (default 330): the run's limit
#       (an AVX2-only CPU calibrates both apps in ~180 s: 1,2,4,8 clients do not fit in 330 s there)
what=$1; tag=${2:?usage: run.sh onecl|clients TAG}
cd "$(dirname "$0")/../../../.."
dir=docs/bench/batching/served-s11
export NETNS=${NETNS:?set NETNS} RAY_TMPDIR=${RAY_TMPDIR:?set RAY_TMPDIR}
tmp=$(mktemp -d)
export SPECDEC_BATCH_K_TRACE=$tmp/k.jsonl SPECDEC_TARGET_BATCH_TRACE=$tmp/target.jsonl
head="echo \"== lock taken \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg) at \$(git log --oneline -1 | cut -c1-70)\""
tail="echo \"== lock released \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg)\""
py="ip netns exec $NETNS env RAY_worker_niceness=${RAY_worker_niceness:-0} RAY_TMPDIR=$RAY_TMPDIR HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD .venv/bin/python"
if [ "$what" = onecl ]; then
  out=$dir/onecl-$tag.txt
  flock -w ${LOCK_WAIT:-1800} /tmp/specdec-heavy.lock timeout 330 bash -c "$head
    $py docs/bench/served-w8a8/one_client_modes.py 3 128 2>&1 | grep -E '^==|^\{|^warmup|Error'
    $tail" > $out 2>&1
  gzip -c $tmp/k.jsonl > $dir/k-trace-$tag.jsonl.gz
elif [ "$what" = clients ]; then
  out=$dir/clients-$tag.log
  flock -w ${LOCK_WAIT:-1800} /tmp/specdec-heavy.lock timeout ${CLIENTS_TIMEOUT_S:-330} bash -c "$head
    $py -m benchmarks.served_clients --clients ${3:-1,2,4,8} --tokens ${4:-32} --rounds ${5:-1} ${VARIANT:+--variant $VARIANT} --out $dir/clients-$tag.json 2>&1 \
      | grep --line-buffered -E '^\[served_clients\]|^\||^Served|^Per round|^Outputs|Error'
    $tail" > $out 2>&1
  gzip -c $tmp/target.jsonl > $dir/target-trace-$tag.jsonl.gz
  [ -s $tmp/k.jsonl ] && gzip -c $tmp/k.jsonl > $dir/k-trace-$tag.jsonl.gz
else
  echo "usage: run.sh onecl|clients TAG" >&2; exit 2
fi
rm -rf $tmp
cat $out
