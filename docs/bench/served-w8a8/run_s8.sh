#!/bin/bash
# usage: run_s8.sh TREE TAG: run_format.sh w8a8 of the checkout TREE (heavy lock, in ns-embedlean), with
# watch_smaps.py sampling the model processes' mappings during the served pair; raw output to
# docs/bench/served-w8a8/run-TAG-w8a8.txt of this checkout. TREE: this checkout (the change) or a checkout
# of main before it (git worktree add --detach DIR main; ln -s /work/main/.venv DIR/.venv).
tree=$1; tag=$2
here=$(cd "$(dirname "$0")" && pwd)
export NETNS=ns-embedlean RAY_TMPDIR=/tmp/ray-embedlean
out=$here/run-$tag-w8a8.txt
python3 $here/watch_smaps.py $RAY_TMPDIR 2400 > /tmp/embedlean-smaps-$tag.txt &
watcher=$!
echo "== tree $tree at $(git -C $tree log --oneline -1 | cut -c1-60)" > $out
bash $tree/docs/bench/served-w8a8/run_format.sh w8a8 $tag >> $out 2>&1
wait $watcher
cat /tmp/embedlean-smaps-$tag.txt >> $out
