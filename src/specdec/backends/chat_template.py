"""Chat templates as Hugging Face writes them (Jinja in the GGUF's tokenizer.chat_template)."""
from __future__ import annotations

import json
from datetime import datetime
from typing import Optional, Sequence

from specdec.types import SpecdecError


def render_chat_template(template: str, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None,
                         bos_token: str = "", eos_token: str = "") -> str:
    """Render a Hugging Face-style Jinja chat template, as transformers does, ending with the
    assistant prompt; `tools`: OpenAI's tool definitions ({"type": "function", "function": ...});
    `bos_token`, `eos_token`: the model's texts of them, which templates such as Llama 3's write."""
    from jinja2 import BaseLoader
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=BaseLoader())
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama 3.1's date line, as transformers
    try:
        return env.from_string(template).render(messages=list(messages), add_generation_prompt=True,
                                                 tools=list(tools) if tools else None,
                                                 bos_token=bos_token, eos_token=eos_token)
    except TemplateError as exc:
        raise SpecdecError(f"the chat template refused the messages: {exc}") from None
