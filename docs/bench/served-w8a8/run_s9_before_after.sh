#!/bin/bash
# usage: run_s9_before_after.sh TAG OLD_TREE: under the heavy lock (at most 330 s), two fresh servers
# of the default preset (deployments/local-cpu.yaml), the code before (OLD_TREE, a checkout of
# 9f41a04: `git worktree add --detach DIR 9f41a04; ln -s /work/main/.venv DIR/.venv`) then this
# checkout, each with served_pair.sh's requests (PROPOSERS: speculation = the fresh server's first
# request, plain decoding, speculation = second); batch-K traces to trace-TAG-{before,after}.jsonl.
tag=$1; old=$2
cd "$(dirname "$0")/../../.."
here=$PWD
export PROPOSERS=${PROPOSERS:-default,none,default}
flock -w 1800 /tmp/specdec-heavy.lock timeout 330 bash -c "
  echo \"== lock taken \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg); before: \$(git -C $old log --oneline -1 | cut -c1-60); after: \$(git log --oneline -1 | cut -c1-60)\"
  SRC=$old bash docs/bench/served-w8a8/served_pair.sh $tag-before $here/deployments/local-cpu.yaml SPECDEC_BATCH_K_TRACE=$here/docs/bench/served-w8a8/trace-$tag-before.jsonl
  SRC=$here bash docs/bench/served-w8a8/served_pair.sh $tag-after deployments/local-cpu.yaml SPECDEC_BATCH_K_TRACE=$here/docs/bench/served-w8a8/trace-$tag-after.jsonl
  echo \"== lock released \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1-3 /proc/loadavg)\""
