"""Protos <-> specdec core types, in one place.

Every function here is a pure, total translation: no validation beyond what the target type
does itself (a :class:`~specdec.request.GenerationRequest` is validated by
:func:`specdec.request.parse_request`, which raises
:class:`~specdec.errors.InvalidRequestError`; a :class:`~specdec.types.DraftBlock` checks its
shapes). Unset optional proto fields are left out of the request dict so the core's defaults
apply.

Wire shapes (see ``protos/specdec/v1/exchange.proto``): token ids travel as ``repeated uint32``
(varints), the sparse proposal distribution q as ``[K*M]`` ids + ``[K*M]`` float32 probabilities
row-major, so a K=4, M=64 block is about 1.8 KB.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping, Sequence

from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.request import GenerationRequest, SamplingParams, parse_request
from specdec.types import (
    BatchShape,
    Checkpoint,
    DraftBlock,
    FinishReason,
    GenerationChunk,
    GenerationResult,
    SpeculationStats,
    Usage,
    VerifyResult,
)

if TYPE_CHECKING:  # torch and the logit processing only in the functions that build tensors: the
    # router and target replicas use this module and hold no model (tests/deployments/test_lean_imports.py)
    from specdec.engine.processors import LogitProcessing

# --- enums ---------------------------------------------------------------------------------

FINISH_REASON_TO_PROTO: dict[FinishReason, int] = {
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
    FinishReason.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
    FinishReason.MAX_TOKENS: pb.FINISH_REASON_MAX_TOKENS,
    FinishReason.CONTEXT_LENGTH: pb.FINISH_REASON_CONTEXT_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}
FINISH_REASON_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in FINISH_REASON_TO_PROTO.items()}

#: proto Proposer -> core proposer name; UNSPECIFIED is absent (the server chooses).
PROPOSER_FROM_PROTO: dict[int, str] = {
    pb.PROPOSER_DRAFT: "draft",
    pb.PROPOSER_NGRAM: "ngram",
    pb.PROPOSER_NONE: "none",
}
PROPOSER_TO_PROTO: dict[str, int] = {v: k for k, v in PROPOSER_FROM_PROTO.items()}


# --- public request / response --------------------------------------------------------------


def sampling_to_dict(msg: pb.SamplingParams) -> dict:
    """The fields of a SamplingParams proto that were set, as a dict for the core model."""
    out: dict = {"temperature": msg.temperature, "top_k": msg.top_k}
    if msg.HasField("top_p"):
        out["top_p"] = msg.top_p
    if msg.HasField("seed"):
        out["seed"] = msg.seed
    if msg.min_p:
        out["min_p"] = msg.min_p
    if msg.HasField("repetition_penalty"):
        out["repetition_penalty"] = msg.repetition_penalty
    if msg.presence_penalty:
        out["presence_penalty"] = msg.presence_penalty
    if msg.frequency_penalty:
        out["frequency_penalty"] = msg.frequency_penalty
    if msg.logit_bias:
        out["logit_bias"] = {int(k): float(v) for k, v in sorted(msg.logit_bias.items())}
    return out


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """SamplingParams proto -> core SamplingParams (pydantic validation applies)."""
    return SamplingParams.model_validate(sampling_to_dict(msg))


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Core SamplingParams -> proto (``seed`` left unset when None)."""
    msg = pb.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                            min_p=params.min_p, presence_penalty=params.presence_penalty,
                            frequency_penalty=params.frequency_penalty)
    if params.seed is not None:
        msg.seed = params.seed
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    for k, v in params.logit_bias.items():
        msg.logit_bias[int(k)] = float(v)
    return msg


