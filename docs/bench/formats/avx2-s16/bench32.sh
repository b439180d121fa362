#!/bin/bash
# Issue 9's in-process goals on an AVX2-only CPU, int4 (the AVX2 default until session 16) against w8a8 on
# fbgemm, float32 alone as the baseline, 32 tokens, one thread, 3 repeats (session 15's bench32 arms).
# usage: flock -w 1800 /tmp/specdec-heavy.lock bash docs/bench/formats/avx2-s16/bench32.sh [OUT]
# FORMATS: the --formats of the run (default session 16's float32:alone,int4,w8a8; session 18's w7a8-s18/bench32.sh sets it).
cd "$(dirname "$0")/../../../.."
out=${1:-docs/bench/formats/avx2-s16/bench32}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{ echo "== start $(date -u +%T) $(git log --oneline -1 | cut -c1-60) load $(cut -d' ' -f1-3 /proc/loadavg) $(grep -m1 'model name' /proc/cpuinfo) family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2) model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2)"
  timeout 3000 .venv/bin/specdec bench --formats "${FORMATS:-float32:alone,int4,w8a8}" --alone-prompts code-prime --alone-rounds 3 \
      --prompts code-prime,code-rename,code-rename-full,poem-sea --tokens 32 --repeats 3 --no-bracket \
      --ks 8,12 --draft-min-confidence 0.4 --ngram-ks 16 --proposers draft,ngram --hf assisted --adaptive 0,4 \
      --adaptive-min-confidence 0.4 --draft-vocab-subset 65536 --threads 1 --no-plot \
      --only code:hf-assisted,ours-draft-K8-c0.4,ours-draft-K12-c0.4,ours-adaptive-w0-c0.4,ours-adaptive-w4-c0.4 \
      --only copy:ours-ngram-K16 --only copy_full:ours-ngram-K16 \
      --only creative:ours-adaptive-w0-c0.4,ours-adaptive-w4-c0.4 --out "$out"
  echo "== end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"; } 2>&1 | grep -v "Loading weights" | tee "$out/log.txt" | tail -60
