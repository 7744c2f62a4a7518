"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) as a surface of the
serving core: what the OpenAI SDK's `responses.create`, the Agents SDK and Codex CLI send.

A request becomes the chat request it means (the conversation as chat messages, its function
tools, its text format as response_format), so its prompt, its tools' grammar and its sampling
are made exactly as chat completions makes them; the answer's text is read into output items
(turns.py): a message with output_text, then function_call items.

- `input`: a string, or items: messages of every role (`developer` as system) with text parts,
  `function_call` and `function_call_output` items; `reasoning` items a client passes back are
  dropped (this model writes none). Images and files are a 400.
- tools: `function`, and the functions inside a `namespace` tool (offered as `namespace__name`,
  their calls returned with `namespace` and `name`, so the client can route them); built-in tools
  the server cannot run (`web_search`, `file_search`, ...) are left out of what the model is
  offered, and a 400 only when `tool_choice` forces one. `custom` tools are offered as functions
  taking one string, `input`, and returned as `custom_tool_call` items (a regex format enforced
  on it, a Lark format not).
- `store` (default true) keeps the response, with the conversation it ends, for
  `previous_response_id` and `GET /v1/responses/{id}`: per tenant, in bounded memory, lost on
  restart.
- Streaming: response.created, response.in_progress, then per item output_item.added,
  content_part.added, output_text.delta..., output_text.done, content_part.done (messages) or
  function_call_arguments.delta..., function_call_arguments.done (calls), output_item.done; then
  response.completed (response.incomplete when max_output_tokens cut it), each with its
  sequence_number. A failure is an `error` event, then response.failed.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from fastapi import Request
from pydantic import Field
from starlette.responses import Response

from specdec.engine.engine import Engine
from specdec.server.choices import usage_of
from specdec.server.convert import (
    chat_request_of, check_model, check_prompt_size, encode_prompt, generation_request,
)
from specdec.server.errors import APIError, bad_request, json_response
from specdec.server.protocol import (
    ChatCompletionRequest, MaxTokens, SpeculativeField, Temperature, TopK, TopP, _neutral, _Strict,
)
from specdec.server.serving import Collected, finish_reason_of, ignored_fields, respond, state_of, submit, tenant_of
from specdec.server.sse import KEEPALIVE, sse_event
from specdec.server.tickets import Started
from specdec.server.tools import calls_finish_reason, tool_names
from specdec.server.turns import Block, Closed, Grew, Opened, Turn
from specdec.types import GenerationRequest, StreamEvent

NAMESPACE_SEPARATOR = "__"
BUILT_IN_TOOLS = frozenset({"web_search", "web_search_preview", "web_search_2025_08_26", "file_search",
                            "computer_use", "computer_use_preview", "code_interpreter", "image_generation", "mcp",
                            "local_shell", "shell", "apply_patch"})
MAX_STORED_PER_TENANT = 256
MAX_STORED_TOTAL = 2048


if TYPE_CHECKING:  # mypy takes no call as a type (as in protocol.py): the values these hold
    _Background = Optional[bool]
    _Conversation = Optional[Any]
else:
    _Background = _neutral(Optional[bool], "false", lambda v: v is False, [{"const": False}])
    _Conversation = _neutral(Optional[Any], "null", lambda v: False, [])


class TextOptions(_Strict):
    format: Optional[dict[str, Any]] = None
    verbosity: Optional[str] = None


class ResponsesRequest(_Strict):
    """The body of POST /v1/responses. Items and tools are read in `conversation_of` (400s name
    the item); fields that only steer OpenAI's own service are accepted and ignored."""

    model: str
    input: Union[str, list[dict[str, Any]]] = Field(min_length=1)
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextOptions] = None
    max_output_tokens: MaxTokens = None
    temperature: Temperature = None
    top_p: TopP = None
    stream: Optional[bool] = False
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    reasoning: Optional[dict[str, Any]] = None  # a model that does not reason: read and unused
    include: Optional[list[str]] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    user: Optional[str] = None
    service_tier: Optional[str] = None
    truncation: Optional[Literal["disabled", "auto"]] = None
    background: _Background = None
    conversation: _Conversation = None
    stream_options: Optional[dict[str, Any]] = None
    # Extensions, as on chat completions.
    top_k: TopK = None
    seed: Optional[int] = None
    speculative_decoding: SpeculativeField = None


