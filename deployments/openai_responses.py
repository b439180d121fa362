"""Core results -> OpenAI's JSON shapes: the response half of the HTTP API
(:mod:`deployments.openai_api` serves it; :mod:`deployments.openai_requests` translates the
bodies; :mod:`deployments.openai_errors` shapes the errors).

Responses follow OpenAI's shapes: ``finish_reason`` ``stop`` (EOS, a stop token, a stop string)
or ``length`` (``max_tokens``, the context limit; the exact reason is in the extra
``choices[i].finish_detail``), ``usage`` (the prompt counted once), ``logprobs`` in each
endpoint's own shape (the target's own log-probabilities at temperature 1). Every response
carries the speculation stats in the extra field ``speculation_stats`` (per choice, and pooled
over the choices at the top level of a unary response and of the streamed usage chunk).

A streamed response is framed as server-sent events (:func:`sse`, :data:`SSE_DONE`), one
:func:`stream_chunk` per relayed chunk.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any, Sequence

from deployments.openai_errors import (  # noqa: F401 (re-exported: the error half used to live here)
    ERROR_TYPE,
    HTTP_STATUS_BY_GRPC,
    error_body,
    error_code,
    error_param,
    error_response,
    http_status_for,
)
from deployments.openai_requests import OpenAIRequest
from protos.specdec.v1 import specdec_pb2 as pb

_FINISH = {
    pb.FINISH_REASON_EOS: ("stop", "eos"),
    pb.FINISH_REASON_STOP_TOKEN: ("stop", "stop_token"),
    pb.FINISH_REASON_STOP_STRING: ("stop", "stop_string"),
    pb.FINISH_REASON_MAX_TOKENS: ("length", "max_tokens"),
    pb.FINISH_REASON_CONTEXT_LENGTH: ("length", "context_length"),
    pb.FINISH_REASON_CANCELLED: ("stop", "cancelled"),
}


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
    """Token ids -> the text pieces and bytes OpenAI's logprobs show.

    ``text(id)``: the tokenizer's decode of the id alone, special tokens included by name (as
    vLLM's ``convert_ids_list_to_tokens``: ``'<|im_end|>'``, so a client can see the end of
    the answer among the alternatives), though ``text`` itself skips them (vLLM's
    ``skip_special_tokens=True``).

    :meth:`bytes_of`: the token's own UTF-8 bytes, as OpenAI defines ``bytes`` (a character
    spelled by several tokens is the concatenation of their bytes; the decode of such a piece
    alone is U+FFFD, whose bytes would be ``[239, 191, 189]``). Read from the vocabulary entry
    for byte-level BPE (GPT-2's byte-to-character table) and SentencePiece byte-fallback pieces
    (``<0xE2>``), used only when those bytes decode to the token's own decode; otherwise the
    UTF-8 encoding of ``text(id)``.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._skipped: dict[int, bool] = {}
        self._byte_of_char: dict[str, int] | None = None

    def __call__(self, token_id: int) -> str:
        t = self._cache.get(token_id)
        if t is None:
            t = self.tokenizer.decode([int(token_id)])
            self._cache[token_id] = t
        return t

    def _raw_bytes(self, token_id: int) -> bytes | None:
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if not isinstance(piece, str) or not piece:
            return None
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if m:  # SentencePiece byte fallback
            return bytes([int(m.group(1), 16)])
        if self._byte_of_char is None:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_of_char = {c: b for b, c in bytes_to_unicode().items()}
        if all(c in self._byte_of_char for c in piece):  # byte-level BPE
            return bytes(self._byte_of_char[c] for c in piece)
        return None

    def skipped(self, token_id: int) -> bool:
        """Whether ``text`` leaves the id out: a special token, which decodes to nothing with
        ``skip_special_tokens`` (every added token marked special, not only the tokenizer's
        ``all_special_ids``: Qwen's ``<|im_start|>``, ``<|fim_prefix|>``, ...)."""
        s = self._skipped.get(token_id)
        if s is None:
            s = self._skipped[token_id] = self.tokenizer.decode([int(token_id)], skip_special_tokens=True) == ""
        return s

    def bytes_of(self, token_id: int) -> bytes:
        """The token's UTF-8 bytes (see the class docstring)."""
        b = self._bytes.get(token_id)
        if b is None:
            shown = self(token_id)
            raw = self._raw_bytes(token_id)
            b = raw if raw is not None and raw.decode("utf-8", errors="replace") == shown else shown.encode("utf-8")
            self._bytes[token_id] = b
        return b


class TextOffsets:
    """Completions' ``text_offset``: where each token's text starts in the choice's ``text``
    (characters; one instance per choice, fed its ids in order, chunk by chunk).

    The text is the tokens' bytes (:meth:`TokenText.bytes_of`) decoded as UTF-8 with
    replacement, special tokens skipped (as ``text`` skips them), so a special token takes no
    characters, and a token that continues a character spelled over several tokens starts just
    after that character's start. Offset i is the length of the text of the tokens before i
    (an incomplete character at their end counted as the one character it becomes).
    """

    def __init__(self, text: TokenText):
        self._text = text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def starts(self, ids: Sequence[int]) -> list[int]:
        """Start offsets (characters into the whole text) of ``ids``, the next ids of the choice."""
        out = []
        for t in ids:
            pending = bool(self._decoder.getstate()[0])
            out.append(self._chars + (1 if pending else 0))
            if not self._text.skipped(int(t)):
                self._chars += len(self._decoder.decode(self._text.bytes_of(int(t))))
        return out


def completion_logprobs(ids: Sequence[int], logprobs: Sequence[float], text: TokenText, offsets: Sequence[int],
                        top: Sequence[pb.TopLogprobs] = (), top_n: int = 0) -> dict:
    """Completions' ``logprobs`` object: tokens, token_logprobs, top_logprobs (per position a
    dict token text -> logprob, or None when N = ``top_n`` = 0; ids that decode to the same text
    share one key, with the most likely one's logprob), text_offset (``offsets``, from
    :class:`TextOffsets`). With N > 0 ``top_logprobs`` is a list also when ``ids`` is empty (a
    streamed chunk, an answer cut by a stop string), and each position's dict also holds the token
    chosen there when it is not among the N most likely (up to N + 1 entries, as OpenAI's legacy
    completions and vLLM give them): ``top_logprobs[j]`` always has the key ``tokens[j]``, whose
    value is the chosen token's logprob unless a more likely id decodes to the same text."""
    tokens = [text(t) for t in ids]
    tops = None
    if top or top_n:  # several ids may decode to the same text: the most likely one's logprob is kept
        tops = []
        for j, m in enumerate(top):
            d: dict[str, float] = {}
            for i, v in zip(m.ids, m.logprobs):
                d.setdefault(text(i), float(v))
            if j < len(tokens) and j < len(logprobs):
                d.setdefault(tokens[j], float(logprobs[j]))
            tops.append(d)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in logprobs], "top_logprobs": tops,
            "text_offset": list(offsets)}


