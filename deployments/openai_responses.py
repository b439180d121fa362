"""Core results -> OpenAI's JSON shapes, and errors in OpenAI's shape: the response half of the
HTTP API (:mod:`deployments.openai_api` serves it; :mod:`deployments.openai_requests` translates
the bodies).

Responses follow OpenAI's shapes: ``finish_reason`` ``stop`` (EOS, a stop token, a stop string)
or ``length`` (``max_tokens``, the context limit; the exact reason is in the extra
``choices[i].finish_detail``), ``usage`` (the prompt counted once), ``logprobs`` in each
endpoint's own shape (the target's own log-probabilities at temperature 1). Every response
carries the speculation stats in the extra field ``speculation_stats`` (per choice, and pooled
over the choices at the top level of a unary response and of the streamed usage chunk).

A streamed response is framed as server-sent events (:func:`sse`, :data:`SSE_DONE`), one
:func:`stream_chunk` per relayed chunk.

Errors use OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}`` with the
status of :data:`HTTP_STATUS_BY_GRPC` (one table, from the gRPC code of
:mod:`deployments.grpc_status`): 400 bad request, 401 missing/unknown key, 404 unknown model or
path, 405 wrong method, 429 over a tenant limit (with ``Retry-After`` in whole seconds), 503
while the models load (``Retry-After: 1``), 504 deadline passed, 500 anything unexpected.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import grpc

from deployments.grpc_status import details_for, status_for
from deployments.openai_requests import OpenAIRequest
from protos.specdec.v1 import specdec_pb2 as pb

#: gRPC status -> HTTP status, the one mapping of the HTTP API.
HTTP_STATUS_BY_GRPC: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.INTERNAL: 500,
}
#: HTTP status -> OpenAI's error ``type``.
ERROR_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}

_FINISH = {
    pb.FINISH_REASON_EOS: ("stop", "eos"),
    pb.FINISH_REASON_STOP_TOKEN: ("stop", "stop_token"),
    pb.FINISH_REASON_STOP_STRING: ("stop", "stop_string"),
    pb.FINISH_REASON_MAX_TOKENS: ("length", "max_tokens"),
    pb.FINISH_REASON_CONTEXT_LENGTH: ("length", "context_length"),
    pb.FINISH_REASON_CANCELLED: ("stop", "cancelled"),
}


# --- errors --------------------------------------------------------------------------------------


def http_status_for(exc: BaseException) -> int:
    """HTTP status of ``exc`` (via its gRPC code: one error table for both APIs)."""
    return HTTP_STATUS_BY_GRPC.get(status_for(exc), 500)


def error_code(exc: BaseException) -> str | None:
    """OpenAI's ``code`` of ``exc``: ``context_length_exceeded`` for a prompt that leaves no room
    (OpenAI's own code), the tenant limit's name for a tenant limit (``tokens_per_minute``, ...),
    else None. Always a string or None, as OpenAI's clients expect."""
    from specdec.errors import PromptTooLongError

    if isinstance(exc, PromptTooLongError):
        return "context_length_exceeded"
    limit = getattr(exc, "limit", None)
    return limit if isinstance(limit, str) else None


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "error"), "param": param, "code": code}}


def error_response(exc: BaseException):
    """A JSONResponse in OpenAI's error shape, with ``Retry-After`` on 429 and 503."""
    from fastapi.responses import JSONResponse

    status = http_status_for(exc)
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if status == 429 and retry is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry)))
    elif status == 503:
        headers["Retry-After"] = "1"
    return JSONResponse(error_body(status, details_for(exc), error_code(exc)), status_code=status, headers=headers)


# --- responses -----------------------------------------------------------------------------------


def stats_dict(stats: pb.SpeculationStats, elapsed_s: float | None = None) -> dict:
    """The speculation stats of one generation as JSON (the extra field ``speculation_stats``)."""
    from deployments import convert

    out = convert.stats_from_proto(stats).as_dict()
    out["wire_bytes_per_step"] = stats.wire_bytes_per_step
    out["round_trip_s"] = stats.round_trip_s
    out["target_compute_s"] = stats.target_compute_s
    if elapsed_s is not None:
        out["elapsed_s"] = elapsed_s
    return out


def pooled_stats(all_stats: Sequence[pb.SpeculationStats]) -> dict:
    """The counters of several generations pooled (ratios derived from the sums)."""
    from deployments import convert
    from specdec.types import SpeculationStats

    pooled = SpeculationStats()
    for s in all_stats:
        one = convert.stats_from_proto(s)
        pooled.steps += one.steps
        pooled.proposed += one.proposed
        pooled.accepted += one.accepted
        pooled.rejected_steps += one.rejected_steps
        for name in ("accepted_per_position", "proposed_per_position"):
            acc, add = getattr(pooled, name), getattr(one, name)
            acc.extend([0] * (len(add) - len(acc)))
            for j, v in enumerate(add):
                acc[j] += v
        for k, v in one.k_counts.items():
            pooled.k_counts[k] = pooled.k_counts.get(k, 0) + v
        pooled.draft_time_s += one.draft_time_s
        pooled.verify_time_s += one.verify_time_s
    return pooled.as_dict()


