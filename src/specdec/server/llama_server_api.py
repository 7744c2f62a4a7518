"""llama-server's utility endpoints (llama.cpp's tools/server), answered as it answers them, so
that tools written for llama-server (its web UI, editor plugins, scripts that count tokens) work:

- `POST /tokenize` `{"content", "add_special": false, "parse_special": true, "with_pieces": false}`
  -> `{"tokens": [id, ...]}`, or with pieces `{"tokens": [{"id": id, "piece": "text"}, ...]}`, a
  piece that is no valid UTF-8 (part of a character) as its list of byte values. `content` is a
  string, or llama-server's mixed list of strings and token ids (ids taken as they are, the first
  string alone getting the special tokens, and only when it comes first); absent: no tokens.
- `POST /detokenize` `{"tokens": [id, ...]}` -> `{"content": text}`: each token's text, special
  tokens as their text (llama.cpp's `common_token_to_piece(..., special=true)`), bytes that are no
  UTF-8 replaced by U+FFFD. An id outside the vocabulary is a 400 (llama-server fails on it).
- `POST /apply-template` `{"messages", "tools", "tool_choice"}` -> `{"prompt": text}`: the chat
  rendered as the chat route renders it (the model's template, the generation prompt at the end).
- `GET /props`: the server's properties in llama-server's shape, those this server can state.

Every text is size-checked before it is tokenized (limits.py's prompt_byte_limit), and tokenizing,
rendering and detokenizing run off the event loop within the request time limit. Unknown fields
are ignored, as llama-server ignores them; a known field of the wrong JSON type is a 400. Errors
are this server's (errors.py). None of these routes is in the OpenAPI document: they are
llama-server's API, documented in docs/server.md ("llama-server's utility endpoints").
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Callable, Optional, Sequence, TypeVar, Union

import anyio
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

import specdec
from specdec.backends.base import Backend
from specdec.server import offload
from specdec.server.convert import DEFAULT_TEMPERATURE
from specdec.server.errors import APIError, bad_request, json_response, register_field_names
from specdec.server.limits import OffLoopJSONRoute, prompt_byte_limit
from specdec.server.protocol import ChatMessage, Int
from specdec.server.serving import state_of
from specdec.server.tools import ToolChoice, Tools, check_tools, template_messages
from specdec.types import SpecdecError

T = TypeVar("T")

router = APIRouter(route_class=OffLoopJSONRoute)

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a random seed per request
ENGINE_SAMPLERS = ("temperature", "top_k", "top_p", "min_p")  # llama.cpp's names, in the engine's order


class _Lenient(BaseModel):
    # llama-server reads the fields it knows and ignores the rest; strict: "true" is no boolean.
    model_config = ConfigDict(extra="ignore", strict=True)


class TokenizeRequest(_Lenient):
    content: Union[str, list[Union[str, Int]], None] = None  # absent: no tokens, as llama-server answers
    add_special: Optional[bool] = None  # default false: no BOS
    parse_special: Optional[bool] = None  # default true: special-token text becomes the special token
    with_pieces: Optional[bool] = None  # default false


class DetokenizeRequest(_Lenient):
    tokens: Optional[list[Int]] = None  # absent: "", as llama-server answers


class ApplyTemplateRequest(_Lenient):
    """The chat fields that shape a prompt (llama-server reads the whole chat request; the
    sampling fields change no prompt)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Optional[Tools] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None


register_field_names([*TokenizeRequest.model_fields, *DetokenizeRequest.model_fields,
                      *ApplyTemplateRequest.model_fields])


# -- the routes ----------------------------------------------------------------------------------
@router.post("/tokenize", include_in_schema=False)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    state = state_of(request)
    backend = state.engine.target
    if body.content is None:
        return json_response({"tokens": []})
    parts = [body.content] if isinstance(body.content, str) else list(body.content)
    check_text_size(backend, state.config, sum(_utf8_size(p) if isinstance(p, str) else 1 for p in parts), "content")
    check_token_ids(backend, [(f"content[{i}]", p) for i, p in enumerate(parts) if not isinstance(p, str)])
    tokens = await off_loop(state.config, tokenize_content, backend, parts, bool(body.add_special),
                            body.parse_special is not False, bool(body.with_pieces))
    return json_response({"tokens": tokens})


@router.post("/detokenize", include_in_schema=False)
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    state = state_of(request)
    backend = state.engine.target
    ids = body.tokens or []
    check_token_ids(backend, [(f"tokens[{i}]", t) for i, t in enumerate(ids)])
    return json_response({"content": await off_loop(state.config, detokenize_ids, backend, ids)})


@router.post("/apply-template", include_in_schema=False)
async def apply_template(body: ApplyTemplateRequest, request: Request) -> Response:
    state = state_of(request)
    engine = state.engine
    setup = check_tools(body)  # roles' fields, tools and tool_choice: a 400 naming the field
    check_chat_size(engine.target, state.config, body, setup.tools if setup.active else ())
    messages = template_messages(body.messages)
    prompt = await off_loop(state.config, render, engine, messages, setup.template_tools)
    return json_response({"prompt": prompt})


@router.get("/props", include_in_schema=False)
async def get_props(request: Request) -> Response:
    return json_response(props(state_of(request)))


