"""Wire types: the OpenAI request and response bodies, in OpenAI's field order.

Requests refuse what the engine does not do: an OpenAI field that would change the output
(penalties, ...) is accepted only with its neutral value (else a 400 naming it). A field no type
here declares is accepted and ignored at every level of a body, as vLLM and llama-server do
(newer SDKs and frameworks send such fields), and named in the response's
X-Specdec-Ignored-Fields header (serving.py), so nothing is ignored unseen. `speculative_decoding`, `top_k`, `min_p` and
`ignore_eos` are extensions, as is `stream_options.speculative` (server/speculative.py).
Conversion into engine types happens once, in convert.py.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator
from pydantic.config import JsonDict, JsonValue

from specdec.drafters.registry import method_names
from specdec.server.errors import register_field_names
from specdec.server.tools import (
    MAX_SCHEMA_DEPTH, CalledFunction, FunctionChoice, FunctionDefinition, MessageToolCall, NamedToolChoice, ToolCall,
    ToolCallDelta, ToolChoice, ToolDefinition, Tools, json_depth,
)

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
    # strict: a value of the wrong JSON type is refused (as OpenAI does), never coerced ("8" is no integer);
    # extra "allow": an unknown field is kept aside (model_extra), ignored and named in a header
    model_config = ConfigDict(extra="allow", strict=True, ser_json_inf_nan="null")


def _whole_number(value):
    """JSON Schema counts 8.0 as an integer, so a request may send it; strict mode refuses any other float."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds) -> Any:
    """An integer field (bounds as Field's ge/le); the bounds first, so that the schema shows them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole_number)]


# mypy takes no call as a type: it sees the aliases that integer() and _neutral() build as the values they hold.
if TYPE_CHECKING:
    Int = int
    Penalty = Optional[float]
    TopK = Optional[int]
    MaxTokens = Optional[int]
    FalseOnly = Optional[bool]
    EmptyList = Optional[list[dict[str, Any]]]
    ZeroOnly = Optional[int]
    NullOnly = Optional[Any]
    TextFormat = Optional[dict[str, Any]]
    TextModality = Optional[list[str]]
    ServiceTier = Optional[str]
    NoFunctionCall = Union[str, dict[str, Any], None]
else:
    Int = integer()
    Penalty = _neutral(Annotated[Optional[float], Field(allow_inf_nan=False)], "0", lambda v: v == 0, [{"const": 0}])
    TopK = Annotated[Optional[integer(ge=-1, le=TOKEN_LIMIT)], Field(description="0 or -1 disables it")]
    MaxTokens = Optional[integer(ge=1, le=TOKEN_LIMIT)]
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
    NoFunctionCall = _neutral(Union[str, dict[str, Any], None], '"none"', lambda v: v == "none", [{"const": "none"}])
Temperature = Annotated[Optional[float], Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[Optional[float], Field(gt=0.0, le=1.0, allow_inf_nan=False)]
MinP = Annotated[Optional[float], Field(ge=0.0, le=1.0, allow_inf_nan=False)]
# Any integer, taken modulo 2**64: a bound near 2**64 would not survive JSON Schema validators that
# compare in floating point (schemathesis sent 2**64 + 383 as valid).
Seed = Annotated[Optional[Int], Field(description="any integer (taken modulo 2**64)")]
StopString = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]
Stop = Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)], None]
MAX_LOGIT_BIAS_ENTRIES = 1024
_TOKEN_ID_KEY = r"^[0-9]{1,10}$"


def _token_id_keys(value):
    if value is not None and len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    if value is not None and any(not re.match(_TOKEN_ID_KEY, key) for key in value):
        raise ValueError("keys must be token ids (decimal integers)")
    return value


LogitBias = Annotated[
    Optional[dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]]],
    AfterValidator(_token_id_keys),
    WithJsonSchema({"anyOf": [{"type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
                               "propertyNames": {"pattern": _TOKEN_ID_KEY},
                               "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
                              {"type": "null"}],
                    "description": "token id -> bias in [-100, 100], added to the target's logits (-100 bans "
                                   "the token); speculation stays exact: proposals are verified against the "
                                   "biased target"})]


MAX_CHOICES = 8  # n: each choice takes a slot (or a place in the queue) of its own
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat; its legacy completions stop at 5, this server at 20
if TYPE_CHECKING:  # as above: integer() builds them
    N = Optional[int]
    TopLogprobs = Optional[int]
    CompletionLogprobs = Optional[int]
else:
    N = Annotated[Optional[integer(ge=1, le=MAX_CHOICES)],
                  Field(description=f"how many choices to generate (1 to {MAX_CHOICES}), each as a request of its own")]
    TopLogprobs = Annotated[Optional[integer(ge=0, le=MAX_TOP_LOGPROBS)], Field(
        description="how many most likely tokens to list at each position (needs logprobs: true)")]
    CompletionLogprobs = Annotated[Optional[integer(ge=0, le=MAX_TOP_LOGPROBS)], Field(
        description="log-probabilities of the chosen tokens and this many most likely tokens at each position")]


class StreamSpeculative(_Strict):
    rejected: Optional[bool] = Field(default=None, description="also the text of each round's rejected proposal")


class TextResponseFormat(_Strict):
    type: Literal["text"]


class JSONObjectResponseFormat(_Strict):
    type: Literal["json_object"]


MAX_SCHEMA_NAME = 64


def _shallow(value):
    # before anything walks it: a schema nested ~1000 deep overflows json.dumps (a 500, not a 400)
    if json_depth(value) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep")
    return value


ResponseSchema = Annotated[Optional[dict[str, Any]], BeforeValidator(_shallow), Field(
    alias="schema", description=f"a JSON Schema, nesting at most {MAX_SCHEMA_DEPTH} deep")]


class JSONSchemaSpec(_Strict):
    """OpenAI's `json_schema`: the schema is enforced token by token whether or not `strict` is set."""

    model_config = ConfigDict(populate_by_name=True)
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]+$", min_length=1, max_length=MAX_SCHEMA_NAME)]
    description: Optional[str] = None
    json_schema: ResponseSchema = None
    strict: Optional[bool] = None


class JSONSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[
    Union[TextResponseFormat, JSONObjectResponseFormat, JSONSchemaResponseFormat, None],
    Field(discriminator="type", description="text, json_object, or json_schema (enforced by constrained decoding)"),
]


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None
    # Extension: every chunk names who produced its tokens (docs/server.md, "Token sources").
    speculative: Union[bool, StreamSpeculative, None] = Field(
        default=None, description="specdec extension: true (or {rejected: true}) adds a `speculative` object to every chunk")


if TYPE_CHECKING:  # as above: integer() builds it
    SpeculativeTokens = Optional[int]
else:
    SpeculativeTokens = Optional[integer(ge=0, le=32)]


def _registered_method(value: str) -> str:
    """A drafting method's name, checked against the registry when the request arrives (so a
    method registered after this module loaded counts)."""
    names = method_names()
    if value not in names:
        quoted = [repr(name) for name in names]
        raise ValueError(f"Input should be {', '.join(quoted[:-1])} or {quoted[-1]}")  # pydantic's Literal wording
    return value


class _RegisteredMethods:
    """The schema's `enum`: the methods registered when the schema is built (FastAPI builds it once)."""

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler) -> JsonDict:
        return {**handler(core_schema), "enum": list(method_names())}


if TYPE_CHECKING:
    MethodName = str
else:
    MethodName = Annotated[str, AfterValidator(_registered_method), _RegisteredMethods]


class SpeculativeDecoding(_Strict):
    """Per-request speculation: `auto` is the engine's adaptive choice; no method means the server's."""

    method: Optional[MethodName] = None
    num_speculative_tokens: SpeculativeTokens = None


SpeculativeField = Annotated[
    Union[bool, SpeculativeDecoding, None],
    Field(description="true (default: the server's method), false (plain decoding), or {method, num_speculative_tokens}"),
]