def _token_entry(text: TokenText, token_id: int, logprob: float) -> dict:
    return {"token": text(token_id), "logprob": float(logprob), "bytes": list(text.bytes_of(token_id))}


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
              top: Sequence[pb.TopLogprobs], offsets: TextOffsets | None = None) -> dict | None:
    """A choice's ``logprobs`` in the shape of ``req``'s endpoint; None when not asked for.
    ``offsets``: the choice's :class:`TextOffsets` (completions' ``text_offset``; a new one when
    None, for a whole answer)."""
    if req.top_logprobs is None:
        return None
    if req.endpoint == "completions":
        starts = (offsets or TextOffsets(text)).starts(ids)
        return completion_logprobs(ids, logprobs, text, starts, top, req.top_logprobs)
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
                 offsets: TextOffsets, first: bool) -> dict:
    """One SSE chunk of choice ``index`` from one relayed stream chunk (``offsets``: the
    choice's :class:`TextOffsets`, fed every chunk of the choice in order)."""
    last = chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    lp = _logprobs(req, chunk.token_ids, chunk.logprobs, text, chunk.top_logprobs, offsets)
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
    out = chunk_envelope(req, [choice])
    if req.include_usage:  # OpenAI: with include_usage every other chunk has "usage": null, the last one the counts
        out["usage"] = None
    return out


def sse(data: Any) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
