cd /work/wt-bench10
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=/work/wt-bench10
date -u; uptime; git -C /work/wt-bench10 log --oneline -1
/usr/bin/time -f "wall %e s" timeout 330 .venv/bin/specdec bench --formats float32:alone,w8a8 --alone-prompts code-prime --alone-rounds 2 \
  --prompts code-prime,code-rename,code-rename-full,poem-sea --tokens 32 --repeats 2 --no-bracket \
  --ks 8 --draft-min-confidence 0.4 --ngram-ks 16 --proposers draft,ngram --hf assisted --adaptive 0,4 \
  --adaptive-min-confidence 0.4 --draft-vocab-subset 65536 --threads 1 --no-plot \
  --only code:hf-assisted,ours-draft-K8-c0.4,ours-adaptive-w0-c0.4,ours-adaptive-w4-c0.4 \
  --only copy:ours-ngram-K16 --only copy_full:ours-ngram-K16 \
  --only creative:ours-adaptive-w0-c0.4,ours-adaptive-w4-c0.4 \
  --out /tmp/bench10/run2
date -u; uptime
