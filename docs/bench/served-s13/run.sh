#!/bin/bash
# Session 13's served measurements on the AVX512-VNNI EPYC (issues 9 and 10), each stage one locked run (<= 7 min):
#   NETNS=ns-X RAY_TMPDIR=/tmp/ray-X bash docs/bench/served-s13/run.sh first TAG
#       two fresh servers one after the other (docs/bench/served-w8a8/run_s12_first12.sh: served_pair_s12.sh, CPU
#       sampler every 0.5 s, K trace + step breakdown): server a sends speculation, plain, speculation, plain (128
#       tokens each; the served stage of docs/bench/lead-measure.sh) as soon as `specdec serve` says serving;
#       server b the same after SETTLE_B (45) idle seconds: is a fresh server's first request slow because it is the
#       first (shapes, allocations) or because it comes early (start-up work, the machine)?
#       Output: docs/bench/served-s13/run-TAG.txt, cpu-/phases-/serve-/trace-TAG-{a,b}.*
#   NETNS=... RAY_TMPDIR=... bash docs/bench/served-s13/run.sh onecl|clients TAG
#       docs/bench/batching/served-s11/run.sh (one client batched vs unbatched, 3 rounds of 128 tokens; 1/2/4/8
#       clients, 32 tokens), outputs moved here.
set -u
what=$1; tag=${2:?usage: run.sh first|onecl|clients TAG}
cd "$(dirname "$0")/../../.."
export NETNS=${NETNS:?set NETNS} RAY_TMPDIR=${RAY_TMPDIR:?set RAY_TMPDIR} LOCK_WAIT=${LOCK_WAIT:-3600}
d=docs/bench/served-s13; w=docs/bench/served-w8a8; b=docs/bench/batching/served-s11
case $what in
 first)
  PROPOSERS=default,none,default,none RUNS=${RUNS:-"a:0 b:${SETTLE_B:-45}"} BUDGET_S=${BUDGET_S:-190} \
    flock -w $LOCK_WAIT /tmp/specdec-heavy.lock timeout 440 bash $w/run_s12_first12.sh $tag
  for f in $w/run-$tag.txt $w/*-$tag-[ab].*; do [ -e "$f" ] && mv "$f" $d/; done ;;
 onecl|clients)
  bash $b/run.sh $what $tag
  if [ $what = onecl ]; then files="$b/onecl-$tag.txt $b/k-trace-$tag.jsonl.gz"
  else files="$(ls $b/clients-$tag.* 2>/dev/null) $b/target-trace-$tag.jsonl.gz"; fi
  for f in $files; do [ -e "$f" ] && mv "$f" $d/; done ;;
 *) echo "usage: run.sh first|onecl|clients TAG" >&2; exit 2 ;;
esac
