"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as a surface of
the serving core: what the `anthropic` SDK and Claude Code (`ANTHROPIC_BASE_URL`) send.

A request becomes the chat request it means, so its prompt, its tools' grammar and its sampling
are made exactly as chat completions makes them; the answer's text is read into content blocks
(turns.py): text, then tool_use blocks.

- `system` (a string or text blocks) and `role: "system"` messages inside `messages` (Claude Code
  sends them); content blocks `text`, `tool_use`, `tool_result` (with `is_error`); `thinking`
  blocks passed back are dropped; images and documents are a 400.
- `tools` with `input_schema`; `tool_choice` auto, any (required), tool (named), none;
  `disable_parallel_tool_use`.
- `output_config.format` (a JSON schema, enforced exactly as response_format is).
- Accepted and not acted on: `thinking` (this model does not think: a no-op), `cache_control`,
  `defer_loading`, `context_management`, `output_config.effort`, `metadata.user_id`, the
  `anthropic-version` and `anthropic-beta` headers, `?beta=true`.
- Claude Code's attribution line (`x-anthropic-billing-header: ...`, which changes every turn and
  would make every turn miss the prefix cache) is dropped from the system text wherever it stands.
- Errors are Anthropic's shape (errors.py), usage has `cache_read_input_tokens`.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional, Union

from fastapi import Request
from pydantic import Field
from starlette.responses import Response

from specdec.engine.engine import Engine
from specdec.server.convert import (
    chat_request_of, check_model, check_prompt_size, encode_prompt, generation_request,
)
from specdec.server.errors import APIError, anthropic_error_body, bad_request, json_response
from specdec.server.offload import off_loop
from specdec.server.protocol import (
    ChatCompletionRequest, MaxTokens, SpeculativeField, Stop, Temperature, TopK, TopP, _Strict,
)
from specdec.server.serving import (
    Collected, finish_reason_of, ignored_fields, respond, state_of, submit, tenant_of,
)
from specdec.server.sse import sse_event
from specdec.server.tenants import tenant_of_scope
from specdec.server.tickets import Started
from specdec.server.tools import calls_finish_reason, tool_names
from specdec.server.turns import Block, Closed, Grew, Opened, Turn, stop_sequence_of
from specdec.types import GenerationRequest, StreamEvent

# Claude Code's per-request attribution line in the system text (its values change every turn).
BILLING_HEADER = re.compile(r"^[ \t]*x-anthropic-billing-header:[^\n]*(\n|$)", re.MULTILINE)


