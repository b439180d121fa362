#!/usr/bin/env bash
# usage: serve_run.sh TAG BATTERY_SECONDS [extra serve args --] [battery checks...]
TAG=$1; BS=$2; shift 2
BS=282; set -- basic bad_http bad_grpc cancel_http concurrent stats features
cd /work/wt-user
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_TMPDIR=/tmp/ray-user
mkdir -p /tmp/ray-user
date -u; cat /proc/loadavg
SERVE_ARGS=(--tenants /tmp/user13/tenants.yaml --metrics-port 9100)
ip netns exec ns-user env RAY_TMPDIR=/tmp/ray-user specdec serve "${SERVE_ARGS[@]}" --keep-running > /tmp/user13/serve-$TAG.log 2>&1 &
SP=$!
trap 'kill -INT $SP 2>/dev/null; sleep 8; kill -TERM $SP 2>/dev/null' EXIT
for i in $(seq 1 150); do
  if ip netns exec ns-user curl -s -o /dev/null -w '%{http_code}' localhost:8000/specdec/health 2>/dev/null | grep -q 200; then echo "ready after ${i}s-ish"; break; fi
  kill -0 $SP 2>/dev/null || { echo "serve died"; tail -30 /tmp/user13/serve-$TAG.log; exit 1; }
  sleep 1
done
date -u
BS=$((BS - SECONDS)); echo "battery budget ${BS}s"
ip netns exec ns-user env RAY_TMPDIR=/tmp/ray-user timeout $BS python -u /tmp/user13/battery.py "$@"
echo battery rc=$?
date -u; cat /proc/loadavg