# -- the work ------------------------------------------------------------------------------------
def piece_json(data: bytes) -> Union[str, list[int]]:
    """llama-server's piece: the text when the bytes are valid UTF-8, else the list of byte values."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def token_text(backend: Backend, token_id: int) -> bytes:
    """A token's bytes as llama.cpp's common_token_to_piece(special=true) gives them: control
    tokens as their text (a backend's token_bytes renders those as nothing; its fingerprint
    bytes are the text)."""
    return backend.fingerprint_bytes(token_id)


def tokenize_content(backend: Backend, parts: Sequence[Union[str, int]], add_special: bool, parse_special: bool,
                     with_pieces: bool) -> list:
    """llama-server's tokenize_mixed: strings tokenized, ids taken as they are; the special tokens
    (BOS) only before a first element that is a string."""
    ids: list[int] = []
    for i, part in enumerate(parts):
        if not isinstance(part, str):
            ids.append(part)
            continue
        try:
            ids += backend.tokenize(part, add_special=add_special and i == 0, parse_special=parse_special)
        except UnicodeError:
            param = "content" if len(parts) == 1 else f"content[{i}]"
            raise bad_request(f"{param}: the text is not valid Unicode (a lone surrogate?).", param) from None
    if not with_pieces:
        return ids
    return [{"id": token, "piece": piece_json(token_text(backend, token))} for token in ids]


def detokenize_ids(backend: Backend, ids: Sequence[int]) -> str:
    return b"".join(token_text(backend, token) for token in ids).decode("utf-8", errors="replace")


def render(engine, messages: list[dict], tools: Optional[list[dict]]) -> str:
    try:
        return engine.render_chat(messages, tools)
    except SpecdecError as exc:  # no chat template, or the template refused the messages
        raise bad_request(f"messages: {exc}", "messages") from None
    except UnicodeError:
        raise bad_request("messages: the text is not valid Unicode (a lone surrogate?).", "messages") from None


def props(state) -> dict:
    """GET /props: llama-server's fields that this server can state. `params` are the sampling
    defaults of a chat or text completion that sets none (the samplers the engine does not run at
    the values that switch them off); n_predict is the server's --max-tokens cap."""
    engine, config = state.engine, state.config
    target = engine.target
    params = {
        "seed": LLAMA_DEFAULT_SEED,
        "temperature": DEFAULT_TEMPERATURE, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
        "typical_p": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0, "repeat_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "mirostat": 0,
        "max_tokens": config.max_tokens, "n_predict": config.max_tokens,
        "ignore_eos": False, "stream": False, "n_probs": 0,
        "samplers": list(ENGINE_SAMPLERS),
        # specdec's own: what a request without `speculative_decoding` gets.
        "speculative_decoding": {"method": config.spec.method, "num_speculative_tokens": config.spec.num_draft_tokens},
    }
    data: dict[str, Any] = {
        "default_generation_settings": {"params": params, "n_ctx": target.n_ctx},
        "total_slots": len(engine.slots),
        "model_alias": config.served_model_name,
    }
    model_path = getattr(target, "model_path", None)
    if model_path is not None:
        data["model_path"] = str(model_path)
    data.update({
        "modalities": {"vision": False, "audio": False},
        "endpoint_slots": False,  # no /slots
        "endpoint_props": False,  # no POST /props
        "endpoint_metrics": True,
    })
    template = target.chat_template_source()
    if template is not None:
        data["chat_template"] = template
    data.update({"build_info": f"specdec-{specdec.__version__}", "is_sleeping": False})
    return data


# -- bounds ---------------------------------------------------------------------------------------
def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_text_size(backend: Backend, config, size: int, param: str) -> None:
    """Text of more bytes than the context's tokens could hold (or than --max-prompt-bytes) is
    refused before it is tokenized, as every route refuses it."""
    n_ctx = backend.n_ctx
    limit = prompt_byte_limit(n_ctx, config.max_prompt_bytes)
    if size > limit:
        raise bad_request(f"{param}: the text is {size} bytes; this server tokenizes at most {limit} "
                          f"(its context holds {n_ctx} tokens).", param, "context_length_exceeded")


def check_chat_size(backend: Backend, config, body: ApplyTemplateRequest, tools: Sequence[dict]) -> None:
    """As the chat route bounds a chat before rendering it (convert.check_prompt_size)."""
    n_ctx = backend.n_ctx
    if len(body.messages) >= n_ctx:
        raise bad_request(f"messages: {len(body.messages)} messages cannot fit a context of {n_ctx} tokens.",
                          "messages", "context_length_exceeded")
    size = sum(_utf8_size(m.text()) + _utf8_size(m.name or "") for m in body.messages)
    size += sum(_utf8_size(call.function.name + call.function.arguments)
                for m in body.messages for call in m.tool_calls or ())
    size += _utf8_size(json.dumps(list(tools), ensure_ascii=False)) if tools else 0
    check_text_size(backend, config, size, "messages")


def check_token_ids(backend: Backend, ids: Sequence[tuple[str, int]]) -> None:
    for param, token in ids:
        if not 0 <= token < backend.vocab_size:
            raise bad_request(f"{param}: token id {token} is outside the vocabulary of {backend.vocab_size}.",
                              param, "invalid_token_id")


async def off_loop(config, function: Callable[..., T], *args) -> T:
    """function(*args) in a worker thread, within the request time limit (a stuck tokenizer must
    not hold the request forever)."""
    try:
        with anyio.fail_after(config.request_timeout):
            return await offload.off_loop(function, *args, abandon_on_cancel=True)
    except TimeoutError:
        raise APIError(503, f"the request took longer than the server's time limit of {config.request_timeout:g}s; "
                            "retry later.", "server_error", None, "timeout",
                       {"Retry-After": str(config.retry_after)}) from None
