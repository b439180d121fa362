"""Bytes that are not a GenerateRequest become INVALID_ARGUMENT, not grpcio's UNKNOWN.

The end-to-end check through Serve's proxy is ``test_undecodable_bytes_are_invalid_argument`` in
``test_serve_grpc.py``; here the pieces, without Ray.
"""

from __future__ import annotations

import grpc
import pytest

from deployments.grpc_status import status_for
from deployments.router import _refuse_undecodable
from deployments.servicer import UndecodableRequest, lenient_deserializer
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.errors import InvalidRequestError

#: a prompt field (1, length-delimited) claiming 5 bytes but carrying 2
TRUNCATED = b"\x0a\x05ab"
#: a prompt field whose bytes are not UTF-8
NOT_UTF8 = b"\x0a\x02\xff\xfe"


@pytest.mark.parametrize("raw", [TRUNCATED, NOT_UTF8], ids=["truncated", "not-utf8"])
def test_undecodable_bytes_are_refused_as_invalid_argument(raw):
    with pytest.raises(Exception):
        pb.GenerateRequest.FromString(raw)  # what grpcio's own deserializer does (-> UNKNOWN)
    req = lenient_deserializer(pb.GenerateRequest)(raw)
    assert isinstance(req, UndecodableRequest)
    assert (req.message_type, req.size) == ("specdec.v1.GenerateRequest", len(raw))
    with pytest.raises(InvalidRequestError) as e:
        _refuse_undecodable(req)
    assert str(e.value).startswith(f"the request is not a valid specdec.v1.GenerateRequest ({len(raw)} bytes): ")
    assert status_for(e.value) is grpc.StatusCode.INVALID_ARGUMENT


def test_valid_bytes_decode_as_before():
    msg = pb.GenerateRequest(prompt="def f():", max_tokens=3)
    assert lenient_deserializer(pb.GenerateRequest)(msg.SerializeToString()) == msg
    _refuse_undecodable(msg)  # a real request passes


def test_plain_grpc_server_with_the_servicer_function():
    """The servicer function on a plain grpcio server: garbage reaches the method, not grpcio's
    error path (Serve's proxy keeps the deserializer the same way)."""
    from concurrent import futures

    from deployments.servicer import add_specdec_servicer

    seen = []

    class Servicer:
        def Generate(self, request, context):
            seen.append(request)
            try:
                _refuse_undecodable(request)
            except InvalidRequestError as e:
                context.abort(status_for(e), str(e))
            return pb.GenerateResponse(text="ok")

        GenerateStream = GetTenantStats = None

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_specdec_servicer(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            raw = ch.unary_unary("/specdec.v1.SpecDec/Generate")
            with pytest.raises(grpc.RpcError) as e:
                raw(TRUNCATED, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("the request is not a valid specdec.v1.GenerateRequest (4 bytes)")
            ok = ch.unary_unary("/specdec.v1.SpecDec/Generate", response_deserializer=pb.GenerateResponse.FromString)
            assert ok(pb.GenerateRequest(prompt="x").SerializeToString(), timeout=10).text == "ok"
    finally:
        server.stop(None)
    assert isinstance(seen[0], UndecodableRequest) and seen[1].prompt == "x"
