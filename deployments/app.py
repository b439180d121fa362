"""The Serve application: a typed builder turning an :class:`AppConfig` into an Application.

    serve run deployments.app:build_app target_tp=2          # args on the command line
    serve run deployments/local-cpu.yaml                     # or the generated config file

Deployments (names are those of the config files; see ``deployments/config.py``):
``Router`` (gRPC ingress, autoscaled) and ``Target`` (TP workers in its placement group).
``Draft`` joins when the decoding loop moves out of the router (issue 3).
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from deployments.config import BUILT, AppConfig
from deployments.router import Router
from deployments.target import Target

#: Deployments the application builds (the Serve config lists options for these only).
BUILT_DEPLOYMENTS = BUILT


def build_app(args: AppConfig) -> Application:
    """Build the specdec application from its config (Serve validates ``args`` into AppConfig)."""
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    opts = cfg.deployment_options()
    target = serve.deployment(Target, name="Target", **opts["Target"]).bind(cfg)
    return serve.deployment(Router, name="Router", **opts["Router"]).bind(cfg, None, target)
