#!/bin/bash
# Served A/B of the batched app only: omp_spin_count 0 against $1 (both apps deployed at once, interleaved).
#   NETNS=ns-X RAY_TMPDIR=/tmp/ray-X bash docs/bench/batching/checks-s25/spin_ab.sh SPIN CLIENTS TOKENS ROUNDS TAG
# Output: docs/bench/batching/served-s11/clients-TAG.{json,md,log}
cd "$(dirname "$0")/../../../.."
: "${NETNS:?set NETNS}" "${RAY_TMPDIR:?set RAY_TMPDIR}"
dir=docs/bench/batching/served-s11
flock -w 1800 /tmp/specdec-heavy.lock timeout 900 bash -c "echo == lock taken \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg) at \$(git log --oneline -1 | cut -c1-70)
ip netns exec $NETNS env RAY_worker_niceness=0 RAY_TMPDIR=$RAY_TMPDIR HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD .venv/bin/python -m benchmarks.served_clients --modes batched --clients $2 --tokens $3 --rounds $4 --variant omp_spin_count=$1 --out $dir/clients-$5.json 2>&1 | grep --line-buffered -E '^\[served_clients\]|^\||^Served|^Per round|^Outputs|Error'
echo == lock released \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg)" > $dir/clients-$5.log 2>&1
cat $dir/clients-$5.log
