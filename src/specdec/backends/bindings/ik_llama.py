"""The ik_llama.cpp binding: ctypes declarations against the libllama.so of `ik-llama-cpp-python`
(pinned in pyproject.toml): specdec's build from its sdist (scripts/install.sh), or PyPI's wheel.

That package's own Python layer is thin and lacks functions we need (llama_kv_cache_seq_rm among
them), and ik_llama.cpp's structs differ from mainline's (more fields, other order), so the few
structs and functions used here are declared from the wheel's `include/llama.h` of that version;
tests/unit/test_ik_binding.py compiles that header and checks every size and offset below.

ik's library is opened with RTLD_DEEPBIND: its libllama.so looks up ggml's symbols in its own
libggml first, even when mainline llama.cpp's libggml (same symbol names) is already loaded
globally in the process.
"""
from __future__ import annotations

import ctypes
import os
import platform
import threading
from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path
from typing import Optional

import numpy as np

from specdec.backends.bindings.base import ContextOptions, KernelRules, LlamaBinding
from specdec.types import SpecdecError

PACKAGE = "ik-llama-cpp-python"
VERSION = "0.1.5"  # as pinned in pyproject.toml; its struct layouts are the ones declared below

c_token = ctypes.c_int32
c_pos = ctypes.c_int32
c_seq_id = ctypes.c_int32
log_callback_type = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_callback = ctypes.c_void_p  # function pointers in the structs are never set here: NULL is enough


class ModelParams(ctypes.Structure):
    """struct llama_model_params (include/llama.h)."""
    _fields_ = [
        ("devices", ctypes.c_char_p),
        ("n_gpu_layers", ctypes.c_int32), ("mla", ctypes.c_int32), ("split_mode", ctypes.c_int),
        ("main_gpu", ctypes.c_int32), ("max_gpu", ctypes.c_int32), ("ncmoe", ctypes.c_int32),
        ("type_k", ctypes.c_int), ("type_v", ctypes.c_int), ("max_ctx_size", ctypes.c_uint32),
        ("n_seq_max", ctypes.c_int32), ("n_ubatch", ctypes.c_int32), ("amb", ctypes.c_int32),
        ("fit_margin", ctypes.c_int32), ("fit", ctypes.c_bool), ("worst_graph_tokens", ctypes.c_int32),
        ("type_k_first", ctypes.c_int), ("type_k_last", ctypes.c_int),
        ("type_v_first", ctypes.c_int), ("type_v_last", ctypes.c_int),
        ("n_k_first", ctypes.c_int32), ("n_k_last", ctypes.c_int32),
        ("n_v_first", ctypes.c_int32), ("n_v_last", ctypes.c_int32),
        ("tensor_split", ctypes.POINTER(ctypes.c_float)), ("rpc_servers", ctypes.c_char_p),
        ("progress_callback", _callback), ("progress_callback_user_data", ctypes.c_void_p),
        ("kv_overrides", ctypes.c_void_p), ("tensor_buft_overrides", ctypes.c_void_p),
        ("vocab_only", ctypes.c_bool), ("use_mmap", ctypes.c_bool), ("use_mlock", ctypes.c_bool),
        ("check_tensors", ctypes.c_bool), ("repack_tensors", ctypes.c_bool), ("use_thp", ctypes.c_bool),
        ("validate_quants", ctypes.c_bool), ("merge_qkv", ctypes.c_bool), ("merge_up_gate_exps", ctypes.c_bool),
        ("mtp", ctypes.c_bool), ("dry_run", ctypes.c_bool), ("flash_attn", ctypes.c_bool),
    ]


