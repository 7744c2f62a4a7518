"""One backend for the llama.cpp family (mainline llama.cpp, ik_llama.cpp), over a binding.

The backend owns what the libraries have in common: loading a GGUF model, its contexts, the
tokenizer and chat template, filling llama_batch rows and copying logits out. Each binding
(bindings/) maps the library's own C API, and carries the kernel rules measured for it: how many
rows a call may hold, how prompts are split, whether attention runs as flash attention, and
whether every sequence needs a context of its own for its numbers to stay its own. The rows of
each call come from decode_plan.plan_calls, a pure function of those rules.
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from specdec.backends.base import Backend, check_gguf_file, default_threads
from specdec.backends.bindings.base import ContextOptions, LlamaBinding
from specdec.backends.cell_blocks import CellBlocks
from specdec.backends.chat_template import render_chat_template
from specdec.backends.decode_plan import plan_calls
from specdec.backends.library_thread import for_new_backend
from specdec.types import SpecdecError

if TYPE_CHECKING:
    from specdec.models.reduced_vocabulary import ReducedVocabulary

MIN_BATCH_CAPACITY = 64
PARKED_SEQUENCES = 64  # spare ids for parked prompt starts (engine/prompt_cache.py): ids cost nothing, cells do


class LlamaFamilyBackend(Backend):
    def __init__(
        self,
        binding: LlamaBinding,
        model_path: str | Path,
        *,
        n_ctx: int = 4096,
        n_threads: Optional[int] = None,
        n_batch: int = 512,
        max_sequences: int = 1,
        exact: bool = True,
        proposals_only: bool = False,
        repack: bool = False,
        vocabulary: Optional["ReducedVocabulary"] = None,
    ):
        path = Path(model_path)
        check_gguf_file(path)
        self._binding = binding
        self.name = binding.name
        self.model_path = path
        self.exact = exact
        if repack and not binding.repacks:
            raise SpecdecError(f"{binding.name} has no separate repacked weight layout; drop --repacked.")
        self.repacked = repack
        self.rules = binding.rules(exact, repacked=repack)
        self.n_threads = n_threads or default_threads()
        self.max_sequences = max_sequences
        self.prefill_alignment = self.rules.prefill_alignment
        self._contexts: list = []
        self._batch = None
        # A draft model's logits only choose what is proposed, never what is accepted: it may run
        # on faster weight layouts whose batched numbers are not exact.
        self.proposals_only = proposals_only
        # A draft may score only a reduced vocabulary (models/reduced_vocabulary.py): its weights
        # come from the derived file, fed embeddings; its tokenizer stays the original's.
        if vocabulary is not None and not (proposals_only and binding.embeddings_one_row):
            raise SpecdecError(f"a reduced vocabulary is for draft models on a library that takes embeddings ({self.name}).")
        self.vocabulary = vocabulary
        self._vocab_model = None
        self._model = None
        self._batch_capacity = max(n_batch, MIN_BATCH_CAPACITY)
        # Loading (repacking runs the kernels' threads) on the thread that will decode
        self._library = for_new_backend()
        self._library.attach()
        self._detached = False
        self._library.call(self._load, path, n_ctx, n_batch, repack or proposals_only)
        self._vocab = binding.vocab(self._vocab_model or self._model)
        self.vocab_size = binding.n_vocab(self._vocab)
        self._logits_width = len(vocabulary.token_ids) if vocabulary else self.vocab_size
        self.eog_token_ids = frozenset(t for t in range(self.vocab_size) if binding.is_eog(self._vocab, t))
        self._pieces: dict[int, bytes] = {}
        self._chat_template = self.metadata("tokenizer.chat_template")

    def _load(self, path: Path, n_ctx: int, n_batch: int, repack: bool) -> None:
        binding, vocabulary = self._binding, self.vocabulary
        self._model = binding.load_model(vocabulary.model_path if vocabulary else path, repack=repack)
        if vocabulary is not None and self._model:
            self._vocab_model = binding.load_model(path, vocab_only=True)
        if not self._model or (vocabulary is not None and not self._vocab_model):
            self._close()
            raise SpecdecError(f"{self.name} could not load {path}: the file is corrupt or not a supported GGUF model.")
        try:
            self._open_contexts(n_ctx, n_batch)
            self._batch = binding.batch_init(self._batch_capacity, max(1, self.max_sequences),
                                             vocabulary.n_embd if vocabulary else 0)
        except BaseException:
            self._close()
            raise

    def _open_contexts(self, n_ctx: int, n_batch: int) -> None:
        """One context for all sequences (each with its own KV), or one per sequence sharing the weights."""
        per_sequence = self.rules.context_per_sequence
        sequences_per_context = 1 if per_sequence else self.max_sequences
        options = ContextOptions(n_ctx=n_ctx * sequences_per_context, n_batch=n_batch, n_seq_max=sequences_per_context,
                                 n_threads=self.n_threads, flash_attn=self.rules.flash_attn)
        for _ in range(self.max_sequences if per_sequence else 1):
            ctx = self._binding.new_context(self._model, options)
            if not ctx:
                raise SpecdecError(f"{self.name} could not create a context of {n_ctx} tokens for {self.model_path}.")
            self._contexts.append(ctx)
        self._cells_per_sequence = min(self._binding.context_cells_per_sequence(ctx, sequences_per_context)
                                       for ctx in self._contexts)
        if self.rules.cell_ranges:
            self._cell_blocks = CellBlocks(self._cells_per_sequence * sequences_per_context)
            self.prefix_share_block = self._cell_blocks.block  # sequences in one cache may hold the same cells
            self.parked_sequences = PARKED_SEQUENCES
        # A padded call writes up to min_rows - 1 cells past the sequence's last position.
        self.n_ctx = self._cells_per_sequence - (self.rules.min_rows - 1)

    def _context_of(self, seq_id: int) -> tuple[object, int]:
        """(context, the sequence's id inside it)."""
        if not 0 <= seq_id < self.max_sequences + self.parked_sequences:
            raise SpecdecError(f"sequence {seq_id} is out of range: this backend holds {self.max_sequences}.")
        if self.rules.context_per_sequence:
            return self._contexts[seq_id], 0
        return self._contexts[0], seq_id

    # -- metadata and tokenizer ---------------------------------------------------------------
    def metadata(self, key: str) -> Optional[str]:
        size = 1 << 16
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._binding.meta_val_str(self._vocab_model or self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 16
        buf = (ctypes.c_int32 * capacity)()
        n = self._binding.tokenize(self._vocab, data, buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (ctypes.c_int32 * capacity)()
            n = self._binding.tokenize(self._vocab, data, buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def _piece(self, token_id: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self._binding.token_to_piece(self._vocab, token_id, buf, 64, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._binding.token_to_piece(self._vocab, token_id, buf, -n, special)
        return buf.raw[:n]

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of a token as text; control tokens (e.g. <|im_start|>) render as nothing."""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._piece(token_id, special=False)
        return piece

    def fingerprint_bytes(self, token_id: int) -> bytes:
        return self._piece(token_id, special=True)

    def chat_template_source(self) -> Optional[str]:
        return self._chat_template or None

    def apply_chat_template(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None) -> str:
        if not self._chat_template:
            raise SpecdecError(f"{self.model_path.name} has no chat template; use a raw completion prompt instead.")
        return render_chat_template(self._chat_template, messages, tools, bos_token=self._special_text("bos"),
                                    eos_token=self._special_text("eos"))

    def _special_text(self, which: str) -> str:
        """The text of the model's BOS or EOS token ("" where the GGUF names none)."""
        token = self.metadata(f"tokenizer.ggml.{which}_token_id")
        if token is None or not token.isdigit() or int(token) >= self.vocab_size:
            return ""
        return self._piece(int(token), special=True).decode("utf-8", errors="replace")

    # -- evaluation ----------------------------------------------------------------------------
    def eval(self, seq_id: int, start: int, tokens: Sequence[int], *, prefill: bool = False) -> np.ndarray:
        return self.eval_many([(seq_id, start, tokens)], prefill=prefill)[0]

    def eval_many(self, requests: Sequence[tuple[int, int, Sequence[int]]], *, prefill: bool = False) -> list[np.ndarray]:
        """Evaluate several sequences' tokens, in shared llama_decode calls where the rules allow."""
        for seq_id, start, tokens in requests:
            self._context_of(seq_id)
            if start + len(tokens) > self.n_ctx:
                raise SpecdecError(f"the sequence would exceed the context of {self.n_ctx} tokens.")
        return self._library.call(self._eval_many, requests, prefill)

    def _eval_many(self, requests: Sequence[tuple[int, int, Sequence[int]]], prefill: bool) -> list[np.ndarray]:
        outputs: list[list[np.ndarray]] = [[] for _ in requests]
        binding, batch = self._binding, self._batch
        for call in plan_calls(requests, prefill=prefill, rules=self.rules, capacity=self._batch_capacity):
            ctx = self._context_of(call[0].seq_id)[0]
            if self.vocabulary is not None:
                embeddings = self.vocabulary.embeddings([row.token for row in call])
                ctypes.memmove(batch.embd, embeddings.ctypes.data, embeddings.nbytes)
            for i, row in enumerate(call):
                if self.vocabulary is None:
                    batch.token[i] = row.token
                batch.pos[i] = row.position
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = self._context_of(row.seq_id)[1]
                batch.logits[i] = not prefill  # pads too: rows with logits share the output kernel
            batch.n_tokens = len(call)
            if self.rules.cell_ranges:
                binding.set_cells(ctx, *self._cells_of(call))
            rc = binding.decode(ctx, batch, self.rules)
            if rc != 0:
                raise SpecdecError(f"llama_decode failed with code {rc} (no room left in the KV cache?).")
            pads = [row for row in call if row.pad]
            if pads:
                ctx_of_pad, local_id = self._context_of(pads[0].seq_id)
                self._truncate(ctx_of_pad, local_id, pads[0].position)
            if prefill:
                continue
            for i, row in enumerate(call):
                if row.pad:
                    continue
                logits = np.ctypeslib.as_array(binding.logits_ith(ctx, i), shape=(self._logits_width,))
                outputs[row.request].append(self.vocabulary.full_logits(logits) if self.vocabulary else logits.copy())
        empty = np.zeros((0, self.vocab_size), dtype=np.float32)
        return [np.stack(rows) if rows else empty for rows in outputs]

    def _cells_of(self, call: list) -> tuple["ctypes.Array", int, int]:
        """Each row's cell in the shared cache (cell_blocks.py), and the cells the call's attention
        spans: from its sequences' first block to its highest cell (a sequence's later positions
        sit at higher cells), so that other sequences' cells outside cost it nothing."""
        local = [self._context_of(row.seq_id)[1] for row in call]
        chosen = [self._cell_blocks.cells(seq, [row.position])[0] for seq, row in zip(local, call)]
        first = min(self._cell_blocks.first_cell(seq) for seq in set(local))
        return (ctypes.c_int32 * len(chosen))(*chosen), first, max(chosen) + 1 - first

    def has_room(self, seq_id: int, end: int) -> bool:
        if not self.rules.cell_ranges or end <= 0:
            return True
        # A padded call writes up to min_rows - 1 cells past a sequence's last position.
        return self._library.call(self._cell_blocks.room, self._context_of(seq_id)[1], end + self.rules.min_rows - 1)

    def room_to_hold(self, seq_id: int, source_seq: int, length: int, end: int) -> bool:
        if not self.rules.cell_ranges or end <= 0:
            return True
        (_, local_id), (_, source) = self._context_of(seq_id), self._context_of(source_seq)
        return self._library.call(self._cell_blocks.room_to_hold, local_id, source, length, end + self.rules.min_rows - 1)

    def reserve(self, seq_id: int, end: int) -> None:
        if self.rules.cell_ranges and end > 0:
            local_id = self._context_of(seq_id)[1]
            self._library.call(self._cell_blocks.cells, local_id, [end - 1])  # takes the blocks up to `end`

    def truncate(self, seq_id: int, length: int) -> None:
        ctx, local_id = self._context_of(seq_id)
        self._library.call(self._truncate, ctx, local_id, length)

    def _truncate(self, ctx, local_id: int, length: int) -> None:
        if self.rules.cell_ranges and self._cell_blocks.keepable(local_id, length) != length:
            raise SpecdecError(f"sequence {local_id} would cut into cells it shares with another (at position {length}).")
        # False: the library kept the cells (a recurrent model's state cannot be cut partway). Going
        # on would decode the next tokens after positions the caller believes gone.
        if self._binding.seq_rm(ctx, local_id, length) is False:
            raise SpecdecError(f"{self.name} refused to remove a sequence's KV cache from position {length} on "
                               "(a model with a recurrent state cannot roll back partway); the cache no longer "
                               "matches the sequence's tokens.")
        if self.rules.cell_ranges:
            self._cell_blocks.truncate(local_id, length)

    def share_prefix(self, source_seq: int, seq_id: int, length: int) -> None:
        if not self.prefix_share_block:
            super().share_prefix(source_seq, seq_id, length)
        self._library.call(self._share_prefix, source_seq, seq_id, length)

    def _share_prefix(self, source_seq: int, seq_id: int, length: int) -> None:
        (ctx, source), (_, local_id) = self._context_of(source_seq), self._context_of(seq_id)
        self._cell_blocks.share(source, local_id, length)
        # The cells get a second owner (no copy): each sequence's attention reads them where they are.
        self._binding.seq_cp(ctx, source, local_id, 0, length)

    def save_positions(self, seq_id: int, length: int) -> Optional[np.ndarray]:
        if not self.copies_cells or length <= 0:
            return None
        if not self.rules.cell_ranges:
            return self._library.call(self._save_sequence, seq_id, length)
        return self._library.call(self._save_positions, seq_id, length)

    def _save_sequence(self, seq_id: int, length: int) -> np.ndarray:
        """A context per sequence: the sequence's whole state, through llama.cpp's state API."""
        ctx, local_id = self._context_of(seq_id)
        copy = self._binding.read_sequence(ctx, local_id)
        if copy is None:
            raise SpecdecError(f"{self.name} could not copy sequence {seq_id} to host memory.")
        return copy

    def _save_positions(self, seq_id: int, length: int) -> np.ndarray:
        ctx, local_id = self._context_of(seq_id)
        cells = self._cell_blocks.held_cells(local_id, length)
        copy = np.empty(length * self._binding.kv_cell_bytes(ctx), dtype=np.uint8)
        if not self._binding.kv_read_cells(ctx, (ctypes.c_int32 * length)(*cells), copy):
            raise SpecdecError(f"{self.name} could not copy sequence {seq_id}'s cells to host memory.")
        return copy

    @property
    def copies_cells(self) -> bool:
        if self.rules.cell_ranges:
            return bool(self._binding.kv_host)
        return self.rules.context_per_sequence and self._binding.sequence_state

    def load_positions(self, seq_id: int, cells: np.ndarray, length: int) -> None:
        if not self.copies_cells:
            super().load_positions(seq_id, cells, length)
        if not self.rules.cell_ranges:
            self._library.call(self._load_sequence, seq_id, cells, length)
            return
        self._library.call(self._load_positions, seq_id, cells, length)

    def _load_sequence(self, seq_id: int, copy: np.ndarray, length: int) -> None:
        ctx, local_id = self._context_of(seq_id)
        if not self._binding.write_sequence(ctx, local_id, copy):
            self._binding.seq_rm(ctx, local_id, 0)
            raise SpecdecError(f"{self.name} could not copy sequence {seq_id}'s state back.")
        self._binding.seq_rm(ctx, local_id, length)  # the copy may hold more than is loaded

    def _load_positions(self, seq_id: int, copy: np.ndarray, length: int) -> None:
        ctx, local_id = self._context_of(seq_id)
        cell_bytes = self._binding.kv_cell_bytes(ctx)
        stored = copy.nbytes // cell_bytes
        if stored * cell_bytes != copy.nbytes or not 0 < length <= stored:
            raise SpecdecError(f"a copy of {copy.nbytes} bytes holds no {length} cells of {cell_bytes} bytes.")
        chosen = self._cell_blocks.cells(local_id, range(length))  # blocks of its own, as its own writes take
        self._write_cells(ctx, local_id, chosen, copy, length, stored)

    def _write_cells(self, ctx, local_id: int, chosen: Sequence[int], copy: np.ndarray, length: int, stored: int) -> None:
        """Positions < length of `copy` (`stored` cells) into the cells `chosen` (the sequence's blocks already)."""
        positions = (ctypes.c_int32 * length)(*range(length))
        if not self._binding.kv_write_cells(ctx, local_id, (ctypes.c_int32 * length)(*chosen), positions, copy, stored):
            self._cell_blocks.truncate(local_id, 0)
            raise SpecdecError(f"{self.name} could not copy cells back into sequence {local_id}'s.")

    def gather(self, seq_id: int, length: int, end: int) -> bool:
        if not self.rules.cell_ranges or not self.copies_cells or length <= 0:
            return False
        return self._library.call(self._gather, seq_id, length, end + self.rules.min_rows - 1)

    def _gather(self, seq_id: int, length: int, end: int) -> bool:
        ctx, local_id = self._context_of(seq_id)
        blocks = self._cell_blocks.gathered(local_id, length, end)
        if blocks is None:
            return False
        copy = self._save_positions(seq_id, length)
        if self._binding.seq_rm(ctx, local_id, 0) is False:
            raise SpecdecError(f"{self.name} refused to clear sequence {seq_id} to move its cells.")
        chosen = self._cell_blocks.move_to(local_id, blocks)[:length]
        self._write_cells(ctx, local_id, chosen, copy, length, length)
        return True

    def keepable(self, seq_id: int, length: int) -> int:
        if not self.rules.cell_ranges:
            return length
        return self._cell_blocks.keepable(self._context_of(seq_id)[1], length)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "model": str(self.model_path),
            "library": str(getattr(self._binding, "path", "")) or None,  # a build's costs are its own
            "threads": self.n_threads,
            "exact": self.exact,
            "flash_attn": self.rules.flash_attn,
            "max_decode_rows": self.rules.max_decode_rows,
            "context_per_sequence": self.rules.context_per_sequence,
            "cell_ranges": self.rules.cell_ranges,
            "prefix_share_block": self.prefix_share_block,
            "host_copies": self.copies_cells,
            "min_rows": self.rules.min_rows,
            "repacked": self.repacked,
            "proposals_only": self.proposals_only,
            "vocabulary": len(self.vocabulary.token_ids) if self.vocabulary else self.vocab_size,
        }

    def close(self) -> None:
        if self._detached:
            return  # closed already
        self._detached = True
        try:
            self._library.call(self._close)
        finally:
            self._library.detach()

    def _close(self) -> None:
        binding = self._binding
        if self._batch is not None:
            binding.batch_free(self._batch)
            self._batch = None
        while self._contexts:
            binding.free_context(self._contexts.pop())
        for model in ("_model", "_vocab_model"):
            if getattr(self, model, None):
                binding.free_model(getattr(self, model))
                setattr(self, model, None)

    def __del__(self):
        if sys.is_finalizing():
            return  # the library thread may be gone: the process's exit frees everything
        try:
            self.close()
        except Exception:
            pass
