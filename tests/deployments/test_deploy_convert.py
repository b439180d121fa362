"""Protos <-> core types: round trips and request validation through parse_request."""

from __future__ import annotations

import grpc
import pytest
import torch

from deployments import convert
from deployments.grpc_status import STATUS_BY_ERROR, abort_with, status_for
from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from specdec import errors
from specdec.request import SamplingParams
from specdec.types import (
    DraftBlock,
    FinishReason,
    GenerationChunk,
    GenerationResult,
    SpeculationStats,
    Usage,
    VerifyResult,
)
from tests.deployments.grpc_context import RecordingContext


def test_minimal_prompt_request_gets_core_defaults():
    req = convert.request_from_proto(pb.GenerateRequest(prompt="def f():"))
    assert req.prompt == "def f():"
    assert req.max_tokens == 128 and req.sampling.greedy and req.sampling.top_p == 1.0
    assert req.speculation.proposer == "draft"


def test_full_request_maps_every_field():
    msg = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
        max_tokens=7,
        sampling=pb.SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=42),
        stop=["\n\n"],
        stop_token_ids=[2],
        ignore_eos=True,
        logprobs=True,
        speculation=pb.SpeculationHints(proposer=pb.PROPOSER_NGRAM, max_k=0, draft_min_confidence=0.4),
        cache_salt="tenant-a-user-17",
    )
    req = convert.request_from_proto(msg)
    assert req.cache_salt == "tenant-a-user-17"
    assert req.messages[0].content == "hi" and req.max_tokens == 7
    # doubles on the wire: exactly the values an in-process caller passes
    assert req.sampling.temperature == 0.7 and req.sampling.top_p == 0.9
    assert req.sampling.top_k == 20 and req.sampling.seed == 42
    assert req.stop == ["\n\n"] and req.stop_token_ids == [2] and req.ignore_eos and req.logprobs
    assert req.speculation.proposer == "ngram" and req.speculation.k == 0  # explicit 0 kept
    assert req.speculation.draft_min_confidence == 0.4
    back = convert.request_from_proto(convert.request_to_proto(req))
    assert back == req


def test_token_id_prompt_round_trips():
    msg = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]), max_tokens=3)
    assert convert.request_from_proto(msg).prompt_token_ids == [5, 6, 7]


@pytest.mark.parametrize(
    "msg, fragment",
    [
        (pb.GenerateRequest(), "exactly one of"),  # no input at all
        (pb.GenerateRequest(prompt=""), "prompt is empty"),  # oneof keeps an explicit ""
        (pb.GenerateRequest(prompt="x", max_tokens=0), "max_tokens"),  # explicit 0 is not "unset"
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_p=0.0)), "top_p"),
        (pb.GenerateRequest(prompt="x", speculation=pb.SpeculationHints(max_k=99)),
         "invalid request: speculation.max_k: Input should be less than or equal to 16"),
        (pb.GenerateRequest(prompt="x", speculation=pb.SpeculationHints(proposer=77)), "proposer"),
        (pb.GenerateRequest(prompt="x", stop=[""]), "stop strings"),
        (pb.GenerateRequest(prompt="x", speculation=pb.SpeculationHints(draft_min_confidence=1.5)),
         "draft_min_confidence"),
    ],
)
def test_bad_requests_raise_invalid_request(msg, fragment):
    with pytest.raises(errors.InvalidRequestError, match=fragment):
        convert.request_from_proto(msg)


def test_draft_block_with_sparse_q_round_trips_exactly():
    g = torch.Generator().manual_seed(0)
    q_probs = torch.rand(4, 64, generator=g).softmax(-1).to(torch.float32)  # [K, M]
    q_ids = torch.randint(0, 151_936, (4, 64), generator=g)  # [K, M]
    block = DraftBlock(token_ids=q_ids[:, 0].clone(), q_ids=q_ids, q_probs=q_probs)
    msg = convert.draft_block_to_proto(block, "s1", 12)
    wire = xpb.CandidateBlock.FromString(msg.SerializeToString())
    back = convert.draft_block_from_proto(wire)
    assert wire.session_id == "s1" and wire.position == 12 and not wire.HasField("open")
    assert torch.equal(back.token_ids, block.token_ids)
    assert torch.equal(back.q_ids, q_ids) and back.q_ids.dtype == torch.long
    assert torch.equal(back.q_probs, q_probs)  # float32 travels bit-exactly
    print(f"K=4 M=64 block: {len(msg.SerializeToString())} bytes")


def test_deterministic_and_empty_blocks():
    block = DraftBlock(token_ids=torch.tensor([3, 4]))
    back = convert.draft_block_from_proto(convert.draft_block_to_proto(block, "s", 5))
    assert back.q_ids is None and back.token_ids.tolist() == [3, 4]
    empty = convert.draft_block_from_proto(convert.draft_block_to_proto(DraftBlock.empty(), "s", 5))
    assert empty.k == 0 and empty.token_ids.dtype == torch.long


