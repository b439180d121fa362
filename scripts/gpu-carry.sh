#!/usr/bin/env bash
# What a GPU machine without network needs besides the working tree, built here into .gpu/ (git-ignored):
#   .gpu/whl        wheels for Python 3.12 on manylinux x86_64: transformers and pydantic at the project's
#                   versions with the dependencies a CUDA image may lack or hold in older versions (numpy and
#                   torch are the image's), and py-spy for profiles
#   .gpu/demo-meta  the demo pair's configs, generation configs, tokenizer and chat template (no weights):
#                   benchmarks/random_pair.py builds a pair of the same shapes with random weights from them
# About 45 MB: it travels with the working tree (a lent machine takes 64 MiB per call), e.g.
#   run(command="GPU_CHECK_SYSTEM_PYTHON=1 GPU_CHECK_WHEELS=.gpu/whl GPU_CHECK_MODELS=random GPU_CHECK_SIZE=short
#                bash scripts/gpu-check.sh; tar czf $OUT/gpu.tgz docs/bench/gpu", carry=[".gpu"])
# Needs: the package registry, and the demo pair in the local cache (`specdec prefetch`).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> "$(git rev-parse --git-common-dir)/info/exclude"
PY=${PYTHON:-.venv/bin/python}
rm -rf .gpu/whl && mkdir -p .gpu/whl
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .gpu/whl \
  "transformers==$("$PY" -c 'import transformers; print(transformers.__version__)')" \
  "pydantic==$("$PY" -c 'import pydantic; print(pydantic.VERSION)')" py-spy
rm -f .gpu/whl/numpy-*.whl  # the image's numpy (torch was built against it)
HF_HUB_OFFLINE=1 PYTHONPATH=$PWD "$PY" -m benchmarks.random_pair --meta .gpu/demo-meta --export-meta >/dev/null
du -sh .gpu/whl .gpu/demo-meta
