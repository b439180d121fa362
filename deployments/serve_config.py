"""The AppConfig that ``specdec serve`` deploys: a preset or a ``--config`` file, then the flags.

A bad value is one line naming where it came from (``--tp: Input should be greater than or equal
to 1``, ``target_tp in app.yaml: ...``, ``--config app.yaml is not valid YAML: ...``), raised as
:class:`specdec.errors.SpecDecError` before Ray starts, never a pydantic or YAML traceback. No
Ray or gRPC at import (``deployments.cli`` imports this module).
"""

from __future__ import annotations

import os

#: AppConfig fields that ``specdec serve`` flags set -> the flag.
FLAG_OF_FIELD: dict[str, str] = {
    "target_model": "--target", "draft_model": "--draft", "target_tp": "--tp",
    "draft_vocab_subset": "--draft-vocab-subset", "draft_vocab_table": "--draft-vocab-table",
    "grpc_port": "--grpc-port", "http_port": "--http-port", "tenants_file": "--tenants",
}


def _validated(data: dict, names: dict[str, str], where: str):
    """``AppConfig.model_validate(data)``; a ValidationError becomes a SpecDecError naming each
    field by ``names`` (flags), else as ``FIELD in WHERE``."""
    from pydantic import ValidationError

    from deployments.config import AppConfig
    from specdec.errors import SpecDecError

    try:
        return AppConfig.model_validate(data)
    except ValidationError as e:
        parts = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"])
            name = names.get(field) or (f"{field} in {where}" if field else where)
            parts.append(f"{name}: {err['msg'].removeprefix('Value error, ')}")
        raise SpecDecError("; ".join(parts)) from None