# -- the store -----------------------------------------------------------------------------------
class ResponseStore:
    """Stored responses by tenant: the response object and the chat messages of the conversation
    it ends (its input and its output), LRU, bounded per tenant and in all."""

    def __init__(self, per_tenant: int = MAX_STORED_PER_TENANT, total: int = MAX_STORED_TOTAL):
        self.per_tenant, self.total = per_tenant, total
        self._items: OrderedDict[tuple[Optional[str], str], tuple[dict, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, tenant: Optional[str], response: dict, messages: list[dict]) -> None:
        with self._lock:
            self._items[(tenant, response["id"])] = (response, messages)
            mine = [key for key in self._items if key[0] == tenant]
            for key in mine[:max(0, len(mine) - self.per_tenant)]:
                del self._items[key]
            while len(self._items) > self.total:
                self._items.popitem(last=False)

    def get(self, tenant: Optional[str], response_id: str) -> Optional[tuple[dict, list[dict]]]:
        with self._lock:
            found = self._items.get((tenant, response_id))
            if found is not None:
                self._items.move_to_end((tenant, response_id))
            return found


def store_of(request: Request) -> ResponseStore:
    state = request.app.state
    if not hasattr(state, "responses_store"):
        state.responses_store = ResponseStore()
    return state.responses_store


def not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response has the id {response_id!r} (responses are kept in memory, per API "
                         "key, and lost on restart).", "invalid_request_error", "previous_response_id", "not_found")


# -- the request ---------------------------------------------------------------------------------
class Offered:
    """The tools the model is offered, and how a call's name maps back to the client's tool."""

    def __init__(self) -> None:
        self.tools: list[dict] = []  # chat completions' tool definitions
        self.origin: dict[str, tuple[str, Optional[str], str]] = {}  # offered name -> (kind, namespace, name)

    def add(self, name: str, description: Optional[str], parameters: Any, kind: str, namespace: Optional[str],
            param: str) -> None:
        offered = f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name
        if offered in self.origin:
            raise bad_request(f"{param}: a second tool named {offered!r}.", param, "invalid_tools")
        function: dict[str, Any] = {"name": offered}
        if description is not None:
            function["description"] = description
        if parameters is not None:
            function["parameters"] = parameters
        self.tools.append({"type": "function", "function": function})
        self.origin[offered] = (kind, namespace, name)


def custom_parameters(form: Any, param: str) -> dict:
    """A custom tool's free-form input as the one string argument `input`; a regex format holds
    that string to the regex exactly, as a JSON schema's `pattern` (a Lark format is not enforced)."""
    text: dict[str, Any] = {"type": "string"}
    if isinstance(form, dict) and form.get("type") == "grammar" and form.get("syntax") == "regex":
        definition = form.get("definition")
        if not isinstance(definition, str):
            raise bad_request(f"{param}.format.definition: required (the regex).", f"{param}.format.definition")
        text["pattern"] = f"^(?:{definition})$"
    return {"type": "object", "properties": {"input": text}, "required": ["input"], "additionalProperties": False}


def offered_tools(tools: list[dict[str, Any]]) -> Offered:
    offered = Offered()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        kind = tool.get("type")
        if kind == "function":
            offered.add(_name(tool, param), tool.get("description"), tool.get("parameters"), "function", None, param)
        elif kind == "namespace":
            namespace = _name(tool, param)
            for j, inner in enumerate(tool.get("tools") or []):
                where = f"{param}.tools[{j}]"
                if not isinstance(inner, dict) or inner.get("type", "function") != "function":
                    continue  # a namespace's non-function tools are the client's to run, not the model's
                offered.add(_name(inner, where), inner.get("description"), inner.get("parameters"), "function",
                            namespace, where)
        elif kind == "custom":
            offered.add(_name(tool, param), tool.get("description"), custom_parameters(tool.get("format"), param),
                        "custom", None, param)
        elif not isinstance(kind, str):
            raise bad_request(f"{param}.type: required (a string).", f"{param}.type")
        # built-in and unknown tool types: this server cannot run them, so the model is not offered them
    return offered


def _name(tool: Any, param: str) -> str:
    name = tool.get("name") if isinstance(tool, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request(f"{param}.name: required (a string).", f"{param}.name")
    return name


def _choice(choice: Union[str, dict, None], offered: Offered) -> tuple[Any, Offered]:
    """tool_choice in chat completions' terms, and the tools left to offer."""
    if choice is None or isinstance(choice, str):
        return choice, offered
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = choice.get("name")
        namespace = choice.get("namespace")
        offered_name = f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name
        if offered_name not in offered.origin:
            raise bad_request(f"tool_choice.name: no tool is named {name!r}.", "tool_choice.name", "invalid_tools")
        return {"type": "function", "function": {"name": offered_name}}, offered
    if kind == "allowed_tools":
        allowed = {tool.get("name") for tool in choice.get("tools") or [] if isinstance(tool, dict)}
        kept = Offered()
        for tool in offered.tools:
            name = tool["function"]["name"]
            if offered.origin[name][2] in allowed or name in allowed:
                kept.tools.append(tool)
                kept.origin[name] = offered.origin[name]
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise bad_request("tool_choice.mode: must be \"auto\" or \"required\".", "tool_choice.mode")
        return (mode if kept.tools else "none"), kept
    if kind in BUILT_IN_TOOLS:
        raise bad_request(f"tool_choice: this server cannot run the built-in tool {kind!r}.", "tool_choice",
                          "unsupported_tool")
    raise bad_request(f"tool_choice.type: {kind!r} is not a tool choice this server knows.", "tool_choice.type")


def _text_of(content: Any, param: str) -> str:
    """A message's text: a string, or its text parts joined; images and files are a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param}: must be a string or a list of content parts.", param)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{param}[{i}]: this model reads text only ({kind} is not supported).",
                              f"{param}[{i}].type", "unsupported_content")
        else:
            raise bad_request(f"{param}[{i}].type: {kind!r} is not a content part this server knows.",
                              f"{param}[{i}].type")
    return "".join(texts)


def conversation_of(items: Union[str, list[dict[str, Any]]], offered: Offered) -> list[dict]:
    """The input as chat completions' messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{param}: an input item must be an object.", param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{param}.role: {role!r} is not a message role.", f"{param}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content", ""), f"{param}.content")})
        elif kind in ("function_call", "custom_tool_call"):
            name = _name(item, param)
            namespace = item.get("namespace")
            offered_name = f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name
            if kind == "custom_tool_call":
                arguments = json.dumps({"input": item.get("input", "")}, ensure_ascii=False)
            else:
                arguments = item.get("arguments", "{}")
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
            call = {"id": str(item.get("call_id") or item.get("id") or f"call_{i}"), "type": "function",
                    "function": {"name": offered_name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output", "")
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{param}.call_id: required (the id of the call it answers).", f"{param}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": output if isinstance(output, str) else _text_of(output, f"{param}.output")})
        elif kind == "reasoning":
            continue  # a reasoning model's own items, passed back: this model has none to read
        else:
            raise bad_request(f"{param}.type: {kind!r} is not an input item this server takes.", f"{param}.type",
                              "unsupported_item")
    return messages


def response_format_of(text: Optional[TextOptions]) -> Optional[dict]:
    form = text.format if text is not None else None
    if not form or form.get("type") == "text":
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema":
        spec = {"name": form.get("name") or "response", "schema": form.get("schema")}
        if form.get("strict") is not None:
            spec["strict"] = form["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(f"text.format.type: {form.get('type')!r} is not a text format.", "text.format.type")


def chat_request(body: ResponsesRequest, history: list[dict], offered: Offered, choice: Any) -> ChatCompletionRequest:
    """The chat completions request that this Responses request means."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    if not messages:
        raise bad_request("input: the conversation is empty.", "input")
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": response_format_of(body.text),
        "speculative_decoding": body.speculative_decoding,
    }
    if offered.tools:
        fields["tools"] = offered.tools
        fields["tool_choice"] = choice
    elif choice not in (None, "none", "auto"):
        raise bad_request("tool_choice: no tool this server can run was given.", "tool_choice")
    return chat_request_of(fields, "input")


# -- the answer ----------------------------------------------------------------------------------
class ResponseBuilder:
    """The response object, and its output items as the turn's blocks make them."""

    def __init__(self, body: ResponsesRequest, model: str, offered: Offered, chat: ChatCompletionRequest):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.body, self.model, self.offered, self.chat = body, model, offered, chat
        self.turn = Turn(tool_names(chat))
        self.item_ids: dict[int, str] = {}

    def item_id(self, block: Block) -> str:
        if block.index not in self.item_ids:
            prefix = "msg" if block.kind == "text" else "fc"
            self.item_ids[block.index] = f"{prefix}_{uuid.uuid4().hex[:24]}"
        return self.item_ids[block.index]

    def item(self, block: Block, done: bool) -> dict:
        status = "completed" if done else "in_progress"
        if block.kind == "text":
            content = [self.text_part(block.text)] if done else []
            return {"id": self.item_id(block), "type": "message", "status": status, "role": "assistant",
                    "content": content}
        kind, namespace, name = self.offered.origin.get(block.name or "", ("function", None, block.name or ""))
        if kind == "custom":
            value = block.arguments_value()
            text = value.get("input", "") if isinstance(value, dict) else str(value)
            return {"id": self.item_id(block), "type": "custom_tool_call", "status": status,
                    "call_id": block.call_id, "name": name, "input": text if done else ""}
        item = {"id": self.item_id(block), "type": "function_call", "status": status, "call_id": block.call_id,
                "name": name, "arguments": block.text if done else ""}
        if namespace is not None:
            item["namespace"] = namespace
        return item

    @staticmethod
    def text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(self, status: str, stats: Optional[dict] = None, finish_reason: Optional[str] = None) -> dict:
        output = [self.item(block, done=True) for block in self.turn.blocks if block.closed]
        usage = None
        if stats is not None:
            counted = usage_of([stats])
            cached = counted.prompt_tokens_details.cached_tokens if counted.prompt_tokens_details else 0
            usage = {"input_tokens": counted.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": counted.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": counted.total_tokens, "speculative": counted.speculative}
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None, "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": self.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": body.reasoning,
            "store": body.store is not False, "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": (body.text.format if body.text and body.text.format else {"type": "text"})},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [], "truncation": body.truncation or "disabled", "usage": usage,
            "metadata": body.metadata or {}, "user": body.user,
        }

    def final_status(self, event: StreamEvent) -> tuple[str, str]:
        finish_reason = calls_finish_reason(finish_reason_of(event), len(self.turn.calls))
        return ("incomplete" if finish_reason == "length" else "completed"), finish_reason

    def output_messages(self) -> list[dict]:
        """The output as chat messages, for the stored conversation."""
        text = "".join(block.text for block in self.turn.blocks if block.kind == "text")
        calls = [{"id": block.call_id, "type": "function", "function": {"name": block.name, "arguments": block.text}}
                 for block in self.turn.calls]
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return [message] if text or calls else []


class ResponsesStream:
    """The Responses event stream (serving.StreamWriter)."""

    def __init__(self, builder: ResponseBuilder, on_done):
        self.builder = builder
        self.sequence = 0
        self.on_done = on_done

    def _event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(kind, payload)

    def begin(self) -> list[bytes]:
        response = self.builder.response("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def item(self, index: int, item: Union[Started, StreamEvent]) -> list[bytes]:
        if isinstance(item, Started):
            return []
        builder = self.builder
        out = self._blocks(builder.turn.feed(item.text))
        if item.finish_reason is not None:
            out += self._blocks(builder.turn.finish())
            status, finish_reason = builder.final_status(item)
            response = builder.response(status, item.stats or {}, finish_reason)
            self.on_done(response, builder)
            out.append(self._event(f"response.{status}", response=response))
        return out

    def _blocks(self, events) -> list[bytes]:
        out = []
        builder = self.builder
        for event in events:
            block = event.block
            item_id = builder.item_id(block)
            where = {"item_id": item_id, "output_index": block.index}
            if isinstance(event, Opened):
                out.append(self._event("response.output_item.added", output_index=block.index,
                                       item=builder.item(block, done=False)))
                if block.kind == "text":
                    out.append(self._event("response.content_part.added", **where, content_index=0,
                                           part=builder.text_part("")))
            elif isinstance(event, Grew):
                if block.kind == "text":
                    out.append(self._event("response.output_text.delta", **where, content_index=0,
                                           delta=event.delta, logprobs=[]))
                else:
                    out.append(self._event("response.function_call_arguments.delta", **where, delta=event.delta))
            elif isinstance(event, Closed):
                if block.kind == "text":
                    out.append(self._event("response.output_text.done", **where, content_index=0, text=block.text,
                                           logprobs=[]))
                    out.append(self._event("response.content_part.done", **where, content_index=0,
                                           part=builder.text_part(block.text)))
                else:
                    out.append(self._event("response.function_call_arguments.done", **where,
                                           arguments=block.text))
                out.append(self._event("response.output_item.done", output_index=block.index,
                                       item=builder.item(block, done=True)))
        return out

    def end(self) -> list[bytes]:
        return []

    def failure(self, error: APIError) -> list[bytes]:
        response = self.builder.response("failed")
        response["error"] = {"code": error.code or "server_error", "message": error.message}
        return [self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=response)]

    def keepalive(self) -> bytes:
        return KEEPALIVE


async def create_response(request: Request, body: ResponsesRequest) -> Response:
    """POST /v1/responses."""
    state = state_of(request)
    check_model(body.model, state.config)
    tenant = tenant_of(request)
    store = store_of(request)
    history: list[dict] = []
    if body.previous_response_id is not None:
        found = store.get(tenant, body.previous_response_id)
        if found is None:
            raise not_found(body.previous_response_id)
        history = [dict(message) for message in found[1]]
    offered = offered_tools(body.tools or [])
    choice, offered = _choice(body.tool_choice, offered)
    history += conversation_of(body.input, offered)
    chat = chat_request(body, history, offered, choice)
    builder = ResponseBuilder(body, state.config.served_model_name, offered, chat)

    def prepare(engine: Engine) -> list[GenerationRequest]:
        return [generation_request(engine, state.config, chat, encode_prompt(engine, chat), tenant)]

    def keep(response: dict, done: ResponseBuilder) -> None:
        if body.store is not False:
            store.put(tenant, response, history + done.output_messages())

    def whole(results: list[Collected]) -> dict:
        result = results[0]
        assert result.final is not None
        builder.turn.feed(result.text)
        builder.turn.finish()
        status, finish_reason = builder.final_status(result.final)
        response = builder.response(status, result.stats, finish_reason)
        keep(response, builder)
        return response

    merge = await submit(request, 1, prepare, lambda engine: check_prompt_size(engine, state.config, chat))
    return await respond(request, merge, stream=bool(body.stream), writer=lambda: ResponsesStream(builder, keep),
                         whole=whole, ignored=ignored_fields(body))


async def get_response(request: Request, response_id: str) -> Response:
    """GET /v1/responses/{id}: a stored response."""
    found = store_of(request).get(tenant_of(request), response_id)
    if found is None:
        raise not_found(response_id)
    return json_response(found[0])

