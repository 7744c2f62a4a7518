"""OpenAI tool calling on Qwen2.5-style models: the request's tools checked (400s naming the
parameter), handed to the model's own chat template, the model's `<tool_call>` blocks parsed
back into `tool_calls` (whole, or chunk by chunk as `delta.tool_calls`), and a grammar in
llguidance's Lark dialect that constrains the calls.

The model writes a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline. `tool_choice`:

- "none": the template renders without the tools (as vLLM does) and the text is not parsed;
- "auto": free text, or text then calls; once `<tool_call>` begins, the grammar holds the call to a
  declared name and that function's `parameters` schema;
- "required" / {"type": "function", ...}: the grammar forces calls (of that function), then the end.
"""
from __future__ import annotations

import json
import re
import uuid
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, Iterable, Literal, Optional, Sequence, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from specdec.grammar.compiler import GrammarTimeout, grammar_error
from specdec.server.errors import bad_request
from specdec.types import GrammarSpec

MAX_TOOLS = 128
MAX_SCHEMA_DEPTH = 32  # objects and arrays nested in one tool's parameters
MAX_TOOLS_BYTES = 1 << 20  # all tool definitions, as JSON
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
# How the arguments JSON is spaced inside a call: the model's own style (json.dumps'), never
# unbounded whitespace (a model can loop on it); unsupported schema keywords are ignored, not fatal.
JSON_STYLE = {"lenient": True, "whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"}
# response_format's JSON, when it is the answer a call may replace: as grammar/compiler.py lays it out.
ANSWER_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# -- wire types ----------------------------------------------------------------------------------
class _Strict(BaseModel):
    # as protocol.py's: unknown fields ignored (and named), JSON types never coerced
    model_config = ConfigDict(extra="allow", strict=True)


ToolName = Annotated[str, Field(pattern=NAME_PATTERN, description="a-z, A-Z, 0-9, _ and -; at most 64")]
# What the document can say of a parameters schema (its depth and whether llguidance compiles it
# it cannot: those are 400s with code "invalid_tools").
ArgumentsSchema = Annotated[dict[str, Any], WithJsonSchema({
    "type": "object", "description": f'a JSON Schema of "type": "object" ({{}}: no arguments), nesting at most '
                                     f"{MAX_SCHEMA_DEPTH} deep; the arguments are held to it",
    "anyOf": [{"maxProperties": 0}, {"required": ["type"], "properties": {"type": {"const": "object"}}}]})]
INVALID_TOOLS = "invalid_tools"  # a 400 no schema can foresee: names that clash, a schema llguidance refuses


class FunctionDefinition(_Strict):
    name: ToolName
    description: Optional[str] = None
    parameters: Optional[ArgumentsSchema] = None
    strict: Optional[bool] = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionChoice(_Strict):
    name: ToolName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionChoice


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]
Tools = Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)]


class CalledFunction(_Strict):
    name: str
    arguments: str = Field(description="the arguments as a JSON string (other text reaches the template as text)")


class MessageToolCall(_Strict):
    """A call in an assistant message of the conversation so far."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _unset(value) -> bool:
    return value is None


class FunctionCallDelta(BaseModel):
    name: Optional[str] = Field(default=None, exclude_if=_unset)
    arguments: Optional[str] = Field(default=None, exclude_if=_unset)


class ToolCallDelta(BaseModel):
    """One piece of a streamed call: the first names it (index, id, type, function.name); later
    ones carry only index and a piece of function.arguments, as OpenAI streams them."""

    index: int
    id: Optional[str] = Field(default=None, exclude_if=_unset)
    type: Optional[Literal["function"]] = Field(default=None, exclude_if=_unset)
    function: Optional[FunctionCallDelta] = Field(default=None, exclude_if=_unset)


# -- the request ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolSetup:
    """What a chat request asks of tool calling, checked."""

    tools: tuple[dict, ...] = ()  # as the chat template gets them: {"type": "function", "function": {...}}
    choice: str = "auto"  # "none", "auto", "required" or "function" (the one `forced` names)
    forced: Optional[str] = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the model is shown the tools and its output parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def template_tools(self) -> Optional[list[dict]]:
        return list(self.tools) if self.active else None


def calls_expected(body) -> bool:
    """Whether a chat request's output is read for calls: it has tools and tool_choice is not "none"."""
    return bool(getattr(body, "tools", None)) and getattr(body, "tool_choice", None) != "none"


