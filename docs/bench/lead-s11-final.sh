#!/bin/bash
# the lead's quiet measurements, session 11 (each stage takes the heavy lock itself)
cd /work/wt-lead11 && git merge -q --ff-only main || exit 1
L="flock -w 900 /tmp/specdec-heavy.lock docs/bench/lead-s11-measure.sh"
for st in "$@"; do
 case $st in
  onecl|clients) NETNS=ns-lead11 RAY_TMPDIR=/tmp/ray-lead11 bash docs/bench/batching/served-s11/run.sh $st s11-lead ;;
  *) $L $st ;;
 esac
done
