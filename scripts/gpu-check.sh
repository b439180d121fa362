#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, one command that
#   1. creates ./.venv-gpu and installs the CUDA build of torch (pinned: torch==2.13.0, inside
#      pyproject's range >=2.13,<2.15), the project with its demo extra, and pytest;
#   2. runs the tests marked `gpu` (tests/test_gpu.py: the demo pair greedy on CUDA equal to the
#      target alone, a seeded sampled request giving the same output twice, the served path at
#      TP=1 on one GPU; tests/test_gpu_batch.py: continuous batching on CUDA with tiny models in
#      float32 and bfloat16), the engine and batching tests again with every tiny model on the GPU
#      (SPECDEC_TEST_DEVICE=cuda), and the CPU-side device checks (tests/test_devices.py, the TP=1 worker);
#   3. times the verify forward by rows and positions (benchmarks.forward_costs), tokens/s of the
#      target alone and with speculation (`specdec bench --device cuda`, short settings: 2 prompts,
#      64 tokens, K = 2, 4, 8, 2 repeats) and batched against unbatched clients (benchmarks.batching);
# and writes everything it prints to docs/bench/gpu/ (gpu-check.log, environment.txt, the
# benchmarks' json / md), ready to commit. Exit status: that of the tests.
#
#   bash scripts/gpu-check.sh                   # PyPI's torch==2.13.0 (the CUDA build on Linux x86_64)
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 bash scripts/gpu-check.sh   # another CUDA build
#   GPU_CHECK_SKIP_INSTALL=1 bash scripts/gpu-check.sh   # reuse .venv-gpu as it is
#   PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels bash scripts/gpu-check.sh   # a machine without network
#     (pip reads these itself; the wheel folder needs torch==2.13.0 for CUDA, the demo-pair wheels
#      and the project's dependencies, e.g. from `pip download` on a machine of the same platform)
#
# A machine that has a CUDA torch already and cannot receive the demo pair (no network, small
# uploads: this project's lent GPU machines) runs the same checks on a pair of the demo pair's
# shapes with random weights (benchmarks/random_pair.py; the demo-pair tests are then skipped):
#   GPU_CHECK_SYSTEM_PYTHON=1 GPU_CHECK_WHEELS=.gpu/whl GPU_CHECK_MODELS=random \
#     GPU_CHECK_META=.gpu/demo-meta bash scripts/gpu-check.sh
#   (python3 as it is, the wheels in GPU_CHECK_WHEELS installed over it into /tmp/specdec-site:
#    transformers and pydantic at the project's versions; `bash scripts/gpu-carry.sh` builds .gpu/
#    (the wheels and the demo pair's configs and tokenizer) on a machine with the registry and the demo cache;
#    add GPU_CHECK_SIZE=short to fit one 10-minute call)
# Time limits: GPU_CHECK_IMPORT_TIMEOUT (importing torch and finding the GPU, default 120 s),
# GPU_CHECK_TEST_TIMEOUT (each test and benchmark step, default 900 s, 240 s with GPU_CHECK_SIZE=short).
#
# Needs: NVIDIA driver (nvidia-smi), Python >= 3.11, the package registry (or a wheel folder),
# about 25 GB of disk (venv, demo pair cache) and 20 GB of GPU memory.
set -euo pipefail
cd "$(dirname "$0")/.."
# settings checked before anything is written or installed
for var in GPU_CHECK_IMPORT_TIMEOUT GPU_CHECK_TEST_TIMEOUT; do
  case ${!var-1} in
    ''|*[!0-9]*|0) echo "gpu-check: $var=${!var}: expected whole seconds above 0" >&2; exit 2 ;;
  esac
done
case ${GPU_CHECK_SIZE:-full} in
  short|full) ;;
  *) echo "gpu-check: GPU_CHECK_SIZE=$GPU_CHECK_SIZE: expected short or full" >&2; exit 2 ;;
