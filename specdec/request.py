"""Validated generation requests (pydantic).

One ``GenerationRequest`` describes everything the engine needs for one completion. The gRPC
layer converts its proto into this model, so validation lives here once; a ``ValidationError``
from pydantic is turned into :class:`specdec.errors.InvalidRequestError` by
:func:`parse_request`.
"""

from __future__ import annotations

import re
from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specdec.errors import InvalidRequestError

#: Largest speculation length K accepted anywhere (tokens per speculation step).
MAX_SPECULATION_LENGTH = 16

Proposer = Literal["draft", "ngram", "none"]

#: Largest ``top_k`` (the gRPC field's range, uint32); any value at or above the vocabulary size
#: keeps every token.
MAX_TOP_K = 2**32 - 1
#: Largest ``max_tokens`` (and ``min_tokens``) a request may ask for.
MAX_TOKENS = 1_000_000
#: Seeds are the gRPC field's range, uint64: 0 .. 2**64 - 1. Every one is used as it is (the
#: random streams hash it, :func:`specdec.engine.sampling.derive_seeds`), so no two alias.
SEED_RANGE = 2**64
#: Longest ``cache_salt`` (characters).
MAX_CACHE_SALT_CHARS = 1024


def _unicode_text(text: str) -> str:
    """``text`` if it encodes as UTF-8; else ValueError naming the first lone surrogate.

    JSON's ``\\ud800`` escapes and undecodable command-line bytes (``surrogateescape``) reach
    Python as lone surrogates, which no tokenizer can encode.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text: a lone surrogate U+{ord(text[e.start]):04X} at character "
                         f"{e.start}") from None
    return text


class ChatMessage(BaseModel):
    """One chat turn, rendered with the target's chat template."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str

    @field_validator("content")
    @classmethod
    def _content_unicode(cls, v: str) -> str:
        return _unicode_text(v)


class SamplingParams(BaseModel):
    """How the target's next-token distribution is turned into a token.

    ``temperature == 0`` means greedy decoding (argmax, lowest id on ties). First the
    output-dependent processors (``logit_bias``, repetition, presence and frequency penalties;
    :mod:`specdec.engine.processors`), then temperature, top-k, top-p and min-p are applied, identically
    to draft and target distributions at every position (see :mod:`specdec.engine.sampling`).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="0 disables top-k")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=SEED_RANGE, description="per-request seed (0 .. 2**64 - 1); None draws one")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top probability; 0: off")
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=10.0,
        description="over prompt and output: a seen token's positive logit / penalty, negative x penalty; 1: off",
    )
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted once per token in the output")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted per occurrence in the output")
    logit_bias: dict[int, float] = Field(
        default_factory=dict, max_length=1024, description="token id -> bias added to its logit (-100..100)",
    )

    @model_validator(mode="after")
    def _bias_range(self) -> "SamplingParams":
        for tid, bias in self.logit_bias.items():
            if tid < 0:
                raise ValueError(f"logit_bias: token id {tid} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: the bias of token {tid} must be in -100..100, got {bias}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SpeculationParams(BaseModel):
    """Which proposer drafts and how many tokens (K) per speculation step, at most.

    ``k`` is the largest K the caller allows; the engine may use less near the context limit,
    and the serving layer's controller may choose less per tenant. ``k == 0`` or
    ``proposer == "none"`` is plain decoding.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    proposer: Proposer = "draft"
    k: int = Field(4, ge=0, le=MAX_SPECULATION_LENGTH)
    ngram_min: int = Field(1, ge=1, le=16, description="shortest n-gram matched by prompt lookup")
    ngram_max: int = Field(3, ge=1, le=16, description="longest n-gram matched by prompt lookup")
    draft_min_confidence: float = Field(
        0.0, ge=0.0, le=1.0,
        description="draft proposer: end a block after a drafted token whose draft probability is "
                    "below this (0 = always draft K; transformers' assisted generation uses 0.4)",
    )

    @model_validator(mode="after")
    def _ngram_range(self) -> "SpeculationParams":
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        return self


class GenerationRequest(BaseModel):
    """One completion request: a prompt (text, chat messages or token ids) and its limits."""

    model_config = ConfigDict(extra="forbid")
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = Field(128, ge=1, le=MAX_TOKENS)
    stop: list[str] = Field(default_factory=list, max_length=16)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20, description="with logprobs: the target's N most likely ids per position")
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS, description="EOS and stop token ids masked until this many tokens")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    speculation: SpeculationParams = Field(default_factory=SpeculationParams)
    cache_salt: str | None = Field(
        None, min_length=1, max_length=MAX_CACHE_SALT_CHARS,
        description="prefix caching: only requests with the same salt share cached prompt prefixes "
                    "(vLLM's cache_salt; a random string of 43+ characters makes a request's prefixes its "
                    "caller's alone); None: no salt",
    )

    @field_validator("prompt", "cache_salt")
    @classmethod
    def _prompt_unicode(cls, v: str | None) -> str | None:
        return v if v is None else _unicode_text(v)

    @field_validator("stop")
    @classmethod
    def _stop_unicode(cls, v: list[str]) -> list[str]:
        for s in v:
            _unicode_text(s)
        return v

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerationRequest":
        given = [x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
        if self.prompt is not None and self.prompt == "":
            raise ValueError("prompt is empty")
        if self.messages is not None and len(self.messages) == 0:
            raise ValueError("messages is empty")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids is empty")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self


#: The top-level fields the cross-field rules of :class:`GenerationRequest` name in their sentences
#: ("min_tokens (9) must be <= max_tokens (8)", "top_logprobs needs logprobs", "stop strings must not
#: be empty"), longest first so ``top_logprobs`` is not read as ``logprobs``.
_BARE_FIELD = re.compile(r"\b(top_logprobs|min_tokens|max_tokens|logprobs|stop)\b")


def _rename_bare_fields(msg: str, field_names: Mapping[str, str]) -> str:
    """``msg`` with each field name of :data:`_BARE_FIELD` spelled as ``field_names`` calls it
    (``specdec generate``: "--top-logprobs needs --logprobs"); names it does not list stay."""
    return _BARE_FIELD.sub(lambda m: field_names.get(m.group(1), m.group(1)), msg)


def parse_request(data: dict, field_names: Mapping[str, str] | None = None) -> GenerationRequest:
    """Validate a plain dict into a :class:`GenerationRequest`.

    Args:
        data: the request as plain data.
        field_names: core field path -> the name the caller used for it, for error messages
            (the gRPC API calls ``speculation.k`` ``speculation.max_k``); paths not listed keep
            their core name.

    Raises:
        InvalidRequestError: with pydantic's field-by-field message when validation fails,
            naming each field as the caller sent it.
    """
    try:
        return GenerationRequest.model_validate(data)
    except ValidationError as e:
        parts = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            loc = (field_names or {}).get(loc, loc)
            msg = err["msg"]
            if err.get("type") == "value_error" and msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]  # our validators' own sentences, without pydantic's prefix
            if not loc and field_names:  # a rule over several fields names them in its sentence
                msg = _rename_bare_fields(msg, field_names)
            parts.append(f"{loc}: {msg}" if loc else msg)  # no location: a rule over several fields
        raise InvalidRequestError("invalid request: " + "; ".join(parts)) from None