def test_malformed_q_is_rejected():
    msg = xpb.CandidateBlock(token_ids=[1, 2], q=xpb.SparseDistribution(width=3, ids=[1] * 5, probs=[0.2] * 5))
    with pytest.raises(ValueError, match="K\\*M"):
        convert.draft_block_from_proto(msg)


def test_session_open_round_trips():
    sampling = SamplingParams(temperature=0.8, top_k=5, seed=3)
    msg = convert.session_open_to_proto([1, 2, 3], sampling, seed=9, logprobs=True)
    block = convert.draft_block_to_proto(DraftBlock.empty(), "s", 3, open=msg)
    ids, s, seed, lp = convert.session_open_from_proto(xpb.CandidateBlock.FromString(block.SerializeToString()).open)
    assert (ids, s, seed, lp) == ([1, 2, 3], sampling, 9, True)


def test_session_open_carries_the_processing():
    from specdec.engine.processors import LogitProcessing

    sampling = SamplingParams(temperature=0.8, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5,
                              frequency_penalty=-0.25, logit_bias={5: 2.5, 17: -100.0})
    proc = LogitProcessing(prompt_len=3, logit_bias={5: 2.5, 17: -100.0}, repetition_penalty=1.3,
                           presence_penalty=0.5, frequency_penalty=-0.25, min_tokens=4, suppress_ids=(0, 9))
    msg = xpb.SessionOpen.FromString(convert.session_open_to_proto([1, 2, 3], sampling, 9, True, proc, 5).SerializeToString())
    assert convert.session_open_from_proto(msg)[1] == sampling
    assert convert.session_open_options(msg) == {"processing": proc, "top_logprobs": 5, "prefix_scope": ""}
    plain = convert.session_open_to_proto([1, 2, 3], SamplingParams(), 9, False)
    assert convert.session_open_options(plain) == {"processing": None, "top_logprobs": 0, "prefix_scope": ""}
    scoped = xpb.SessionOpen.FromString(convert.session_open_to_proto(
        [1, 2, 3], SamplingParams(), 9, False, prefix_scope="7ed4cc851bc1f3c8ace2487b56dfe52c").SerializeToString())
    assert convert.session_open_options(scoped)["prefix_scope"] == "7ed4cc851bc1f3c8ace2487b56dfe52c"