class ContextParams(ctypes.Structure):
    """struct llama_context_params (include/llama.h)."""
    _fields_ = [
        ("seed", ctypes.c_uint32), ("n_ctx", ctypes.c_uint32), ("n_batch", ctypes.c_uint32),
        ("n_ubatch", ctypes.c_uint32), ("n_seq_max", ctypes.c_uint32), ("n_threads", ctypes.c_uint32),
        ("n_threads_batch", ctypes.c_uint32), ("max_extra_alloc", ctypes.c_int32),
        ("worst_case_tokens", ctypes.c_int32),
        ("rope_scaling_type", ctypes.c_int), ("pooling_type", ctypes.c_int), ("attention_type", ctypes.c_int),
        ("rope_freq_base", ctypes.c_float), ("rope_freq_scale", ctypes.c_float),
        ("yarn_ext_factor", ctypes.c_float), ("yarn_attn_factor", ctypes.c_float),
        ("yarn_beta_fast", ctypes.c_float), ("yarn_beta_slow", ctypes.c_float),
        ("yarn_orig_ctx", ctypes.c_uint32), ("defrag_thold", ctypes.c_float),
        ("cb_eval", _callback), ("cb_eval_user_data", ctypes.c_void_p),
        ("type_k", ctypes.c_int), ("type_v", ctypes.c_int), ("type_reduce", ctypes.c_int),
        ("type_k_first", ctypes.c_int), ("type_k_last", ctypes.c_int),
        ("type_v_first", ctypes.c_int), ("type_v_last", ctypes.c_int),
        ("n_k_first", ctypes.c_int32), ("n_k_last", ctypes.c_int32),
        ("n_v_first", ctypes.c_int32), ("n_v_last", ctypes.c_int32),
        ("logits_all", ctypes.c_bool), ("embeddings", ctypes.c_bool), ("offload_kqv", ctypes.c_bool),
        ("flash_attn", ctypes.c_bool), ("mla_attn", ctypes.c_int), ("attn_max_batch", ctypes.c_int),
        ("fused_moe_up_gate", ctypes.c_bool), ("grouped_expert_routing", ctypes.c_bool),
        ("fused_up_gate", ctypes.c_bool), ("fused_mmad", ctypes.c_bool), ("rope_cache", ctypes.c_bool),
        ("graph_reuse", ctypes.c_bool), ("min_experts", ctypes.c_int), ("thresh_experts", ctypes.c_float),
        ("only_active_experts", ctypes.c_bool), ("k_cache_hadamard", ctypes.c_bool),
        ("v_cache_hadamard", ctypes.c_bool), ("split_mode_graph_scheduling", ctypes.c_bool),
        ("scheduler_async", ctypes.c_bool), ("mtp", ctypes.c_bool), ("mtp_op_type", ctypes.c_int),
        ("abort_callback", _callback), ("abort_callback_data", ctypes.c_void_p),
        ("offload_policy", ctypes.c_void_p), ("cuda_params", ctypes.c_void_p),
    ]


class Batch(ctypes.Structure):
    """struct llama_batch (include/llama.h)."""
    _fields_ = [
        ("n_tokens", ctypes.c_int32),
        ("token", ctypes.POINTER(c_token)), ("embd", ctypes.POINTER(ctypes.c_float)),
        ("pos", ctypes.POINTER(c_pos)), ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
        ("seq_id", ctypes.POINTER(ctypes.POINTER(c_seq_id))), ("logits", ctypes.POINTER(ctypes.c_int8)),
        ("all_pos_0", c_pos), ("all_pos_1", c_pos), ("all_seq_id", c_seq_id),
    ]


