from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Proposer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSER_UNSPECIFIED: _ClassVar[Proposer]
    PROPOSER_DRAFT: _ClassVar[Proposer]
    PROPOSER_NGRAM: _ClassVar[Proposer]
    PROPOSER_NONE: _ClassVar[Proposer]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_MAX_TOKENS: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
PROPOSER_UNSPECIFIED: Proposer
PROPOSER_DRAFT: Proposer
PROPOSER_NGRAM: Proposer
PROPOSER_NONE: Proposer
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_MAX_TOKENS: FinishReason
FINISH_REASON_CONTEXT_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class SpeculationHints(_message.Message):
    __slots__ = ("proposer", "max_k", "draft_min_confidence")
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    proposer: Proposer
    max_k: int
    draft_min_confidence: float
    def __init__(self, proposer: _Optional[_Union[Proposer, str]] = ..., max_k: _Optional[int] = ..., draft_min_confidence: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "prompt_token_ids", "max_tokens", "sampling", "stop", "stop_token_ids", "ignore_eos", "logprobs", "speculation", "min_tokens", "top_logprobs", "cache_salt")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: ChatMessages
    prompt_token_ids: TokenIds
    max_tokens: int
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    speculation: SpeculationHints
    min_tokens: int
    top_logprobs: int
    cache_salt: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., speculation: _Optional[_Union[SpeculationHints, _Mapping]] = ..., min_tokens: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("ids", "logprobs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("steps", "proposed", "accepted", "rejected_steps", "acceptance_rate", "mean_accepted_length", "accepted_per_position", "proposed_per_position", "k_counts", "draft_time_s", "verify_time_s", "wire_bytes_per_step", "round_trip_s", "target_compute_s", "verify_costs", "cost_draft_s", "cost_drafted")
    class KCountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    K_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TIME_S_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIP_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COSTS_FIELD_NUMBER: _ClassVar[int]
    COST_DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    COST_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    steps: int
    proposed: int
    accepted: int
    rejected_steps: int
    acceptance_rate: float
    mean_accepted_length: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    proposed_per_position: _containers.RepeatedScalarFieldContainer[int]
    k_counts: _containers.ScalarMap[int, int]
    draft_time_s: float
    verify_time_s: float
    wire_bytes_per_step: float
    round_trip_s: float
    target_compute_s: float
    verify_costs: _containers.RepeatedCompositeFieldContainer[VerifyCost]
    cost_draft_s: float
    cost_drafted: int
    def __init__(self, steps: _Optional[int] = ..., proposed: _Optional[int] = ..., accepted: _Optional[int] = ..., rejected_steps: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., proposed_per_position: _Optional[_Iterable[int]] = ..., k_counts: _Optional[_Mapping[int, int]] = ..., draft_time_s: _Optional[float] = ..., verify_time_s: _Optional[float] = ..., wire_bytes_per_step: _Optional[float] = ..., round_trip_s: _Optional[float] = ..., target_compute_s: _Optional[float] = ..., verify_costs: _Optional[_Iterable[_Union[VerifyCost, _Mapping]]] = ..., cost_draft_s: _Optional[float] = ..., cost_drafted: _Optional[int] = ...) -> None: ...

class VerifyCost(_message.Message):
    __slots__ = ("positions", "steps", "seconds")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    positions: int
    steps: int
    seconds: float
    def __init__(self, positions: _Optional[int] = ..., steps: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "usage", "stats", "elapsed_s", "top_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    usage: Usage
    stats: SpeculationStats
    elapsed_s: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., elapsed_s: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class GenerateStreamChunk(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "usage", "stats", "elapsed_s", "top_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    usage: Usage
    stats: SpeculationStats
    elapsed_s: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., elapsed_s: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class GetTenantStatsRequest(_message.Message):
    __slots__ = ("proposer",)
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    proposer: Proposer
    def __init__(self, proposer: _Optional[_Union[Proposer, str]] = ...) -> None: ...

class CostTerms(_message.Message):
    __slots__ = ("draft_per_token_s", "verify_s_by_positions", "round_trip_s")
    DRAFT_PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_BY_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIP_S_FIELD_NUMBER: _ClassVar[int]
    draft_per_token_s: float
    verify_s_by_positions: _containers.RepeatedScalarFieldContainer[float]
    round_trip_s: float
    def __init__(self, draft_per_token_s: _Optional[float] = ..., verify_s_by_positions: _Optional[_Iterable[float]] = ..., round_trip_s: _Optional[float] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("requests", "prompt_tokens", "completion_tokens")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GetTenantStatsResponse(_message.Message):
    __slots__ = ("tenant_id", "proposer", "acceptance_rate", "current_k", "predicted_speedup", "cost", "usage", "stats", "batch")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_K_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    proposer: Proposer
    acceptance_rate: float
    current_k: int
    predicted_speedup: float
    cost: CostTerms
    usage: TenantUsage
    stats: SpeculationStats
    batch: BatchLoad
    def __init__(self, tenant_id: _Optional[str] = ..., proposer: _Optional[_Union[Proposer, str]] = ..., acceptance_rate: _Optional[float] = ..., current_k: _Optional[int] = ..., predicted_speedup: _Optional[float] = ..., cost: _Optional[_Union[CostTerms, _Mapping]] = ..., usage: _Optional[_Union[TenantUsage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., batch: _Optional[_Union[BatchLoad, _Mapping]] = ...) -> None: ...

class BatchLoad(_message.Message):
    __slots__ = ("forwards", "mean_rows", "mean_positions", "max_rows", "k_under_load", "tenant_rows_per_step", "tenant_positions_per_step", "tenant_steps", "k_under_load_replica", "replicas")
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ROWS_FIELD_NUMBER: _ClassVar[int]
    MEAN_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    K_UNDER_LOAD_FIELD_NUMBER: _ClassVar[int]
    TENANT_ROWS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    TENANT_POSITIONS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    TENANT_STEPS_FIELD_NUMBER: _ClassVar[int]
    K_UNDER_LOAD_REPLICA_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    forwards: int
    mean_rows: float
    mean_positions: float
    max_rows: int
    k_under_load: int
    tenant_rows_per_step: float
    tenant_positions_per_step: float
    tenant_steps: int
    k_under_load_replica: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaKUnderLoad]
    def __init__(self, forwards: _Optional[int] = ..., mean_rows: _Optional[float] = ..., mean_positions: _Optional[float] = ..., max_rows: _Optional[int] = ..., k_under_load: _Optional[int] = ..., tenant_rows_per_step: _Optional[float] = ..., tenant_positions_per_step: _Optional[float] = ..., tenant_steps: _Optional[int] = ..., k_under_load_replica: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaKUnderLoad, _Mapping]]] = ...) -> None: ...

class ReplicaKUnderLoad(_message.Message):
    __slots__ = ("replica", "k_under_load", "k_model", "guard_forced", "decided_s_ago", "reported_s_ago", "tenant_rows_per_step", "tenant_positions_per_step", "tenant_steps", "sessions")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    K_UNDER_LOAD_FIELD_NUMBER: _ClassVar[int]
    K_MODEL_FIELD_NUMBER: _ClassVar[int]
    GUARD_FORCED_FIELD_NUMBER: _ClassVar[int]
    DECIDED_S_AGO_FIELD_NUMBER: _ClassVar[int]
    REPORTED_S_AGO_FIELD_NUMBER: _ClassVar[int]
    TENANT_ROWS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    TENANT_POSITIONS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    TENANT_STEPS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    k_under_load: int
    k_model: int
    guard_forced: bool
    decided_s_ago: float
    reported_s_ago: float
    tenant_rows_per_step: float
    tenant_positions_per_step: float
    tenant_steps: int
    sessions: int
    def __init__(self, replica: _Optional[str] = ..., k_under_load: _Optional[int] = ..., k_model: _Optional[int] = ..., guard_forced: _Optional[bool] = ..., decided_s_ago: _Optional[float] = ..., reported_s_ago: _Optional[float] = ..., tenant_rows_per_step: _Optional[float] = ..., tenant_positions_per_step: _Optional[float] = ..., tenant_steps: _Optional[int] = ..., sessions: _Optional[int] = ...) -> None: ...
