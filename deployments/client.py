"""A small Python client of the SpecDec gRPC service.

    from deployments.client import SpecDecClient
    with SpecDecClient("localhost:9000") as c:
        r = c.generate(messages=[{"role": "user", "content": "Write a prime check in Python."}], max_tokens=64)
        print(r.text, r.stats.acceptance_rate)
        for piece in c.stream(prompt="def add(a, b):", max_tokens=32):
            print(piece.text, end="")

Results are the core's types (:class:`specdec.types.GenerationResult` /
:class:`~specdec.types.GenerationChunk`), so code written against the in-process engine reads a
served result the same way; the served-only wire numbers (bytes per step, round trip) are in
``result.wire``. gRPC errors become :class:`SpecDecError` subclasses named after the status code
(``InvalidArgument``, ``Unauthenticated``, ``ResourceExhausted``, ``DeadlineExceeded``,
``Cancelled``, ``Unavailable``, ...) carrying ``code`` and the server's ``details``. A ``timeout``
is sent both as the gRPC deadline and as ``specdec-timeout-s`` metadata, so the server stops the
generation at the deadline too (Serve's proxy does not pass the gRPC deadline on).
"""

from __future__ import annotations

import re
import secrets
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import grpc

from deployments import convert
from deployments.metadata import TIMEOUT_KEY  # the deadline's metadata key (no Ray import)
from protos.specdec.v1 import specdec_pb2 as pb
from protos.specdec.v1 import specdec_pb2_grpc as pb_grpc
from specdec.types import GenerationChunk, GenerationResult


class SpecDecError(Exception):
    """A failed call. Attributes: ``code`` (status code name, e.g. ``"INVALID_ARGUMENT"``), ``details``."""

    def __init__(self, code: str, details: str, retry_after_s: float | None = None):
        self.code = code
        self.details = details
        self.retry_after_s = retry_after_s
        super().__init__(f"{code}: {details}")


class InvalidArgument(SpecDecError): ...
class Unauthenticated(SpecDecError): ...
class PermissionDenied(SpecDecError): ...
class ResourceExhausted(SpecDecError): ...
class DeadlineExceeded(SpecDecError): ...
class Cancelled(SpecDecError): ...
class Unavailable(SpecDecError): ...
class NotFound(SpecDecError): ...


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.NOT_FOUND: NotFound,
}


#: how the server states when to retry in a RESOURCE_EXHAUSTED message (read when a reply lacks
#: the ``retry-after-s`` trailer: a server before 2026-12-03 failed to set it, a list was due)
_RETRY_IN_TEXT = re.compile(r"retry after ([0-9]+(?:\.[0-9]+)?) s")


