"""What a request's prompt starts with, as digests the request router can route on.

A replica that has just served a long prompt keeps it in a slot's KV cache and reuses it for the
next prompt that starts the same way (the prefix cache: a shared system prompt, a document asked
several questions, a chat's history). Prompt processing runs at tens of tokens a second on a
CPU, so sending such a request to that replica saves seconds. Ray's request router sees a
request's headers only, so a middleware in the proxy (proxy.py) reads the body, takes its prompt
text, and passes digests of its leading blocks in a header:

    x-specdec-prefix: <digest of chars [0, 256)>,<digest of [0, 512)>,...   (at most 64 blocks)

Each digest covers the whole text up to the end of its block (a chain), so two prompts share the
i-th digest exactly when they share their first (i + 1) * 256 characters. The router (router.py)
routes on the digest at `--prefix-routing-chars`. No Ray here: unit-tested alone.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional

PREFIX_HEADER = b"x-specdec-prefix"
BLOCK_CHARS = 256
MAX_BLOCKS = 64  # 16,384 characters: the longest prefix one can route on
DEFAULT_PREFIX_CHARS = 1024  # about 250 tokens: seconds of prompt processing on a CPU
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones, in order
        return "".join(part.get("text", "") for part in content if isinstance(part, dict)
                       and isinstance(part.get("text"), str))
    return ""


def prompt_text(body: Any) -> str:
    """The text a request's prompt starts with, in the order the model reads it: chat messages
    role by role (what the chat template renders, minus its markup), or a completion's prompt."""
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(f"{m.get('role', '')}\n{_content_text(m.get('content'))}\n"
                       for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt
    if isinstance(prompt, list):  # token ids
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def prefix_digests(text: str) -> list[str]:
    """Chained digests of the text's whole 256-character blocks (a partial last block has none).

    Example: 700 characters -> 2 digests, for [0, 256) and [0, 512)."""
    digests, chain = [], hashlib.blake2b(digest_size=8)
    for i in range(min(len(text) // BLOCK_CHARS, MAX_BLOCKS)):
        chain.update(text[i * BLOCK_CHARS:(i + 1) * BLOCK_CHARS].encode("utf-8", "surrogatepass"))
        digests.append(chain.copy().hexdigest())
    return digests


def encode_header(digests: list[str]) -> bytes:
    return ",".join(digests).encode("ascii")


def routing_digest(header: Optional[bytes], prefix_chars: int) -> Optional[str]:
    """The digest of the prompt's first `prefix_chars` characters, from the header; None when the
    prompt is shorter, the header absent or routing on prefixes off (`prefix_chars` 0)."""
    if not header or prefix_chars <= 0:
        return None
    digests = header.decode("ascii", "replace").split(",")
    index = prefix_chars // BLOCK_CHARS - 1
    return digests[index] if 0 <= index < len(digests) else None


def validate_prefix_chars(prefix_chars: int) -> Optional[str]:
    """Why a `--prefix-routing-chars` value cannot be used, or None."""
    if prefix_chars == 0:
        return None
    if prefix_chars < 0 or prefix_chars % BLOCK_CHARS or prefix_chars > BLOCK_CHARS * MAX_BLOCKS:
        return (f"--prefix-routing-chars must be 0 (off) or a multiple of {BLOCK_CHARS} up to "
                f"{BLOCK_CHARS * MAX_BLOCKS}.")
    return None
