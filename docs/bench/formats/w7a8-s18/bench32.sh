#!/bin/bash
# Issue 9 in process on an AVX2-only CPU, session 18: w8a8 on fbgemm (two halves per row, the AVX2 default until
# session 18) against w7a8 (one pass), float32 alone as the baseline: session 16's bench32.sh arms (32 tokens, one
# thread, 3 repeats) with these formats.
# usage: flock -w 1800 /tmp/specdec-heavy.lock bash docs/bench/formats/w7a8-s18/bench32.sh [OUT]
FORMATS=float32:alone,w8a8,w7a8 exec bash "$(dirname "$0")/../avx2-s16/bench32.sh" "${1:-docs/bench/formats/w7a8-s18/bench32}"