def map_error(e: grpc.RpcError) -> SpecDecError:
    """A grpc.RpcError as the matching :class:`SpecDecError` subclass.

    ``retry_after_s`` comes from the ``retry-after-s`` trailer, else from the message text.
    """
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    retry = None
    for k, v in (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ():
        if k == "retry-after-s":
            try:
                retry = float(v)
            except ValueError:
                pass
    cls = _BY_CODE.get(code, SpecDecError)
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    if retry is None and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        m = _RETRY_IN_TEXT.search(details)
        retry = float(m.group(1)) if m else None
    return cls(code.name if code is not None else "UNKNOWN", details, retry)


@dataclass
class WireStats:
    """Served-only numbers of one generation (0 when unknown)."""

    bytes_per_step: float = 0.0
    round_trip_s: float = 0.0
    target_compute_s: float = 0.0


@dataclass
class ServedResult:
    """A served generation: the core result plus the wire numbers and the client's wall time."""

    result: GenerationResult
    wire: WireStats = field(default_factory=WireStats)
    wall_s: float = 0.0

    def __getattr__(self, name):  # reads like a GenerationResult
        return getattr(self.result, name)


def _max_k(max_k, k, stacklevel: int = 3):
    """``max_k``, or the value of its deprecated alias ``k`` (with a DeprecationWarning pointing
    ``stacklevel`` frames up: the caller of :func:`build_request` or of ``SpecDecClient.generate``).

    Raises:
        InvalidArgument: both given, with different values.
    """
    if k is None:
        return max_k
    warnings.warn("k= is deprecated: use max_k= (the request field speculation.max_k)", DeprecationWarning,
                  stacklevel=stacklevel)
    if max_k is not None and max_k != k:
        raise InvalidArgument("INVALID_ARGUMENT", f"give max_k or its deprecated alias k, not two different values "
                                                  f"(max_k={max_k!r}, k={k!r})")
    return k


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[dict] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    max_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    logprobs: bool = False,
    proposer: str | None = None,
    max_k: int | None = None,
    draft_min_confidence: float | None = None,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int = 0,
    top_logprobs: int = 0,
    cache_salt: str | None = None,
    k: int | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest proto from keyword arguments (unset ones are left to the server).

    ``max_k``: the largest K per speculation step (the proto's ``speculation.max_k``, the OpenAI
    API's ``speculation.max_k``); ``k`` is its deprecated old name (a ``DeprecationWarning``).

    ``cache_salt``: only requests with the same salt share cached prompt prefixes (the proto's
    ``cache_salt``); None: no salt.

    Raises:
        InvalidArgument: a value the wire format cannot carry (a negative or too large count,
            id or seed for its uint32 / uint64 field, a non-number), checked here rather than
            sent; narrower ranges are the server's to check.
    """
    max_k = _max_k(max_k, k)
    u32, u64 = 2**32 - 1, 2**64 - 1  # the proto fields' ranges (uint32, seed uint64)
    for name, value, top in (("max_tokens", max_tokens, u32), ("top_k", top_k, u32), ("max_k", max_k, u32),
                             ("seed", seed, u64), ("min_tokens", min_tokens, u32), ("top_logprobs", top_logprobs, u32)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top):
            raise InvalidArgument("INVALID_ARGUMENT", f"{name} must be a whole number in 0..{top}, got {value!r}")
    if any(not isinstance(t, int) or not 0 <= t <= u32 for t in list(stop_token_ids) + list(prompt_token_ids or ())):
        raise InvalidArgument("INVALID_ARGUMENT", f"token ids must be whole numbers in 0..{u32}")
    if any(not isinstance(t, int) or not 0 <= t <= u32 for t in (logit_bias or {})):
        raise InvalidArgument("INVALID_ARGUMENT", f"logit_bias keys must be token ids (whole numbers in 0..{u32})")
    for name, value in (("temperature", temperature), ("top_p", top_p), ("draft_min_confidence", draft_min_confidence),
                        ("min_p", min_p), ("repetition_penalty", repetition_penalty),
                        ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                        *(("logit_bias", v) for v in (logit_bias or {}).values())):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InvalidArgument("INVALID_ARGUMENT", f"{name} must be a number, got {value!r}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidArgument("INVALID_ARGUMENT", f"cache_salt must be a string, got {cache_salt!r}")
    msg = pb.GenerateRequest(stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                             logprobs=logprobs, min_tokens=min_tokens, top_logprobs=top_logprobs)
    if cache_salt is not None:
        msg.cache_salt = cache_salt
    if prompt is not None:
        msg.prompt = prompt
    elif messages is not None:
        msg.messages.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]))
    elif prompt_token_ids is not None:
        msg.prompt_token_ids.CopyFrom(pb.TokenIds(ids=list(prompt_token_ids)))
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    sampling = pb.SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p, presence_penalty=presence_penalty,
                                 frequency_penalty=frequency_penalty)
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    for tid, bias in (logit_bias or {}).items():
        sampling.logit_bias[tid] = bias
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    msg.sampling.CopyFrom(sampling)
    if proposer is not None or max_k is not None or draft_min_confidence is not None:
        hints = pb.SpeculationHints()
        if proposer is not None:
            hints.proposer = convert.PROPOSER_TO_PROTO[proposer]
        if max_k is not None:
            hints.max_k = max_k
        if draft_min_confidence is not None:
            hints.draft_min_confidence = draft_min_confidence
        msg.speculation.CopyFrom(hints)
    return msg


class SpecDecClient:
    """Client of one SpecDec server.

    Args:
        address: ``host:port`` of the gRPC endpoint (Serve's gRPC proxy, default port 9000).
        application: the Serve application name (gRPC ``application`` metadata).
        api_key: tenant API key, sent as ``authorization: Bearer <key>`` (tenants: issue 4).
        session_id: default session id (sticky routing) for every call; None: one per call.
    """

    def __init__(self, address: str, application: str = "specdec", api_key: str | None = None,
                 session_id: str | None = None, channel: grpc.Channel | None = None):
        self.address = address
        self.application = application
        self.api_key = api_key
        self.session_id = session_id
        self._channel = channel or grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        self._stub = pb_grpc.SpecDecStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "SpecDecClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def metadata(self, timeout: float | None = None, session_id: str | None = None) -> list[tuple[str, str]]:
        md = [("application", self.application)]
        if self.api_key:
            md.append(("authorization", f"Bearer {self.api_key}"))
        sid = session_id or self.session_id
        if sid:
            md.append(("session_id", sid))
        if timeout is not None and 0 < timeout < float("inf"):
            # full precision: 0.0004 s was sent as "0.000", which the server refuses (only more than
            # 0 is a deadline); 0 or negative is left to gRPC's own deadline, which fires at once
            md.append((TIMEOUT_KEY, repr(float(timeout))))
        return md

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the gRPC channel connects (not whether the models are loaded)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def generate_proto(self, request: pb.GenerateRequest, timeout: float | None = None,
                       session_id: str | None = None) -> pb.GenerateResponse:
        try:
            return self._stub.Generate(request, metadata=self.metadata(timeout, session_id), timeout=timeout)
        except grpc.RpcError as e:
            raise map_error(e) from None

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, session_id: str | None = None,
                 **kwargs) -> ServedResult:
        """One completion (unary). Keyword arguments as :func:`build_request`.

        Raises:
            SpecDecError: a subclass per status code.
        """
        import time

        t0 = time.perf_counter()
        if "k" in kwargs:  # the deprecated alias, warned about at the caller's line
            kwargs["max_k"] = _max_k(kwargs.get("max_k"), kwargs.pop("k"), stacklevel=3)
        resp = self.generate_proto(build_request(prompt, **kwargs), timeout, session_id)
        return ServedResult(
            convert.result_from_proto(resp, want_logprobs=kwargs.get("logprobs", False)),
            WireStats(resp.stats.wire_bytes_per_step, resp.stats.round_trip_s, resp.stats.target_compute_s),
            time.perf_counter() - t0,
        )

    def stream_proto(self, request: pb.GenerateRequest, timeout: float | None = None,
                     session_id: str | None = None) -> Iterator[pb.GenerateStreamChunk]:
        call = self._stub.GenerateStream(request, metadata=self.metadata(timeout, session_id), timeout=timeout)
        try:
            yield from call
        except grpc.RpcError as e:
            raise map_error(e) from None
        finally:
            call.cancel()  # no-op once finished; stops the generation if the caller stopped reading

    def stream(self, prompt: str | None = None, *, timeout: float | None = None, session_id: str | None = None,
               **kwargs) -> Iterator[GenerationChunk]:
        """Stream one completion (keyword arguments as :func:`build_request`). Closing the iterator
        early cancels the generation on the server."""
        if "k" in kwargs:  # the deprecated alias, warned about where the caller iterates
            kwargs["max_k"] = _max_k(kwargs.get("max_k"), kwargs.pop("k"), stacklevel=3)
        for c in self.stream_proto(build_request(prompt, **kwargs), timeout, session_id):
            fr = convert.FINISH_REASON_FROM_PROTO.get(c.finish_reason)
            yield GenerationChunk(c.text, list(c.token_ids), list(c.logprobs) if c.logprobs else None, fr)

    def tenant_stats(self, proposer: str | None = None, timeout: float | None = 30.0) -> pb.GetTenantStatsResponse:
        """The caller's tenant statistics (needs an API key on a server with tenants)."""
        req = pb.GetTenantStatsRequest()
        if proposer is not None:
            req.proposer = convert.PROPOSER_TO_PROTO[proposer]
        try:
            return self._stub.GetTenantStats(req, metadata=self.metadata(None), timeout=timeout)
        except grpc.RpcError as e:
            raise map_error(e) from None


def new_session_id() -> str:
    """A random session id for multi-turn sticky routing."""
    return secrets.token_hex(8)
