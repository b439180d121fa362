"""The Serve application: a typed builder turning an :class:`AppConfig` into an Application.

    serve run deployments.app:build_app target_tp=2          # args on the command line
    serve run deployments/local-cpu.yaml                     # or the generated config file

Deployments (names are those of the config files; see ``deployments/config.py``):
``Router`` (ingress of the gRPC API and of the OpenAI-compatible HTTP API, autoscaled; admits
and relays), ``Draft`` (the decoding loops and the
draft model; sticky on the session id) and ``Target`` (TP workers in its placement group; sticky
on the session id). Router -> Draft: one ``DraftJob`` per generation, a stream of chunks back;
Draft -> Target: one ``CandidateBlock`` / ``VerificationResult`` round trip per speculation step.
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from deployments.config import BUILT, AppConfig
from deployments.draft import Draft
from deployments.router import Router
from deployments.target import Target

#: Deployments the application builds (the Serve config lists options for these only).
BUILT_DEPLOYMENTS = BUILT


def build_app(args: AppConfig) -> Application:
    """Build the specdec application from its config (Serve validates ``args`` into AppConfig)."""
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    opts = cfg.deployment_options()
    target = serve.deployment(Target, name="Target", **opts["Target"]).bind(cfg)
    draft = serve.deployment(Draft, name="Draft", **opts["Draft"]).bind(cfg, target)
    # FastAPI ingress built per replica by Router.__serve_build_asgi_app__ (the OpenAI API on
    # Serve's HTTP proxy); the gRPC proxy calls the same class's RPC-named methods.
    ingress = serve.ingress()(Router)
    return serve.deployment(ingress, name="Router", **opts["Router"]).bind(cfg, draft, target)