def test_request_round_trips_the_sampling_surface():
    from specdec.request import parse_request

    req = parse_request({"prompt": "x", "max_tokens": 9, "min_tokens": 3, "logprobs": True, "top_logprobs": 7,
                         "sampling": {"temperature": 0.5, "min_p": 0.2, "repetition_penalty": 1.1,
                                      "presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {"3": -1.5}}})
    assert convert.request_from_proto(convert.request_to_proto(req)) == req


def test_verify_result_round_trips():
    r = VerifyResult(accepted=2, token_ids=[7, 8, 9], logprobs=[-0.5, -1.25, -2.0], committed_len=40)
    msg = convert.verify_result_to_proto(r, target_time_s=0.01)
    assert convert.verify_result_from_proto(msg, want_logprobs=True) == r
    top = VerifyResult(accepted=0, token_ids=[7], logprobs=[-0.5], committed_len=4, top_logprobs=[[(7, -0.5), (3, -1.5)]])
    assert convert.verify_result_from_proto(convert.verify_result_to_proto(top), want_logprobs=True) == top
    assert convert.verify_result_from_proto(msg, want_logprobs=False).logprobs is None
    with pytest.raises(ValueError, match="SESSION_MISSING"):
        convert.verify_result_from_proto(xpb.VerificationResult(status=xpb.VERIFY_STATUS_SESSION_MISSING), False)


def test_the_batch_forward_of_a_verify_result_round_trips_with_and_without_its_context():
    """The target's batched forward (BatchShape) travels with each reply; its rows' mean context
    is optional on the wire (a target that does not report it: None, not 0)."""
    from specdec.types import BatchShape

    for shape in (BatchShape(7, 8, 40, 0.25, 131.5), BatchShape(7, 8, 40, 0.25)):
        r = VerifyResult(accepted=1, token_ids=[7, 8], logprobs=None, committed_len=40)
        msg = convert.verify_result_to_proto(r, target_time_s=0.3, batch=shape)
        assert msg.HasField("batch_context") is (shape.context is not None)
        assert convert.verify_result_from_proto(msg, False).batch == shape  # 0.25 and 131.5: exact in float32
    for bad in (float("nan"), float("inf"), -3.0):  # a context no target reports: unknown, never a price
        msg = convert.verify_result_to_proto(r, target_time_s=0.3, batch=BatchShape(7, 8, 40, 0.25))
        msg.batch_context = bad
        assert convert.verify_result_from_proto(msg, False).batch == BatchShape(7, 8, 40, 0.25, None)


def _stats() -> SpeculationStats:
    s = SpeculationStats()
    s.record_step(4, 4, 0.01, 0.02)
    s.record_step(4, 1, 0.01, 0.02)
    s.record_step(0, 0, 0.0, 0.02)
    return s


def test_stats_round_trip_and_none_ratios():
    s = _stats()
    msg = convert.stats_to_proto(s)
    assert msg.acceptance_rate == pytest.approx(5 / 8) and dict(msg.k_counts) == {4: 2, 0: 1}
    assert convert.stats_from_proto(msg).as_dict() == s.as_dict()
    empty = convert.stats_to_proto(SpeculationStats())
    assert not empty.HasField("acceptance_rate") and not empty.HasField("mean_accepted_length")


def test_chunks_join_to_the_unary_response():
    stats, usage = _stats(), Usage(prompt_tokens=3, completion_tokens=3)
    result = GenerationResult(
        text="abc", token_ids=[1, 2, 3], finish_reason=FinishReason.STOP_STRING, usage=usage, stats=stats, elapsed_s=0.5
    )
    chunks = [
        convert.chunk_to_proto(GenerationChunk(text="ab", token_ids=[1, 2])),
        convert.chunk_to_proto(
            GenerationChunk(text="c", token_ids=[3], finish_reason=FinishReason.STOP_STRING), usage, stats, 0.5
        ),
    ]
    assert chunks[0].finish_reason == pb.FINISH_REASON_UNSPECIFIED and not chunks[0].HasField("usage")
    assert convert.join_chunks(chunks) == convert.result_to_proto(result)
    assert convert.result_from_proto(convert.result_to_proto(result)).token_ids == [1, 2, 3]


def test_every_finish_reason_has_a_proto_value():
    assert set(convert.FINISH_REASON_TO_PROTO) == set(FinishReason)


# --- status table ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc, code",
    [
        (errors.InvalidRequestError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.PromptTooLongError(300, 256), grpc.StatusCode.INVALID_ARGUMENT),  # subclass
        (errors.AuthenticationError("no key"), grpc.StatusCode.UNAUTHENTICATED),
        (errors.PermissionDeniedError("not yours"), grpc.StatusCode.PERMISSION_DENIED),
        (errors.ResourceExhaustedError("slow down", "tokens_per_minute", 1.5), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.DeadlineExceededError("late"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (errors.GenerationCancelledError("bye"), grpc.StatusCode.CANCELLED),
        (errors.ModelNotReadyError("loading"), grpc.StatusCode.UNAVAILABLE),
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_table(exc, code):
    assert status_for(exc) is code


def test_abort_with_sets_code_details_and_returns_empty_response():
    ctx = RecordingContext()
    out = abort_with(ctx, errors.ResourceExhaustedError("tokens_per_minute exceeded", "tokens_per_minute", 2.0), pb.GenerateResponse)
    assert out == pb.GenerateResponse()
    assert ctx.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens_per_minute" in ctx.details
    assert ctx.trailing == (("retry-after-s", "2.000"),)  # set as a list (Ray Serve appends it to its own)


def test_internal_errors_do_not_leak_their_message():
    ctx = RecordingContext()
    assert abort_with(ctx, KeyError("secret-internal-state")) is None
    assert ctx.code is grpc.StatusCode.INTERNAL and "secret" not in ctx.details


def test_abort_without_context_reraises():
    with pytest.raises(errors.InvalidRequestError):
        abort_with(None, errors.InvalidRequestError("x"))


def test_every_core_error_is_mapped():
    import inspect

    core = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.SpecDecError)]
    unmapped = [c.__name__ for c in core if c is not errors.SpecDecError and status_for(c.__new__(c)) is grpc.StatusCode.INTERNAL]
    assert not unmapped, unmapped
    assert all(isinstance(v, grpc.StatusCode) for v in STATUS_BY_ERROR.values())


def test_abort_stream_sets_code_then_raises():
    from deployments.grpc_status import StreamAborted, abort_stream

    ctx = RecordingContext()
    with pytest.raises(StreamAborted):
        abort_stream(ctx, errors.InvalidRequestError("prompt is empty"))
    assert ctx.code is grpc.StatusCode.INVALID_ARGUMENT and ctx.details == "prompt is empty"


def test_client_error_mapping_reads_retry_after_from_the_message():
    """Ray Serve's proxy drops trailing metadata: the client finds the retry time in the text."""
    import grpc

    from deployments.client import InvalidArgument, ResourceExhausted, build_request, map_error

    class Err(grpc.RpcError):
        def __init__(self, code, details, trailer=()):
            self._c, self._d, self._t = code, details, trailer

        def code(self):
            return self._c

        def details(self):
            return self._d

        def trailing_metadata(self):
            return self._t

    msg = ("tenant 'small' is over its limit of 40 tokens per minute (limit tokens_per_minute): "
           "request needs 9, 4 available; retry after 7.5 s")
    e = map_error(Err(grpc.StatusCode.RESOURCE_EXHAUSTED, msg))
    assert isinstance(e, ResourceExhausted) and e.retry_after_s == 7.5 and e.details == msg
    assert map_error(Err(grpc.StatusCode.RESOURCE_EXHAUSTED, msg, (("retry-after-s", "3.25"),))).retry_after_s == 3.25
    assert map_error(Err(grpc.StatusCode.INVALID_ARGUMENT, "retry after 2 s")).retry_after_s is None
    for kwargs, text in [({"max_tokens": -1}, "max_tokens must be a whole number in 0..4294967295, got -1"),
                         ({"top_k": -3}, "top_k must be a whole number in 0..4294967295, got -3"),
                         ({"max_k": -1}, "max_k must be a whole number in 0..4294967295, got -1"),
                         ({"stop_token_ids": [-2]}, "token ids must be whole numbers in 0..4294967295"),
                         ({"draft_min_confidence": "high"}, "draft_min_confidence must be a number, got 'high'"),
                         # beyond the proto fields' ranges: was a ValueError traceback from protobuf
                         ({"seed": 2**64}, "seed must be a whole number in 0..18446744073709551615, got 18446744073709551616"),
                         ({"max_tokens": 2**32}, "max_tokens must be a whole number in 0..4294967295, got 4294967296"),
                         ({"prompt_token_ids": [2**32]}, "token ids must be whole numbers in 0..4294967295"),
                         ({"logit_bias": {2**32: 1.0}}, r"logit_bias keys must be token ids \(whole numbers in 0..4294967295\)")]:
        with pytest.raises(InvalidArgument, match=text):
            build_request(None if "prompt_token_ids" in kwargs else "x", **kwargs)
    assert build_request("x", seed=2**64 - 1).sampling.seed == 2**64 - 1


def test_client_takes_max_k_as_the_proto_names_it_and_k_with_a_deprecation_warning():
    """The proto field is ``speculation.max_k`` (so is the OpenAI API's); the client library's
    keyword was ``k``: ``max_k`` now, ``k`` still works with a DeprecationWarning pointing at the
    caller's line, and two different values are refused."""
    import warnings

    from deployments.client import InvalidArgument, SpecDecClient, build_request

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name warns about nothing
        assert build_request("x", max_k=3).speculation.max_k == 3
        assert not build_request("x").HasField("speculation")
    message = r"^k= is deprecated: use max_k= \(the request field speculation.max_k\)$"
    with pytest.warns(DeprecationWarning, match=message) as rec:
        assert build_request("x", k=3).speculation.max_k == 3
    assert [w.filename for w in rec] == [__file__]
    with pytest.warns(DeprecationWarning, match=message):
        assert build_request("x", k=2, max_k=2).speculation.max_k == 2
    with pytest.warns(DeprecationWarning, match=message), pytest.raises(InvalidArgument) as e:
        build_request("x", k=2, max_k=5)
    assert e.value.details == "give max_k or its deprecated alias k, not two different values (max_k=5, k=2)"

    class Stub:  # the gRPC stub: records the requests, answers a finished generation
        def __init__(self):
            self.sent = []

        def Generate(self, request, metadata=None, timeout=None):
            self.sent.append(request)
            return pb.GenerateResponse(token_ids=[7], finish_reason=pb.FINISH_REASON_MAX_TOKENS)

        def GenerateStream(self, request, metadata=None, timeout=None):
            self.sent.append(request)
            return FakeCall([pb.GenerateStreamChunk(token_ids=[7], finish_reason=pb.FINISH_REASON_MAX_TOKENS)])

    class FakeCall(list):
        def cancel(self):
            pass

    client = SpecDecClient("unused:1", channel=grpc.insecure_channel("unused:1"))
    client._stub = stub = Stub()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert client.generate("x", max_k=4).token_ids == [7]
        assert [c.token_ids for c in client.stream("x", max_k=1)] == [[7]]
    with pytest.warns(DeprecationWarning, match=message) as rec:
        assert client.generate("x", k=2).token_ids == [7]
        assert [c.token_ids for c in client.stream("x", k=0)] == [[7]]
    assert [w.filename for w in rec] == [__file__, __file__]
    assert [m.speculation.max_k for m in stub.sent] == [4, 1, 2, 0]
    client.close()
