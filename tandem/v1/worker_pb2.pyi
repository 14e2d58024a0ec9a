from tandem.v1 import generate_pb2 as _generate_pb2
from tandem.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model", "model_config_json", "device", "dtype", "num_kv_blocks", "block_size", "rank", "world_size", "segment_generation", "last_step_id", "last_step_generation")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_GENERATION_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_config_json: str
    device: str
    dtype: str
    num_kv_blocks: int
    block_size: int
    rank: int
    world_size: int
    segment_generation: int
    last_step_id: int
    last_step_generation: int
    def __init__(self, model: _Optional[str] = ..., model_config_json: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., segment_generation: _Optional[int] = ..., last_step_id: _Optional[int] = ..., last_step_generation: _Optional[int] = ...) -> None: ...

class AcknowledgeRequest(_message.Message):
    __slots__ = ("segment_name", "segment_generation", "steps")
    SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    segment_name: str
    segment_generation: int
    steps: _containers.RepeatedCompositeFieldContainer[UnseenStep]
    def __init__(self, segment_name: _Optional[str] = ..., segment_generation: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[UnseenStep, _Mapping]]] = ...) -> None: ...

class UnseenStep(_message.Message):
    __slots__ = ("step_id", "items")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    items: _containers.RepeatedCompositeFieldContainer[ShmAddress]
    def __init__(self, step_id: _Optional[int] = ..., items: _Optional[_Iterable[_Union[ShmAddress, _Mapping]]] = ...) -> None: ...

class AcknowledgeResponse(_message.Message):
    __slots__ = ("acked", "last_step_id")
    ACKED_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    acked: int
    last_step_id: int
    def __init__(self, acked: _Optional[int] = ..., last_step_id: _Optional[int] = ...) -> None: ...

class FeatureField(_message.Message):
    __slots__ = ("name", "tensor", "keep_on_cpu")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    KEEP_ON_CPU_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: _tensor_pb2.Tensor
    keep_on_cpu: bool
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., keep_on_cpu: _Optional[bool] = ...) -> None: ...

class FeatureItem(_message.Message):
    __slots__ = ("fields",)
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    fields: _containers.RepeatedCompositeFieldContainer[FeatureField]
    def __init__(self, fields: _Optional[_Iterable[_Union[FeatureField, _Mapping]]] = ...) -> None: ...

class ShmAddress(_message.Message):
    __slots__ = ("generation", "address", "monotonic_id", "refs", "nbytes")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MONOTONIC_ID_FIELD_NUMBER: _ClassVar[int]
    REFS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    generation: int
    address: int
    monotonic_id: int
    refs: int
    nbytes: int
    def __init__(self, generation: _Optional[int] = ..., address: _Optional[int] = ..., monotonic_id: _Optional[int] = ..., refs: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Feature(_message.Message):
    __slots__ = ("identifier", "modality", "offset", "length", "item", "shm")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    ITEM_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    modality: str
    offset: int
    length: int
    item: FeatureItem
    shm: ShmAddress
    def __init__(self, identifier: _Optional[str] = ..., modality: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., item: _Optional[_Union[FeatureItem, _Mapping]] = ..., shm: _Optional[_Union[ShmAddress, _Mapping]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "features", "sampling", "block_ids", "num_computed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    features: _containers.RepeatedCompositeFieldContainer[Feature]
    sampling: _generate_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., features: _Optional[_Iterable[_Union[Feature, _Mapping]]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("request_id", "new_block_ids", "num_computed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class EncoderInputs(_message.Message):
    __slots__ = ("feature_indices",)
    FEATURE_INDICES_FIELD_NUMBER: _ClassVar[int]
    feature_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, feature_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "segment_name", "segment_generation", "new_requests", "cached_requests", "num_scheduled_tokens", "scheduled_encoder_inputs", "free_encoder_mm_hashes", "finished_request_ids", "trace_context", "token_masks", "deferred_mask_ids")
    class NumScheduledTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ScheduledEncoderInputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: EncoderInputs
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[EncoderInputs, _Mapping]] = ...) -> None: ...
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class TokenMasksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_ENCODER_INPUTS_FIELD_NUMBER: _ClassVar[int]
    FREE_ENCODER_MM_HASHES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_MASK_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    segment_name: str
    segment_generation: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    num_scheduled_tokens: _containers.ScalarMap[str, int]
    scheduled_encoder_inputs: _containers.MessageMap[str, EncoderInputs]
    free_encoder_mm_hashes: _containers.RepeatedScalarFieldContainer[str]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    trace_context: _containers.ScalarMap[str, str]
    token_masks: _containers.ScalarMap[str, bytes]
    deferred_mask_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., segment_name: _Optional[str] = ..., segment_generation: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., num_scheduled_tokens: _Optional[_Mapping[str, int]] = ..., scheduled_encoder_inputs: _Optional[_Mapping[str, EncoderInputs]] = ..., free_encoder_mm_hashes: _Optional[_Iterable[str]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., token_masks: _Optional[_Mapping[str, bytes]] = ..., deferred_mask_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StepMasks(_message.Message):
    __slots__ = ("step_id", "token_masks")
    class TokenMasksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    token_masks: _containers.ScalarMap[str, bytes]
    def __init__(self, step_id: _Optional[int] = ..., token_masks: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class SampledTokens(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[SampledLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[SampledLogprobs, _Mapping]]] = ...) -> None: ...

class SampledLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "sampled", "shm_resolved", "shm_acked", "encoder_runs")
    class SampledEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SampledTokens
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[SampledTokens, _Mapping]] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    SHM_RESOLVED_FIELD_NUMBER: _ClassVar[int]
    SHM_ACKED_FIELD_NUMBER: _ClassVar[int]
    ENCODER_RUNS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.MessageMap[str, SampledTokens]
    shm_resolved: int
    shm_acked: int
    encoder_runs: int
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Mapping[str, SampledTokens]] = ..., shm_resolved: _Optional[int] = ..., shm_acked: _Optional[int] = ..., encoder_runs: _Optional[int] = ...) -> None: ...

class StepsRequest(_message.Message):
    __slots__ = ("step", "masks")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    step: StepRequest
    masks: StepMasks
    def __init__(self, step: _Optional[_Union[StepRequest, _Mapping]] = ..., masks: _Optional[_Union[StepMasks, _Mapping]] = ...) -> None: ...

class StepsResponse(_message.Message):
    __slots__ = ("step_id", "done", "error", "not_run")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NOT_RUN_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    done: StepResponse
    error: StepError
    not_run: bool
    def __init__(self, step_id: _Optional[int] = ..., done: _Optional[_Union[StepResponse, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., not_run: _Optional[bool] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
