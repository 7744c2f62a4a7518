"""What a llama.cpp-family library must offer LlamaFamilyBackend, and how its kernels must be driven.

Mainline llama.cpp (through llama-cpp-python) and ik_llama.cpp (through ctypes) share the C API's
ideas — models, contexts, batches, llama_decode, a KV cache per sequence id — but not its names,
signatures or struct layouts. A binding maps them onto the few calls below; everything else
(batch building, logits, tokenizer, chat template) is the backend's, written once.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TypeVar

import numpy as np

T = TypeVar("T")


@dataclass(frozen=True)
class KernelRules:
    """How to call one library's CPU kernels so that, in exact mode, evaluating k tokens at once
    gives bit for bit the logits of k one-token steps. Measured facts, one set per library and
    mode (docs/exactness.md), not options.

    max_decode_rows: rows per llama_decode call when logits are wanted (None: as many as fit);
    prefill_alignment: prompt chunks end at multiples of this, so that a prompt position is
        computed the same way whatever prefix was cached before (1: any split is the same);
    max_prefill_rows: rows per prompt-processing call (None: as many as fit);
    flash_attn: run attention with the flash-attention kernel;
    fa_reference: send flash attention down its reference path (mainline's patched switch);
    context_per_sequence: give every sequence a context (KV cache) of its own, sharing the
        loaded weights, where sequences sharing one cache change each other's numbers;
    min_rows: rows per call at least, where one row runs a kernel of its own (repacked weights):
        a shorter call is padded with rows whose logits are dropped and whose cells are removed;
    cell_ranges: sequences share one context (and llama_decode calls), each kept in an aligned
        range of cells of its own that the caller chooses (LlamaBinding.set_cells), so that its
        attention sums as if it were alone.
    """

    max_decode_rows: Optional[int]
    prefill_alignment: int
    flash_attn: bool
    max_prefill_rows: Optional[int] = None
    fa_reference: bool = False
    context_per_sequence: bool = False
    min_rows: int = 1
    cell_ranges: bool = False


@dataclass(frozen=True)
class ContextOptions:
    n_ctx: int  # KV cells in all, for every sequence together
    n_batch: int
    n_seq_max: int
    n_threads: int
    flash_attn: bool


class LlamaBinding(ABC):
    """One llama.cpp-family library. Handles (model, context, vocab, batch) are its own objects;
    the backend only passes them back. Calls whose C name and signature both libraries share are
    made here, on `_lib` (the library's functions under their C names); a binding overrides only
    what differs."""

    name: str
    _lib: object

    @abstractmethod
    def rules(self, exact: bool, repacked: bool = False) -> KernelRules:
        """The measured kernel rules for exact (or the lossy inexact) mode, on weights as stored
        or repacked."""

    # Whether load_model(repack=True) lays the weights out differently (ik_llama.cpp's row-
    # interleaved types); mainline repacks Q4_K in every mode, so it has no separate choice.
    repacks: bool = False

    # Whether a one-row llama_decode may carry embeddings instead of tokens (the reduced-vocabulary
    # draft's input, models/reduced_vocabulary.py).
    embeddings_one_row: bool = False

    @abstractmethod
    def load_model(self, path: Path, repack: bool = False, vocab_only: bool = False):
        """A loaded model, or a false value when the library refused the file. `repack`: lay the
        weights out for the library's fastest kernels, whose rules(repacked=True) then apply;
        `vocab_only`: the tokenizer and metadata, no weights."""

    @abstractmethod
    def free_model(self, model) -> None: ...

    @abstractmethod
    def new_context(self, model, options: ContextOptions):
        """A context (KV cache and compute buffers), or a false value when it could not be made."""

    @abstractmethod
    def free_context(self, ctx) -> None: ...

    @abstractmethod
    def context_cells_per_sequence(self, ctx, n_seq_max: int) -> int:
        """How many positions one sequence may hold in this context."""

    def vocab(self, model):
        return self._lib.llama_model_get_vocab(model)

    def n_vocab(self, vocab) -> int:
        return self._lib.llama_vocab_n_tokens(vocab)

    def is_eog(self, vocab, token: int) -> bool:
        return self._lib.llama_vocab_is_eog(vocab, token)

    @abstractmethod
    def tokenize(self, vocab, data: bytes, buffer, capacity: int, add_special: bool, parse_special: bool) -> int:
        """Tokens of UTF-8 `data` (special-token text parsed as special tokens if `parse_special`)
        into an int32 buffer; returns their count, or minus the capacity needed."""

    @abstractmethod
    def token_to_piece(self, vocab, token: int, buffer, length: int, special: bool) -> int:
        """A token's bytes into a char buffer; returns their count, or minus the length needed."""

    def meta_val_str(self, model, key: bytes, buffer, size: int) -> int:
        """A GGUF metadata value into a char buffer; its length, or < 0 when the key is absent."""
        return self._lib.llama_model_meta_val_str(model, key, buffer, size)

    def batch_init(self, capacity: int, n_seq_max: int, n_embd: int = 0):
        """A llama_batch with token (or, n_embd > 0, embd: n_embd floats a row), pos, n_seq_id, seq_id
        and logits arrays of `capacity` rows."""
        return self._lib.llama_batch_init(capacity, n_embd, n_seq_max)

    def batch_free(self, batch) -> None:
        self._lib.llama_batch_free(batch)

    def decode(self, ctx, batch, rules: KernelRules) -> int:
        """llama_decode under `rules` (a library may need a switch set around it); 0 on success."""
        return self._lib.llama_decode(ctx, batch)

    def logits_ith(self, ctx, i: int):
        """A float pointer to the logits of the last decode's i-th row."""
        return self._lib.llama_get_logits_ith(ctx, i)

    def set_cells(self, ctx, cells, kv_first: int, n_kv: int) -> None:
        """The cell of each token of the next decode (an int32 array), and the cells its attention
        spans (n_kv from kv_first, covering every cell of its sequences), where rules say cell_ranges."""
        raise NotImplementedError(f"{self.name} places tokens in cells of its own choosing")

    kv_host: bool = False  # copies cells to host memory and back (kv_read_cells, kv_write_cells)

    def kv_cell_bytes(self, ctx) -> int:
        """Bytes one cell's K and V take in host memory (every layer)."""
        raise NotImplementedError(f"{self.name} does not copy cells to host memory")

    def kv_read_cells(self, ctx, cells, destination: np.ndarray) -> bool:
        """The K and V of the named cells (an int32 array) into `destination` (uint8, their bytes);
        False where a cell is empty or out of range."""
        raise NotImplementedError(f"{self.name} does not copy cells to host memory")

    def kv_write_cells(self, ctx, seq_id: int, cells, positions, source: np.ndarray, stored: int) -> bool:
        """The first len(cells) of the `stored` cells a kv_read_cells copy holds into the named free
        cells, which seq_id then holds at `positions`; False, nothing written, where one is taken."""
        raise NotImplementedError(f"{self.name} does not copy cells to host memory")

    sequence_state: bool = False  # copies a sequence's whole state out and back (read_sequence, write_sequence)

    def read_sequence(self, ctx, seq_id: int) -> Optional[np.ndarray]:
        """seq_id's cached positions, K and V, as llama.cpp's state API writes them; None on failure."""
        raise NotImplementedError(f"{self.name} does not copy sequences to host memory")

    def write_sequence(self, ctx, seq_id: int, source: np.ndarray) -> bool:
        """A read_sequence copy into seq_id (holding nothing); False where it does not fit."""
        raise NotImplementedError(f"{self.name} does not copy sequences to host memory")

    def seq_cp(self, ctx, source: int, seq_id: int, start: int, end: int) -> None:
        """seq_id also owns source's cells of positions start..end-1 (no copy), where rules say cell_ranges."""
        raise NotImplementedError(f"{self.name} places tokens in cells of its own choosing")

    @abstractmethod
    def seq_rm(self, ctx, seq_id: int, start: int) -> bool:
        """Drop seq_id's cached positions from `start` onward; False when the library refuses (a
        partial removal from a recurrent model's state)."""


def once(factory: Callable[[], T]) -> Callable[[], T]:
    """factory's result, made on the first call only: a library is opened and initialised once
    per process, whatever thread asks first."""
    lock = threading.Lock()
    made: list[T] = []

    def get() -> T:
        with lock:
            if not made:
                made.append(factory())
            return made[0]

    return get
