from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "logprobs", "prompt_logprobs", "stop_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    logprobs: bool
    prompt_logprobs: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., prompt_logprobs: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ExcludedWorker(_message.Message):
    __slots__ = ("worker_id", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class HashScheme(_message.Message):
    __slots__ = ("block_tokens", "seed")
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    block_tokens: int
    seed: bytes
    def __init__(self, block_tokens: _Optional[int] = ..., seed: _Optional[bytes] = ...) -> None: ...

class PromptHashes(_message.Message):
    __slots__ = ("scheme", "hashes")
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    scheme: HashScheme
    hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, scheme: _Optional[_Union[HashScheme, _Mapping]] = ..., hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("request", "excluded", "retry", "prompt_hashes", "settled")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_HASHES_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    excluded: _containers.RepeatedCompositeFieldContainer[ExcludedWorker]
    retry: bool
    prompt_hashes: PromptHashes
    settled: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., excluded: _Optional[_Iterable[_Union[ExcludedWorker, _Mapping]]] = ..., retry: _Optional[bool] = ..., prompt_hashes: _Optional[_Union[PromptHashes, _Mapping]] = ..., settled: _Optional[_Iterable[str]] = ...) -> None: ...

class PlaceResponse(_message.Message):
    __slots__ = ("request_id", "prefill_worker", "decode_worker", "prefill_incarnation", "decode_incarnation", "prefill_reason", "decode_reason", "cached_tokens", "hash_scheme")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DECODE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REASON_FIELD_NUMBER: _ClassVar[int]
    DECODE_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_worker: str
    decode_worker: str
    prefill_incarnation: str
    decode_incarnation: str
    prefill_reason: str
    decode_reason: str
    cached_tokens: int
    hash_scheme: HashScheme
    def __init__(self, request_id: _Optional[str] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., prefill_incarnation: _Optional[str] = ..., decode_incarnation: _Optional[str] = ..., prefill_reason: _Optional[str] = ..., decode_reason: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., hash_scheme: _Optional[_Union[HashScheme, _Mapping]] = ...) -> None: ...

class SettleRequest(_message.Message):
    __slots__ = ("request_id", "request_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SettleResponse(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: bool
    def __init__(self, held: _Optional[bool] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OK: _ClassVar[Error.Code]
        INVALID_ARGUMENT: _ClassVar[Error.Code]
        RESOURCE_EXHAUSTED: _ClassVar[Error.Code]
        INTERNAL: _ClassVar[Error.Code]
        UNAVAILABLE: _ClassVar[Error.Code]
    OK: Error.Code
    INVALID_ARGUMENT: Error.Code
    RESOURCE_EXHAUSTED: Error.Code
    INTERNAL: Error.Code
    UNAVAILABLE: Error.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: Error.Code
    message: str
    def __init__(self, code: _Optional[_Union[Error.Code, str]] = ..., message: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_id", "logprob", "finished", "finish_reason", "prompt_logprobs", "error", "prefill_worker", "decode_worker", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    logprob: float
    finished: bool
    finish_reason: str
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    error: Error
    prefill_worker: str
    decode_worker: str
    cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("probe",)
    PROBE_FIELD_NUMBER: _ClassVar[int]
    probe: bool
    def __init__(self, probe: _Optional[bool] = ...) -> None: ...

class WorkerHealth(_message.Message):
    __slots__ = ("worker_id", "role", "healthy", "fast_paths_active", "fast_path_fallbacks", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    FAST_PATHS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    healthy: bool
    fast_paths_active: _containers.RepeatedScalarFieldContainer[str]
    fast_path_fallbacks: _containers.RepeatedScalarFieldContainer[str]
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., healthy: _Optional[bool] = ..., fast_paths_active: _Optional[_Iterable[str]] = ..., fast_path_fallbacks: _Optional[_Iterable[str]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "workers")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    workers: _containers.RepeatedCompositeFieldContainer[WorkerHealth]
    def __init__(self, serving: _Optional[bool] = ..., workers: _Optional[_Iterable[_Union[WorkerHealth, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "healthy", "running", "waiting", "kv_usage", "kv_free_tokens", "inflight", "cached_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    healthy: bool
    running: int
    waiting: int
    kv_usage: float
    kv_free_tokens: int
    inflight: int
    cached_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., healthy: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., kv_free_tokens: _Optional[int] = ..., inflight: _Optional[int] = ..., cached_blocks: _Optional[int] = ...) -> None: ...

class DecisionCount(_message.Message):
    __slots__ = ("stage", "reason", "count")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    stage: str
    reason: str
    count: int
    def __init__(self, stage: _Optional[str] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("policy", "workers", "decisions", "requests_total", "retries_total", "worker_deaths_total", "errors_total")
    class ErrorsTotalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RETRIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WORKER_DEATHS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ERRORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    policy: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    decisions: _containers.RepeatedCompositeFieldContainer[DecisionCount]
    requests_total: int
    retries_total: int
    worker_deaths_total: int
    errors_total: _containers.ScalarMap[str, int]
    def __init__(self, policy: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., decisions: _Optional[_Iterable[_Union[DecisionCount, _Mapping]]] = ..., requests_total: _Optional[int] = ..., retries_total: _Optional[int] = ..., worker_deaths_total: _Optional[int] = ..., errors_total: _Optional[_Mapping[str, int]] = ...) -> None: ...
