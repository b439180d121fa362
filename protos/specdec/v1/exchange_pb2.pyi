from protos.specdec.v1 import specdec_pb2 as _specdec_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFY_STATUS_UNSPECIFIED: _ClassVar[VerifyStatus]
    VERIFY_STATUS_OK: _ClassVar[VerifyStatus]
    VERIFY_STATUS_SESSION_MISSING: _ClassVar[VerifyStatus]
    VERIFY_STATUS_POSITION_MISMATCH: _ClassVar[VerifyStatus]
    VERIFY_STATUS_CANCELLED: _ClassVar[VerifyStatus]
VERIFY_STATUS_UNSPECIFIED: VerifyStatus
VERIFY_STATUS_OK: VerifyStatus
VERIFY_STATUS_SESSION_MISSING: VerifyStatus
VERIFY_STATUS_POSITION_MISMATCH: VerifyStatus
VERIFY_STATUS_CANCELLED: VerifyStatus

class SessionOpen(_message.Message):
    __slots__ = ("token_ids", "sampling", "seed", "logprobs", "prompt_len", "min_tokens", "suppress_token_ids", "top_logprobs", "tenant", "tenant_weight", "prefix_scope")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUPPRESS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SCOPE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _specdec_pb2.SamplingParams
    seed: int
    logprobs: bool
    prompt_len: int
    min_tokens: int
    suppress_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: int
    tenant: str
    tenant_weight: float
    prefix_scope: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_specdec_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., prompt_len: _Optional[int] = ..., min_tokens: _Optional[int] = ..., suppress_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[int] = ..., tenant: _Optional[str] = ..., tenant_weight: _Optional[float] = ..., prefix_scope: _Optional[str] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("width", "ids", "probs")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    width: int
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, width: _Optional[int] = ..., ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class CandidateBlock(_message.Message):
    __slots__ = ("session_id", "position", "token_ids", "q", "open")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    q: SparseDistribution
    open: SessionOpen
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[SparseDistribution, _Mapping]] = ..., open: _Optional[_Union[SessionOpen, _Mapping]] = ...) -> None: ...

class VerificationResult(_message.Message):
    __slots__ = ("status", "accepted", "token_ids", "logprobs", "committed_len", "target_position", "target_time_s", "top_logprobs", "batch_forward", "batch_rows", "batch_positions", "batch_forward_s", "batch_context")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    TARGET_POSITION_FIELD_NUMBER: _ClassVar[int]
    TARGET_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FORWARD_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    status: VerifyStatus
    accepted: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    committed_len: int
    target_position: int
    target_time_s: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_specdec_pb2.TopLogprobs]
    batch_forward: int
    batch_rows: int
    batch_positions: int
    batch_forward_s: float
    batch_context: float
    def __init__(self, status: _Optional[_Union[VerifyStatus, str]] = ..., accepted: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., committed_len: _Optional[int] = ..., target_position: _Optional[int] = ..., target_time_s: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_specdec_pb2.TopLogprobs, _Mapping]]] = ..., batch_forward: _Optional[int] = ..., batch_rows: _Optional[int] = ..., batch_positions: _Optional[int] = ..., batch_forward_s: _Optional[float] = ..., batch_context: _Optional[float] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class DraftJob(_message.Message):
    __slots__ = ("session_id", "request", "deadline_unix_s", "resume_token_ids", "resume_text_chars", "probe_steps", "tenant", "tenant_weight", "resume_held_token_ids", "resume_held_logprobs", "resume_held_top_logprobs", "resume_steps", "batch_adaptive", "k_min")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    PROBE_STEPS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RESUME_HELD_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_HELD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESUME_HELD_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    K_MIN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request: _specdec_pb2.GenerateRequest
    deadline_unix_s: float
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_text_chars: int
    probe_steps: int
    tenant: str
    tenant_weight: float
    resume_held_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_held_logprobs: _containers.RepeatedScalarFieldContainer[float]
    resume_held_top_logprobs: _containers.RepeatedCompositeFieldContainer[_specdec_pb2.TopLogprobs]
    resume_steps: int
    batch_adaptive: bool
    k_min: int
    def __init__(self, session_id: _Optional[str] = ..., request: _Optional[_Union[_specdec_pb2.GenerateRequest, _Mapping]] = ..., deadline_unix_s: _Optional[float] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., resume_text_chars: _Optional[int] = ..., probe_steps: _Optional[int] = ..., tenant: _Optional[str] = ..., tenant_weight: _Optional[float] = ..., resume_held_token_ids: _Optional[_Iterable[int]] = ..., resume_held_logprobs: _Optional[_Iterable[float]] = ..., resume_held_top_logprobs: _Optional[_Iterable[_Union[_specdec_pb2.TopLogprobs, _Mapping]]] = ..., resume_steps: _Optional[int] = ..., batch_adaptive: _Optional[bool] = ..., k_min: _Optional[int] = ...) -> None: ...

class DraftChunkTrailer(_message.Message):
    __slots__ = ("held_token_ids", "held_logprobs", "held_top_logprobs", "steps")
    HELD_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HELD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HELD_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    held_token_ids: _containers.RepeatedScalarFieldContainer[int]
    held_logprobs: _containers.RepeatedScalarFieldContainer[float]
    held_top_logprobs: _containers.RepeatedCompositeFieldContainer[_specdec_pb2.TopLogprobs]
    steps: int
    def __init__(self, held_token_ids: _Optional[_Iterable[int]] = ..., held_logprobs: _Optional[_Iterable[float]] = ..., held_top_logprobs: _Optional[_Iterable[_Union[_specdec_pb2.TopLogprobs, _Mapping]]] = ..., steps: _Optional[int] = ...) -> None: ...
