#!/bin/bash
# session 12 batchk12: issue 10's 8-client goal at 32 tokens, 1 round, with the adaptive controller's decision trace
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-docs/bench/batching/batchk12/goal-32-trace}
mkdir -p $OUT; rm -f $OUT/trace.jsonl
echo "== start $(date -u +%T) load $(cat /proc/loadavg) at $(git log --oneline -1 | cut -c1-60)" > $OUT/log.txt
echo "SPECDEC_BATCH_K_TRACE=$OUT/trace.jsonl python -m benchmarks.batching_goal --max-tokens 32 --rounds 1 --out $OUT $*" >> $OUT/log.txt
SPECDEC_BATCH_K_TRACE=$OUT/trace.jsonl .venv/bin/python -m benchmarks.batching_goal --max-tokens 32 --rounds 1 --out $OUT "$@" >> $OUT/log.txt 2>&1
echo "== end $(date -u +%T) load $(cat /proc/loadavg)" >> $OUT/log.txt
