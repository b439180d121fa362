#!/usr/bin/env bash
# The README's main command: installs (idempotent), fetches the demo pair, serves it on a local
# Ray (Ray Serve + gRPC on :9000), sends one real gRPC code-writing request, prints the answer
# with tokens/s and acceptance rate, and shuts down. Extra arguments go to `specdec serve`
# (e.g. --keep-running, --tp 1, --max-tokens 64, --message "...").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo   # no test tools: the main job installs only what it runs
. .venv/bin/activate
specdec prefetch
exec specdec serve --demo-request "$@"
