"""Bytes that are not a GenerateRequest become INVALID_ARGUMENT, not grpcio's UNKNOWN.

The end-to-end check through Serve's proxy is ``test_undecodable_bytes_are_invalid_argument`` in
``test_serve_grpc.py``; here the pieces, without Ray.
"""

from __future__ import annotations

import grpc
import pytest

from deployments.grpc_status import status_for
from deployments.ingress.checks import refuse_undecodable as _refuse_undecodable
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


@pytest.mark.parametrize("servicer_function, code", [
    ("protos.specdec.v1.specdec_pb2_grpc.add_SpecDecServicer_to_server", grpc.StatusCode.UNKNOWN),  # before
    ("deployments.servicer.add_specdec_servicer", grpc.StatusCode.INVALID_ARGUMENT),  # ours
], ids=["generated", "ours"])
def test_grpc_aio_server_with_the_servicer_function(servicer_function, code):
    """A servicer function on a plain ``grpc.aio`` server (the server class Serve's proxy is built
    on): with the generated one grpcio fails the parse itself and answers UNKNOWN before the
    method runs; with ours the garbage reaches the method, which refuses it with
    INVALID_ARGUMENT. Serve's proxy keeps the registered deserializer the same way
    (``test_undecodable_bytes_are_invalid_argument`` in test_serve_grpc.py goes through it)."""
    import asyncio
    import importlib

    module, name = servicer_function.rsplit(".", 1)
    add = getattr(importlib.import_module(module), name)
    seen = []

    class Servicer:
        async def Generate(self, request, context):
            seen.append(request)
            try:
                _refuse_undecodable(request)
            except InvalidRequestError as e:
                await context.abort(status_for(e), str(e))
            return pb.GenerateResponse(text="ok")

        GenerateStream = GetTenantStats = None

    async def main():
        server = grpc.aio.server()
        add(Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                raw = ch.unary_unary("/specdec.v1.SpecDec/Generate")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await raw(TRUNCATED, timeout=10)
                ok = ch.unary_unary("/specdec.v1.SpecDec/Generate", response_deserializer=pb.GenerateResponse.FromString)
                assert (await ok(pb.GenerateRequest(prompt="x").SerializeToString(), timeout=10)).text == "ok"
                return e.value
        finally:
            await server.stop(None)

    err = asyncio.run(main())
    assert err.code() == code, err.details()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert err.details().startswith("the request is not a valid specdec.v1.GenerateRequest (4 bytes)")
        assert isinstance(seen[0], UndecodableRequest) and seen[1].prompt == "x"
    else:
        assert [r.prompt for r in seen] == ["x"]  # the garbage never reached the method
