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
    FINISH_REASON_CONSTRAINT: _ClassVar[FinishReason]

class ProcessorCacheResult(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROCESSOR_CACHE_RESULT_UNSPECIFIED: _ClassVar[ProcessorCacheResult]
    PROCESSOR_CACHE_RESULT_HIT: _ClassVar[ProcessorCacheResult]
    PROCESSOR_CACHE_RESULT_MISS: _ClassVar[ProcessorCacheResult]
    PROCESSOR_CACHE_RESULT_REFUSED: _ClassVar[ProcessorCacheResult]

class ImageTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IMAGE_TRANSPORT_UNSPECIFIED: _ClassVar[ImageTransport]
    IMAGE_TRANSPORT_SHM: _ClassVar[ImageTransport]
    IMAGE_TRANSPORT_INLINE: _ClassVar[ImageTransport]

class EncoderResult(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODER_RESULT_UNSPECIFIED: _ClassVar[EncoderResult]
    ENCODER_RESULT_RAN: _ClassVar[EncoderResult]
    ENCODER_RESULT_CACHED: _ClassVar[EncoderResult]
    ENCODER_RESULT_SKIPPED: _ClassVar[EncoderResult]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_CONSTRAINT: FinishReason
PROCESSOR_CACHE_RESULT_UNSPECIFIED: ProcessorCacheResult
PROCESSOR_CACHE_RESULT_HIT: ProcessorCacheResult
PROCESSOR_CACHE_RESULT_MISS: ProcessorCacheResult
PROCESSOR_CACHE_RESULT_REFUSED: ProcessorCacheResult
IMAGE_TRANSPORT_UNSPECIFIED: ImageTransport
IMAGE_TRANSPORT_SHM: ImageTransport
IMAGE_TRANSPORT_INLINE: ImageTransport
ENCODER_RESULT_UNSPECIFIED: EncoderResult
ENCODER_RESULT_RAN: EncoderResult
ENCODER_RESULT_CACHED: EncoderResult
ENCODER_RESULT_SKIPPED: EncoderResult

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
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "stop", "include_stop_str_in_output", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "json_schema", "regex", "grammar", "json_object", "choice")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    json_schema: str
    regex: str
    grammar: str
    json_object: bool
    choice: ChoiceList
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "images", "sampling", "cache_salt", "messages", "prompt_token_ids", "tools_json")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    images: _containers.RepeatedCompositeFieldContainer[MediaItem]
    sampling: SamplingParams
    cache_salt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tools_json: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., images: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., tools_json: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "mm_items", "mm_cache_hits", "encoder_runs", "images", "constraint")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MM_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_RUNS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    mm_items: int
    mm_cache_hits: int
    encoder_runs: int
    images: _containers.RepeatedCompositeFieldContainer[ImageUsage]
    constraint: ConstraintUsage
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., mm_items: _Optional[int] = ..., mm_cache_hits: _Optional[int] = ..., encoder_runs: _Optional[int] = ..., images: _Optional[_Iterable[_Union[ImageUsage, _Mapping]]] = ..., constraint: _Optional[_Union[ConstraintUsage, _Mapping]] = ...) -> None: ...

class ConstraintUsage(_message.Message):
    __slots__ = ("kind", "compile_ms", "cache_hit")
    KIND_FIELD_NUMBER: _ClassVar[int]
    COMPILE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    compile_ms: float
    cache_hit: bool
    def __init__(self, kind: _Optional[str] = ..., compile_ms: _Optional[float] = ..., cache_hit: _Optional[bool] = ...) -> None: ...

