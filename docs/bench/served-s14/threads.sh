#!/bin/bash
# Session 14: served threads per model process, one after the other, each a fresh server, the served stage's four
# requests (speculation, plain, speculation, plain; 128 greedy tokens of the demo code prompt):
#   NETNS=ns-X RAY_TMPDIR=/tmp/ray-X bash docs/bench/served-s14/threads.sh TAG [VARIANT...]
# variants: default (deployments/local-cpu.yaml: draft 2 threads, TP rank 2, OMP_WAIT_POLICY=PASSIVE),
# t1 (draft 1, TP rank 1), d1 (draft 1, TP rank 2). Output: docs/bench/served-s14/threads-TAG.txt
tag=$1; shift
cd "$(dirname "$0")/../../.."
out=docs/bench/served-s14/threads-$tag.txt
for v in "${@:-default t1 d1}"; do
  for vv in $v; do
    cfg=deployments/local-cpu.yaml; [ "$vv" = default ] || cfg=docs/bench/served-s14/local-cpu-$vv.yaml
    echo "=== $vv ($cfg) $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) at $(git log --oneline -1 | cut -c1-9)"
    flock -w 1800 /tmp/specdec-heavy.lock env PROPOSERS=default,none,default,none timeout 420 \
      bash docs/bench/served-w8a8/served_pair.sh s14-$tag-$vv $cfg
  done
done 2>&1 | tee -a $out