# `stream_options` only with `stream: true`, in the schema as in the validator below.
_STREAM_OPTIONS_NEED_STREAM: JsonDict = {
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


def _when_role(roles: list[JsonValue], then: JsonDict, otherwise: Optional[JsonDict] = None) -> JsonDict:
    rule: JsonDict = {"if": {"properties": {"role": {"enum": roles}}}, "then": then}
    return {**rule, "else": otherwise} if otherwise is not None else rule


_PRESENT: JsonDict = {"not": {"type": "null"}}
# Which fields a role takes, in the schema as in tools.check_tools: content (null only in an
# assistant message with tool_calls), tool_call_id (tool messages only), tool_calls (assistant only).
_MESSAGE_ROLES: JsonDict = {"allOf": [
    _when_role(["assistant"], {"anyOf": [{"required": ["content"], "properties": {"content": _PRESENT}},
                                         {"required": ["tool_calls"], "properties": {"tool_calls": {
                                             "type": "array", "minItems": 1}}}]},
               {"required": ["content"], "properties": {"content": _PRESENT, "tool_calls": {"type": "null"}}}),
    _when_role(["tool"], {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
               {"properties": {"tool_call_id": {"type": "null"}}}),
]}


class ChatMessage(_Strict):
    """One message; which fields a role takes (tool_call_id: tool; tool_calls and a null content:
    assistant) is checked in tools.check_tools, with a 400 naming the field."""

    model_config = ConfigDict(json_schema_extra=_MESSAGE_ROLES)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextContentPart], None] = Field(
        default=None, validate_default=True, description="required, except in an assistant message with tool_calls")
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None
    tool_call_id: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_present(cls, value, info):
        # absent content: pydantic's own "Field required" for every role but assistant's
        if value is None and info.data.get("role") not in (None, "assistant"):
            raise ValueError("required (only an assistant message with tool_calls may leave it null)")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


# tool_choice "required" or naming a function only with tools, in the schema as in tools.check_tools.
_TOOL_CHOICE_NEEDS_TOOLS: JsonDict = {
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": ["none", "auto", None]}}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
}


# top_logprobs > 0 only with `logprobs: true`, in the schema as in the validator below.
_TOP_LOGPROBS_NEED_LOGPROBS: JsonDict = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}


class ChatCompletionRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM, _TOP_LOGPROBS_NEED_LOGPROBS,
                                                           _TOOL_CHOICE_NEEDS_TOOLS]})

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    model: str
    audio: NullOnly = None
    frequency_penalty: Penalty = None
    function_call: NoFunctionCall = None
    functions: EmptyList = None
    logit_bias: LogitBias = None
    logprobs: Optional[bool] = None
    max_completion_tokens: MaxTokens = None
    max_tokens: MaxTokens = None
    metadata: Optional[dict[str, str]] = None
    modalities: TextModality = None
    n: N = None
    parallel_tool_calls: Optional[bool] = None
    prediction: NullOnly = None
    presence_penalty: Penalty = None
    reasoning_effort: NullOnly = None
    response_format: ResponseFormat = None
    seed: Seed = None
    service_tier: ServiceTier = None
    stop: Stop = None
    store: FalseOnly = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Temperature = None
    tool_choice: Optional[ToolChoice] = None
    tools: Optional[Tools] = None
    top_logprobs: TopLogprobs = None
    top_p: TopP = None
    user: Optional[str] = None
    web_search_options: NullOnly = None
    # Extensions (not in OpenAI's API).
    top_k: TopK = None
    min_p: MinP = None
    ignore_eos: Optional[bool] = None
    cache_prompt: Optional[bool] = None  # llama-server's: false processes the whole prompt again
    speculative_decoding: SpeculativeField = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("only allowed when logprobs is true")
        return value


# -- completions ---------------------------------------------------------------------------------
if TYPE_CHECKING:  # as above: integer() builds it
    PromptTokens = list[int]
else:
    PromptTokens = Annotated[list[integer(ge=0, le=TOKEN_LIMIT)], Field(min_length=1)]


MAX_PROMPTS = 16  # a list of prompts: each with its n choices, all queued together or none