def request_to_dict(req: pb.GenerateRequest) -> dict:
    """GenerateRequest proto -> the plain dict :func:`specdec.request.parse_request` validates."""
    data: dict = {}
    which = req.WhichOneof("input")
    if which == "prompt":
        data["prompt"] = req.prompt
    elif which == "messages":
        data["messages"] = [{"role": m.role, "content": m.content} for m in req.messages.messages]
    elif which == "prompt_token_ids":
        data["prompt_token_ids"] = list(req.prompt_token_ids.ids)
    if req.HasField("max_tokens"):
        data["max_tokens"] = req.max_tokens
    if req.HasField("sampling"):
        data["sampling"] = sampling_to_dict(req.sampling)
    if req.stop:
        data["stop"] = list(req.stop)
    if req.stop_token_ids:
        data["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos:
        data["ignore_eos"] = True
    if req.logprobs:
        data["logprobs"] = True
    if req.top_logprobs:
        data["top_logprobs"] = req.top_logprobs
    if req.HasField("cache_salt"):
        data["cache_salt"] = req.cache_salt
    if req.min_tokens:
        data["min_tokens"] = req.min_tokens
    if req.HasField("speculation"):
        spec: dict = {}
        if req.speculation.proposer != pb.PROPOSER_UNSPECIFIED:
            spec["proposer"] = PROPOSER_FROM_PROTO.get(req.speculation.proposer, f"unknown({req.speculation.proposer})")
        if req.speculation.HasField("max_k"):
            spec["k"] = req.speculation.max_k
        if req.speculation.HasField("draft_min_confidence"):
            spec["draft_min_confidence"] = req.speculation.draft_min_confidence
        if spec:
            data["speculation"] = spec
    return data


#: Core field paths whose gRPC name differs (for error messages naming what the caller sent).
PROTO_FIELD_NAMES: dict[str, str] = {"speculation.k": "speculation.max_k"}


def request_from_proto(req: pb.GenerateRequest) -> GenerationRequest:
    """GenerateRequest proto -> validated core request.

    Raises:
        InvalidRequestError: no or several inputs, empty prompt, parameters out of range; fields
            are named as in the proto (``speculation.max_k``, not the core's ``speculation.k``).
    """
    return parse_request(request_to_dict(req), PROTO_FIELD_NAMES)


def request_to_proto(req: GenerationRequest) -> pb.GenerateRequest:
    """Core request -> GenerateRequest proto (for the client library and tests)."""
    msg = pb.GenerateRequest(
        max_tokens=req.max_tokens,
        sampling=sampling_to_proto(req.sampling),
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
        min_tokens=req.min_tokens,
        speculation=pb.SpeculationHints(proposer=PROPOSER_TO_PROTO[req.speculation.proposer], max_k=req.speculation.k,
                                        draft_min_confidence=req.speculation.draft_min_confidence),
    )
    if req.cache_salt is not None:
        msg.cache_salt = req.cache_salt
    if req.prompt is not None:
        msg.prompt = req.prompt
    elif req.messages is not None:
        msg.messages.messages.extend(pb.ChatMessage(role=m.role, content=m.content) for m in req.messages)
    else:
        msg.prompt_token_ids.ids.extend(req.prompt_token_ids)
    return msg


def stats_to_proto(stats: SpeculationStats) -> pb.SpeculationStats:
    """Core stats -> proto; ratios that are None (no data) stay unset."""
    msg = pb.SpeculationStats(
        steps=stats.steps,
        proposed=stats.proposed,
        accepted=stats.accepted,
        rejected_steps=stats.rejected_steps,
        accepted_per_position=stats.accepted_per_position,
        proposed_per_position=stats.proposed_per_position,
        k_counts={int(k): int(v) for k, v in stats.k_counts.items()},
        draft_time_s=stats.draft_time_s,
        verify_time_s=stats.verify_time_s,
    )
    if stats.acceptance_rate is not None:
        msg.acceptance_rate = stats.acceptance_rate
    if stats.mean_accepted_length is not None:
        msg.mean_accepted_length = stats.mean_accepted_length
    return msg


def stats_from_proto(msg: pb.SpeculationStats) -> SpeculationStats:
    """Proto -> core stats (the ratios are derived again from the counts)."""
    return SpeculationStats(
        steps=msg.steps,
        proposed=msg.proposed,
        accepted=msg.accepted,
        rejected_steps=msg.rejected_steps,
        accepted_per_position=list(msg.accepted_per_position),
        proposed_per_position=list(msg.proposed_per_position),
        k_counts={int(k): int(v) for k, v in sorted(msg.k_counts.items())},
        draft_time_s=msg.draft_time_s,
        verify_time_s=msg.verify_time_s,
    )


def set_step_costs(msg: pb.SpeculationStats, costs: Mapping) -> None:
    """Write a :meth:`specdec.control.adaptive.StepCosts.as_dict` into ``msg`` (served stats only)."""
    del msg.verify_costs[:]
    for positions, (seconds, steps) in sorted((costs.get("verify_s_by_positions") or {}).items()):
        msg.verify_costs.add(positions=int(positions), steps=int(steps), seconds=float(seconds))
    msg.cost_draft_s = float(costs.get("draft_s") or 0.0)
    msg.cost_drafted = int(costs.get("drafted") or 0)


def step_costs_from_proto(msg: pb.SpeculationStats) -> dict | None:
    """The controller's ``costs`` mapping from served stats; None when they carry no step costs."""
    if not msg.verify_costs and not msg.cost_drafted:
        return None
    return {
        "verify_s_by_positions": {int(c.positions): [float(c.seconds), int(c.steps)] for c in msg.verify_costs},
        "draft_s": float(msg.cost_draft_s),
        "drafted": int(msg.cost_drafted),
    }


def usage_to_proto(usage: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)


def top_logprobs_to_proto(top: Sequence[Sequence[tuple[int, float]]] | None) -> list[pb.TopLogprobs]:
    """Per token ``[(id, logprob), ...]`` -> TopLogprobs messages (empty list for None)."""
    return [pb.TopLogprobs(ids=[int(i) for i, _ in row], logprobs=[float(v) for _, v in row]) for row in top or []]


def top_logprobs_from_proto(msgs) -> list[list[tuple[int, float]]]:
    """TopLogprobs messages -> per token ``[(id, logprob), ...]``."""
    return [list(zip((int(i) for i in m.ids), (float(v) for v in m.logprobs))) for m in msgs]


def checkpoint_trailer(cp: Checkpoint) -> xpb.DraftChunkTrailer:
    """A generation's checkpoint -> the trailer of the chunk streamed at it (its held tokens)."""
    sent = cp.sent_ids
    msg = xpb.DraftChunkTrailer(held_token_ids=cp.token_ids[sent:], steps=cp.steps)
    if cp.logprobs is not None:
        msg.held_logprobs.extend(cp.logprobs[sent:])
    if cp.top_logprobs is not None:
        msg.held_top_logprobs.extend(top_logprobs_to_proto(cp.top_logprobs[sent:]))
    return msg


def checkpoint_from_job(job: xpb.DraftJob, seed: int) -> Checkpoint | None:
    """The resume fields of a DraftJob -> the Checkpoint to continue from (None: a fresh job).

    The client holds ``resume_token_ids`` (their logprobs are placeholders: never sent again)
    and ``resume_text_chars`` characters; ``resume_held_*`` follow them in the history.
    """
    sent = [int(t) for t in job.resume_token_ids]
    held = [int(t) for t in job.resume_held_token_ids]
    if not sent and not held and not job.resume_text_chars and not job.resume_steps:
        return None
    logprobs = [0.0] * len(sent) + [float(v) for v in job.resume_held_logprobs]
    top = [[] for _ in sent] + top_logprobs_from_proto(job.resume_held_top_logprobs)
    return Checkpoint(
        token_ids=sent + held,
        logprobs=logprobs if len(logprobs) == len(sent) + len(held) else None,
        top_logprobs=top if len(top) == len(sent) + len(held) else None,
        steps=int(job.resume_steps),
        seed=seed,
        sent_ids=len(sent),
        sent_text_chars=int(job.resume_text_chars),
    )


def result_to_proto(result: GenerationResult) -> pb.GenerateResponse:
    """Finished core generation -> unary GenerateResponse."""
    return pb.GenerateResponse(
        text=result.text,
        token_ids=result.token_ids,
        logprobs=result.logprobs or [],
        finish_reason=FINISH_REASON_TO_PROTO[result.finish_reason],
        usage=usage_to_proto(result.usage),
        stats=stats_to_proto(result.stats),
        elapsed_s=result.elapsed_s,
        top_logprobs=top_logprobs_to_proto(result.top_logprobs),
    )


def result_from_proto(msg: pb.GenerateResponse, want_logprobs: bool = False) -> GenerationResult:
    """Unary GenerateResponse -> core GenerationResult (client side)."""
    return GenerationResult(
        text=msg.text,
        token_ids=list(msg.token_ids),
        finish_reason=FINISH_REASON_FROM_PROTO[msg.finish_reason],
        usage=Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens),
        stats=stats_from_proto(msg.stats),
        logprobs=list(msg.logprobs) if (want_logprobs or msg.logprobs) else None,
        elapsed_s=msg.elapsed_s,
        top_logprobs=top_logprobs_from_proto(msg.top_logprobs) if msg.top_logprobs else None,
    )


