"""The OpenAI HTTP API's request and response bodies, as pydantic models.

Only what Tandem serves is declared. Requests forbid unknown fields, so a client asking for
something Tandem does not do (``logit_bias``, ``functions``, ...) gets a 400 naming the
field rather than an answer that silently ignored it; the few fields every SDK sends and
that change nothing here (``user``) are declared and ignored. A ``null`` field is the
same as an absent one, as in OpenAI's API. Tandem's own extensions
follow vLLM's names (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``,
``structured_outputs``) plus ``cache_salt``.
Field ranges are checked by the scheduler (one rule set for gRPC and HTTP), not here.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

# What the proto's integer fields can hold: out-of-range values are refused here, by name,
# rather than by protobuf's setter deep inside the conversion.
U32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
U64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
I32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A ``null`` field means its default, as in OpenAI's API (SDKs and proxies send
        ``"n": null``); so a field this server does not serve is refused only when set."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """OpenAI's ``response_format.json_schema``: the schema is always enforced (``strict``
    is accepted either way); no schema means any JSON value."""

    name: str = Field(max_length=64)
    description: str | None = None  # accepted, unused
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs`` extension: exactly one of these (``json``: a JSON
    schema, as an object or its text; ``grammar``: llguidance's Lark dialect)."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(_Request):
    """The sampling fields both endpoints share (``None`` = the server's default)."""

    model: str
    max_tokens: U32 | None = None
    temperature: float | None = None  # unset = 1, OpenAI's default
    top_p: float | None = None
    top_k: I32 | None = None
    min_p: float | None = None
    seed: U64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[U32] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: U32 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    cache_salt: str | None = None
    user: str | None = None  # accepted, unused


class ImageUrl(_Request):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted, unused


class TextContent(_Request):
    type: Literal["text"]
    text: str


class ImageContent(_Request):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextContent | ImageContent, Field(discriminator="type")]


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text of an object


class ToolCallIn(_Request):
    """A call an earlier assistant turn made."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted, unused
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call answered


class FunctionDefinition(_Request):
    # OpenAI's rule for function names
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # accepted: a forced call always follows the schema


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, min_length=1)  # OpenAI refuses [] too
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: a forced call is one call
    max_completion_tokens: U32 | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: U32 | None = None


class CompletionRequest(SamplingFields):
    # One prompt: a string or token ids; a list holding exactly one is accepted, as the
    # SDK may send it (several prompts in one request are refused: send one each).
    prompt: str | list[str] | list[U32] | list[list[U32]]
    logprobs: U32 | None = None  # how many top tokens per position (OpenAI: 0..5)
    echo: bool = False
    suffix: str | None = None


# --- responses ---------------------------------------------------------------------------

class _Response(BaseModel):
    pass


class PromptTokensDetails(_Response):
    cached_tokens: int


class TandemImageUsage(_Response):
    """Where one image's work came from (``Usage.images`` of the gRPC API, lowercased)."""

    key: str  # the processor-cache key: the client's uuid, else the content hash
    processor_cache: str  # hit | miss | refused ("" if unknown)
    refused_reason: str  # with refused: oversize | full | disabled
    transport: str  # shm | inline
    encoder: str  # ran | cached | skipped ("" if the request ended before it was scheduled)
    cached_tokens: int  # placeholder tokens served from the prefix cache
    tokens: int  # placeholder tokens of the image


class TandemConstraintUsage(_Response):
    """What the request's structured-output constraint cost (``Usage.constraint``)."""

    kind: str  # json_schema | json_object | regex | grammar | choice
    compile_ms: float  # waited for its compile (~0 when a cached one served it)
    cache_hit: bool  # an earlier request's compile served it


class TandemUsage(_Response):
    """Tandem's cache figures (an extension of OpenAI's usage)."""

    mm_items: int  # images in the request
    mm_cache_hits: int  # images whose processed features came from the processor cache
    encoder_runs: int  # images the workers ran through the vision encoder
    images: list[TandemImageUsage]  # one per image, in prompt order
    constraint: TandemConstraintUsage | None = None  # None: free text


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    tandem: TandemUsage


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob]


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Response):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


ChoiceT = TypeVar("ChoiceT", bound=_Response)


class _Envelope(_Response, Generic[ChoiceT]):
    """What every completion body, whole or streamed, wraps its choices in; each body
    names its ``object`` (a literal) and its choice type."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChoiceT]
    usage: Usage | None = None  # a stream's chunks carry none but (``include_usage``) the last


class ChatCompletion(_Envelope[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    usage: Usage


class Delta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    # OpenAI's form: a call's first delta {"index", "id", "type", "function": {"name",
    # "arguments": ""}}, later ones {"index", "function": {"arguments": fragment}}
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(_Response):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Envelope[ChatChunkChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Envelope[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    max_model_len: int  # vLLM's extension: prompt plus output tokens


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    """A response body as JSON-ready data (``None`` fields kept: OpenAI sends ``null``)."""
    return model.model_dump(mode="json")
