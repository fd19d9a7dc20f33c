from splitserve.proto.splitserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole

class KvLayout(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "layout", "compat_hash")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str
    compat_hash: str
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layout: _Optional[str] = ..., compat_hash: _Optional[str] = ...) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("seq", "reset", "stored", "evicted")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    evicted: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, seq: _Optional[int] = ..., reset: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., evicted: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "kv_layout", "num_blocks", "max_model_len", "model", "pulls_cached_kv_min_blocks", "adapters")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PULLS_CACHED_KV_MIN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    address: str
    kv_layout: KvLayout
    num_blocks: int
    max_model_len: int
    model: str
    pulls_cached_kv_min_blocks: int
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., kv_layout: _Optional[_Union[KvLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., model: _Optional[str] = ..., pulls_cached_kv_min_blocks: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_total_blocks", "num_used_blocks", "num_running_requests", "num_waiting_requests", "num_reserved_requests", "num_running_tokens", "num_pending_prefill_tokens", "ready", "num_finished_requests", "step_cost", "prefill_share", "prefill_chunk_tokens", "kv_events", "kv_push_costs", "served_adapters")
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STEP_COST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SHARE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_COSTS_FIELD_NUMBER: _ClassVar[int]
    SERVED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    num_total_blocks: int
    num_used_blocks: int
    num_running_requests: int
    num_waiting_requests: int
    num_reserved_requests: int
    num_running_tokens: int
    num_pending_prefill_tokens: int
    ready: bool
    num_finished_requests: int
    step_cost: StepCost
    prefill_share: float
    prefill_chunk_tokens: int
    kv_events: KvEvents
    kv_push_costs: _containers.RepeatedCompositeFieldContainer[KvPushCost]
    served_adapters: ServedAdapters
    def __init__(self, num_total_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., num_reserved_requests: _Optional[int] = ..., num_running_tokens: _Optional[int] = ..., num_pending_prefill_tokens: _Optional[int] = ..., ready: _Optional[bool] = ..., num_finished_requests: _Optional[int] = ..., step_cost: _Optional[_Union[StepCost, _Mapping]] = ..., prefill_share: _Optional[float] = ..., prefill_chunk_tokens: _Optional[int] = ..., kv_events: _Optional[_Union[KvEvents, _Mapping]] = ..., kv_push_costs: _Optional[_Iterable[_Union[KvPushCost, _Mapping]]] = ..., served_adapters: _Optional[_Union[ServedAdapters, _Mapping]] = ...) -> None: ...

class ServedAdapters(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...

class KvPushCost(_message.Message):
    __slots__ = ("decode_address", "base_s", "per_token_s", "pushes")
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BASE_S_FIELD_NUMBER: _ClassVar[int]
    PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    decode_address: str
    base_s: float
    per_token_s: float
    pushes: int
    def __init__(self, decode_address: _Optional[str] = ..., base_s: _Optional[float] = ..., per_token_s: _Optional[float] = ..., pushes: _Optional[int] = ...) -> None: ...

class StepCost(_message.Message):
    __slots__ = ("decode_base_s", "per_decode_seq_s", "per_context_token_s", "prefill_base_s", "per_prefill_token_s", "decode_steps", "prefill_steps")
    DECODE_BASE_S_FIELD_NUMBER: _ClassVar[int]
    PER_DECODE_SEQ_S_FIELD_NUMBER: _ClassVar[int]
    PER_CONTEXT_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BASE_S_FIELD_NUMBER: _ClassVar[int]
    PER_PREFILL_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STEPS_FIELD_NUMBER: _ClassVar[int]
    decode_base_s: float
    per_decode_seq_s: float
    per_context_token_s: float
    prefill_base_s: float
    per_prefill_token_s: float
    decode_steps: int
    prefill_steps: int
    def __init__(self, decode_base_s: _Optional[float] = ..., per_decode_seq_s: _Optional[float] = ..., per_context_token_s: _Optional[float] = ..., prefill_base_s: _Optional[float] = ..., per_prefill_token_s: _Optional[float] = ..., decode_steps: _Optional[int] = ..., prefill_steps: _Optional[int] = ...) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "replace", "check_only")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    CHECK_ONLY_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    replace: bool
    check_only: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., replace: _Optional[bool] = ..., check_only: _Optional[bool] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter", "newly_loaded")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    NEWLY_LOADED_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapter
    newly_loaded: bool
    def __init__(self, adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ..., newly_loaded: _Optional[bool] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "remote_prefill", "prior_output_token_ids", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    remote_prefill: bool
    prior_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., remote_prefill: _Optional[bool] = ..., prior_output_token_ids: _Optional[_Iterable[int]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class KvReservation(_message.Message):
    __slots__ = ("transfer_id", "decode_address", "num_tokens", "compat_hash", "block_order", "run_lengths", "transfer_secret", "num_cached_blocks", "layers_per_message")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ORDER_FIELD_NUMBER: _ClassVar[int]
    RUN_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECRET_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    decode_address: str
    num_tokens: int
    compat_hash: str
    block_order: _containers.RepeatedScalarFieldContainer[int]
    run_lengths: _containers.RepeatedScalarFieldContainer[int]
    transfer_secret: bytes
    num_cached_blocks: int
    layers_per_message: int
    def __init__(self, transfer_id: _Optional[int] = ..., decode_address: _Optional[str] = ..., num_tokens: _Optional[int] = ..., compat_hash: _Optional[str] = ..., block_order: _Optional[_Iterable[int]] = ..., run_lengths: _Optional[_Iterable[int]] = ..., transfer_secret: _Optional[bytes] = ..., num_cached_blocks: _Optional[int] = ..., layers_per_message: _Optional[int] = ...) -> None: ...

class WorkerTokens(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "stop_token_id", "usage", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    usage: _common_pb2.Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class WorkerGenerateResponse(_message.Message):
    __slots__ = ("reservation", "tokens")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    reservation: KvReservation
    tokens: WorkerTokens
    def __init__(self, reservation: _Optional[_Union[KvReservation, _Mapping]] = ..., tokens: _Optional[_Union[WorkerTokens, _Mapping]] = ...) -> None: ...

class WorkerAbortRequest(_message.Message):
    __slots__ = ("request_id", "as_stopped")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AS_STOPPED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    as_stopped: bool
    def __init__(self, request_id: _Optional[str] = ..., as_stopped: _Optional[bool] = ...) -> None: ...

class WorkerAbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class KvHandshakeRequest(_message.Message):
    __slots__ = ("layout",)
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ...) -> None: ...

class KvHandshakeResponse(_message.Message):
    __slots__ = ("layout", "ucx_address", "transport")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    ucx_address: bytes
    transport: str
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ..., ucx_address: _Optional[bytes] = ..., transport: _Optional[str] = ...) -> None: ...

class CompleteKvRequest(_message.Message):
    __slots__ = ("transfer_id", "request_id", "first_token_id", "first_logprob", "num_cached_tokens", "prompt_logprobs")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    request_id: str
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, transfer_id: _Optional[int] = ..., request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class CompleteKvResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushCachedKvRequest(_message.Message):
    __slots__ = ("transfer_id", "request_id", "first_block", "transport_address", "block_order", "run_lengths", "transfer_secret", "compat_hash", "layers_per_message")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ORDER_FIELD_NUMBER: _ClassVar[int]
    RUN_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECRET_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYERS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    request_id: str
    first_block: int
    transport_address: bytes
    block_order: _containers.RepeatedScalarFieldContainer[int]
    run_lengths: _containers.RepeatedScalarFieldContainer[int]
    transfer_secret: bytes
    compat_hash: str
    layers_per_message: int
    def __init__(self, transfer_id: _Optional[int] = ..., request_id: _Optional[str] = ..., first_block: _Optional[int] = ..., transport_address: _Optional[bytes] = ..., block_order: _Optional[_Iterable[int]] = ..., run_lengths: _Optional[_Iterable[int]] = ..., transfer_secret: _Optional[bytes] = ..., compat_hash: _Optional[str] = ..., layers_per_message: _Optional[int] = ...) -> None: ...

class PushCachedKvResponse(_message.Message):
    __slots__ = ("bytes_sent",)
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    bytes_sent: int
    def __init__(self, bytes_sent: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "target", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    target: KvReservation
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., target: _Optional[_Union[KvReservation, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("num_cached_tokens",)
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    def __init__(self, num_cached_tokens: _Optional[int] = ...) -> None: ...

class WorkerStreamsRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: WorkerStreamStart
    cancel: int
    def __init__(self, start: _Optional[_Union[WorkerStreamStart, _Mapping]] = ..., cancel: _Optional[int] = ...) -> None: ...

class WorkerStreamStart(_message.Message):
    __slots__ = ("key", "request")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    key: int
    request: WorkerGenerateRequest
    def __init__(self, key: _Optional[int] = ..., request: _Optional[_Union[WorkerGenerateRequest, _Mapping]] = ...) -> None: ...

class WorkerStreamsResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[WorkerStreamItem]
    def __init__(self, items: _Optional[_Iterable[_Union[WorkerStreamItem, _Mapping]]] = ...) -> None: ...

class WorkerStreamItem(_message.Message):
    __slots__ = ("key", "response", "end")
    KEY_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    key: int
    response: WorkerGenerateResponse
    end: _common_pb2.StreamEnd
    def __init__(self, key: _Optional[int] = ..., response: _Optional[_Union[WorkerGenerateResponse, _Mapping]] = ..., end: _Optional[_Union[_common_pb2.StreamEnd, _Mapping]] = ...) -> None: ...