class ImageUsage(_message.Message):
    __slots__ = ("key", "processor_cache", "refused_reason", "transport", "encoder", "cached_tokens", "tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PROCESSOR_CACHE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REASON_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ENCODER_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: str
    processor_cache: ProcessorCacheResult
    refused_reason: str
    transport: ImageTransport
    encoder: EncoderResult
    cached_tokens: int
    tokens: int
    def __init__(self, key: _Optional[str] = ..., processor_cache: _Optional[_Union[ProcessorCacheResult, str]] = ..., refused_reason: _Optional[str] = ..., transport: _Optional[_Union[ImageTransport, str]] = ..., encoder: _Optional[_Union[EncoderResult, str]] = ..., cached_tokens: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "text", "logprob", "token_bytes", "special")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    token_bytes: bytes
    special: bool
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., token_bytes: _Optional[bytes] = ..., special: _Optional[bool] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("token", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: TokenLogprob
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ...) -> None: ...

class CacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStatsResponse(_message.Message):
    __slots__ = ("shm_capacity_bytes", "shm_used_bytes", "shm_objects", "shm_unacked_refs", "prefix_cache_blocks", "prefix_cache_hit_tokens_total", "mm_cache_hits_total", "mm_cache_misses_total", "mm_cache_type", "kv_blocks_total", "kv_blocks_free", "mm_cache_capacity_bytes", "mm_cache_curve", "mm_cache_achievable_hit_ratio", "mm_cache_curve_references", "mm_cache_recommended_bytes", "requests_in_flight")
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
    MM_CACHE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MM_CACHE_CURVE_FIELD_NUMBER: _ClassVar[int]
    MM_CACHE_ACHIEVABLE_HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    MM_CACHE_CURVE_REFERENCES_FIELD_NUMBER: _ClassVar[int]
    MM_CACHE_RECOMMENDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
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
    mm_cache_capacity_bytes: int
    mm_cache_curve: _containers.RepeatedCompositeFieldContainer[CurvePoint]
    mm_cache_achievable_hit_ratio: float
    mm_cache_curve_references: int
    mm_cache_recommended_bytes: int
    requests_in_flight: int
    def __init__(self, shm_capacity_bytes: _Optional[int] = ..., shm_used_bytes: _Optional[int] = ..., shm_objects: _Optional[int] = ..., shm_unacked_refs: _Optional[int] = ..., prefix_cache_blocks: _Optional[int] = ..., prefix_cache_hit_tokens_total: _Optional[int] = ..., mm_cache_hits_total: _Optional[int] = ..., mm_cache_misses_total: _Optional[int] = ..., mm_cache_type: _Optional[str] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., mm_cache_capacity_bytes: _Optional[int] = ..., mm_cache_curve: _Optional[_Iterable[_Union[CurvePoint, _Mapping]]] = ..., mm_cache_achievable_hit_ratio: _Optional[float] = ..., mm_cache_curve_references: _Optional[int] = ..., mm_cache_recommended_bytes: _Optional[int] = ..., requests_in_flight: _Optional[int] = ...) -> None: ...

class CurvePoint(_message.Message):
    __slots__ = ("capacity_bytes", "hit_ratio")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    hit_ratio: float
    def __init__(self, capacity_bytes: _Optional[int] = ..., hit_ratio: _Optional[float] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ImageLimits(_message.Message):
    __slots__ = ("min_pixels", "max_pixels", "max_images_per_request", "max_image_bytes", "max_input_pixels")
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_PIXELS_FIELD_NUMBER: _ClassVar[int]
    min_pixels: int
    max_pixels: int
    max_images_per_request: int
    max_image_bytes: int
    max_input_pixels: int
    def __init__(self, min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ..., max_images_per_request: _Optional[int] = ..., max_image_bytes: _Optional[int] = ..., max_input_pixels: _Optional[int] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_id", "model_type", "max_context_length", "max_prompt_tokens", "max_output_tokens", "default_max_tokens", "vocab_size", "eos_token_ids", "has_chat_template", "image_limits", "mm_cache_type", "prefix_caching", "served_model_names", "tool_call_parser")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_LIMITS_FIELD_NUMBER: _ClassVar[int]
    MM_CACHE_TYPE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_PARSER_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_type: str
    max_context_length: int
    max_prompt_tokens: int
    max_output_tokens: int
    default_max_tokens: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_chat_template: bool
    image_limits: ImageLimits
    mm_cache_type: str
    prefix_caching: bool
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    tool_call_parser: str
    def __init__(self, model_id: _Optional[str] = ..., model_type: _Optional[str] = ..., max_context_length: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_chat_template: _Optional[bool] = ..., image_limits: _Optional[_Union[ImageLimits, _Mapping]] = ..., mm_cache_type: _Optional[str] = ..., prefix_caching: _Optional[bool] = ..., served_model_names: _Optional[_Iterable[str]] = ..., tool_call_parser: _Optional[str] = ...) -> None: ...