esac
OUT=docs/bench/gpu
mkdir -p "$OUT"
LOG="$OUT/gpu-check.log"
exec > >(tee "$LOG") 2>&1
step() { printf '\n== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

step "GPU"
if ! command -v nvidia-smi >/dev/null; then
  echo "gpu-check: nvidia-smi not found: this script needs a machine with an NVIDIA GPU and its driver" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

MODELS=${GPU_CHECK_MODELS:-demo}
# GPU_CHECK_SIZE=short: one prompt, fewer tokens and repeats, no unrelated-draft bench and no sweep of the
# engine tests on the GPU: fits one 10-minute call on a lent machine (session 22's H200 ran these steps
# in about 6 minutes with the random pair); the default (full) needs about 20.
if [ "${GPU_CHECK_SIZE:-full}" = short ]; then
  PROMPTS=code-prime TOKENS=48 KS=2,4 REPEATS=1 CLIENTS=1,4,8 BTOKENS=32 SHORT=1
  : "${GPU_CHECK_TEST_TIMEOUT:=240}"
else
  PROMPTS=code-prime,poem-sea TOKENS=64 KS=2,4,8 REPEATS=2 CLIENTS=1,2,4,8 BTOKENS=64 SHORT=
fi
if [ -n "${GPU_CHECK_SYSTEM_PYTHON:-}" ]; then
  step "python3 as it is, the project from the working tree"
  if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/specdec-site "$GPU_CHECK_WHEELS"/*.whl
    export PYTHONPATH=/tmp/specdec-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
  # `python` and `specdec` as commands (timeout runs commands, not shell functions)
  mkdir -p /tmp/specdec-bin
  # a wrapper, not a link: a link to a venv's python (an image's /opt/torch/.venv) runs outside that venv
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" >/tmp/specdec-bin/python
  chmod +x /tmp/specdec-bin/python
  printf '#!/bin/sh\nexec python3 -m specdec.cli "$@"\n' >/tmp/specdec-bin/specdec
  chmod +x /tmp/specdec-bin/specdec
  export PATH=/tmp/specdec-bin:$PATH
else
step "venv .venv-gpu"
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "gpu-check: $PY is Python $("$PY" -c 'import platform; print(platform.python_version())'); the project needs >= 3.11 (set PYTHON=python3.11 or newer)" >&2
  exit 2
fi
if [ ! -x .venv-gpu/bin/python ]; then
  "$PY" -m venv .venv-gpu
fi
. .venv-gpu/bin/activate
if [ -z "${GPU_CHECK_SKIP_INSTALL:-}" ]; then
  python -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  python -m pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  # the demo extra and the test runner only: the dev extra's other tools are not needed here
  python -m pip install -q -e ".[demo]" "pytest>=8" "pytest-timeout>=2.3"
fi
fi
# time-boxed: session 23's lent machine (torch in /opt/torch/.venv) never finished `import torch`
# (over 440 s), and the whole call's device time went with it
IMPORT_S=${GPU_CHECK_IMPORT_TIMEOUT:-120}
set +e
timeout "$IMPORT_S" python - <<'EOF'
import sys, time
t0 = time.perf_counter()
import torch
print(f"torch {torch.__version__} imported in {time.perf_counter() - t0:.1f} s from {torch.__file__}", flush=True)
print(f"CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")
if torch.version.cuda is None or not torch.cuda.is_available():
    sys.exit("gpu-check: this torch cannot use the GPU (a CPU build, or a CUDA build the driver does not "
             "support); set TORCH_INDEX_URL to a CUDA wheel index matching the driver and rerun")
print("device 0:", torch.cuda.get_device_name(0), f"({time.perf_counter() - t0:.1f} s)")
EOF
rc=$?
set -e
if [ "$rc" -eq 124 ]; then
  echo "gpu-check: importing torch and finding the GPU took more than $IMPORT_S s ($(command -v python)); set GPU_CHECK_IMPORT_TIMEOUT to wait longer" >&2
  exit 3
elif [ "$rc" -ne 0 ]; then
  exit "$rc"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

step "environment"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  echo "cpus: $(nproc)"
} | tee "$OUT/environment.txt"

if [ "$MODELS" = random ]; then
  step "a pair of the demo pair's shapes with random weights (benchmarks/random_pair.py)"
  PAIR=/tmp/specdec-random-pair
  python -m benchmarks.random_pair --meta "${GPU_CHECK_META:-.gpu/demo-meta}" --out "$PAIR" --device cuda \
    --damp "${GPU_CHECK_DAMP:-0.02}"
  TARGET=$PAIR/target DRAFT=$PAIR/draft-prefix FAR_DRAFT=$PAIR/draft
else
  step "demo pair (assembled once into the cache)"
  # `specdec prefetch` alone builds this host CPU's default format (w8a8 on a Xeon with AMX: minutes
  # of quantizing nothing here loads). Build what this script loads instead: bfloat16, the default
  # on CUDA (`specdec bench --device cuda`), and float32, what the tests load unless they name a
  # format (tests/conftest.py sets SPECDEC_WEIGHT_FORMAT=float32).
  specdec prefetch --format bfloat16
  specdec prefetch --format float32

  TARGET=demo:target DRAFT=demo:draft FAR_DRAFT=
fi

step "tests marked gpu, and the device checks"
set +e
T=${GPU_CHECK_TEST_TIMEOUT:-900}
if [ "$MODELS" = random ]; then MARK="gpu and not demo"; else MARK=gpu; fi
timeout "$T" python -m pytest -p no:cacheprovider -rs -v -m "$MARK" tests/test_gpu.py tests/test_gpu_batch.py
TESTS_RC=$?
timeout "$T" python -m pytest -p no:cacheprovider -q tests/test_devices.py tests/deployments/test_tp_worker_device.py
DEVICE_RC=$?
set -e
[ "$TESTS_RC" -eq 0 ] && TESTS_RC=$DEVICE_RC

step "one verify forward by rows and positions (benchmarks.forward_costs --device cuda)"
timeout "$T" python -m benchmarks.forward_costs --target "$TARGET" --draft "$DRAFT" --device cuda \
  --out "$OUT/forward" || echo "forward_costs failed: rc=$?"

step "tokens/s: target alone vs speculation (specdec bench --device cuda)"
timeout "$T" specdec bench --device cuda --target "$TARGET" --draft "$DRAFT" --prompts "$PROMPTS" \
  --tokens "$TOKENS" --ks "$KS" --proposers draft,none --adaptive 0 --hf assisted --repeats "$REPEATS" --no-plot --out "$OUT/bench" \
  || echo "bench failed: rc=$?"
[ -f "$OUT/bench/bench.json" ] && python - "$OUT/bench/bench.json" <<'EOF' || true
import json, sys
report = json.load(open(sys.argv[1]))
meta = report["meta"]
print(f"\ntokens/s on {meta.get('device', '?')}, median of {meta.get('repeats')} runs; speedup over the target alone")
for r in report["rows"]:
    same = "" if r.get("identical") else "   OUTPUT DIFFERS FROM THE TARGET ALONE"
    print(f"  {r['prompt']:12s} {r['method']:18s} {r['tokens_per_s']:8.1f} tok/s  {r['speedup']:5.2f}x{same}")
EOF
echo "table: $OUT/bench/table.md"
step "batched against unbatched clients, in process (benchmarks.batching --device cuda)"
timeout "$T" python -m benchmarks.batching --device cuda --target "$TARGET" --draft "$DRAFT" --clients "$CLIENTS" \
  --k 4 --max-tokens "$BTOKENS" --adaptive --out "$OUT/batching" || echo "batching failed: rc=$?"

if [ -n "$FAR_DRAFT" ] && [ -z "$SHORT" ]; then
  step "speculation with an unrelated draft (acceptance about 0): what adaptive K must turn off"
  timeout "$T" specdec bench --device cuda --target "$TARGET" --draft "$FAR_DRAFT" --prompts code-prime \
    --tokens 64 --ks 4 --proposers draft,none --adaptive 0 --skip-hf --repeats 2 --no-plot --out "$OUT/bench-far" \
    || echo "bench (unrelated draft) failed: rc=$?"
fi

SWEEP_RC=0
if [ -z "$SHORT" ]; then
step "the engine and batching tests again, every tiny model on the GPU (SPECDEC_TEST_DEVICE=cuda)"
set +e
SPECDEC_TEST_DEVICE=cuda timeout "$T" python -m pytest -p no:cacheprovider -q -rfE \
  tests/test_batch.py tests/test_engine.py tests/test_greedy_identity.py tests/test_verifier.py \
  tests/test_batch_forward.py tests/test_block_validation.py tests/test_incremental.py tests/test_stopping.py
SWEEP_RC=$?
set -e
fi
[ "$TESTS_RC" -eq 0 ] && TESTS_RC=$SWEEP_RC

step "done: tests rc=$TESTS_RC; output in $OUT/"
exit "$TESTS_RC"
