"""Wire types: the OpenAI request and response bodies, in OpenAI's field order.

Requests refuse what the engine does not do: an OpenAI field that would change the output
(tools, logprobs, penalties, ...) is accepted only with its neutral value, and an unknown field is
refused, so nothing is ever silently ignored. `speculative_decoding`, `top_k`, `min_p` and
`ignore_eos` are extensions. Conversion into engine types happens once, in convert.py.
"""
from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator

from specdec.server.errors import register_field_names

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 512
TOKEN_LIMIT = 2**31 - 1


def _neutral(annotation, description: str, is_neutral: Callable[[Any], bool], accepted: list) -> Any:
    """An OpenAI field this server does not implement: only its neutral value passes (and null).

    The OpenAPI schema lists exactly the accepted values; a request with any other value gets a
    400 naming the field, whatever its type.
    """

    def check(value):
        if value is not None and not is_neutral(value):
            raise ValueError(f"not supported by this server (only {description} is accepted)")
        return value

    schema = {"anyOf": [*accepted, {"type": "null"}],
              "description": f"Not supported by this server: only {description} (or null) is accepted."}
    return Annotated[annotation, AfterValidator(check), WithJsonSchema(schema)]


def _unsupported(annotation) -> Any:
    return _neutral(annotation, "null", lambda value: False, [])


class _Strict(BaseModel):
    # strict: a value of the wrong JSON type is refused (as OpenAI does), never coerced ("8" is no integer)
    model_config = ConfigDict(extra="forbid", strict=True, ser_json_inf_nan="null")


def _whole_number(value):
    """JSON Schema counts 8.0 as an integer, so a request may send it; strict mode refuses any other float."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds) -> Any:
    """An integer field (bounds as Field's ge/le); the bounds first, so that the schema shows them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole_number)]


Int = integer()
Penalty = _neutral(Annotated[Optional[float], Field(allow_inf_nan=False)], "0", lambda v: v == 0, [{"const": 0}])
Temperature = Annotated[Optional[float], Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[Optional[float], Field(gt=0.0, le=1.0, allow_inf_nan=False)]
MinP = Annotated[Optional[float], Field(ge=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[Optional[integer(ge=-1, le=TOKEN_LIMIT)], Field(description="0 or -1 disables it")]
# Any integer, taken modulo 2**64: a bound near 2**64 would not survive JSON Schema validators that
# compare in floating point (schemathesis sent 2**64 + 383 as valid).
Seed = Annotated[Optional[Int], Field(description="any integer (taken modulo 2**64)")]
MaxTokens = Optional[integer(ge=1, le=TOKEN_LIMIT)]
StopString = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]
Stop = Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)], None]
FalseOnly = _neutral(Optional[bool], "false", lambda v: v is False, [{"const": False}])
EmptyList = _neutral(Optional[list[dict[str, Any]]], "an empty list", lambda v: not v, [{"type": "array", "maxItems": 0}])
ZeroOnly = _neutral(Optional[Int], "0", lambda v: v == 0, [{"const": 0}])
NullOnly = _unsupported(Optional[Any])
TextFormat = _neutral(Optional[dict[str, Any]], '{"type": "text"}', lambda v: v == {"type": "text"}, [{
    "type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"], "additionalProperties": False}])
