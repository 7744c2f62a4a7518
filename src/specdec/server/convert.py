"""From wire requests to engine requests: done once, here, so the engine never sees pydantic."""
from __future__ import annotations

import dataclasses
import json
from typing import Optional, Union, cast

from pydantic import ValidationError

from specdec.engine.engine import Engine
from specdec.grammar.compiler import GrammarBusy
from specdec.server.config import ServerConfig
from specdec.server.errors import APIError, bad_request
from specdec.server.fim import encode_fim, fim_stop_tokens
from specdec.server.limits import prompt_byte_limit
from specdec.server.protocol import ChatCompletionRequest, CompletionRequest, SpeculativeDecoding
from specdec.server.tools import check_tools, marker_tokens, template_messages, tool_grammar
from specdec.types import GenerationRequest, GrammarSpec, SamplingParams, SpecConfig, SpecdecError

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send temperature 0 for greedy decoding


def chat_request_of(fields: dict, param: str) -> ChatCompletionRequest:
    """The chat completions request another surface's request means (its fields set, None left
    out); what the chat types refuse is a 400 naming the other surface's `param`."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise bad_request(f"{param}: {where}: {first.get('msg')}", param) from None


def check_model(model: str, config: ServerConfig) -> None:
    if model != config.served_model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {config.served_model_name!r}.",
                       "invalid_request_error", "model", "model_not_found")


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_prompt_size(engine: Engine, config: ServerConfig, body: Union[ChatCompletionRequest, CompletionRequest]) -> None:
    """Refuse, before it is rendered and tokenized, a prompt that cannot fit the context: more
    bytes of text than the context's tokens could hold (or than --max-prompt-bytes), more
    messages than it has tokens (each message renders into tokens of its own), more token ids."""
    n_ctx = engine.target.n_ctx
    if isinstance(body, ChatCompletionRequest):
        param, messages = "messages", body.messages
        if len(messages) >= n_ctx:
            raise bad_request(f"messages: {len(messages)} messages cannot fit a context of {n_ctx} tokens.",
                              param, "context_length_exceeded")
        setup = check_tools(body)  # tools, tool_choice and tool messages: a 400 before any work
        size = sum(_utf8_size(m.text()) + _utf8_size(m.name or "") for m in messages)
        size += sum(_utf8_size(call.function.name + call.function.arguments)
                    for m in messages for call in m.tool_calls or ())
        size += _utf8_size(json.dumps(setup.tools, ensure_ascii=False)) if setup.active else 0
    else:
        param, prompt = "prompt", body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], int):
            if len(prompt) >= n_ctx:
                raise bad_request(f"prompt: the prompt has {len(prompt)} tokens but the context holds only {n_ctx}.",
                                  param, "context_length_exceeded")
            if not body.suffix:
                return
            param, size = "suffix", _utf8_size(body.suffix)  # text beside token ids: measured all the same
        else:
            # cast: text here, as prompts_of splits a list of token lists into one prompt each
            text = cast(str, prompt[0] if isinstance(prompt, list) else prompt)
            size = _utf8_size(text) + _utf8_size(body.suffix or "")
    limit = prompt_byte_limit(n_ctx, config.max_prompt_bytes)
    if size > limit:
        raise bad_request(f"{param}: the prompt is {size} bytes of text; this server takes at most {limit} "
                          f"(its context holds {n_ctx} tokens).", param, "context_length_exceeded")


def encode_prompt(engine: Engine, body: Union[ChatCompletionRequest, CompletionRequest]) -> list[int]:
    source: Union[str, list[dict]]
    if isinstance(body, ChatCompletionRequest):
        param = "messages"
        setup = check_tools(body)
        source, chat, tools = template_messages(body.messages), True, setup.template_tools
    else:
        param = "prompt"
        prompt = body.prompt
        if body.suffix and body.echo:
            raise bad_request("suffix: fill-in-the-middle does not echo the prompt; drop echo or the suffix.", "suffix", "fim_unsupported")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            bad = [t for t in prompt if t >= engine.target.vocab_size]
            if bad:
                raise bad_request(f"prompt: token id {bad[0]} is outside the vocabulary of {engine.target.vocab_size}.",
                                  "prompt", "invalid_token_id")
            return encode_fim(engine.target, prompt, body.suffix) if body.suffix else list(prompt)
        # cast: as in check_prompt_size
        source, chat, tools = cast(str, prompt[0] if isinstance(prompt, list) else prompt), False, None
        if body.suffix:  # fill-in-the-middle: the prompt and the suffix in the model's FIM tokens
            return encode_fim(engine.target, source, body.suffix)
    try:
        token_ids = engine.encode_prompt(source, chat=chat, tools=tools)
    except SpecdecError as exc:
        raise bad_request(f"{param}: {exc}", param) from None
    except UnicodeError:
        raise bad_request(f"{param}: the text is not valid Unicode (a lone surrogate?).", param) from None
    if not token_ids:
        raise bad_request(f"{param}: the prompt is empty.", param)
    return token_ids


def speculation(value: Union[bool, SpeculativeDecoding, None], config: ServerConfig, engine: Engine) -> SpecConfig:
    if value is None or value is True:
        spec = config.spec
    elif value is False:
        spec = SpecConfig("off", config.spec.num_draft_tokens)
    else:
        method = config.spec.method if value.method is None else value.method
        k = config.spec.num_draft_tokens if value.num_speculative_tokens is None else value.num_speculative_tokens
        spec = SpecConfig(method, k)
    if spec.method not in engine.methods:
        raise bad_request(f"speculative_decoding.method: {spec.method!r} needs a draft model, and this server runs "
                          f"without one; choose one of {', '.join(engine.methods)}.", "speculative_decoding.method")
    return spec


def generation_request(engine: Engine, config: ServerConfig, body: Union[ChatCompletionRequest, CompletionRequest],
                       prompt_ids: list[int], tenant: Optional[str] = None) -> GenerationRequest:
    n_ctx = engine.target.n_ctx
    prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if len(prompt_ids) >= n_ctx:
        raise bad_request(f"{prompt_param}: the prompt has {len(prompt_ids)} tokens but the context holds only "
                          f"{n_ctx}.", prompt_param, "context_length_exceeded")
    max_tokens: Optional[int] = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = config.max_tokens
    # Beyond the room the context leaves, the answer ends there ("length"), as peers do: agents ask
    # for 32,000 tokens whatever the model holds. Only a prompt that does not fit is refused.
    max_tokens = min(max_tokens, n_ctx - len(prompt_ids))
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    try:
        sampling = SamplingParams(
            temperature=temperature,
            top_k=max(0, body.top_k or 0),
            top_p=1.0 if body.top_p is None else body.top_p,
            min_p=body.min_p or 0.0,
            seed=None if body.seed is None else body.seed % 2**64,
            # "7" and "007" name one token: the last given wins, as a JSON object's last key does
            logit_bias=tuple({int(token): bias for token, bias in (body.logit_bias or {}).items()}.items()),
        )
        sampling.check_vocabulary(engine.target.vocab_size)
    except SpecdecError as exc:
        raise bad_request(f"logit_bias: {exc}", "logit_bias", "invalid_token_id") from None
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = body.logprobs
        prompt_logprobs = body.logprobs if body.echo else None  # echo with logprobs: the prompt's too
    request = GenerationRequest(
        prompt_token_ids=tuple(prompt_ids),
        max_tokens=max_tokens,
        sampling=sampling,
        spec=speculation(body.speculative_decoding, config, engine),
        stop=stop,
        ignore_eos=bool(body.ignore_eos),
        tenant=tenant,
        cache_prompt=body.cache_prompt is not False,
        # A FIM answer also ends at the FIM format's end tokens (<|fim_pad|>, <|file_sep|>, ...).
        stop_token_ids=(fim_stop_tokens(engine.target) if isinstance(body, CompletionRequest) and body.suffix
                        else frozenset()),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        grammar=request_grammar(engine, body),
    )
    try:
        request.validate()
    except SpecdecError as exc:
        raise bad_request(str(exc)) from None
    return request


def prompts_of(body: Union[ChatCompletionRequest, CompletionRequest]) -> list[Union[ChatCompletionRequest,
                                                                                 CompletionRequest]]:
    """The request once per prompt: completions may send a list of them (strings or token lists),
    each with its own choices; a chat request is one prompt."""
    if isinstance(body, CompletionRequest) and isinstance(body.prompt, list) and body.prompt \
            and not isinstance(body.prompt[0], int):
        return [body.model_copy(update={"prompt": prompt}) for prompt in body.prompt]
    return [body]


def logprob_entries(request: GenerationRequest, n_ctx: int) -> int:
    """The log-probability entries one choice of the request may carry: a token's own and its top
    ones, for every token it may generate (and its echoed prompt's)."""
    if request.logprobs is None:
        return 0
    tokens = n_ctx if request.max_tokens is None else request.max_tokens
    if request.prompt_logprobs is not None:
        tokens += len(request.prompt_token_ids)
    return tokens * (request.logprobs + 1)


def check_unstreamed_size(config: ServerConfig, entries: int, top_param: str) -> None:
    """A whole answer is built and held at once: one that could hold more log-probability entries
    than --max-unstreamed-logprobs is refused, before any is generated; a stream has no bound."""
    limit = config.max_unstreamed_logprobs
    if entries > limit:
        raise bad_request(f"stream: this answer could hold {entries} log-probability entries (n x tokens x "
                          f"({top_param} + 1)); an answer that is not streamed holds at most {limit}: send "
                          f"stream: true, or lower n, max_tokens or {top_param}.", "stream", "response_too_large")


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """One generation request per choice: the request's seed + i for choice i (so a seeded request
    is reproducible and its choices differ), or each its own random seed without one. The prompt
    is scored (echo with logprobs) once, by choice 0: its logprobs serve every choice."""
    seed = request.sampling.seed
    return [request if i == 0 else dataclasses.replace(request, prompt_logprobs=None, sampling=dataclasses.replace(
        request.sampling, seed=None if seed is None else (seed + i) % 2**64)) for i in range(n)]


def request_grammar(engine: Engine, body: Union[ChatCompletionRequest, CompletionRequest]) -> Optional[GrammarSpec]:
    """The constraint on the output: the tools' calls (tools.py; with response_format, its JSON is
    the text a call may replace), else response_format's."""
    setup = check_tools(body) if isinstance(body, ChatCompletionRequest) else None
    if setup is None or not setup.active:
        return response_grammar(engine, body)
    form = body.response_format
    text_schema = None
    if form is not None and form.type == "json_object":
        text_schema = {"type": "object"}
    elif form is not None and form.type == "json_schema":
        schema = form.json_schema.json_schema
        text_schema = {"type": "object"} if schema is None else schema
    try:
        spec = tool_grammar(setup, marker_tokens(engine.target), text_schema, engine.grammars.time_limit)
    except GrammarBusy as exc:
        raise _busy(exc, "tools") from None
    assert spec is not None  # setup.active: tool calling is on
    return compiled_grammar(engine, spec, "tools", "invalid_value")


def response_grammar(engine: Engine, body: Union[ChatCompletionRequest, CompletionRequest]) -> Optional[GrammarSpec]:
    """`response_format` as a grammar the engine enforces (None for text), checked now: a schema
    the grammar library cannot enforce is a 400 naming what it refused."""
    form = body.response_format
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        spec, param = GrammarSpec("json_object"), "response_format"
    else:
        schema = form.json_schema.json_schema
        spec = GrammarSpec("json_schema", json.dumps({"type": "object"} if schema is None else schema))
        param = "response_format.json_schema.schema"
    return compiled_grammar(engine, spec, param, "unsupported_schema")


def compiled_grammar(engine: Engine, spec: GrammarSpec, param: str, code: str) -> GrammarSpec:
    """The spec with its grammar compiled (cached; on the grammar threads, within their time limit),
    so the engine's worker only copies it per choice; what cannot be used is a 400 naming `param`."""
    try:
        return dataclasses.replace(spec, compiled=engine.grammars.compile(spec))
    except GrammarBusy as exc:
        raise _busy(exc, param) from None
    except SpecdecError as exc:  # GrammarTimeout among them
        raise bad_request(f"{param}: {exc}", param, code) from None


def _busy(exc: GrammarBusy, param: str) -> APIError:
    return APIError(503, str(exc), "server_error", param, "grammar_compiler_busy", {"Retry-After": "1"})