class MessagesRequest(_Strict):
    """The body of POST /v1/messages; content blocks and tools are read in `chat_request` (400s
    name the block)."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: MaxTokens = None  # Anthropic requires it; peers default it
    system: Union[str, list[dict[str, Any]], None] = None
    stop_sequences: Stop = None
    stream: Optional[bool] = False
    temperature: Temperature = None
    top_p: TopP = None
    top_k: TopK = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None  # a model that does not think: a documented no-op
    output_config: Optional[dict[str, Any]] = None
    context_management: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    # Extensions, as on chat completions.
    seed: Optional[int] = None
    speculative_decoding: SpeculativeField = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None


# -- the request ---------------------------------------------------------------------------------
def _system_text(system: Union[str, list, None], param: str = "system") -> str:
    if system is None:
        return ""
    text = system if isinstance(system, str) else "\n\n".join(_block_texts(system, param, allow=("text",)))
    return BILLING_HEADER.sub("", text)


def _block_texts(blocks: list, param: str, allow: tuple[str, ...]) -> list[str]:
    texts = []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and "text" in allow:
            texts.append(str(block.get("text", "")))
        elif kind in ("image", "document", "search_result", "container_upload"):
            raise bad_request(f"{param}[{i}]: this model reads text only ({kind} blocks are not supported).",
                              f"{param}[{i}].type", "unsupported_content")
        else:
            raise bad_request(f"{param}[{i}].type: {kind!r} is not a block this server takes here.",
                              f"{param}[{i}].type")
    return texts


def _tool_result_text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_block_texts(content, param, allow=("text",)))
    raise bad_request(f"{param}: must be a string or a list of text blocks.", param)


def conversation_of(body: Union[MessagesRequest, CountTokensRequest]) -> list[dict]:
    """The system text and messages as chat completions' messages."""
    system = _system_text(body.system)
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    for i, message in enumerate(body.messages):
        param = f"messages[{i}]"
        role = message.get("role")
        content = message.get("content", "")
        if role == "system":  # Claude Code puts one inside messages
            text = _system_text(content, f"{param}.content")
            if messages and messages[0]["role"] == "system":
                messages[0]["content"] = "\n\n".join(t for t in (messages[0]["content"], text) if t)
            elif text:
                messages.insert(0, {"role": "system", "content": text})
            continue
        if role not in ("user", "assistant"):
            raise bad_request(f"{param}.role: {role!r} is not a message role.", f"{param}.role")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{param}.content: must be a string or a list of content blocks.", f"{param}.content")
        texts: list[str] = []
        calls: list[dict] = []
        for j, block in enumerate(content):
            where = f"{param}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id", f"toolu_{j}")), "type": "function", "function": {
                    "name": str(block.get("name", "")),
                    "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if texts:  # text before a result stays before it
                    messages.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                text = _tool_result_text(block.get("content"), f"{where}.content")
                if block.get("is_error"):
                    text = f"Error: {text}"
                messages.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text})
            elif kind in ("thinking", "redacted_thinking"):
                continue  # a thinking model's blocks, passed back: this model has none to read
            elif kind in ("image", "document", "search_result", "container_upload"):
                raise bad_request(f"{where}: this model reads text only ({kind} blocks are not supported).",
                                  f"{where}.type", "unsupported_content")
            else:
                raise bad_request(f"{where}.type: {kind!r} is not a content block this server takes in a {role} "
                                  "message.", f"{where}.type")
        if calls:
            messages.append({"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls})
        elif texts or role == "assistant":
            messages.append({"role": role, "content": "\n".join(texts)})
    return messages


def tools_of(tools: Optional[list[dict]], choice: Optional[dict]) -> tuple[list[dict], Any, Optional[bool]]:
    """(chat tool definitions, chat tool_choice, parallel_tool_calls)."""
    offered = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{i}]: a tool must be an object.", f"tools[{i}]")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            continue  # Anthropic's server tools (web_search_..., bash_...): this server cannot run them
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].name: required (a string).", f"tools[{i}].name")
        function: dict[str, Any] = {"name": name, "parameters": tool.get("input_schema") or {}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        offered.append({"type": "function", "function": function})
    if choice is None:
        return offered, None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return offered, kind, parallel
    if kind == "any":
        return offered, "required", parallel
    if kind == "tool":
        return offered, {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise bad_request(f"tool_choice.type: {kind!r} is not auto, any, tool or none.", "tool_choice.type")


def _response_format(output_config: Optional[dict]) -> Optional[dict]:
    form = (output_config or {}).get("format")
    if not form:
        return None
    if form.get("type") != "json_schema":
        raise bad_request(f"output_config.format.type: {form.get('type')!r} is not supported (json_schema is).",
                          "output_config.format.type")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": form.get("schema")}}


def chat_request(body: Union[MessagesRequest, CountTokensRequest]) -> ChatCompletionRequest:
    tools, choice, parallel = tools_of(body.tools, body.tool_choice)
    fields: dict[str, Any] = {"model": body.model, "messages": conversation_of(body)}
    if tools:
        fields["tools"] = tools
        if choice is not None:
            fields["tool_choice"] = choice
        if parallel is not None:
            fields["parallel_tool_calls"] = parallel
    elif choice not in (None, "none", "auto"):
        raise bad_request("tool_choice: needs tools.", "tool_choice")
    if isinstance(body, MessagesRequest):
        fields.update({"max_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                       "top_k": body.top_k, "seed": body.seed, "stop": body.stop_sequences,
                       "response_format": _response_format(body.output_config),
                       "speculative_decoding": body.speculative_decoding})
    return chat_request_of(fields, "messages")


# -- the answer ----------------------------------------------------------------------------------
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessageBuilder:
    def __init__(self, model: str, chat: ChatCompletionRequest, backend):
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model, self.chat, self.backend = model, chat, backend
        self.turn = Turn(tool_names(chat))
        self.stop = (chat.stop,) if isinstance(chat.stop, str) else tuple(chat.stop or ())
        self.token_ids: list[int] = []
        self.tool_ids: dict[int, str] = {}

    def tool_id(self, block: Block) -> str:
        if block.index not in self.tool_ids:
            self.tool_ids[block.index] = f"toolu_{uuid.uuid4().hex[:24]}"
        return self.tool_ids[block.index]

    def block(self, block: Block, done: bool) -> dict:
        if block.kind == "text":
            return {"type": "text", "text": block.text if done else ""}
        return {"type": "tool_use", "id": self.tool_id(block), "name": block.name,
                "input": block.arguments_value() if done else {}}

    def stop_reason(self, event: StreamEvent, text: str) -> tuple[str, Optional[str]]:
        finish_reason = calls_finish_reason(finish_reason_of(event), len(self.turn.calls))
        if finish_reason == "stop" and self.stop:
            matched = stop_sequence_of(self.backend.detokenize(self.token_ids), text, self.stop)
            if matched is not None:
                return "stop_sequence", matched
        return STOP_REASONS.get(finish_reason, "end_turn"), None

    @staticmethod
    def usage(stats: dict, input_tokens: Optional[int] = None) -> dict:
        prompt = stats.get("prompt_tokens", input_tokens or 0)
        cached = stats.get("cached_prompt_tokens", 0)
        return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": stats.get("generated_tokens", 0),
                "speculative": stats or None}

    def message(self, stats: dict, stop_reason: Optional[str], stop_sequence: Optional[str]) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [self.block(block, done=True) for block in self.turn.blocks],
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self.usage(stats)}


