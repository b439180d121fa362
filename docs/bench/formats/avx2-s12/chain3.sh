#!/bin/bash
# third lock turns: the draft's one-position step alone (D), then the target at one thread with its
# row plans and the 5-block check (E; A2 timed out in its 2-thread forwards)
cd /work/wt-avx2fmt12
while kill -0 8825 2>/dev/null; do sleep 3; done
SKIP_TARGET=1 THREADS=1,2 PER_S=80 flock -w 1800 /tmp/specdec-heavy.lock timeout 300 docs/bench/formats/avx2-s12/run_avx2.sh D int8,int4,float32 > /dev/null
SKIP_DRAFT=1 THREADS=1 PER_S=140 flock -w 1800 /tmp/specdec-heavy.lock timeout 290 docs/bench/formats/avx2-s12/run_avx2.sh E int4,int8 > /dev/null
