"""From wire requests to engine requests: done once, here, so the engine never sees pydantic."""
from __future__ import annotations

from typing import Optional, Union

from specdec.engine.engine import Engine
from specdec.server.config import ServerConfig
from specdec.server.errors import APIError, bad_request
from specdec.server.limits import prompt_byte_limit
from specdec.server.protocol import ChatCompletionRequest, CompletionRequest, SpeculativeDecoding
from specdec.types import GenerationRequest, SamplingParams, SpecConfig, SpecdecError

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send temperature 0 for greedy decoding


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
        size = sum(_utf8_size(m.text()) + _utf8_size(m.name or "") for m in messages)
    else:
        param, prompt = "prompt", body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], int):
            if len(prompt) >= n_ctx:
                raise bad_request(f"prompt: the prompt has {len(prompt)} tokens but the context holds only {n_ctx}.",
                                  param, "context_length_exceeded")
            return
        size = _utf8_size(prompt[0] if isinstance(prompt, list) else prompt)
    limit = prompt_byte_limit(n_ctx, config.max_prompt_bytes)
    if size > limit:
        raise bad_request(f"{param}: the prompt is {size} bytes of text; this server takes at most {limit} "
                          f"(its context holds {n_ctx} tokens).", param, "context_length_exceeded")


def encode_prompt(engine: Engine, body: Union[ChatCompletionRequest, CompletionRequest]) -> list[int]:
    if isinstance(body, ChatCompletionRequest):
        param = "messages"
        messages = []
        for message in body.messages:
            role = "system" if message.role == "developer" else message.role
            rendered = {"role": role, "content": message.text()}
            if message.name is not None:
                rendered["name"] = message.name  # the model's chat template decides what it means
            messages.append(rendered)
        source, chat = messages, True
    else:
        param = "prompt"
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            bad = [t for t in prompt if t >= engine.target.vocab_size]
            if bad:
                raise bad_request(f"prompt: token id {bad[0]} is outside the vocabulary of {engine.target.vocab_size}.",
                                  "prompt", "invalid_token_id")
            return list(prompt)
        source, chat = (prompt[0] if isinstance(prompt, list) else prompt), False
    try:
        token_ids = engine.encode_prompt(source, chat=chat)
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
    max_param = "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens, max_param = body.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = config.max_tokens  # generation also ends at the context limit
    elif len(prompt_ids) + max_tokens > n_ctx:
        raise bad_request(f"{max_param}: the prompt ({len(prompt_ids)} tokens) plus {max_param} ({max_tokens}) "
                          f"exceeds the context of {n_ctx} tokens.", max_param, "context_length_exceeded")
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    sampling = SamplingParams(
        temperature=temperature,
        top_k=max(0, body.top_k or 0),
        top_p=1.0 if body.top_p is None else body.top_p,
        min_p=body.min_p or 0.0,
        seed=None if body.seed is None else body.seed % 2**64,
    )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    request = GenerationRequest(
        prompt_token_ids=tuple(prompt_ids),
        max_tokens=max_tokens,
        sampling=sampling,
        spec=speculation(body.speculative_decoding, config, engine),
        stop=stop,
        ignore_eos=bool(body.ignore_eos),
        tenant=tenant,
        cache_prompt=body.cache_prompt is not False,
    )
    try:
        request.sampling.validate()
        request.spec.validate()
    except SpecdecError as exc:
        raise bad_request(str(exc)) from None
    return request
