#!/bin/bash
# second lock turns: run A again (run 1 hit a cache.crop bug), then bfloat16
cd /work/wt-avx2fmt12
while kill -0 2297 2>/dev/null; do sleep 3; done
PER_S=95 flock -w 1800 /tmp/specdec-heavy.lock timeout 300 docs/bench/formats/avx2-s12/run_avx2.sh A2 int8,int4,float32 > /dev/null
CAP_S=3 PER_S=150 flock -w 1800 /tmp/specdec-heavy.lock timeout 200 docs/bench/formats/avx2-s12/run_avx2.sh B2 bfloat16 > /dev/null
