"""The mainline llama.cpp binding: llama-cpp-python's low-level API (built by scripts/install.sh
with specdec's one-line flash-attention switch, scripts/patch_llama_cpp.sh).

Exact mode's kernel rules, measured on a 2-core AMD EPYC (Zen 4, AVX-512) in docs/exactness.md:
- decode-time evaluations go to llama_decode in pieces of at most 3 rows: from 4 rows the
  repacked Q4_K weights switch from their one-row kernel (gemv) to a four-row kernel (gemm), and
  from 8 rows ggml's tiled K-quant matmul takes over, each with its own accumulation order.
  On that CPU a row costs about as much in any of them (the kernels are compute-bound), so the
  pieces cost little;
- flash attention on, forced onto its reference path (GGML_CPU_FA_REFERENCE): otherwise a
  one-token step over a cache of 512+ cells splits the KV across threads and merges partial
  softmaxes in another order;
- prompt processing in chunks of 64 positions, aligned to multiples of 64: a prompt's cache
  depends on where its processing was split (logits up to 0.43 apart after the same 39 prompt
  tokens processed at once or split at 37).
Every sequence has a KV stream of its own in one context (kv_unified off), so several sequences
share a llama_decode call without changing each other's numbers.
"""
from __future__ import annotations

import ctypes
import os
import threading
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path

from specdec.backends.bindings.base import ContextOptions, KernelRules, LlamaBinding, once
from specdec.types import SpecdecError

FA_REFERENCE_ENV = "GGML_CPU_FA_REFERENCE"  # read by the patched kernel at every call
EXACT_RULES = KernelRules(max_decode_rows=3, prefill_alignment=64, max_prefill_rows=64, flash_attn=True,
                          fa_reference=True)
INEXACT_RULES = KernelRules(max_decode_rows=None, prefill_alignment=1, flash_attn=True)


def installed() -> bool:
    return find_spec("llama_cpp") is not None


class LlamaCppPythonBinding(LlamaBinding):
    name = "llama.cpp"

    def __init__(self):
        try:
            import llama_cpp
        except ImportError:
            raise SpecdecError("the llama.cpp backend needs llama-cpp-python, built by `make install`.") from None
        self._lib = llama_cpp
        self._silence = None
        if not os.environ.get("SPECDEC_LLAMA_LOG"):
            self._silence = llama_cpp.llama_log_callback(lambda level, text, user_data: None)  # kept: C calls it
            llama_cpp.llama_log_set(self._silence, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        # The flash-attention switch is process-wide, so exact and inexact contexts in one process
        # take turns: each sets it for its own llama_decode calls.
        self._decode_lock = threading.Lock()
        self._memories: dict[int, object] = {}

    def rules(self, exact: bool, repacked: bool = False) -> KernelRules:
        return EXACT_RULES if exact else INEXACT_RULES

    # -- models and contexts -----------------------------------------------------------------
    def load_model(self, path: Path, repack: bool = False, vocab_only: bool = False):  # mainline repacks Q4_K in every mode
        params = self._lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.vocab_only = vocab_only
        return self._lib.llama_model_load_from_file(str(path).encode(), params)

    def free_model(self, model) -> None:
        self._lib.llama_model_free(model)

    def new_context(self, model, options: ContextOptions):
        lib = self._lib
        params = lib.llama_context_default_params()
        params.n_ctx = options.n_ctx
        params.kv_unified = False  # a KV stream per sequence: sequences never share cells
        params.n_batch = params.n_ubatch = options.n_batch
        params.n_seq_max = options.n_seq_max
        params.n_threads = params.n_threads_batch = options.n_threads
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if options.flash_attn else \
            lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        ctx = lib.llama_init_from_model(model, params)
        if ctx:
            self._memories[ctx] = lib.llama_get_memory(ctx)
        return ctx

    def free_context(self, ctx) -> None:
        self._memories.pop(ctx, None)
        self._lib.llama_free(ctx)

    def context_cells_per_sequence(self, ctx, n_seq_max: int) -> int:
        return self._lib.llama_n_ctx_seq(ctx)

    # -- vocabulary and metadata -------------------------------------------------------------
    def tokenize(self, vocab, data: bytes, buffer, capacity: int, add_special: bool, parse_special: bool) -> int:
        return self._lib.llama_tokenize(vocab, data, len(data), buffer, capacity, add_special, parse_special)

    def token_to_piece(self, vocab, token: int, buffer, length: int, special: bool) -> int:
        return self._lib.llama_token_to_piece(vocab, token, buffer, length, 0, special)

    # -- evaluation --------------------------------------------------------------------------
    def decode(self, ctx, batch, rules: KernelRules) -> int:
        with self._fa_reference(rules.fa_reference):
            return self._lib.llama_decode(ctx, batch)

    @contextmanager
    def _fa_reference(self, on: bool):
        with self._decode_lock:
            if on and os.environ.get(FA_REFERENCE_ENV) != "1":
                os.environ[FA_REFERENCE_ENV] = "1"
            elif not on and FA_REFERENCE_ENV in os.environ:
                del os.environ[FA_REFERENCE_ENV]
            yield

    def seq_rm(self, ctx, seq_id: int, start: int) -> bool:
        return bool(self._lib.llama_memory_seq_rm(self._memories[ctx], seq_id, start, -1))


binding = once(LlamaCppPythonBinding)  # the process's one instance
