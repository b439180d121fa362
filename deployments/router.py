"""The gRPC ingress: admits requests, picks K and the proposer, returns or streams the output.

Plain class (decorated in :mod:`deployments.app`), so tests can build it without Serve. Method
names equal the RPC names of ``specdec.v1.SpecDec``: Serve's gRPC proxy routes
``/specdec.v1.SpecDec/Generate`` to :meth:`Router.Generate`, passing the deserialized request
and a ``grpc_context``. No exception ever leaves a method: errors are set on the context
(:func:`deployments.grpc_status.abort_with`), else Serve would answer INTERNAL.

Current state (skeleton): generation runs on an in-process :class:`specdec.engine.SpeculativeEngine`
built in the router. Still to wire (issue 3): the decoding loop moves to the Draft deployment,
talking to the Target deployment with CandidateBlock/VerificationResult protos, and the router
only admits and picks K (issue 4 adds tenants and the controller).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator

from deployments import convert
from deployments.config import AppConfig
from deployments.grpc_status import abort_stream, abort_with
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.errors import ModelNotReadyError, PermissionDeniedError

log = logging.getLogger(__name__)


def build_engine(cfg: AppConfig):
    """The in-process engine for ``cfg``'s model pair (skeleton path)."""
    from specdec.engine import SpeculativeEngine
    from specdec.models.loader import load_model
    from specdec.models.spec import parse_model_spec
    from specdec.models.vocab import check_pair_compatible

    target = load_model(parse_model_spec(cfg.target_model))
    draft = load_model(parse_model_spec(cfg.draft_model)) if cfg.draft_model else None
    if draft is not None:
        check_pair_compatible(draft, target)
    return SpeculativeEngine(target, draft)


class Router:
    """Ingress of the SpecDec service.

    Args:
        cfg: the application config.
        engine: an engine to use (tests inject one); built from ``cfg`` when None.
        target: handle of the Target deployment (not used by the skeleton's generation path yet).
    """

    def __init__(self, cfg: AppConfig, engine: Any = None, target: Any = None):
        self.cfg = cfg
        self.target = target
        self.engine = engine if engine is not None else build_engine(cfg)

    def _request(self, request: pb.GenerateRequest):
        req = convert.request_from_proto(request)
        if self.engine is None:
            raise ModelNotReadyError("the models are not loaded yet; retry shortly")
        return req

    def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        """Unary generation."""
        try:
            result = self.engine.generate(self._request(request))
            return convert.result_to_proto(result)
        except Exception as e:  # mapped at the edge, never raised into Serve
            return abort_with(grpc_context, e, pb.GenerateResponse)

    def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None) -> Iterator[pb.GenerateStreamChunk]:
        """Server-streaming generation; the last chunk carries finish reason, usage and stats."""
        try:
            gen = self.engine.start(self._request(request))
        except Exception as e:
            abort_stream(grpc_context, e)
        try:
            t0 = time.perf_counter()
            for chunk in gen:
                if chunk.finish_reason is None:
                    yield convert.chunk_to_proto(chunk)
                else:
                    res = gen.result()
                    yield convert.chunk_to_proto(chunk, res.usage, res.stats, time.perf_counter() - t0)
        except Exception as e:
            gen.close()
            abort_stream(grpc_context, e)

    def GetTenantStats(self, request: pb.GetTenantStatsRequest, grpc_context=None) -> pb.GetTenantStatsResponse:
        """Tenant statistics (issue 4); until tenants exist: PERMISSION_DENIED with a clear message."""
        return abort_with(
            grpc_context, PermissionDeniedError("tenant statistics need a tenants file; none is configured"),
            pb.GetTenantStatsResponse,
        )
