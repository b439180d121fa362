#!/bin/bash
# the locked runs of this folder, one after the other (each its own lock turn, < 5 min)
cd /work/wt-avx2fmt12
while kill -0 1538 2>/dev/null; do sleep 5; done
PER_S=100 flock -w 1800 /tmp/specdec-heavy.lock timeout 300 docs/bench/formats/avx2-s12/run_avx2.sh A int8,int4,float32 > /dev/null
CAP_S=3 PER_S=100 flock -w 1800 /tmp/specdec-heavy.lock timeout 300 docs/bench/formats/avx2-s12/run_avx2.sh B bfloat16,float16,w8a8 > /dev/null
