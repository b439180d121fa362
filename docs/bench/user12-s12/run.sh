#!/bin/bash
# usage: run.sh PHASE...   (inside: ip netns exec ns-user12; under the heavy lock)
set -u; BUDGET=${BUDGET:-285}
cd /work/wt-user12
. /tmp/u12/keys.env; export KA KB
export PYTHONPATH=/work/wt-user12 RAY_TMPDIR=/tmp/ray-user12 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 METRICS_PORT=9101
mkdir -p $RAY_TMPDIR
echo "load $(cat /proc/loadavg) $(date -u +%T)"
setsid .venv/bin/specdec serve --config /tmp/u12/app.yaml --tenants /tmp/u12/tenants.yaml --keep-running --metrics-port 9101 > /tmp/u12/serve-$1.log 2>&1 &
SP=$!; export SERVE_PID=$SP
for i in $(seq 1 150); do
  curl -s -o /dev/null -w '%{http_code}' localhost:8000/specdec/health 2>/dev/null | grep -q 200 && break; sleep 1
done
echo "ready after ${i}s $(date -u +%T)"
timeout $((BUDGET - SECONDS)) bash -c "for ph in $*; do .venv/bin/python /tmp/u12/probe.py \$ph; done"
if kill -0 $SP 2>/dev/null; then kill -INT $SP; sleep 15; fi
kill -0 $SP 2>/dev/null && { echo "serve still alive, killing group"; kill -TERM -- -$SP; sleep 5; }
echo "leftover ray processes in the netns' RAY_TMPDIR:"; ps -eo pid,args | grep -c "ray-user12" 
echo "load $(cat /proc/loadavg) $(date -u +%T)"
for p in $(pgrep -f "ray-user12"); do kill $p 2>/dev/null; done; sleep 2
for p in $(pgrep -f "ray-user12"); do kill -9 $p 2>/dev/null; done
echo "after cleanup: $(pgrep -fc ray-user12) processes"
