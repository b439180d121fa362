#!/bin/bash
# run from the repository root, under the heavy lock: flock -w 1800 /tmp/specdec-heavy.lock timeout 330 bash <this>
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=docs/bench/formats/bench-s11/creative11
echo "== start $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) at $(git log --oneline -1 | cut -c1-60)"
timeout 220 .venv/bin/specdec bench --prompts code-prime,poem-sea --tokens 32 --repeats 3 --no-bracket \
  --ks 8 --draft-min-confidence 0.4 --proposers draft --skip-hf --adaptive 0,4 \
  --adaptive-min-confidence 0.4 --draft-vocab-subset 65536 --threads 1 --no-plot \
  --only code:ours-draft-K8-c0.4,ours-adaptive-w0-c0.4,ours-adaptive-w4-c0.4 \
  --only creative:ours-adaptive-w0-c0.4,ours-adaptive-w4-c0.4 \
  --out $OUT
echo "== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
