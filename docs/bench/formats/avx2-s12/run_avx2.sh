#!/bin/bash
# usage: flock -w 1800 /tmp/specdec-heavy.lock timeout 300 docs/bench/formats/avx2-s12/run_avx2.sh TAG FMT[,FMT...]
# one process per format (formats_avx2.py), per-format timeout PER_S (default 140); -> docs/bench/formats/avx2-s12/run-TAG.txt
cd "$(dirname "$0")/../../../.."
tag=$1; fmts=$2; d=docs/bench/formats/avx2-s12; out=$d/run-$tag.txt
{ echo "== $(date -u +%H:%M:%S) $(git log --oneline -1 | cut -c1-60) load $(cat /proc/loadavg) cmd: $0 $*"
  for f in ${fmts//,/ }; do
    echo "--- $f $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    /usr/bin/time -f "maxrss_kib %M wall_s %e" timeout ${PER_S:-140} .venv/bin/python $d/formats_avx2.py $f 2>&1 | grep -v Warning
  done
  echo "== end $(date -u +%H:%M:%S) load $(cat /proc/loadavg)"; } > $out 2>&1
cat $out