def tool_names(body) -> frozenset[str]:
    """The names of a chat request's tools when its output is read for calls, else none."""
    if not calls_expected(body):
        return frozenset()
    return frozenset(tool.function.name for tool in body.tools)


_Reason = TypeVar("_Reason", bound=str)


def calls_finish_reason(finish_reason: _Reason, calls: int) -> Union[_Reason, Literal["tool_calls"]]:
    """OpenAI's "tool_calls" where the model ended its turn with calls; "length" stays "length"."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def json_depth(value: Any) -> int:
    """Nesting of objects and arrays, counted without recursion (a hostile schema may nest deeply)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _parameters(function: FunctionDefinition, param: str) -> dict:
    """The function's arguments schema; absent or {} means no arguments."""
    schema = function.parameters
    if not schema:
        return {"type": "object", "properties": {}}
    if schema.get("type") != "object":
        raise bad_request(f'{param}: must be a JSON Schema with "type": "object" (the arguments are a JSON object).',
                          param)
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise bad_request(f"{param}: the schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep.", param,
                          INVALID_TOOLS)
    return schema


def check_tools(body) -> ToolSetup:
    """The request's tools, tool_choice and tool messages, checked; a 400 names what is wrong."""
    tools: Sequence[ToolDefinition] = getattr(body, "tools", None) or ()
    choice = getattr(body, "tool_choice", None)
    _check_messages(body.messages)
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools: {len(tools)} tools; this server takes at most {MAX_TOOLS}.", "tools")
    rendered, seen = [], set()
    for i, tool in enumerate(tools):
        function = tool.function
        if function.name in seen:
            raise bad_request(f"tools[{i}].function.name: a second tool named {function.name!r}.",
                              f"tools[{i}].function.name", INVALID_TOOLS)
        seen.add(function.name)
        definition: dict[str, Any] = {"name": function.name}
        if function.description is not None:
            definition["description"] = function.description
        definition["parameters"] = _parameters(function, f"tools[{i}].function.parameters")
        rendered.append({"type": "function", "function": definition})
    size = len(json.dumps(rendered, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > MAX_TOOLS_BYTES:
        raise bad_request(f"tools: the definitions take {size} bytes as JSON; this server takes at most "
                          f"{MAX_TOOLS_BYTES}.", "tools", "context_length_exceeded")
    forced = None
    if choice not in (None, "none", "auto") and not tools:
        shown = choice if isinstance(choice, str) else choice.model_dump()
        raise bad_request(f"tool_choice: {shown!r} needs tools.", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        forced = choice.function.name
        if forced not in seen:
            raise bad_request(f"tool_choice.function.name: no tool is named {forced!r}.",
                              "tool_choice.function.name", INVALID_TOOLS)
        choice = "function"
    elif choice is None:
        choice = "auto"
    parallel = getattr(body, "parallel_tool_calls", None) is not False
    return ToolSetup(tuple(rendered), choice, forced, parallel)


def _check_messages(messages) -> None:
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role == "tool":
            if message.tool_call_id is None:
                raise bad_request(f"{where}.tool_call_id: a tool message needs the id of the call it answers.",
                                  f"{where}.tool_call_id")
        elif message.tool_call_id is not None:
            raise bad_request(f"{where}.tool_call_id: only a tool message has one.", f"{where}.tool_call_id")
        if message.tool_calls is not None and message.role != "assistant":
            raise bad_request(f"{where}.tool_calls: only an assistant message has tool calls.", f"{where}.tool_calls")
        if message.content is None and not message.tool_calls:
            raise bad_request(f"{where}.content: required (an assistant message may leave it null only with "
                              f"tool_calls).", f"{where}.content")


def _arguments_value(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments  # not JSON (a call cut short, say): the template gets the text as it is
    # nested past what a template's tojson (inside Jinja's own frames) surely can write: the text
    return arguments if json_depth(value) > 2 * MAX_SCHEMA_DEPTH else value


def template_messages(messages) -> list[dict]:
    """Chat messages as the chat template gets them: `developer` as `system`, each as
    template_message makes it, `name` kept (the model's chat template decides what it means)."""
    rendered_all = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        rendered = template_message(message, role, message.text())
        if message.name is not None:
            rendered["name"] = message.name
        rendered_all.append(rendered)
    return rendered_all


def template_message(message, role: str, content: Optional[str]) -> dict:
    """A chat message as the template gets it: OpenAI's tool fields where present; a call's
    arguments as the value they encode (Qwen2.5's template writes them with `tojson`)."""
    rendered: dict = {"role": role, "content": content}
    if message.tool_calls:
        if not content:
            rendered["content"] = None  # "" would still make a template write an empty line of text
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": _arguments_value(call.function.arguments)}}
            for call in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


# -- the grammar ---------------------------------------------------------------------------------
# Text that holds no `<tool_call>`: in "auto", the call marker is the only way into a call.
_TEXT = "TEXT: /(?s:.+)/ & ~/(?s:.*)<tool_call>(?s:.*)/"


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a Lark string literal (names are [a-zA-Z0-9_-])


def _arguments_schema(parameters: Any, style: dict = JSON_STYLE) -> str:
    if not isinstance(parameters, dict):
        return json.dumps(parameters)
    schema = {key: value for key, value in parameters.items() if key != "x-guidance"}  # the layout is ours
    return json.dumps({**schema, "x-guidance": style}, ensure_ascii=False)


def lark_source(tools: Sequence[dict], choice: str, forced: Optional[str], parallel: bool,
                markers: Optional[tuple[int, int]], text_schema: Any = None) -> str:
    """The Lark grammar for these tools. `markers`: the ids of `<tool_call>` and `</tool_call>`
    where the vocabulary has each as one token (the model writes them so), else None (plain text).
    `text_schema`: response_format's schema, for the answer that is no call ("auto")."""
    if markers is not None:
        open_, close = f"<[{markers[0]}]>", f"<[{markers[1]}]>"
    else:
        open_, close = _lark_string(OPEN), _lark_string(CLOSE)
    functions = [tool["function"] for tool in tools if forced is None or tool["function"]["name"] == forced]
    lines = ["%llguidance {}"]
    more = ' ("\\n" call)*' if parallel else ""
    if choice in ("required", "function"):
        lines.append("start: calls")
    elif text_schema is not None:
        lines += ["start: answer | calls", f"answer: %json {_arguments_schema(text_schema, ANSWER_STYLE)}"]
    elif markers is not None:
        lines += ["start: TEXT? calls?", _TEXT]
    else:
        # A text marker ends the free text lazily: at its first `<tool_call>`, the call begins.
        lines += [f"start: TEXT? | calls | lead body {close}{more}", _TEXT, f"lead[lazy]: /(?s:.*){re.escape(OPEN)}/"]
    # A newline after the last call may still end the turn: the model's newline must not commit it
    # to another call (with tool_choice "required" it would invent calls until max_tokens).
    end = ' "\\n"?' if parallel else ""
    lines += [f"calls: call{more}{end}", f"call: {open_} body {close}",
              'body: "\\n{\\"name\\": " fn "}\\n"',
              "fn: " + " | ".join(f"fn_{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        lines.append(f'fn_{i}: {_lark_string(json.dumps(function["name"]) + ", " + json.dumps("arguments") + ": ")} '
                     f"args_{i}")
        lines.append(f"args_{i}: %json {_arguments_schema(function['parameters'])}")
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=64)
def _checked_source(tools_json: str, choice: str, forced: Optional[str], parallel: bool,
                    markers: Optional[tuple[int, int]], text_schema_json: str, limit: Optional[float]) -> str:
    tools = json.loads(tools_json)
    for i, tool in enumerate(tools):  # each schema alone first: the 400 names the tool
        error = _limited_error(GrammarSpec("lark", f"start: %json {_arguments_schema(tool['function']['parameters'])}\n"),
                               limit)
        if error:
            param = f"tools[{i}].function.parameters"
            raise bad_request(f"{param}: this schema cannot constrain the arguments: {error}", param, INVALID_TOOLS)
    source = lark_source(tools, choice, forced, parallel, markers, json.loads(text_schema_json))
    error = _limited_error(GrammarSpec("lark", source), limit)
    if error:
        raise bad_request(f"tools: the tools' grammar cannot be built: {error}", "tools", INVALID_TOOLS)
    return source


def _limited_error(spec: GrammarSpec, limit: Optional[float]) -> Optional[str]:
    try:
        return grammar_error(spec, limit)
    except GrammarTimeout as exc:  # too slow to compile is a 400 naming the part, as a refusal is
        return str(exc)


def tool_grammar(setup: ToolSetup, markers: Optional[tuple[int, int]] = None,
                 text_schema: Any = None, limit: Optional[float] = None) -> Optional[GrammarSpec]:
    """The constraint for a request's calls, or None where tool calling is off ("none", no tools).
    Checked with llguidance (a schema it cannot compile is a 400 naming the tool); cached, so a
    repeated set of tools is built once. `text_schema`: see lark_source; `limit`: seconds each
    check may take (grammar/compiler.py's threads)."""
    if not setup.active:
        return None
    tools_json = json.dumps(setup.tools, ensure_ascii=False)
    return GrammarSpec("lark", _checked_source(tools_json, setup.choice, setup.forced, setup.parallel, markers,
                                               json.dumps(text_schema), limit))


_MARKERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # backend -> its marker ids


def marker_tokens(backend) -> Optional[tuple[int, int]]:
    """The ids of `<tool_call>` and `</tool_call>` where the backend's vocabulary has each as one
    token that prints as itself (Qwen2.5: 151657, 151658), else None."""
    if backend in _MARKERS:
        return _MARKERS[backend]
    ids: Optional[list[int]] = []
    for marker in (OPEN, CLOSE):
        tokens = backend.tokenize(marker, add_special=False, parse_special=True)
        if len(tokens) != 1 or backend.token_bytes(tokens[0]) != marker.encode():
            ids = None
            break
        assert ids is not None  # None only on the way out of the loop
        ids.append(tokens[0])
    _MARKERS[backend] = tuple(ids) if ids else None
    return _MARKERS[backend]


# -- the output ----------------------------------------------------------------------------------
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_block(inner: str) -> Optional[tuple[str, str]]:
    """(name, arguments as a JSON string) of the text between `<tool_call>` and `</tool_call>`, or
    None where it is not a call ({"name": str, "arguments": {...}}). The arguments keep the model's
    own text where they can be cut from it (what streaming sent)."""
    try:
        call = json.loads(inner)
    except (ValueError, RecursionError):  # a model may nest arrays past Python's recursion limit
        return None
    if not isinstance(call, dict) or set(call) != {"name", "arguments"} or not isinstance(call["name"], str):
        return None
    arguments = call["arguments"]
    if isinstance(arguments, str):
        return call["name"], arguments  # already a JSON string
    if not isinstance(arguments, dict):
        return None
    header = _HEADER.match(inner)
    try:
        if header is not None and inner[header.end():header.end() + 1] == "{":
            value, end = json.JSONDecoder().raw_decode(inner, header.end())
            if value == arguments:  # the text cut is the object parsed (not a repeated key's first)
                return call["name"], inner[header.end():end]
        return call["name"], json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None


@dataclass
class ParsedOutput:
    content: Optional[str]
    tool_calls: list[ToolCall]


def _block_end(text: str, start: int) -> int:
    """Where the `</tool_call>` that closes a block whose body begins at `start` is, or -1: after
    the JSON object the body opens with (a `</tool_call>` inside one of its strings is text), or
    the first one where the body is no object."""
    body = len(text) - len(text[start:].lstrip())
    if body < len(text) and text[body] == "{":
        scanner = _ArgumentsScanner()
        scanner.feed(text[body:])
        if not scanner.done:
            return -1
        start = body + scanner.end
    return text.find(CLOSE, start)


# A turn that opens with a bare call: the JSON object alone or in a ```json fence, no <tool_call>
# tags (small Qwen2.5 models write it so; llama.cpp's Hermes parser takes the same forms).
_LEAD = re.compile(r"\s*(```(?:json)?[ \t]*\n)?\s*")
_FENCE_OPENINGS = ("```json\n", "```\n")
_BARE_HEADER = '{"name":"'
PENDING = "pending"


def lead_call(text: str, names: frozenset[str], final: bool) -> Union[None, str, tuple[str, str, int]]:
    """Whether `text`, a turn so far, opens with a bare call to one of the tools `names`:
    (name, arguments as a JSON string, where the call's text ends), PENDING while it still may
    (not `final`), or None. The object must be {"name": <a declared tool>, "arguments" (or
    "parameters"): {...}}; any other JSON is the model's text."""
    if not names:
        return None
    stripped = text.lstrip()
    if not final and (not stripped or any(opening.startswith(stripped) for opening in _FENCE_OPENINGS)):
        return PENDING  # nothing yet, or a fence still being written
    lead = _LEAD.match(text)
    assert lead is not None  # the pattern matches the empty string
    start = lead.end()
    if start == len(text):
        return None if final else PENDING
    if text[start] != "{":
        return None
    scanner = _ArgumentsScanner()
    scanner.feed(text[start:])
    if not scanner.done:
        header = re.sub(r"\s+", "", text[start:start + 64])  # spacing inside the header does not matter
        could = header.startswith(_BARE_HEADER) or _BARE_HEADER.startswith(header)
        return PENDING if could and not final else None
    end = start + scanner.end
    try:
        value = json.loads(text[start:end])
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    key = "arguments" if "arguments" in value else "parameters"
    if set(value) != {"name", key} or not isinstance(value[key], dict):
        return None
    parsed = parse_block(text[start:end]) if key == "arguments" else None
    arguments = parsed[1] if parsed is not None else json.dumps(value[key], ensure_ascii=False)
    if lead.group(1):  # a fence opened: its closing belongs to the call
        close = re.compile(r"\s*```").match(text, end)
        if close is not None:
            end = close.end()
        elif not final and "```".startswith(text[end:].strip()[:3]):
            return PENDING
    return value["name"], arguments, end


def parse_output(text: str, names: frozenset[str] = frozenset()) -> ParsedOutput:
    """The calls in a whole generation, and its text outside them (None where there is none).
    Whitespace next to a call (the newline between two) is no content; a block that is no call
    (malformed JSON) stays in the content as written; one never closed (cut by max_tokens) is
    dropped. With the tools' `names`, a turn that opens with a bare call (lead_call) opens with
    that call."""
    segments: list[str] = []
    calls: list[ToolCall] = []
    position = 0
    after_call = False
    lead = lead_call(text, names, final=True)
    if isinstance(lead, tuple):
        calls.append(ToolCall(id=new_call_id(), function=FunctionCall(name=lead[0], arguments=lead[1])))
        position, after_call = lead[2], True
    while True:
        start = text.find(OPEN, position)
        end = _block_end(text, start + len(OPEN)) if start >= 0 else -1
        parsed = parse_block(text[start + len(OPEN):end]) if end >= 0 else None
        if parsed is None:
            if start < 0 or end < 0:
                # A call cut short (max_tokens inside it) is no call and no text: its markup is dropped.
                segment = text[position:start] if start >= 0 else text[position:]
                segment = segment.rstrip() if start >= 0 else segment
                segments.append(segment.lstrip() if after_call else segment)
                break
            # not a call: it is text, and the search goes on after its marker
            segment = text[position:start + len(OPEN)]
            segments.append(segment.lstrip() if after_call else segment)
            position, after_call = start + len(OPEN), False
            continue
        segment = text[position:start]
        segments.append((segment.lstrip() if after_call else segment).rstrip())
        calls.append(ToolCall(id=new_call_id(), function=FunctionCall(name=parsed[0], arguments=parsed[1])))
        position, after_call = end + len(CLOSE), True
    content = "".join(segments)
    if not calls:
        return ParsedOutput(content if content or not text else None, [])
    return ParsedOutput(content or None, calls)


def _marker_prefix(text: str) -> int:
    """Length of the longest end of `text` that could begin `<tool_call>`."""
    for length in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-length:]):
            return length
    return 0


class _ArgumentsScanner:
    """Finds where a JSON object ends, fed piece by piece (strings and escapes respected)."""

    def __init__(self):
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False
        self.end = 0  # characters fed that belong to the object

    def feed(self, text: str) -> int:
        """How much of `text` belongs to the object (all of it until the object closes)."""
        taken = self._feed(text)
        self.end += taken
        return taken

    def _feed(self, text: str) -> int:
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class ToolStreamParser:
    """Cuts a streamed generation into content and `delta.tool_calls`, as parse_output would cut
    the whole text: text that might begin `<tool_call>` (or whitespace that might precede one) is
    held back until decided; a call is announced (index, id, name) once its name is complete, and
    its arguments follow piece by piece as the model writes them.

    Where a block turns out not to be a call after its name was sent (malformed JSON without a
    grammar, or cut by max_tokens), the streamed call stays as sent: a stream cannot take back."""

    def __init__(self, names: frozenset[str] = frozenset()):
        self.names = names  # the tools' names: a turn may open with a bare call (lead_call)
        self._lead = bool(names)  # the turn's start is still undecided
        self.index = 0  # calls completed or under way
        self._pending = ""  # text not yet sent (state "text") or the block so far (state "block")
        self._in_block = False
        self._after_call = False  # whitespace right after a call is no content
        self._held_space = ""  # whitespace before a `<tool_call>`: content only if the block is no call
        self._announced: Optional[str] = None  # the id of the call under way, once its name went out
        self._streamed = ""  # its arguments sent so far
        self._scanner: Optional[_ArgumentsScanner] = None
        self._arguments_at = 0  # where its arguments begin in the block

    # Each method returns a list of items: a str (content) or a ToolCallDelta.
    def feed(self, text: str) -> list:
        self._pending += text
        out: list = []
        if self._lead and not self._take_lead(out, final=False):
            return out
        while True:
            if self._in_block:
                if not self._advance_block(out):
                    break
            else:
                if not self._advance_text(out):
                    break
        return out

    def _take_lead(self, out: list, final: bool) -> bool:
        """Decide the turn's start (a bare call, or not); False while it is still undecided."""
        lead = lead_call(self._pending, self.names, final)
        if lead == PENDING:
            return False
        self._lead = False
        if isinstance(lead, tuple):
            name, arguments, end = lead
            out.append(ToolCallDelta(index=self.index, id=new_call_id(), type="function",
                                     function=FunctionCallDelta(name=name, arguments=arguments)))
            self.index += 1
            self._pending, self._after_call = self._pending[end:], True
        return True

    def finish(self) -> list:
        out: list = []
        if self._lead:
            self._take_lead(out, final=True)
            out += self.feed("")
        if self._in_block:
            pass  # a call cut short: its markup is no content (a call announced stays as sent)
        else:
            text = self._pending.lstrip() if self._after_call else self._pending
            if text:
                out.append(text)
        self._pending = ""
        return [item for item in out if not isinstance(item, str) or item]

    def _advance_text(self, out: list) -> bool:
        pending = self._pending
        if self._after_call:
            stripped = pending.lstrip()
            if not stripped:
                self._pending = ""
                return False
            pending, self._after_call = stripped, False
        start = pending.find(OPEN)
        if start >= 0:
            before = pending[:start]
            text = before.rstrip()
            if text:
                out.append(text)
            self._held_space = before[len(text):]
            self._pending = pending[start + len(OPEN):]
            self._in_block, self._announced, self._streamed, self._scanner = True, None, "", None
            return True
        hold = _marker_prefix(pending)
        ready = pending[:len(pending) - hold]
        text = ready.rstrip()
        if text:
            out.append(text)
        self._pending = pending[len(text):]
        return False

    def _advance_block(self, out: list) -> bool:
        block = self._pending
        if self._announced is None:
            header = _HEADER.match(block)
            if header is not None and block[header.end():header.end() + 1] == "{":
                try:
                    name = json.loads(f'"{header.group(1)}"')
                except ValueError:
                    name = None
                if name is not None:
                    self._announced = new_call_id()
                    self._arguments_at = header.end()
                    self._scanner = _ArgumentsScanner()
                    out.append(ToolCallDelta(index=self.index, id=self._announced, type="function",
                                             function=FunctionCallDelta(name=name, arguments="")))
        end = _block_end(block, 0)
        if self._announced is not None and self._scanner is not None and not self._scanner.done:
            written = block[self._arguments_at + len(self._streamed):end if end >= 0 else len(block)]
            piece = written[:self._scanner.feed(written)]
            if piece:
                self._streamed += piece
                out.append(ToolCallDelta(index=self.index, function=FunctionCallDelta(arguments=piece)))
        if end < 0:
            return False
        parsed = parse_block(block[:end])
        rest = block[end + len(CLOSE):]
        if self._announced is not None:
            if parsed is not None and parsed[1].startswith(self._streamed) and parsed[1] != self._streamed:
                out.append(ToolCallDelta(index=self.index,
                                         function=FunctionCallDelta(arguments=parsed[1][len(self._streamed):])))
            self._close_call(rest)
        elif parsed is not None:
            out.append(ToolCallDelta(index=self.index, id=new_call_id(), type="function",
                                     function=FunctionCallDelta(name=parsed[0], arguments=parsed[1])))
            self._close_call(rest)
        else:
            # not a call: its text is content, and the text after its marker is read again
            out.append(self._held_space + OPEN)
            self._in_block, self._held_space, self._pending = False, "", block
        return True

    def _close_call(self, rest: str) -> None:
        self.index += 1
        self._in_block, self._after_call, self._held_space, self._pending = False, True, "", rest
        self._announced, self._scanner = None, None