def chunk_to_proto(
    chunk: GenerationChunk,
    usage: Usage | None = None,
    stats: SpeculationStats | None = None,
    elapsed_s: float = 0.0,
) -> pb.GenerateStreamChunk:
    """Core chunk -> stream chunk; pass ``usage``/``stats``/``elapsed_s`` on the last chunk only."""
    msg = pb.GenerateStreamChunk(text=chunk.text, token_ids=chunk.token_ids, logprobs=chunk.logprobs or [],
                                 top_logprobs=top_logprobs_to_proto(chunk.top_logprobs))
    if chunk.finish_reason is not None:
        msg.finish_reason = FINISH_REASON_TO_PROTO[chunk.finish_reason]
        msg.elapsed_s = elapsed_s
    if usage is not None:
        msg.usage.CopyFrom(usage_to_proto(usage))
    if stats is not None:
        msg.stats.CopyFrom(stats_to_proto(stats))
    return msg


def join_chunks(chunks: Sequence[pb.GenerateStreamChunk]) -> pb.GenerateResponse:
    """Concatenate stream chunks into the GenerateResponse the unary call would return."""
    out = pb.GenerateResponse()
    for c in chunks:
        out.text += c.text
        out.token_ids.extend(c.token_ids)
        out.logprobs.extend(c.logprobs)
        out.top_logprobs.extend(c.top_logprobs)
        if c.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            out.finish_reason = c.finish_reason
            out.usage.CopyFrom(c.usage)
            out.stats.CopyFrom(c.stats)
            out.elapsed_s = c.elapsed_s
    return out