_p = ctypes.c_void_p
# name -> (argument types, result type), as in include/llama.h
FUNCTIONS = {
    "llama_backend_init": ([], None),
    "llama_log_set": ([log_callback_type, _p], None),
    "llama_model_default_params": ([], ModelParams),
    "llama_context_default_params": ([], ContextParams),
    "llama_model_load_from_file": ([ctypes.c_char_p, ModelParams], _p),
    "llama_free_model": ([_p], None),
    "llama_init_from_model": ([_p, ContextParams], _p),
    "llama_free": ([_p], None),
    "llama_n_ctx": ([_p], ctypes.c_uint32),
    "llama_model_get_vocab": ([_p], _p),
    "llama_vocab_n_tokens": ([_p], ctypes.c_int32),
    "llama_vocab_is_eog": ([_p, c_token], ctypes.c_bool),
    "llama_vocab_tokenize": ([_p, ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(c_token), ctypes.c_int32,
                              ctypes.c_bool, ctypes.c_bool], ctypes.c_int32),
    "llama_token_to_piece_vocab": ([_p, c_token, ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_bool],
                                   ctypes.c_int32),
    "llama_model_meta_val_str": ([_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int32),
    "llama_batch_init": ([ctypes.c_int32, ctypes.c_int32, ctypes.c_int32], Batch),
    "llama_batch_free": ([Batch], None),
    "llama_decode": ([_p, Batch], ctypes.c_int32),
    "llama_get_logits_ith": ([_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)),
    "llama_kv_cache_seq_rm": ([_p, c_seq_id, c_pos, c_pos], ctypes.c_bool),
    "llama_state_seq_get_size": ([_p, c_seq_id, ctypes.c_uint32], ctypes.c_size_t),
    "llama_state_seq_get_data": ([_p, ctypes.c_void_p, ctypes.c_size_t, c_seq_id, ctypes.c_uint32], ctypes.c_size_t),
    "llama_state_seq_set_data": ([_p, ctypes.c_void_p, ctypes.c_size_t, c_seq_id, ctypes.c_uint32], ctypes.c_size_t),
    "llama_kv_cache_seq_cp": ([_p, c_seq_id, c_seq_id, c_pos, c_pos], None),
}

# Exact mode's kernel rules for PyPI's wheel (its AVX2 kernels); the measurements behind each are
# in docs/exactness.md, "ik_llama.cpp": up to 31 rows share the one-token kernel's summing order;
# prompt positions depend on their chunk, so prompts go in 64-row chunks aligned to 64; flash
# attention tiles the KV by query rows (and aborts on two sequences); a shared cache moves a
# sequence's numbers with where its cells land, so each sequence gets a context of its own.
EXACT_RULES = KernelRules(max_decode_rows=31, prefill_alignment=64, max_prefill_rows=64, flash_attn=False,
                          context_per_sequence=True)
# Lossy: every sequence in one shared cache and one llama_decode call (faster with several streams).
INEXACT_RULES = KernelRules(max_decode_rows=None, prefill_alignment=1, flash_attn=False)
# Weights repacked at load into row-interleaved types (Q4_K -> Q4_K_R4): every row count from 2 up
# runs one kernel that accumulates each row on its own, and it is faster at every row count; a
# single row runs a kernel of its own, so no call holds fewer than 2 rows (docs/exactness.md,
# "The target repacked"; scripts/probe_ik_kernels.py).
REPACKED_EXACT_RULES = KernelRules(max_decode_rows=64, prefill_alignment=64, max_prefill_rows=64, flash_attn=False,
                                   context_per_sequence=True, min_rows=2)
# Built from source with scripts/patch_ik_llama_cpp.sh (its one-row kernels summing in the multi-row
# order; the library exports ONE_ROW_EXACT_SYMBOL), 1..64 rows give the same logits: no padding.
# And a position holds the same K and V however it was computed (a prompt chunk of any size or
# start, a decode step, a verification): prefix caching reuses every cached position, the last
# answer included, not only whole 64-aligned prompt chunks (tests/integration/test_real_pair.py).
REPACKED_ONE_ROW_EXACT_RULES = replace(REPACKED_EXACT_RULES, min_rows=1, prefill_alignment=1)
ONE_ROW_EXACT_SYMBOL = "specdec_one_row_exact"
# The same build places each token at the cell specdec names (patch part 4): all sequences in
# one context, each in an aligned range of cells of its own, so that several share a call and
# each sums its attention as alone (docs/exactness.md, "Streams sharing a forward").
REPACKED_SHARED_RULES = replace(REPACKED_ONE_ROW_EXACT_RULES, context_per_sequence=False, cell_ranges=True)
KV_CELLS_SYMBOL = "specdec_kv_cells"
# And copies cells out to host memory and back (patch part 6): parked prompt starts kept in RAM.
KV_HOST_SYMBOL = "specdec_kv_host"
# Exported by the same build where a one-row call may carry embeddings (unpatched, it dies).
EMBEDDINGS_ONE_ROW_SYMBOL = "specdec_embeddings_one_row"


def library_path() -> Optional[Path]:
    """The libllama.so to load: the package's own override (IK_LLAMA_CPP_LIB_PATH, an exact path),
    else the one the wheel installed; None when the package is not installed."""
    if os.environ.get("IK_LLAMA_CPP_LIB_PATH"):
        return Path(os.environ["IK_LLAMA_CPP_LIB_PATH"])
    spec = find_spec("ik_llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib" / "libllama.so"


WHEEL_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})  # PyPI's wheel; specdec's builds say theirs in lib/cpu-flags


