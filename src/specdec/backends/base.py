"""The backend interface: who runs a model.

A backend evaluates tokens at given positions of a sequence's KV cache and returns logits for
every evaluated position; it can truncate a sequence's cache to a length (rollback of rejected
drafts). It knows nothing of drafting or acceptance. Callers track which tokens are cached
(see backends/sequence.py); the backend only checks that evaluation continues where the cache ends.
"""
from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from specdec.types import SpecdecError


class Backend(ABC):
    name: str = "backend"
    vocab_size: int
    n_ctx: int
    eog_token_ids: frozenset[int]
    max_sequences: int = 1
    # > 1: prompt processing runs in chunks that start and end at multiples of this (see
    # aligned_chunks), because this backend's numbers for a position depend on the batch it was
    # computed in; prefix caching then reuses only whole chunks (backends/sequence.py).
    prefill_alignment: int = 1
    # > 0: a sequence may take another's cached positions (share_prefix) in blocks of this,
    # without computing them again; 0: each sequence computes its own.
    prefix_share_block: int = 0
    # Sequence ids max_sequences .. max_sequences + parked_sequences - 1 may hold shared positions
    # (share_prefix, truncate) but are never evaluated: prompt starts parked (engine/prompt_cache.py).
    parked_sequences: int = 0

    @abstractmethod
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text -> ids. `parse_special`: special-token text (e.g. `<|im_start|>`) becomes the special
        token; False: it is tokenized as the plain text it is (a user's message)."""

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character)."""

    @abstractmethod
    def apply_chat_template(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None) -> str:
        """Render chat messages with the model's own template, ending with the assistant prompt;
        `tools`: OpenAI's tool definitions, for the template's tools section."""

    @abstractmethod
    def eval(self, seq_id: int, start: int, tokens: Sequence[int], *, prefill: bool = False) -> np.ndarray:
        """Evaluate tokens at positions start.. of seq_id's cache, which must hold exactly `start` tokens.

        Returns logits [len(tokens), vocab] (float32) for every position, or an empty [0, vocab]
        array when prefill is True (prompt processing needs no logits and may use larger batches).
        """

    @abstractmethod
    def truncate(self, seq_id: int, length: int) -> None:
        """Drop seq_id's cached positions from `length` onward."""

    def share_prefix(self, source_seq: int, seq_id: int, length: int) -> None:
        """seq_id (holding nothing) takes source_seq's cached positions < length, as if it had
        computed them itself: the blocks of prefix_share_block holding them, the last one in part
        where length is no multiple of it (neither may then write in that block while the other
        holds it: keepable)."""
        raise NotImplementedError(f"{self.name} cannot share cached positions between sequences")

    def save_positions(self, seq_id: int, length: int) -> Optional[np.ndarray]:
        """A copy in host memory of seq_id's cached positions < length (load_positions puts them
        back, bit for bit), or None where this backend cannot copy its cache out."""
        return None

    @property
    def copies_cells(self) -> bool:
        """Whether save_positions copies this backend's cache out (else it gives None)."""
        return False

    def load_positions(self, seq_id: int, cells: np.ndarray, length: int) -> None:
        """seq_id (holding nothing) holds the first `length` positions of a save_positions copy, in
        cells of its own, as if it had computed them."""
        raise NotImplementedError(f"{self.name} cannot copy its cache back from host memory")

    def gather(self, seq_id: int, length: int, end: int) -> bool:
        """Move seq_id's cached positions < length into cells that lie together, with room after
        them for its positions < end, where they lie among other sequences' cells (which its
        attention would read past at every step) and it holds them alone; whether it moved them.
        The values are copied as they are: the logits that follow do not change."""
        return False

    def keepable(self, seq_id: int, length: int) -> int:
        """The longest prefix up to `length` of seq_id's cache that it may truncate to and then
        extend (positions another sequence shares may pin more of it)."""
        return length

    def has_room(self, seq_id: int, end: int) -> bool:
        """Whether seq_id can take the cells of its positions < end now (without evicting anything)."""
        return True

    def room_to_hold(self, seq_id: int, source_seq: int, length: int, end: int) -> bool:
        """Whether seq_id, holding source_seq's cached positions < length in place of what it
        holds (its own when source_seq is seq_id), could take the cells of its positions < end
        now; where cells are no scarcer than positions, always."""
        return True

    def reserve(self, seq_id: int, end: int) -> None:
        """Make room for seq_id's positions < end before a forward it shares with other sequences:
        a SpecdecError here fails that sequence alone, where inside the forward it would fail all."""

    def eval_many(self, requests: Sequence[tuple[int, int, Sequence[int]]], *, prefill: bool = False) -> list[np.ndarray]:
        """Evaluate several sequences' (seq_id, start, tokens); backends that can batch them override this."""
        return [self.eval(seq_id, start, tokens, prefill=prefill) for seq_id, start, tokens in requests]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")

    def chat_template_source(self) -> Optional[str]:
        """The model's chat template as it ships with it (Jinja), or None: none, or rendered otherwise."""
        return None

    def describe(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "n_ctx": self.n_ctx}

    def vocab_fingerprint(self) -> str:
        """A hash of every token's bytes: equal fingerprints mean interchangeable token ids."""
        digest = hashlib.sha256()
        for token_id in range(self.vocab_size):
            digest.update(self.fingerprint_bytes(token_id))
            digest.update(b"\x00")
        return digest.hexdigest()

    def fingerprint_bytes(self, token_id: int) -> bytes:
        """A token's identity in the fingerprint; backends whose control tokens render as nothing give their text."""
        return self.token_bytes(token_id)

    def close(self) -> None:
        pass


def aligned_chunks(start: int, count: int, alignment: int, max_rows: Optional[int] = None) -> list[tuple[int, int]]:
    """(offset, length) of the chunks that evaluate positions start..start+count-1 when every chunk
    but the last must end at a multiple of `alignment` and hold at most `max_rows` rows (default:
    `alignment`; a multiple of it).

    Every position is then computed in the same chunk, of the same rows, whatever prefix of the
    prompt was already cached — as long as the cached prefix is a whole number of chunks.
    Example: start 128, count 150, alignment 64 -> [(0, 64), (64, 64), (128, 22)];
    with max_rows 128 -> [(0, 128), (128, 22)]; start 100 -> the first chunk ends at 128.
    """
    if count <= 0:
        return []
    if alignment <= 1:
        size = max_rows or count
        return [(offset, min(size, count - offset)) for offset in range(0, count, size)]
    limit = max_rows or alignment
    if limit % alignment:
        raise ValueError(f"max_rows ({limit}) must be a multiple of the alignment ({alignment})")
    chunks, position, end = [], start, start + count
    while position < end:
        stop = min(end, position + limit)
        if stop < end:
            stop = stop // alignment * alignment  # > position, since limit >= alignment
        chunks.append((position - start, stop - position))
        position = stop
    return chunks


def default_threads() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_gguf_file(path: Path) -> None:
    if not path.exists():
        raise SpecdecError(f"model file {path} does not exist.")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise SpecdecError(f"model file {path} is not a GGUF file.")


def check_draft_compatible(target: Backend, draft: Backend) -> None:
    """Refuse a draft whose token ids do not mean what the target's mean."""
    if draft.vocab_size != target.vocab_size:
        raise SpecdecError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) does not match the target's "
            f"({target.vocab_size} tokens); choose a draft model with the target's tokenizer."
        )
    if draft.vocab_fingerprint() != target.vocab_fingerprint():
        raise SpecdecError(
            "the draft model's vocabulary has the target's size but different tokens; "
            "choose a draft model with the target's tokenizer."
        )