# --- draft <-> target exchange --------------------------------------------------------------


def session_open_to_proto(
    token_ids: Sequence[int], sampling: SamplingParams, seed: int, logprobs: bool,
    processing: LogitProcessing | None = None, top_logprobs: int = 0, prefix_scope: str = "",
) -> xpb.SessionOpen:
    """What the target needs to (re)open a session after ``token_ids`` (with the request's
    output-dependent processing, whose penalties and bias travel in ``sampling``, and its prefix
    cache scope)."""
    msg = xpb.SessionOpen(
        token_ids=token_ids, sampling=sampling_to_proto(sampling), seed=seed, logprobs=logprobs,
        top_logprobs=top_logprobs, prefix_scope=prefix_scope,
    )
    if processing is not None:
        msg.prompt_len = processing.prompt_len
        msg.min_tokens = processing.min_tokens
        msg.suppress_token_ids.extend(processing.suppress_ids)
    return msg


def session_open_options(msg: xpb.SessionOpen) -> dict:
    """The keyword options of ``TargetVerifier.open_session`` a SessionOpen carries beyond
    :func:`session_open_from_proto`'s four: ``processing``, ``top_logprobs`` and ``prefix_scope``."""
    from specdec.engine.processors import LogitProcessing

    s = sampling_from_proto(msg.sampling)
    processing = LogitProcessing(
        prompt_len=int(msg.prompt_len),
        logit_bias=dict(s.logit_bias),
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        min_tokens=int(msg.min_tokens),
        suppress_ids=tuple(int(t) for t in msg.suppress_token_ids),
    )
    return {"processing": processing if processing.active else None, "top_logprobs": int(msg.top_logprobs),
            "prefix_scope": msg.prefix_scope}


def session_open_from_proto(msg: xpb.SessionOpen) -> tuple[list[int], SamplingParams, int, bool]:
    """SessionOpen -> ``(token_ids, sampling, seed, logprobs)``, the target's open_session args."""
    return list(msg.token_ids), sampling_from_proto(msg.sampling), int(msg.seed), bool(msg.logprobs)


