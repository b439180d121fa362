"""``specdec serve`` run as a user runs it, on the tiny pair from a config: a local Ray, the
application, the demo request over gRPC, and a quiet shutdown."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.deployments.serving import KEYS, free_port, write_tenants

pytestmark = pytest.mark.serve


def test_serve_demo_request_answers_and_shuts_down_without_a_failed_task(models, tmp_path):
    """Every ``specdec serve`` ended with "(raylet) Task ServeController.graceful_shutdown failed
    ... killed by `ray.kill`" (serve.shutdown() waits on a task that can only fail); the
    shutdown now prints no failed task, and the run still answers the demo request."""
    target, draft = models
    env = {**os.environ, "SPECDEC_API_KEY": KEYS["alpha"], "PYTHONUNBUFFERED": "1"}
    grpc_port = free_port()
    run = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "serve", "--target", target, "--draft", draft, "--num-cpus", "2",
         "--tenants", write_tenants(tmp_path / "tenants.yaml"), "--grpc-port", str(grpc_port),
         "--http-port", str(free_port()), "--demo-request", "--max-tokens", "4"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert f"gRPC:  localhost:{grpc_port}" in out and "[specdec serve] shutting down" in out
    assert "tokens/s" in out  # the demo request's answer line
    assert "graceful_shutdown failed" not in out and "Traceback" not in out, out[-3000:]