def _config_file(path: str):
    """The AppConfig of a ``--config`` file: AppConfig YAML, or a Serve config file (its first
    application's args)."""
    import yaml

    from specdec.errors import SpecDecError

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise SpecDecError(f"cannot read --config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise SpecDecError(f"--config {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if isinstance(data, dict) and "applications" in data:  # a Serve config file
        apps = data["applications"]
        data = (apps[0].get("args") if isinstance(apps, list) and apps and isinstance(apps[0], dict) else None)
        if not isinstance(data, dict):
            raise SpecDecError(f"--config {path}: a Serve config file whose first application has no args mapping")
    if data is not None and not isinstance(data, dict):
        raise SpecDecError(f"--config {path} must hold a mapping of AppConfig fields, got {type(data).__name__}")
    return _validated(data or {}, {}, path)


def _check_ports_distinct(cfg, over: dict, metrics_port: int | None, where: str) -> None:
    """Refuse two of the gRPC, HTTP and metrics ports being one port, naming each by its flag
    when a flag set it, else as ``FIELD in WHERE``.

    Args:
        cfg: the preset's or ``--config`` file's AppConfig (its own ports already differ).
        over: the flags' AppConfig overrides (``grpc_port``, ``http_port`` when given).
        metrics_port: ``--metrics-port``, or None (Ray picks a free one).
        where: the config's source, ``--config``'s path or "the local-cpu preset".

    Raises:
        SpecDecError: e.g. ``--grpc-port and http_port in the local-cpu preset are both 8000: ...``
            (Serve's proxies listen with SO_REUSEPORT: both bound the one port and the kernel split
            the connections between them).
    """
    from specdec.errors import SpecDecError

    ports = [(over[f] if f in over else getattr(cfg, f), FLAG_OF_FIELD[f] if f in over else f"{f} in {where}")
             for f in ("grpc_port", "http_port")]
    if metrics_port is not None:
        ports.append((metrics_port, "--metrics-port"))
    for i, (port, name) in enumerate(ports):
        for other, other_name in ports[i + 1:]:
            if port == other:
                raise SpecDecError(f"{name} and {other_name} are both {port}: the gRPC, HTTP and metrics servers "
                                   "need a port each")


def _check_demo_request(args) -> None:
    """Check ``--message`` and ``--max-tokens`` of ``--demo-request`` by the core's request rules
    before anything starts (the request is sent only once the models are loaded).

    Raises:
        SpecDecError: ``--max-tokens: Input should be greater than or equal to 1``, ...
    """
    from pydantic import ValidationError

    from specdec.errors import SpecDecError
    from specdec.request import GenerationRequest

    try:
        GenerationRequest.model_validate({"messages": [{"role": "user", "content": args.message}],
                                          "max_tokens": args.max_tokens})
    except ValidationError as e:
        raise SpecDecError("; ".join(
            f"{'--max-tokens' if err['loc'][:1] == ('max_tokens',) else '--message'}: "
            f"{err['msg'].removeprefix('Value error, ')}" for err in e.errors())) from None


def load_config(args):
    """The AppConfig of ``specdec serve``: preset or ``--config`` file, then the flag overrides.

    Raises:
        SpecDecError: the config file cannot be read or parsed, a value of it or of a flag is out
            of range (named by its flag, or as ``FIELD in FILE``), ``--num-cpus`` below 1, ``--metrics-port``
            outside 1..65535, ``--shutdown-grace`` negative or not finite, two of the gRPC, HTTP and
            metrics ports the same, ``--demo-request``'s ``--max-tokens`` or ``--message`` refused by
            the core's request rules.
        TenantConfigError: the tenants file cannot be read or is not a valid tenants file.
    """
    from deployments.config import PRESETS
    from specdec.errors import SpecDecError

    cfg = _config_file(args.config) if args.config else PRESETS["local-cpu.yaml"]
    num_cpus = getattr(args, "num_cpus", None)
    if num_cpus is not None and num_cpus < 1:  # 0 silently meant "all of this machine's"
        raise SpecDecError(f"--num-cpus: Input should be greater than or equal to 1, got {num_cpus}")
    grace = getattr(args, "shutdown_grace", None)
    if grace is not None and not (0 <= grace < float("inf")):  # NaN fails both comparisons
        raise SpecDecError(f"--shutdown-grace: Input should be a number of seconds, at least 0, got {grace:g}")
    metrics_port = getattr(args, "metrics_port", None)
    if metrics_port is not None and not 1 <= metrics_port <= 65535:
        raise SpecDecError(f"--metrics-port: Input should be a port in 1..65535, got {metrics_port}")
    over: dict = {}
    if args.target:
        over["target_model"] = args.target
    if args.draft:
        over["draft_model"] = None if args.draft == "none" else args.draft
    if args.tp is not None:  # 0 was taken for "not given" and the config's TP served silently
        over["target_tp"] = args.tp
    if getattr(args, "draft_vocab_subset", None) is not None:
        over["draft_vocab_subset"] = args.draft_vocab_subset or None
    if getattr(args, "draft_vocab_table", None):
        over["draft_vocab_table"] = args.draft_vocab_table
    if args.grpc_port is not None:
        over["grpc_port"] = args.grpc_port
    if args.http_port is not None:
        over["http_port"] = args.http_port
    if getattr(args, "tenants", None) is not None:
        if not args.tenants.strip():  # e.g. --tenants "$UNSET": serving without API keys must not happen silently
            from specdec.control.tenants import TenantConfigError

            raise TenantConfigError("--tenants is empty: give the tenants file's path")
        over["tenants_file"] = os.path.abspath(args.tenants)  # Ray's workers run in other folders
    where = args.config or "the local-cpu preset"
    _check_ports_distinct(cfg, over, metrics_port, where)
    if getattr(args, "demo_request", False):
        _check_demo_request(args)
    if over:
        cfg = _validated({**cfg.model_dump(), **over}, {f: FLAG_OF_FIELD[f] for f in over}, where)
    if cfg.tenants_file:  # read it here: a bad file is one line now, not a failed deploy later
        from specdec.control.tenants import load_tenants_config

        load_tenants_config(cfg.tenants_file)
    return cfg
