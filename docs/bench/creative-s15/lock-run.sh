#!/bin/bash
# The one demo-pair run of this helper (under the heavy lock): demo_ab.py, then specdec bench on the creative arms.
cd /work/wt-creative
out=docs/bench/creative-s15
echo "== start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) at $(git rev-parse --short HEAD)" | tee $out/lock-run.log
timeout 480 env PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/python $out/demo_ab.py 5 \
  > $out/demo_ab.log 2>&1
echo "== demo_ab rc=$? $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $out/lock-run.log
timeout 420 env PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/specdec bench --formats w8a8 \
  --prompts poem-sea --tokens 32 --repeats 3 --no-bracket --proposers draft --adaptive 0,4 \
  --adaptive-min-confidence 0.4 --draft-vocab-subset 65536 --threads 1 --no-plot --skip-hf \
  --only creative:ours-adaptive-w0-c0.4,ours-adaptive-w4-c0.4 --out $out/after > $out/bench_after.log 2>&1
echo "== bench rc=$? $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $out/lock-run.log
