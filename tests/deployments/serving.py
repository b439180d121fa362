"""Helpers of the served tests (``test_serve_grpc.py``, ``test_serve_http.py``): the test tenants
and their keys, free ports, and one Ray + Serve + specdec application on the tiny pair.

Not a test module; the ``models`` fixture that builds the tiny pair is in ``conftest.py`` here.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import time
from pathlib import Path
from typing import Iterator

from deployments.config import HEALTH_SERVICER, SPECDEC_SERVICER, AppConfig

#: The Serve application's name and route prefix.
APP = "specdec"
#: API keys of the test tenants (the tenants file holds only their sha256 hashes).
KEYS = {"alpha": "sk-test-alpha-0001", "beta": "sk-test-beta-0002", "small": "sk-test-small-0003",
        "lookup": "sk-test-lookup-0004"}
#: gRPC metadata of requests run as tenant alpha (fixed K = the request's own K, so tests control
#: speculation).
MD = (("application", APP), ("authorization", f"Bearer {KEYS['alpha']}"))


def write_tenants(path) -> str:
    """Write the test tenants (alpha, beta, small, lookup; hashes of :data:`KEYS`) to ``path``;
    returns it as a string."""
    import yaml

    from specdec.control.tenants import hash_api_key

    any_proposer = {"allowed_proposers": ["draft", "ngram", "none"], "k_min": 0, "k_max": 8}
    tenants = [
        {"id": "alpha", "api_key_hashes": [hash_api_key(KEYS["alpha"])],
         "limits": {"max_concurrent_requests": 16, "max_tokens": 1024, "max_prompt_tokens": 4096},
         "speculation": {**any_proposer, "adaptive": False, "fixed_k": 8}},
        {"id": "beta", "api_key_hashes": [hash_api_key(KEYS["beta"])],
         "limits": {"max_concurrent_requests": 4, "max_tokens": 256, "max_prompt_tokens": 256},
         "speculation": {**any_proposer, "adaptive": True}},
        {"id": "small", "api_key_hashes": [hash_api_key(KEYS["small"])],
         "limits": {"max_concurrent_requests": 1, "tokens_per_minute": 40, "max_tokens": 8, "max_prompt_tokens": 64},
         "speculation": {"allowed_proposers": ["ngram"], "k_min": 0, "k_max": 2, "adaptive": False}},
        {"id": "lookup", "api_key_hashes": [hash_api_key(KEYS["lookup"])],
         "speculation": {"allowed_proposers": ["ngram"], "k_min": 0, "k_max": 4}},
    ]
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return str(path)


#: where :func:`free_port` looks: above Ray's worker ports (10002-19999 by default) and below the
#: kernel's ephemeral range (32768-60999), from which the OS gives Ray's processes their outgoing
#: connections' ports; an ephemeral port picked here was taken in between by the Ray started after
#: the pick (CI: "Failed to bind to address [::]:40333" for Serve's gRPC proxy)
FREE_PORT_RANGE = (20000, 32000)


def free_port() -> int:
    """A TCP port in :data:`FREE_PORT_RANGE` free (IPv4 and, where the host has it, IPv6) at the
    time of the call.

    Raises:
        RuntimeError: no free port found in 200 random tries.
    """
    import random

    for _ in range(200):
        port = random.randrange(*FREE_PORT_RANGE)
        try:
            with socket.socket() as s:
                s.bind(("", port))
            if socket.has_ipv6:
                with socket.socket(socket.AF_INET6) as s6:
                    s6.bind(("::", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                continue
            if e.errno != errno.EADDRNOTAVAIL:  # EADDRNOTAVAIL: no IPv6 on this host, the IPv4 check stands
                raise
        return port
    raise RuntimeError(f"no free TCP port in {FREE_PORT_RANGE}")


def wait_running(serve, app: str, timeout_s: float = 120) -> None:
    """Wait until Serve reports ``app`` RUNNING; RuntimeError if its deploy failed, TimeoutError
    after ``timeout_s`` seconds."""
    from ray.serve.schema import ApplicationStatus

    end = time.time() + timeout_s
    while time.time() < end:
        status = serve.status().applications.get(app)
        if status is not None and status.status == ApplicationStatus.RUNNING:
            return
        if status is not None and status.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"deploy failed: {status.message}")
        time.sleep(0.2)
    raise TimeoutError(f"application {app} not RUNNING after {timeout_s} s")


@contextlib.contextmanager
def serve_tiny_app(models: tuple[str, str], target_tp: int, **overrides) -> Iterator[AppConfig]:
    """A local Ray (2 CPUs) and Serve on free HTTP and gRPC ports, with the specdec application
    of the tiny pair ``models`` (target folder, draft folder) deployed without waiting for it;
    yields its :class:`AppConfig` (tenants of :func:`write_tenants`, ``target_tp`` TP workers,
    other fields from ``overrides``).
    Serve and Ray are shut down on exit."""
    import ray
    from ray import serve
    from ray.serve.api import _run
    from ray.serve.config import HTTPOptions, gRPCOptions

    from deployments.app import build_app

    target, draft = models
    tenants = write_tenants(Path(target).parent / "tenants.yaml")
    cfg = AppConfig(target_model=target, draft_model=draft, target_tp=target_tp, grpc_port=free_port(),
                    http_port=free_port(), cpu_threads=1, ready_timeout_s=1.0, tenants_file=tenants, **overrides)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(
            http_options=HTTPOptions(port=cfg.http_port),
            grpc_options=gRPCOptions(port=cfg.grpc_port, grpc_servicer_functions=[SPECDEC_SERVICER, HEALTH_SERVICER]),
        )
        _run(build_app(cfg), _blocking=False, name=APP, route_prefix=f"/{APP}")
        yield cfg
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def deployment_handle(name: str):
    """The deployment handle of ``name`` (``"Router"``, ``"Draft"``, ``"Target"``) in :data:`APP`."""
    from ray import serve

    return serve.get_deployment_handle(name, app_name=APP)


def sessions() -> tuple[list[str], list[str]]:
    """The open session ids of the Draft and of the Target deployment."""
    return deployment_handle("Draft").Sessions.remote().result(timeout_s=30), deployment_handle("Target").Sessions.remote().result(timeout_s=30)


def wait_no_sessions(timeout_s: float = 20) -> tuple[list[str], list[str]]:
    """:func:`sessions` once both are empty, or as they are after ``timeout_s`` seconds."""
    end = time.time() + timeout_s
    while True:
        d, t = sessions()
        if (not d and not t) or time.time() > end:
            return d, t
        time.sleep(0.1)


def replica_pids(deployment: str) -> list[int]:
    """Pids of the live replicas of ``deployment`` in :data:`APP` started by this test process's Ray
    (processes below this one titled ``ray::ServeReplica:<APP>:<deployment>``, with ``.<method>``
    while they run a task; Linux /proc)."""
    import os

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [os.getpid()]
    while stack:
        for pid in children.get(stack.pop(), []):
            stack.append(pid)
            try:
                title = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            name = f"ray::ServeReplica:{APP}:{deployment}"
            if title.strip() == name or title.startswith(name + "."):  # ".<method>" while it runs one
                found.append(pid)
    return found


def maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's library mapped (it imported torch)."""
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)
