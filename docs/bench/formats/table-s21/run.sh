#!/bin/bash
# Issue 9's format table on one machine in one run (session 21, Zen 4): every format the README offers,
# target alone, our draft K=8 (early stop 0.4) and prompt lookup K=16, one thread, tokens per CPU second.
#   flock -w 1800 /tmp/specdec-heavy.lock bash docs/bench/formats/table-s21/run.sh
cd "$(dirname "$0")/../../../.."
out=docs/bench/formats/table-s21
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{ echo "== start $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) at $(git log --oneline -1 | cut -c1-60)"
  grep -m1 'model name' /proc/cpuinfo; python3 -c "import torch; print('cpu capability', torch.backends.cpu.get_cpu_capability())" 2>/dev/null || .venv/bin/python -c "import torch; print('cpu capability', torch.backends.cpu.get_cpu_capability())"
  /usr/bin/time -v .venv/bin/specdec bench --formats float32,bfloat16,float16,int8,int4,w8a8,w7a8 \
    --prompts code-prime,code-rename,poem-sea --tokens 32 --repeats 1 --no-bracket \
    --ks 8 --draft-min-confidence 0.4 --ngram-ks 16 --proposers draft,ngram --skip-hf \
    --threads 1 --no-plot --out $out
  echo "== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"; } 2>&1 | tr '\r' '\n' | grep -v '%|' > $out/log.txt
