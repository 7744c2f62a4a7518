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
routes on the digest at `--prefix-routing-chars`.

An agent's or a chat client's session key goes in a header of its own (a digest of it):

    x-specdec-session: <digest of prompt_cache_key, or of the Messages API's metadata.user_id>

Codex CLI sends its thread id as `prompt_cache_key` in every request, Claude Code a session id in
`metadata.user_id`: their sessions all start with the same long system prompt, so the prefix
alone would send every session to one replica; the key keeps each session on its replica and
spreads the sessions. No Ray here: unit-tested alone.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional

from specdec.server.messages import BILLING_HEADER

PREFIX_HEADER = b"x-specdec-prefix"
SESSION_HEADER = b"x-specdec-session"
BLOCK_CHARS = 256
MAX_BLOCKS = 64  # 16,384 characters: the longest prefix one can route on
DEFAULT_PREFIX_CHARS = 1024  # about 250 tokens: seconds of prompt processing on a CPU
ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts or blocks: the text ones, in order
        return "".join(part.get("text", "") for part in content if isinstance(part, dict)
                       and isinstance(part.get("text"), str))
    return ""


def _item_text(item: dict) -> str:
    """A message's, or a Responses input item's, text as the model reads it (its markup aside)."""
    role = item.get("role") or item.get("type") or ""
    text = _content_text(item.get("content"))
    for field in ("arguments", "output"):  # function_call / function_call_output items
        if not text and isinstance(item.get(field), str):
            text = item[field]
    if role == "system":  # Claude Code's attribution line changes every turn (server/messages.py)
        text = BILLING_HEADER.sub("", text)
    return f"{role}\n{text}\n"


def prompt_text(body: Any) -> str:
    """The text a request's prompt starts with, in the order the model reads it: chat, Messages
    and Responses turns role by role (what the chat template renders, minus its markup), or a
    completion's prompt."""
    if not isinstance(body, dict):
        return ""
    start = ""
    for system in (body.get("system"), body.get("instructions")):  # Messages', Responses' system text
        if _content_text(system):
            start += _item_text({"role": "system", "content": system})
    turns = body.get("messages")
    if not isinstance(turns, list):
        turns = body.get("input")
        if isinstance(turns, str):
            return start + _item_text({"role": "user", "content": turns})
    if isinstance(turns, list):
        return start + "".join(_item_text(item) for item in turns if isinstance(item, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt
    if isinstance(prompt, list):  # token ids
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def session_digest(body: Any) -> Optional[str]:
    """A digest of the session key the client sent (prompt_cache_key, Messages' metadata.user_id)."""
    if not isinstance(body, dict):
        return None
    key = body.get("prompt_cache_key")
    metadata = body.get("metadata")
    if not isinstance(key, str) and isinstance(metadata, dict):
        key = metadata.get("user_id")
    if not isinstance(key, str) or not key:
        return None
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


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
