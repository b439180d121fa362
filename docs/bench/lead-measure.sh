#!/bin/bash
# usage: TAG=s12-lead NETNS=ns-X RAY_TMPDIR=/tmp/ray-X flock -w 900 /tmp/specdec-heavy.lock docs/bench/lead-measure.sh STAGE...
# stages: served onecl batchgoal (BG_ROUNDS rounds, default 3) bench32 bench128 (run from any directory; works in the repository holding it);
# benchavx2: session 12's in-process bench on an AVX2-only CPU (float32 baseline, int4 defaults, 64 tokens).
# TAG names the outputs (default s12-lead; its first part, s12, names the session's folders): served-w8a8/run-TAG.txt,
# batching/inprocess-TAG/, formats/bench-SESSION/lead and lead-128/.
set -u
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NETNS=${NETNS:?set NETNS (a network namespace for the served stages)} RAY_TMPDIR=${RAY_TMPDIR:?set RAY_TMPDIR}
NSX="ip netns exec $NETNS env RAY_worker_niceness=${RAY_worker_niceness:-0} RAY_TMPDIR=$RAY_TMPDIR HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$PWD"
c=$(git log --oneline -1 | cut -c1-7)
TAG=${TAG:-s12-lead}; SESSION=${TAG%%-*}
hdr() { echo "== $1 $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) at $(git log --oneline -1 | cut -c1-70)"; }
for st in "$@"; do
 echo "=== $st start $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) at $c"
 case $st in
 served)
  tag=$TAG; out=docs/bench/served-w8a8/run-$tag.txt
  export SPECDEC_BATCH_K_TRACE=$PWD/docs/bench/served-w8a8/trace-$tag.jsonl; rm -f $SPECDEC_BATCH_K_TRACE
  { hdr start; PROPOSERS=default,none,default,none timeout 400 bash docs/bench/served-w8a8/served_pair.sh $tag deployments/local-cpu.yaml SPECDEC_BATCH_K_TRACE=$SPECDEC_BATCH_K_TRACE; hdr end; } > $out 2>&1
  python3 docs/bench/served-w8a8/step_breakdown.py $SPECDEC_BATCH_K_TRACE >> $out; unset SPECDEC_BATCH_K_TRACE
  gzip -f docs/bench/served-w8a8/trace-$tag.jsonl; cat $out ;;
 onecl)
  out=docs/bench/served-w8a8/run-$TAG-onecl.txt
  { hdr start; $NSX timeout 400 .venv/bin/python docs/bench/served-w8a8/one_client_modes.py 3 128 2>&1 | grep -E '^==|^\{|^warmup|Error'; hdr end; } > $out 2>&1; cat $out ;;
 batchgoal)
  mkdir -p docs/bench/batching/inprocess-$TAG
  { hdr start; timeout 1500 .venv/bin/python -m benchmarks.batching_goal --max-tokens 32,128 --rounds ${BG_ROUNDS:-3} --out docs/bench/batching/inprocess-$TAG; hdr end; } 2>&1 | tee docs/bench/batching/inprocess-$TAG/log.txt | tail -40 ;;
 bench32)
  mkdir -p docs/bench/formats/bench-$SESSION/lead
  { hdr start; timeout 1200 .venv/bin/specdec bench --formats float32:alone,w8a8 --alone-prompts code-prime --alone-rounds 3 \
      --prompts code-prime,code-rename,code-rename-full,poem-sea --tokens 32 --repeats 3 --no-bracket \
      --ks 8,12 --draft-min-confidence 0.4 --ngram-ks 16 --proposers draft,ngram --hf assisted --adaptive 0,4 \
      --adaptive-min-confidence 0.4 --draft-vocab-subset 65536 --threads 1 --no-plot \
      --only code:hf-assisted,ours-draft-K8-c0.4,ours-draft-K12-c0.4,ours-adaptive-w0-c0.4,ours-adaptive-w4-c0.4 \
      --only copy:ours-ngram-K16 --only copy_full:ours-ngram-K16 \
      --only creative:ours-adaptive-w0-c0.4,ours-adaptive-w4-c0.4 \
      --out docs/bench/formats/bench-$SESSION/lead; hdr end; } 2>&1 | tee docs/bench/formats/bench-$SESSION/lead/log.txt | tail -40 ;;
 benchavx2)
  mkdir -p docs/bench/formats/bench-$SESSION/lead-avx2
  { hdr start; timeout 1500 .venv/bin/specdec bench --formats float32:alone,int4 --alone-prompts code-prime --alone-rounds 3 \
      --prompts code-prime,code-rename-full,poem-sea --tokens 64 --repeats 3 --no-bracket \
      --ks 4 --draft-min-confidence 0.4 --ngram-ks 16 --proposers draft,ngram --hf assisted --adaptive 4 \
      --adaptive-min-confidence 0.4 --threads 1 --no-plot \
      --only code:hf-assisted,ours-draft-K4-c0.4,ours-adaptive-w4-c0.4 --only copy_full:ours-ngram-K16 \
      --only creative:ours-adaptive-w4-c0.4 \
      --out docs/bench/formats/bench-$SESSION/lead-avx2; hdr end; } 2>&1 | tee docs/bench/formats/bench-$SESSION/lead-avx2/log.txt | tail -40 ;;
 bench128)
  mkdir -p docs/bench/formats/bench-$SESSION/lead-128
  { hdr start; timeout 1200 .venv/bin/specdec bench --formats w8a8 \
      --prompts code-prime --tokens 128 --repeats 3 --no-bracket \
      --ks 4,8,12 --draft-min-confidence 0.4 --proposers draft --hf assisted --adaptive 4 \
      --adaptive-min-confidence 0.4 --draft-vocab-subset 65536 --threads 1 --no-plot \
      --out docs/bench/formats/bench-$SESSION/lead-128; hdr end; } 2>&1 | tee docs/bench/formats/bench-$SESSION/lead-128/log.txt | tail -40 ;;
 esac
 echo "=== $st end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
done
