"""llama.cpp backend on llama-cpp-python's low-level API.

Exact mode (the default) makes evaluating k tokens at once give, at every position, bit for bit
the logits of k one-token steps (measured in docs/exactness.md):
- decode-time evaluations go to llama_decode in pieces of at most 3 rows: from 4 rows the
  repacked Q4_K weights switch from their one-row kernel (gemv) to a four-row kernel (gemm), and
  from 8 rows ggml's tiled K-quant matmul takes over, each with its own accumulation order.
  On this CPU a row costs about as much in any of them (the kernels are compute-bound), so the
  pieces cost little; prompt processing keeps full batches, since the one-token steps and the
  verifications that follow share its cache;
- flash attention on, forced onto its reference path (GGML_CPU_FA_REFERENCE, a one-line switch
  that scripts/patch_llama_cpp.sh adds to ggml): otherwise a one-token step over a cache of 512+
  cells splits the KV across threads and merges partial softmaxes in another order;
- prompt processing in chunks aligned to multiples of 64 positions, one sequence per call: a
  prompt's cache depends on where its processing was split (measured: logits up to 0.43 apart
  after the same 39 prompt tokens processed at once or split at 37), so with prefix caching a
  request's output would depend on what its slot held before. Aligned chunks, and reuse of whole
  chunks only (engine/sequence.py), compute every prompt position the same way every time.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from specdec.backends.base import Backend, aligned_chunks
from specdec.types import SpecdecError

FA_REFERENCE_ENV = "GGML_CPU_FA_REFERENCE"  # read by the patched kernel at every call
EXACT_MAX_DECODE_ROWS = 3  # the repacked Q4_K kernels switch to a 4-row gemm at 4 rows
EXACT_PREFILL_ALIGNMENT = 64  # prompt chunks (and reusable cached prefixes) are multiples of this

_init_lock = threading.Lock()
_initialised = False
_log_callback = None  # keep a reference: llama.cpp calls it from C


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _llama():
    """Import llama_cpp once, quietly, after the exactness switch is in the environment."""
    global _initialised, _log_callback
    with _init_lock:
        import llama_cpp

        if not _initialised:
            if not os.environ.get("SPECDEC_LLAMA_LOG"):
                _log_callback = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
                llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _initialised = True
        return llama_cpp


# The flash-attention switch is process-wide, so exact and inexact backends in one process take
# turns: each sets it for its own llama_decode calls.
_decode_lock = threading.Lock()


def _set_fa_reference(on: bool) -> None:
    if on and os.environ.get(FA_REFERENCE_ENV) != "1":
        os.environ[FA_REFERENCE_ENV] = "1"
    elif not on and FA_REFERENCE_ENV in os.environ:
        del os.environ[FA_REFERENCE_ENV]


def check_gguf_file(path: Path) -> None:
    if not path.exists():
        raise SpecdecError(f"model file {path} does not exist.")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise SpecdecError(f"model file {path} is not a GGUF file.")


class LlamaCppBackend(Backend):
    name = "llama.cpp"

    def __init__(
        self,
        model_path: str | Path,
        *,
        n_ctx: int = 4096,
        n_threads: Optional[int] = None,
        n_batch: int = 512,
        max_sequences: int = 1,
        exact: bool = True,
    ):
        path = Path(model_path)
        check_gguf_file(path)
        lib = _llama()
        self._lib = lib
        self.model_path = path
        self.exact = exact
        self.n_threads = n_threads or default_threads()
        self.n_batch = n_batch
        self.max_sequences = max_sequences

        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = lib.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise SpecdecError(f"llama.cpp could not load {path}: the file is corrupt or not a supported GGUF model.")

        ctx_params = lib.llama_context_default_params()
        ctx_params.n_ctx = n_ctx * max_sequences  # split evenly: each sequence gets n_ctx
        ctx_params.kv_unified = False
        ctx_params.n_batch = n_batch
        ctx_params.n_ubatch = n_batch
        ctx_params.n_seq_max = max_sequences
        ctx_params.n_threads = self.n_threads
        ctx_params.n_threads_batch = self.n_threads
        ctx_params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        ctx_params.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise SpecdecError(f"llama.cpp could not create a context of {n_ctx} tokens for {path}.")
        self.n_ctx = lib.llama_n_ctx_seq(self._ctx)  # per sequence
        self._memory = lib.llama_get_memory(self._ctx)
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = lib.llama_vocab_n_tokens(self._vocab)
        self.eog_token_ids = frozenset(t for t in range(self.vocab_size) if lib.llama_vocab_is_eog(self._vocab, t))
        self._batch_capacity = max(n_batch, 64)
        self._decode_rows = EXACT_MAX_DECODE_ROWS if exact else self._batch_capacity
        self.prefill_alignment = EXACT_PREFILL_ALIGNMENT if exact else 1
        self._batch = lib.llama_batch_init(self._batch_capacity, 0, max(1, max_sequences))
        self._pieces: dict[int, bytes] = {}
        self._chat_template = self.metadata("tokenizer.chat_template")
        self._lock = threading.Lock()  # one llama_decode at a time on this context

    # -- metadata and tokenizer ---------------------------------------------------------------
    def metadata(self, key: str) -> Optional[str]:
        size = 1 << 16
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 16
        buf = (self._lib.llama_token * capacity)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, True)
        if n < 0:
            capacity = -n
            buf = (self._lib.llama_token * capacity)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, True)
        return list(buf[:n])

    def _piece(self, token_id: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_token_to_piece(self._vocab, token_id, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self._vocab, token_id, buf, -n, 0, special)
        return buf.raw[:n]

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of a token as text; control tokens (e.g. <|im_start|>) render as nothing."""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._piece(token_id, special=False)
        return piece

    def fingerprint_bytes(self, token_id: int) -> bytes:
        return self._piece(token_id, special=True)

    def apply_chat_template(self, messages: Sequence[dict]) -> str:
        if not self._chat_template:
            raise SpecdecError(f"{self.model_path.name} has no chat template; use a raw completion prompt instead.")
        return render_chat_template(self._chat_template, messages)

    # -- evaluation ----------------------------------------------------------------------------
    def eval(self, seq_id: int, start: int, tokens: Sequence[int], *, prefill: bool = False) -> np.ndarray:
        rows = self.eval_many([(seq_id, start, tokens)], prefill=prefill)[0]
        return rows

    def eval_many(self, requests: Sequence[tuple[int, int, Sequence[int]]], *, prefill: bool = False) -> list[np.ndarray]:
        """Evaluate several sequences' tokens in shared llama_decode calls (continuous batching)."""
        flat = [(seq_id, start + i, int(token), index) for index, (seq_id, start, tokens) in enumerate(requests)
                for i, token in enumerate(tokens)]
        if any(pos >= self.n_ctx for _, pos, _, _ in flat):
            raise SpecdecError(f"the sequence would exceed the context of {self.n_ctx} tokens.")
        outputs: list[list[np.ndarray]] = [[] for _ in requests]
        lib = self._lib
        with self._lock, _decode_lock:
            _set_fa_reference(self.exact)
            for chunk in self._pieces_of(requests, flat, prefill):
                batch = self._batch
                for i, (seq_id, pos, token, _) in enumerate(chunk):
                    batch.token[i] = token
                    batch.pos[i] = pos
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = seq_id
                    batch.logits[i] = not prefill
                batch.n_tokens = len(chunk)
                rc = lib.llama_decode(self._ctx, batch)
                if rc != 0:
                    raise SpecdecError(f"llama_decode failed with code {rc} (no room left in the KV cache?).")
                if prefill:
                    continue
                for i, (_, _, _, index) in enumerate(chunk):
                    row = lib.llama_get_logits_ith(self._ctx, i)
                    outputs[index].append(np.ctypeslib.as_array(row, shape=(self.vocab_size,)).copy())
        empty = np.zeros((0, self.vocab_size), dtype=np.float32)
        return [np.stack(rows) if rows else empty for rows in outputs]

    def _pieces_of(self, requests, flat, prefill: bool) -> list[list]:
        """The rows of each llama_decode call. Exact prompt processing goes in aligned chunks of
        one sequence (a prompt position's logits change with the batch it was computed in: a
        prompt split at another point gave logits up to 0.43 apart), exact decoding in pieces of
        at most 3 rows; otherwise as many rows as a batch holds."""
        if prefill and self.exact:
            pieces, first = [], 0
            for seq_id, start, tokens in requests:
                rows = flat[first:first + len(tokens)]
                first += len(tokens)
                pieces += [rows[offset:offset + length] for offset, length in
                           aligned_chunks(start, len(tokens), self.prefill_alignment)]
            return pieces
        size = self._batch_capacity if prefill else self._decode_rows
        return [flat[i:i + size] for i in range(0, len(flat), size)]

    def truncate(self, seq_id: int, length: int) -> None:
        with self._lock:
            self._lib.llama_memory_seq_rm(self._memory, seq_id, length, -1)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "model": str(self.model_path),
            "threads": self.n_threads,
            "exact": self.exact,
            "flash_attn": True,
            "max_decode_rows": self._decode_rows,
        }

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self._ctx)
            self._lib.llama_model_free(self._model)
            self._ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def render_chat_template(template: str, messages: Sequence[dict]) -> str:
    """Render a Hugging Face-style Jinja chat template, as transformers does, ending with the
    assistant prompt."""
    from jinja2 import BaseLoader
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=BaseLoader())
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=list(messages), add_generation_prompt=True, tools=None)
    except TemplateError as exc:
        raise SpecdecError(f"the chat template refused the messages: {exc}") from None
