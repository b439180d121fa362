#!/bin/bash
# usage (under the heavy lock): SRC=<source tree> flock -w 1800 /tmp/specdec-heavy.lock timeout 300 \
#   bash docs/bench/formats/bench-s13/adaptk/run.sh STAGE [SUFFIX]
# SRC: the source tree to run (default /tmp/adaptk-base, an export of cd9fd79 = main at the session's start plus
# the snapshot change; run with PYTHONPATH=$SRC: the shared venv's editable install points at /work/main).
# stages: c32 (code + copy, 32 tokens), code32, copy32, c128a (target, assisted, adaptive taught),
# c128b (target, K4, K8, adaptive cold), diag TOKENS (diag_steps.py)
set -u
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
SRC=${SRC:-/tmp/adaptk-base}
OUTROOT=/work/wt-adaptk/docs/bench/formats/bench-s13/adaptk
st=$1; suf=${2:-}
D=$OUTROOT/$st$suf; mkdir -p $D
cd $SRC; export PYTHONPATH=$SRC
commit=$(cat $SRC/COMMIT 2>/dev/null || git -C $SRC log --oneline -1 | cut -c1-60)
hdr() { echo "== $1 $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) src $SRC at $commit"; }
COMMON="--formats w8a8 --repeats 3 --no-bracket --draft-min-confidence 0.4 --hf assisted --adaptive-min-confidence 0.4 --draft-vocab-subset 65536 --threads 1 --no-plot --out $D"
case $st in
 c32) CMD=".venv/bin/specdec bench $COMMON --prompts code-prime,code-rename --tokens 32 --ks 4,8 --ngram-ks 16 --proposers draft,ngram --adaptive 0,4 \
   --only code:hf-assisted,ours-draft-K4-c0.4,ours-draft-K8-c0.4,ours-adaptive-w0-c0.4,ours-adaptive-w4-c0.4 --only copy:ours-ngram-K16" ;;
 code32) CMD=".venv/bin/specdec bench $COMMON --prompts code-prime --tokens 32 --ks 4,8 --proposers draft --adaptive 0,4 \
   --only code:hf-assisted,ours-draft-K4-c0.4,ours-draft-K8-c0.4,ours-adaptive-w0-c0.4,ours-adaptive-w4-c0.4" ;;
 copy32) CMD=".venv/bin/specdec bench $COMMON --prompts code-rename --tokens 32 --ks 4 --ngram-ks ${NGRAM_KS:-16} --proposers ngram --only copy:${COPY_ONLY:-ours-ngram-K16}" ;;
 c128a) CMD=".venv/bin/specdec bench $COMMON --prompts code-prime --tokens 128 --ks 4 --proposers draft --adaptive 4 \
   --only code:hf-assisted,ours-adaptive-w4-c0.4" ;;
 c128b) CMD=".venv/bin/specdec bench $COMMON --prompts code-prime --tokens 128 --ks 4,8 --proposers draft --adaptive 0 \
   --only code:ours-draft-K4-c0.4,ours-draft-K8-c0.4,ours-adaptive-w0-c0.4" ;;
 c128) CMD=".venv/bin/specdec bench $COMMON --prompts code-prime --tokens 128 --ks 4 --proposers draft --adaptive 4 \
   --only code:ours-draft-K4-c0.4,ours-adaptive-w4-c0.4" ;;
 diag) CMD=".venv/bin/python $OUTROOT/diag_steps.py ${DIAG_TOKENS:-32} 4 $D/diag.json" ;;
 *) echo "unknown stage $st"; exit 2 ;;
esac
{ hdr start; echo "cmd: $CMD"; $CMD; hdr end; } 2>&1 | grep --line-buffered -v 'Loading weights' | tee $D/log.txt | tail -45
