#!/bin/bash
# The lead's quiet measurements at the end of a session, in this order: batchgoal bench128 bench32 onecl clients served.
#   TAG=s12-lead NETNS=ns-X RAY_TMPDIR=/tmp/ray-X bash docs/bench/lead-final.sh batchgoal bench128 bench32 onecl clients served
# Each stage takes the heavy lock itself (onecl/clients through docs/bench/batching/served-s11/run.sh).
set -u
export TAG=${TAG:-s12-lead}
cd "$(dirname "$0")/../.."
: "${NETNS:?set NETNS}" "${RAY_TMPDIR:?set RAY_TMPDIR}"
for st in "$@"; do
 case $st in
  onecl|clients) bash docs/bench/batching/served-s11/run.sh "$st" "${TAG:-s12-lead}" ;;
  *) flock -w 1800 /tmp/specdec-heavy.lock bash docs/bench/lead-measure.sh "$st" ;;
 esac
done