def draft_block_to_proto(
    block: DraftBlock, session_id: str, position: int, open: xpb.SessionOpen | None = None
) -> xpb.CandidateBlock:
    """DraftBlock -> CandidateBlock following a committed sequence of ``position`` tokens.

    Args:
        block: K drafts and q (``q_ids``/``q_probs`` ``[K, M]``, or None for a deterministic q).
        session_id: the session key.
        position: committed sequence length the block follows, in tokens.
        open: set on a session's first step and when rebuilding the target session.
    """
    msg = xpb.CandidateBlock(session_id=session_id, position=position, token_ids=block.token_ids.tolist())
    if block.q_ids is not None:
        import torch

        m = int(block.q_ids.shape[1])
        msg.q.width = m
        msg.q.ids.extend(block.q_ids.reshape(-1).tolist())
        msg.q.probs.extend(block.q_probs.to(torch.float32).reshape(-1).tolist())
    if open is not None:
        msg.open.CopyFrom(open)
    return msg


def draft_block_from_proto(msg: xpb.CandidateBlock) -> DraftBlock:
    """CandidateBlock -> DraftBlock (``[K]`` int64 ids, ``[K, M]`` int64/float32 q or None).

    Raises:
        ValueError: q's size is not K * width.
    """
    import torch

    token_ids = torch.tensor(list(msg.token_ids), dtype=torch.long, device="cpu")  # [K], on the CPU
    if not msg.HasField("q"):
        return DraftBlock(token_ids=token_ids)
    k, m = len(msg.token_ids), msg.q.width
    if m == 0 or len(msg.q.ids) != k * m or len(msg.q.probs) != k * m:
        raise ValueError(
            f"q must hold K*M = {k}*{m} ids and probs, got {len(msg.q.ids)} and {len(msg.q.probs)}"
        )
    q_ids = torch.tensor(list(msg.q.ids), dtype=torch.long, device="cpu").reshape(k, m)  # [K, M]
    q_probs = torch.tensor(list(msg.q.probs), dtype=torch.float32, device="cpu").reshape(k, m)  # [K, M]
    return DraftBlock(token_ids=token_ids, q_ids=q_ids, q_probs=q_probs)


def verify_result_to_proto(result: VerifyResult, target_time_s: float = 0.0,
                           batch: "BatchShape | None" = None) -> xpb.VerificationResult:
    """VerifyResult -> VerificationResult with status OK (``batch``: the forward that answered it)."""
    msg = xpb.VerificationResult(
        status=xpb.VERIFY_STATUS_OK,
        accepted=result.accepted,
        token_ids=result.token_ids,
        logprobs=result.logprobs or [],
        committed_len=result.committed_len,
        target_time_s=target_time_s,
        top_logprobs=top_logprobs_to_proto(result.top_logprobs),
    )
    if batch is not None:
        msg.batch_forward, msg.batch_rows = batch.forward, batch.rows
        msg.batch_positions, msg.batch_forward_s = batch.positions, batch.seconds
        if batch.context is not None:
            msg.batch_context = batch.context
    return msg


def verify_result_from_proto(msg: xpb.VerificationResult, want_logprobs: bool) -> VerifyResult:
    """VerificationResult (status OK) -> VerifyResult.

    Raises:
        ValueError: the status is not OK (the caller handles SESSION_MISSING/POSITION_MISMATCH
            before converting).
    """
    if msg.status != xpb.VERIFY_STATUS_OK:
        raise ValueError(f"cannot convert a {xpb.VerifyStatus.Name(msg.status)} reply to a VerifyResult")
    return VerifyResult(
        accepted=msg.accepted,
        token_ids=list(msg.token_ids),
        logprobs=list(msg.logprobs) if want_logprobs else None,
        committed_len=msg.committed_len,
        top_logprobs=top_logprobs_from_proto(msg.top_logprobs) if msg.top_logprobs else None,
        batch=BatchShape(int(msg.batch_forward), int(msg.batch_rows), int(msg.batch_positions),
                         float(msg.batch_forward_s),
                         float(msg.batch_context) if msg.HasField("batch_context")
                         and math.isfinite(msg.batch_context) and msg.batch_context >= 0 else None)
        if msg.batch_rows else None,
    )
