#!/usr/bin/env bash
# Installs specdec and everything it needs into ./.venv (idempotent).
# CPU build of torch by default; a GPU user installs the CUDA build of torch first
# (SPECDEC_TORCH=skip keeps whatever torch is already in the venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if [ "${SPECDEC_TORCH:-cpu}" != "skip" ]; then
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[dev,demo]"