TextModality = _neutral(Optional[list[str]], '["text"]', lambda v: v == ["text"],
                        [{"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}])
ServiceTier = _neutral(Optional[str], '"auto" or "default"', lambda v: v in ("auto", "default"),
                       [{"enum": ["auto", "default"]}])
NoToolChoice = _neutral(Union[str, dict[str, Any], None], '"none" or "auto" (no tools)', lambda v: v in ("none", "auto"),
                        [{"enum": ["none", "auto"]}])
NoFunctionCall = _neutral(Union[str, dict[str, Any], None], '"none"', lambda v: v == "none", [{"const": "none"}])
LogitBias = _neutral(Optional[dict[str, float]], "an empty object", lambda v: not v, [{"type": "object", "maxProperties": 0}])


def _only_one(value: Optional[int]) -> Optional[int]:
    if value is not None and value != 1:
        raise ValueError("only n=1 is supported; send one request per completion")
    return value


N = Annotated[Optional[Int], AfterValidator(_only_one),
              WithJsonSchema({"anyOf": [{"const": 1}, {"type": "null"}], "description": "only 1 is supported"})]


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None


class SpeculativeDecoding(_Strict):
    """Per-request speculation: `auto` is the engine's adaptive choice; no method means the server's."""

    method: Optional[Literal["draft", "ngram", "off", "auto"]] = None
    num_speculative_tokens: Optional[integer(ge=0, le=32)] = None


SpeculativeField = Annotated[
    Union[bool, SpeculativeDecoding, None],
    Field(description="true (default: the server's method), false (plain decoding), or {method, num_speculative_tokens}"),
]


# `stream_options` only with `stream: true`, in the schema as in the validator below.
_STREAM_OPTIONS_NEED_STREAM = {
    "if": {"not": {"required": ["stream"], "properties": {"stream": {"const": True}}}},
    "then": {"properties": {"stream_options": {"type": "null"}}},
}


class _Request(_Strict):
    model_config = ConfigDict(json_schema_extra=_STREAM_OPTIONS_NEED_STREAM)

    @field_validator("stream_options", check_fields=False)
    @classmethod
    def _stream_options_need_stream(cls, value, info):
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value


# -- chat ----------------------------------------------------------------------------------------
class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextContentPart]]
    name: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    model: str
    audio: NullOnly = None
    frequency_penalty: Penalty = None
    function_call: NoFunctionCall = None
    functions: EmptyList = None
    logit_bias: LogitBias = None
    logprobs: FalseOnly = None
    max_completion_tokens: MaxTokens = None
    max_tokens: MaxTokens = None
    metadata: Optional[dict[str, str]] = None
    modalities: TextModality = None
    n: N = None
    parallel_tool_calls: Optional[bool] = None
    prediction: NullOnly = None
    presence_penalty: Penalty = None
    reasoning_effort: NullOnly = None
    response_format: TextFormat = None
    seed: Seed = None
    service_tier: ServiceTier = None
    stop: Stop = None
    store: FalseOnly = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Temperature = None
    tool_choice: NoToolChoice = None
    tools: EmptyList = None
    top_logprobs: ZeroOnly = None
    top_p: TopP = None
    user: Optional[str] = None
    web_search_options: NullOnly = None
    # Extensions (not in OpenAI's API).
    top_k: TopK = None
    min_p: MinP = None
    ignore_eos: Optional[bool] = None
    cache_prompt: Optional[bool] = None  # llama-server's: false processes the whole prompt again
    speculative_decoding: SpeculativeField = None


# -- completions ---------------------------------------------------------------------------------
PromptTokens = Annotated[list[integer(ge=0, le=TOKEN_LIMIT)], Field(min_length=1)]


def _one_prompt(value):
    if isinstance(value, list) and len(value) > 1 and isinstance(value[0], (str, list)):
        raise ValueError("batched prompts are not supported; send one prompt per request")
    return value


Prompt = Annotated[
    Union[Annotated[str, Field(min_length=1)],
          Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)],
          PromptTokens],
    BeforeValidator(_one_prompt),
    Field(description="a string, a list holding one string, or a list of token ids"),
]


class CompletionRequest(_Request):
    model: str
    prompt: Prompt
    best_of: _neutral(Optional[Int], "1", lambda v: v == 1, [{"const": 1}]) = None
    echo: FalseOnly = None
    frequency_penalty: Penalty = None
    logit_bias: LogitBias = None
    logprobs: NullOnly = None
    max_tokens: MaxTokens = None
    n: N = None
    presence_penalty: Penalty = None
    seed: Seed = None
    stop: Stop = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    suffix: _neutral(Optional[str], '""', lambda v: v == "", [{"const": ""}]) = None
    temperature: Temperature = None
    top_p: TopP = None
    user: Optional[str] = None
    # Extensions (not in OpenAI's API).
    top_k: TopK = None
    min_p: MinP = None
    ignore_eos: Optional[bool] = None
    cache_prompt: Optional[bool] = None  # llama-server's: false processes the whole prompt again
    speculative_decoding: SpeculativeField = None


# -- responses -----------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    speculative: Optional[dict[str, Any]] = Field(
        None, description="the engine's speculative decoding statistics for this request (specdec extension)")


FinishReason = Optional[Literal["stop", "length"]]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: FinishReason = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: FinishReason = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    """OpenAI's error object: all four keys, always (param and code may be null)."""

    model_config = ConfigDict(extra="forbid")
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    """Every error body, and the one error event that ends a failed stream."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


register_field_names(
    name for model in (ChatCompletionRequest, CompletionRequest, ChatMessage, TextContentPart, StreamOptions,
                       SpeculativeDecoding) for name in model.model_fields
)