def cpu_flags() -> frozenset[str]:
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def required_cpu_flags(path: Path) -> frozenset[str]:
    """The instruction sets a library's kernels were compiled for: specdec's build writes them
    beside it (an AVX-512 build where the CPU has the set), PyPI's wheel is AVX2."""
    try:
        return frozenset((path.parent / "cpu-flags").read_text().split())
    except OSError:
        return WHEEL_CPU_FLAGS


def cpu_runs(path: Optional[Path] = None) -> bool:
    """This CPU can run the library's kernels (a build for another CPU would die of SIGILL)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    path = path or library_path()
    return (required_cpu_flags(path) if path else WHEEL_CPU_FLAGS) <= cpu_flags()


def installed() -> bool:
    """The wheel is installed and this CPU can run it."""
    path = library_path()
    return path is not None and path.exists() and cpu_runs(path)


class IkLlamaBinding(LlamaBinding):
    name = "ik_llama.cpp"

    def __init__(self, path: Path):
        if not path.exists():
            raise SpecdecError(f"the ik_llama.cpp backend needs {PACKAGE}=={VERSION}: run `make install` "
                               f"(or pip install {PACKAGE}=={VERSION}); no {path}.")
        if not cpu_runs(path):
            missing = " ".join(sorted(required_cpu_flags(path) - cpu_flags())) or "x86-64"
            raise SpecdecError(f"{path} was built for instructions this CPU lacks ({missing}); run `make install` "
                               "to build ik_llama.cpp for it, or use --backend llama.cpp.")
        self.path = path
        mode = os.RTLD_LOCAL | getattr(os, "RTLD_DEEPBIND", 0)
        self._lib = ctypes.CDLL(str(path), mode=mode)
        for name, (argtypes, restype) in FUNCTIONS.items():
            function = getattr(self._lib, name)
            function.argtypes, function.restype = argtypes, restype
        if self.kv_cells:
            self._lib.specdec_kv_set_cells.argtypes = [_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32, ctypes.c_int32,
                                                        ctypes.c_int32]
            self._lib.specdec_kv_set_cells.restype = None
        if self.kv_host:
            cells = ctypes.POINTER(ctypes.c_int32)
            self._lib.specdec_kv_cell_bytes.argtypes, self._lib.specdec_kv_cell_bytes.restype = [_p], ctypes.c_size_t
            self._lib.specdec_kv_read_cells.argtypes = [_p, cells, ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t]
            self._lib.specdec_kv_read_cells.restype = ctypes.c_bool
            self._lib.specdec_kv_write_cells.argtypes = [_p, ctypes.c_int32, cells, cells, ctypes.c_int32, ctypes.c_void_p,
                                                          ctypes.c_size_t, ctypes.c_int32]
            self._lib.specdec_kv_write_cells.restype = ctypes.c_bool
        self._silence = log_callback_type(lambda level, text, user_data: None)  # kept: C calls it
        if not os.environ.get("SPECDEC_LLAMA_LOG"):
            self._lib.llama_log_set(self._silence, None)
        self._lib.llama_backend_init()

    repacks = True

    @property
    def one_row_exact(self) -> bool:
        """Whether this build's repacked one-row kernels sum like its multi-row ones (patched)."""
        return hasattr(self._lib, ONE_ROW_EXACT_SYMBOL)

    @property
    def embeddings_one_row(self) -> bool:
        return hasattr(self._lib, EMBEDDINGS_ONE_ROW_SYMBOL)

    @property
    def kv_cells(self) -> bool:
        """Whether this build stores tokens at the cells the caller names (patched)."""
        return hasattr(self._lib, KV_CELLS_SYMBOL)

    @property
    def kv_host(self) -> bool:
        """Whether this build copies cells to host memory and back (patched)."""
        return hasattr(self._lib, KV_HOST_SYMBOL)

    def rules(self, exact: bool, repacked: bool = False) -> KernelRules:
        if not exact:
            return INEXACT_RULES
        if repacked:
            if self.kv_cells:
                return REPACKED_SHARED_RULES
            return REPACKED_ONE_ROW_EXACT_RULES if self.one_row_exact else REPACKED_EXACT_RULES
        return EXACT_RULES

    # -- models and contexts -----------------------------------------------------------------
    def load_model(self, path: Path, repack: bool = False, vocab_only: bool = False):
        params = self._lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.vocab_only = vocab_only
        # Run-time repacking into row-interleaved types: faster steps (docs/exactness.md, "The
        # target repacked"); exact only under rules(repacked=True).
        params.repack_tensors = repack
        return self._lib.llama_model_load_from_file(str(path).encode(), params)

    def free_model(self, model) -> None:
        self._lib.llama_free_model(model)

    def new_context(self, model, options: ContextOptions):
        params = self._lib.llama_context_default_params()
        params.n_ctx = options.n_ctx
        params.n_batch = params.n_ubatch = options.n_batch
        params.n_seq_max = options.n_seq_max
        params.n_threads = params.n_threads_batch = options.n_threads
        params.flash_attn = options.flash_attn
        return self._lib.llama_init_from_model(model, params)

    def free_context(self, ctx) -> None:
        self._lib.llama_free(ctx)

    def context_cells_per_sequence(self, ctx, n_seq_max: int) -> int:
        return self._lib.llama_n_ctx(ctx) // n_seq_max  # one cache for all sequences, sized n_ctx x n_seq_max

    # -- vocabulary and metadata -------------------------------------------------------------
    def tokenize(self, vocab, data: bytes, buffer, capacity: int, add_special: bool, parse_special: bool) -> int:
        return self._lib.llama_vocab_tokenize(vocab, data, len(data), buffer, capacity, add_special, parse_special)

    def token_to_piece(self, vocab, token: int, buffer, length: int, special: bool) -> int:
        return self._lib.llama_token_to_piece_vocab(vocab, token, buffer, length, 0, special)

    # -- evaluation --------------------------------------------------------------------------
    def set_cells(self, ctx, cells, kv_first: int, n_kv: int) -> None:
        self._lib.specdec_kv_set_cells(ctx, cells, len(cells), kv_first, n_kv)

    def kv_cell_bytes(self, ctx) -> int:
        return self._lib.specdec_kv_cell_bytes(ctx)

    def kv_read_cells(self, ctx, cells, destination: np.ndarray) -> bool:
        return self._lib.specdec_kv_read_cells(ctx, cells, len(cells), destination.ctypes.data, destination.nbytes)

    def kv_write_cells(self, ctx, seq_id: int, cells, positions, source: np.ndarray, stored: int) -> bool:
        return self._lib.specdec_kv_write_cells(ctx, seq_id, cells, positions, len(cells), source.ctypes.data,
                                                source.nbytes, stored)

    def seq_rm(self, ctx, seq_id: int, start: int) -> bool:
        return bool(self._lib.llama_kv_cache_seq_rm(ctx, seq_id, start, -1))

    sequence_state = True

    def read_sequence(self, ctx, seq_id: int) -> Optional[np.ndarray]:
        size = self._lib.llama_state_seq_get_size(ctx, seq_id, 0)
        copy = np.empty(size, dtype=np.uint8)
        written = self._lib.llama_state_seq_get_data(ctx, copy.ctypes.data, size, seq_id, 0)
        return copy[:written] if written else None

    def write_sequence(self, ctx, seq_id: int, source: np.ndarray) -> bool:
        return self._lib.llama_state_seq_set_data(ctx, source.ctypes.data, source.nbytes, seq_id, 0) > 0

    def seq_cp(self, ctx, source: int, seq_id: int, start: int, end: int) -> None:
        self._lib.llama_kv_cache_seq_cp(ctx, source, seq_id, start, end)


_bindings: dict[Path, IkLlamaBinding] = {}
_bindings_lock = threading.Lock()


def binding() -> IkLlamaBinding:
    """The binding of the library `library_path()` names, opened once per process and path (a
    server that switches to a newer build keeps the older one open for what still uses it)."""
    path = library_path()
    if path is None:
        raise SpecdecError(f"the ik_llama.cpp backend needs {PACKAGE}=={VERSION}: run `make install`.")
    with _bindings_lock:
        if path not in _bindings:
            _bindings[path] = IkLlamaBinding(path)
        return _bindings[path]
