from tandem.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class MediaItem(_message.Message):
    __slots__ = ("encoded", "tensor", "uuid", "mime_type")
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    encoded: bytes
    tensor: _tensor_pb2.Tensor
    uuid: str
    mime_type: str
    def __init__(self, encoded: _Optional[bytes] = ..., tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., uuid: _Optional[str] = ..., mime_type: _Optional[str] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: MediaItem
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[MediaItem, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "images", "sampling", "cache_salt", "messages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    images: _containers.RepeatedCompositeFieldContainer[MediaItem]
    sampling: SamplingParams
    cache_salt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., images: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "mm_items", "mm_cache_hits", "encoder_runs")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MM_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_RUNS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    mm_items: int
    mm_cache_hits: int
    encoder_runs: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., mm_items: _Optional[int] = ..., mm_cache_hits: _Optional[int] = ..., encoder_runs: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class CacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStatsResponse(_message.Message):
    __slots__ = ("shm_capacity_bytes", "shm_used_bytes", "shm_objects", "shm_unacked_refs", "prefix_cache_blocks", "prefix_cache_hit_tokens_total", "mm_cache_hits_total", "mm_cache_misses_total", "mm_cache_type", "kv_blocks_total", "kv_blocks_free")
    SHM_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    SHM_UNACKED_REFS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MM_CACHE_HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MM_CACHE_MISSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MM_CACHE_TYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    shm_capacity_bytes: int
    shm_used_bytes: int
    shm_objects: int
    shm_unacked_refs: int
    prefix_cache_blocks: int
    prefix_cache_hit_tokens_total: int
    mm_cache_hits_total: int
    mm_cache_misses_total: int
    mm_cache_type: str
    kv_blocks_total: int
    kv_blocks_free: int
    def __init__(self, shm_capacity_bytes: _Optional[int] = ..., shm_used_bytes: _Optional[int] = ..., shm_objects: _Optional[int] = ..., shm_unacked_refs: _Optional[int] = ..., prefix_cache_blocks: _Optional[int] = ..., prefix_cache_hit_tokens_total: _Optional[int] = ..., mm_cache_hits_total: _Optional[int] = ..., mm_cache_misses_total: _Optional[int] = ..., mm_cache_type: _Optional[str] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ...) -> None: ...
