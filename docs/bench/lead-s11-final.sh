#!/bin/bash
# The lead's quiet measurements of session 11, in this order: batchgoal bench128 bench32 onecl clients served.
#   NETNS=ns-X RAY_TMPDIR=/tmp/ray-X bash docs/bench/lead-s11-final.sh batchgoal bench128 bench32 onecl clients served
# Each stage takes the heavy lock itself (onecl/clients through docs/bench/batching/served-s11/run.sh).
set -u
cd "$(dirname "$0")/../.."
: "${NETNS:?set NETNS}" "${RAY_TMPDIR:?set RAY_TMPDIR}"
for st in "$@"; do
 case $st in
  onecl|clients) bash docs/bench/batching/served-s11/run.sh "$st" s11-lead ;;
  *) flock -w 900 /tmp/specdec-heavy.lock bash docs/bench/lead-s11-measure.sh "$st" ;;
 esac
done