PING = sse_event("ping", {"type": "ping"})


class MessagesStream:
    """The Messages event stream (serving.StreamWriter): message_start, then per block
    content_block_start, content_block_delta (text_delta, input_json_delta)..., content_block_stop,
    then message_delta (stop_reason, usage) and message_stop; `ping` while it waits; a failure is
    one `error` event."""

    def __init__(self, builder: MessageBuilder, prompt_tokens: int):
        self.builder = builder
        self.prompt_tokens = prompt_tokens
        self.text = ""

    def begin(self) -> list[bytes]:
        builder = self.builder
        message: dict[str, Any] = {"id": builder.id, "type": "message", "role": "assistant", "model": builder.model,
                                   "content": [], "stop_reason": None, "stop_sequence": None,
                                   "usage": {"input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0,
                                             "cache_read_input_tokens": 0, "output_tokens": 0}}
        return [sse_event("message_start", {"type": "message_start", "message": message}), PING]

    def item(self, index: int, item: Union[Started, StreamEvent]) -> list[bytes]:
        if isinstance(item, Started):
            return []
        builder = self.builder
        builder.token_ids += item.token_ids
        self.text += item.text
        out = self._blocks(builder.turn.feed(item.text))
        if item.finish_reason is not None:
            out += self._blocks(builder.turn.finish())
            stop_reason, stop_sequence = builder.stop_reason(item, self.text)
            usage = builder.usage(item.stats or {})
            out.append(sse_event("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": usage}))
            out.append(sse_event("message_stop", {"type": "message_stop"}))
        return out

    def _blocks(self, events) -> list[bytes]:
        out = []
        for event in events:
            block = event.block
            if isinstance(event, Opened):
                out.append(sse_event("content_block_start", {"type": "content_block_start", "index": block.index,
                                                          "content_block": self.builder.block(block, done=False)}))
            elif isinstance(event, Grew):
                delta = ({"type": "text_delta", "text": event.delta} if block.kind == "text"
                         else {"type": "input_json_delta", "partial_json": event.delta})
                out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": block.index,
                                                          "delta": delta}))
            elif isinstance(event, Closed):
                out.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": block.index}))
        return out

    def end(self) -> list[bytes]:
        return []

    def failure(self, error: APIError) -> list[bytes]:
        return [sse_event("error", anthropic_error_body(error))]

    def keepalive(self) -> bytes:
        return PING


async def create_message(request: Request, body: MessagesRequest) -> Response:
    """POST /v1/messages."""
    state = state_of(request)
    check_model(body.model, state.config)
    chat = chat_request(body)
    tenant = tenant_of(request)
    builder = MessageBuilder(body.model, chat, state.engine.target)
    prompt_tokens: list[int] = []

    def prepare(engine: Engine) -> list[GenerationRequest]:
        ids = encode_prompt(engine, chat)
        prompt_tokens.append(len(ids))
        return [generation_request(engine, state.config, chat, ids, tenant)]

    def whole(results: list[Collected]) -> dict:
        result = results[0]
        assert result.final is not None
        builder.token_ids = result.token_ids
        builder.turn.feed(result.text)
        builder.turn.finish()
        stop_reason, stop_sequence = builder.stop_reason(result.final, result.text)
        return builder.message(result.stats, stop_reason, stop_sequence)

    merge = await submit(request, 1, prepare, lambda engine: check_prompt_size(engine, state.config, chat))
    return await respond(request, merge, stream=bool(body.stream),
                         writer=lambda: MessagesStream(builder, prompt_tokens[0] if prompt_tokens else 0),
                         whole=whole, ignored=ignored_fields(body))


async def count_tokens(request: Request, body: CountTokensRequest) -> Response:
    """POST /v1/messages/count_tokens: the prompt's tokens as this model's template makes them."""
    state = state_of(request)
    check_model(body.model, state.config)
    chat = chat_request(body)
    engine = state.engine
    check_prompt_size(engine, state.config, chat)
    ids = await off_loop(encode_prompt, engine, chat, tenant=tenant_of_scope(request.scope))
    return json_response({"input_tokens": len(ids)})
