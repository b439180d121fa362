"""The SpecDec servicer function for Ray Serve's gRPC proxy, with requests that always decode.

Serve's proxy (``ray.serve._private.grpc_util.gRPCGenericServer``, Ray 2.60) keeps the
``request_deserializer`` of the handlers a servicer function registers and replaces only the
behaviour, so with the generated ``add_SpecDecServicer_to_server`` grpcio itself parses the
request bytes in the proxy; bytes that are not a valid ``GenerateRequest`` (a truncated message,
a ``prompt`` that is not UTF-8) raise inside grpcio, which answers UNKNOWN ("Unexpected error")
before any of our code runs.

:func:`add_specdec_servicer` registers the same three methods with a deserializer that never
raises: on a parse error it returns an :class:`UndecodableRequest`, which the proxy forwards to
the router like any request; the router refuses it with INVALID_ARGUMENT naming the message type
and the parse error (:func:`deployments.router.Router._parse`). Everything else is the generated
registration: same service name, method names, response serializers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from protos.specdec.v1 import specdec_pb2 as pb

SERVICE = "specdec.v1.SpecDec"


@dataclass(frozen=True)
class UndecodableRequest:
    """Stands in for a request whose bytes did not parse (picklable, so it reaches the replica).

    Attributes:
        message_type: full proto name the bytes should have been (``specdec.v1.GenerateRequest``).
        size: length of the bytes received.
        error: the parser's message.
    """

    message_type: str
    size: int
    error: str

    def describe(self) -> str:
        """The client-facing message."""
        return f"the request is not a valid {self.message_type} ({self.size} bytes): {self.error}"


def lenient_deserializer(message_cls) -> Callable[[bytes], object]:
    """``message_cls.FromString`` that returns an :class:`UndecodableRequest` instead of raising."""
    name = message_cls.DESCRIPTOR.full_name

    def deserialize(raw: bytes):
        try:
            return message_cls.FromString(raw)
        except (DecodeError, ValueError, TypeError) as e:
            return UndecodableRequest(name, len(raw), str(e) or type(e).__name__)

    return deserialize


def add_specdec_servicer(servicer, server) -> None:
    """Servicer function for ``grpc_options.grpc_servicer_functions`` (see the module docstring)."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate,
            request_deserializer=lenient_deserializer(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream,
            request_deserializer=lenient_deserializer(pb.GenerateRequest),
            response_serializer=pb.GenerateStreamChunk.SerializeToString,
        ),
        "GetTenantStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetTenantStats,
            request_deserializer=lenient_deserializer(pb.GetTenantStatsRequest),
            response_serializer=pb.GetTenantStatsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE, handlers)
