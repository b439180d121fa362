"""Checks of ``specdec serve`` (:func:`deployments.cli.run_serve`): before anything starts, the
ports are free and the model specs name something that exists; after a failed deploy, why each
failed deployment failed. No Ray or gRPC at import (``deployments.cli`` imports this module).
"""

from __future__ import annotations

from typing import Any


def ensure_ports_free(cfg) -> None:
    """Refuse to serve on an HTTP or gRPC port that something already listens on.

    Serve's proxies listen with ``SO_REUSEPORT``, so a second ``specdec serve`` on the same
    ports started without a word and the kernel split the connections between the two servers:
    a caller got answers from either one's models (seen: one greedy request sent 10 times, 5
    answered by each of two tiny targets). Probed by binding each port without
    ``SO_REUSEPORT`` (IPv4 and IPv6), which fails while another socket listens there; a port
    left in TIME_WAIT by a stopped server counts as free (``SO_REUSEADDR``).

    Args:
        cfg: the :class:`deployments.config.AppConfig` (``http_port``, ``grpc_port``).

    Raises:
        specdec.errors.SpecDecError: a port is in use, naming it and the flag to change it.
    """
    import errno
    import socket

    from specdec.errors import SpecDecError

    for name, port, flag in (("HTTP", cfg.http_port, "--http-port"), ("gRPC", cfg.grpc_port, "--grpc-port")):
        for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError:  # no IPv6 on this machine
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise SpecDecError(
                        f"{name} port {port} is already in use on this machine (another `specdec serve`?): a second "
                        "server on it would share its connections, answering some requests with the other "
                        f"server's models; stop that one or pass {flag} with a free port") from None
                # any other failure (e.g. no IPv6 address) says nothing about the port: Serve will tell
            finally:
                sock.close()


def deploy_failures(app_name: str, status: Any = None) -> list[str]:
    """Why the deployments of ``app_name`` failed, one line each: ``Name: <the replica's error>``.

    Serve's own error only names the failed deployments ("Failed to update the deployments
    ['Draft']"); the replica's exception is in the deployment's status message, a traceback
    whose last line is the exception (e.g. ``ModelLoadError: cannot load GGUF file ...``).

    Args:
        app_name: the Serve application.
        status: a ``serve.status()`` result (default: asked now).
    """
    if status is None:
        from ray import serve

        try:
            status = serve.status()
        except Exception as e:  # noqa: BLE001 - the reason is a bonus; the deploy error is already said
            return [f"(Serve's status could not be read: {e})"]
    app = status.applications.get(app_name)
    if app is None:
        return []
    lines = []
    for name, dep in app.deployments.items():
        if str(getattr(dep.status, "value", dep.status)) in ("HEALTHY", "UPDATING", "UPSCALING", "DOWNSCALING"):
            continue
        message = [m.strip() for m in (dep.message or "").splitlines() if m.strip()]
        errors = [m for m in message if not m.startswith(("File ", "Traceback", "^", "~"))]
        lines.append(f"{name}: {errors[-1] if errors else dep.status}")
    return lines


def check_model_specs(cfg) -> None:
    """Parse the target and draft model specs before anything starts: a path that does not
    exist (or is not a folder or a .gguf file) is one line now, not a replica that fails inside
    Ray. Demo specs are assembled later (``ensure_demo_folder``).

    Also checks ``$SPECDEC_WEIGHT_FORMAT`` (:func:`specdec.models.formats.env_format`), which
    was a ValueError traceback from the start line's format lookup.

    Raises:
        specdec.errors.SpecDecError: the spec's error (:func:`specdec.models.spec.parse_model_spec`),
            prefixed with the flag that sets it; ``$SPECDEC_WEIGHT_FORMAT`` names no weight format.
    """
    from specdec.errors import SpecDecError
    from specdec.models.formats import env_format
    from specdec.models.spec import parse_model_spec

    env_format(SpecDecError)  # set but invalid: refused even when both dtypes are given

    for flag, spec in (("--target", cfg.target_model), ("--draft", cfg.draft_model)):
        if spec is None:
            continue
        try:
            parse_model_spec(spec)
        except SpecDecError as e:
            raise type(e)(f"{flag}: {e}") from None