class TokenText:
    """Token ids -> the text pieces and bytes OpenAI's logprobs show (the tokenizer's decode of
    each id alone)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        t = self._cache.get(token_id)
        if t is None:
            t = self.tokenizer.decode([int(token_id)])
            self._cache[token_id] = t
        return t


def completion_logprobs(ids: Sequence[int], logprobs: Sequence[float], text: TokenText, offset: int = 0,
                        top: Sequence[pb.TopLogprobs] = (), top_n: int = 0) -> dict:
    """Completions' ``logprobs`` object: tokens, token_logprobs, top_logprobs (per position a
    dict token text -> logprob, or None when N = ``top_n`` = 0; ids that decode to the same text
    share one key, with the most likely one's logprob), text_offset. With N > 0 ``top_logprobs``
    is a list also when ``ids`` is empty (a streamed chunk, an answer cut by a stop string)."""
    tokens = [text(t) for t in ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    tops = None
    if top or top_n:  # several ids may decode to the same text: the most likely one's logprob is kept
        tops = []
        for m in top:
            d: dict[str, float] = {}
            for i, v in zip(m.ids, m.logprobs):
                d.setdefault(text(i), float(v))
            tops.append(d)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in logprobs], "top_logprobs": tops,
            "text_offset": offsets}


def _token_entry(text: TokenText, token_id: int, logprob: float) -> dict:
    s = text(token_id)
    return {"token": s, "logprob": float(logprob), "bytes": list(s.encode("utf-8"))}


def chat_logprobs(ids: Sequence[int], logprobs: Sequence[float], text: TokenText,
                  top: Sequence[pb.TopLogprobs] = ()) -> dict:
    """Chat's ``logprobs`` object: ``content`` = one entry per token, each with its
    ``top_logprobs`` alternatives (most likely first)."""
    content = []
    for j, (t, lp) in enumerate(zip(ids, logprobs)):
        entry = _token_entry(text, t, lp)
        alts = top[j] if j < len(top) else None
        entry["top_logprobs"] = [_token_entry(text, i, v) for i, v in zip(alts.ids, alts.logprobs)] if alts else []
        content.append(entry)
    return {"content": content}


def _logprobs(req: OpenAIRequest, ids: Sequence[int], logprobs: Sequence[float], text: TokenText,
              top: Sequence[pb.TopLogprobs], offset: int = 0) -> dict | None:
    """A choice's ``logprobs`` in the shape of ``req``'s endpoint; None when not asked for.
    ``offset``: completions' ``text_offset`` of the first token (characters before it)."""
    if req.top_logprobs is None:
        return None
    if req.endpoint == "completions":
        return completion_logprobs(ids, logprobs, text, offset, top, req.top_logprobs)
    return chat_logprobs(ids, logprobs, text, top)


def usage_dict(finals: Sequence[pb.GenerateResponse | pb.GenerateStreamChunk]) -> dict:
    prompt = int(finals[0].usage.prompt_tokens) if finals else 0
    completion = sum(int(f.usage.completion_tokens) for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def unary_response(req: OpenAIRequest, results: Sequence[pb.GenerateResponse], text: TokenText) -> dict:
    """The whole (non-streamed) response of ``req`` from its choices' joined results."""
    choices = []
    for i, r in enumerate(results):
        reason, detail = _FINISH.get(r.finish_reason, ("stop", "unknown"))
        choice: dict = {"index": i}
        lp = _logprobs(req, r.token_ids, r.logprobs, text, r.top_logprobs)
        if req.endpoint == "completions":
            choice["text"] = r.text
        else:
            choice["message"] = {"role": "assistant", "content": r.text}
        choice.update({"logprobs": lp, "finish_reason": reason, "finish_detail": detail,
                       "token_ids": list(r.token_ids), "speculation_stats": stats_dict(r.stats, r.elapsed_s)})
        choices.append(choice)
    return {
        **_envelope(req, "text_completion" if req.endpoint == "completions" else "chat.completion", choices),
        "usage": usage_dict(results),
        "speculation_stats": pooled_stats([r.stats for r in results]),
    }


def _envelope(req: OpenAIRequest, obj: str, choices: list) -> dict:
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": choices}


def chunk_envelope(req: OpenAIRequest, choices: list) -> dict:
    """A streamed chunk of ``req`` around ``choices`` (id, object, created, model)."""
    return _envelope(req, "text_completion" if req.endpoint == "completions" else "chat.completion.chunk", choices)


def stream_chunk(req: OpenAIRequest, index: int, chunk: pb.GenerateStreamChunk, text: TokenText,
                 offset: int, first: bool) -> dict:
    """One SSE chunk of choice ``index`` from one relayed stream chunk."""
    last = chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    lp = _logprobs(req, chunk.token_ids, chunk.logprobs, text, chunk.top_logprobs, offset)
    choice: dict = {"index": index}
    if req.endpoint == "completions":
        choice["text"] = chunk.text
    else:
        delta: dict = {"content": chunk.text}
        if first:
            delta["role"] = "assistant"
        choice["delta"] = delta
    choice["logprobs"] = lp
    choice["finish_reason"] = _FINISH.get(chunk.finish_reason, ("stop", ""))[0] if last else None
    choice["token_ids"] = list(chunk.token_ids)
    if last:
        choice["finish_detail"] = _FINISH.get(chunk.finish_reason, ("stop", "unknown"))[1]
        choice["speculation_stats"] = stats_dict(chunk.stats, chunk.elapsed_s)
    return chunk_envelope(req, [choice])


def sse(data: Any) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