Prompt = Annotated[
    Union[Annotated[str, Field(min_length=1)],
          Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)],
          PromptTokens,
          Annotated[list[PromptTokens], Field(min_length=1, max_length=MAX_PROMPTS)]],
    Field(description=f"a string, a list of token ids, or a list of up to {MAX_PROMPTS} of either "
                      "(each prompt its own choices)"),
]


if TYPE_CHECKING:  # as above: _neutral() builds it
    BestOf = Optional[int]
else:
    BestOf = _neutral(Optional[Int], "1", lambda v: v == 1, [{"const": 1}])


class CompletionRequest(_Request):
    model: str
    prompt: Prompt
    best_of: BestOf = None
    echo: Annotated[Optional[bool], Field(description="return the prompt before the completion")] = None
    frequency_penalty: Penalty = None
    logit_bias: LogitBias = None
    logprobs: CompletionLogprobs = None
    max_tokens: MaxTokens = None
    n: N = None
    presence_penalty: Penalty = None
    seed: Seed = None
    stop: Stop = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    # Fill-in-the-middle in the model's FIM tokens (server/fim.py); "" or null: a plain completion.
    suffix: Optional[str] = None
    temperature: Temperature = None
    top_p: TopP = None
    user: Optional[str] = None
    # Extensions (not in OpenAI's API).
    top_k: TopK = None
    min_p: MinP = None
    ignore_eos: Optional[bool] = None
    cache_prompt: Optional[bool] = None  # llama-server's: false processes the whole prompt again
    speculative_decoding: SpeculativeField = None
    response_format: ResponseFormat = None  # as on chat (vLLM takes it on completions too)


# -- responses -----------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    speculative: Optional[dict[str, Any]] = Field(
        default=None, description="the engine's speculative decoding statistics for this request (specdec extension)")


FinishReason = Optional[Literal["stop", "length"]]
ChatFinishReason = Optional[Literal["stop", "length", "tool_calls"]]  # tool_calls: the model called tools


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(default=None, exclude_if=lambda value: value is None)


class TopLogprob(BaseModel):
    token: str  # the token's bytes decoded (a partial UTF-8 character as U+FFFD)
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: ChatFinishReason = None


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
    tool_calls: Optional[list[ToolCallDelta]] = Field(default=None, exclude_if=lambda value: value is None)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: ChatFinishReason = None


class SpeculativeRound(BaseModel):
    method: str = Field(description='the proposal\'s source ("draft", "ngram", "cache", "hybrid", "grammar"), '
                                    'or "none": the target decoded one token alone')
    proposed: int
    accepted: int
    rejected: Optional[str] = Field(default=None, exclude_if=lambda value: value is None,
                                    description="the rejected proposal's text, when asked (stream_options)")


class SpeculativeChunk(BaseModel):
    """A chunk's `speculative` extension (stream_options.speculative): over a stream, `sources`
    holds one entry per completion token, in order."""

    sources: list[str] = Field(description='who produced each token whose text ends in this chunk: "target", or the '
                                           "source whose proposal the target accepted; on the finish_reason chunk, "
                                           "the tokens whose text was never sent (a stop string cut it)")
    rounds: list[SpeculativeRound] = Field(description="the decoding rounds whose last token is in this chunk")


SpeculativeExtension = Annotated[Optional[SpeculativeChunk], Field(
    exclude_if=lambda value: value is None, description="specdec extension, only when stream_options.speculative")]


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    speculative: SpeculativeExtension = None


class TextLogprobs(BaseModel):
    """OpenAI's legacy shape: per token its text, log-probability (null for the first prompt token
    under echo), the most likely tokens as {text: log-probability}, and where its text starts."""

    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: Optional[TextLogprobs] = None
    finish_reason: FinishReason = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None
    speculative: SpeculativeExtension = None  # in streamed chunks only


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
                       ToolDefinition, FunctionDefinition, NamedToolChoice, FunctionChoice, MessageToolCall,
                       CalledFunction,
                       StreamSpeculative, SpeculativeDecoding, JSONSchemaResponseFormat, JSONSchemaSpec)
    for name in model.model_fields
)
register_field_names(["schema"])  # JSONSchemaSpec's alias
