"""Check an ik_llama.cpp build for scripts/patch_ik_llama_cpp.sh's part 5: its libllama.so loads
(libggml.so beside it, every symbol resolved), libggml.so holds iqk flash-attention kernels for the
head sizes the build names in `specdec_fa_head_sizes` and no others, names none it lacks, and its
flash attention (ggml_flash_attn_ext) computes what numpy does at head sizes kept (ik's kernels)
and dropped (ggml's own).

    .venv/bin/python scripts/check_ik_flash_attention.py [LIBLLAMA_SO]

Without an argument, the library the ik binding would open (IK_LLAMA_CPP_LIB_PATH, else the
installed wheel's). Prints one JSON line; exits 1 where the build is not so.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from specdec.backends.bindings.ik_llama import library_path

MARKER = "specdec_fa_head_sizes"
KERNEL = re.compile(r"iqk_fa_(\d+_\d+)[A-Za-z]")  # the C++-mangled kernels: _Z14iqk_fa_128_128ii...
HEAD_SIZES = (64, 96, 128, 256)  # kept and dropped
F32, F16 = 0, 1  # ggml_type
# ik's kernels agree with numpy to ~1e-6 here; ggml's own accumulates V*softmax in F16 (~3e-3)
TOLERANCE = 1e-2


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def dynamic_symbols(library: Path, *options: str) -> list[str]:
    output = subprocess.run(["nm", "-D", *options, str(library)], check=True, capture_output=True, text=True).stdout
    return [line.split()[-1] for line in output.splitlines() if line.strip()]


def kernels(symbols) -> list[str]:
    """The head-size pairs ("128_128") of the kernels among symbols, smallest first."""
    sizes = {m[1] for symbol in symbols if (m := KERNEL.search(symbol))}
    return sorted(sizes, key=lambda size: tuple(map(int, size.split("_"))))


def flash_attention_error(ggml, d: int, n_q=4, n_kv=64, n_head=4, n_head_kv=2) -> float:
    """The largest difference between ggml_flash_attn_ext (F16 K, V and mask; n_kv a multiple of
    32, as ik's kernels take it) and numpy, at head size d."""
    p = ctypes.c_void_p
    for name, restype, argtypes in (("ggml_init", p, [InitParams]), ("ggml_new_graph", p, [p]),
                                    ("ggml_new_tensor_4d", p, [p, ctypes.c_int] + [ctypes.c_int64] * 4),
                                    ("ggml_flash_attn_ext", p, [p] * 5 + [ctypes.c_float] * 3),
                                    ("ggml_build_forward_expand", None, [p, p]), ("ggml_get_data", p, [p]),
                                    ("ggml_graph_compute_with_ctx", ctypes.c_int, [p, p, ctypes.c_int]),
                                    ("ggml_free", None, [p])):
        getattr(ggml, name).restype, getattr(ggml, name).argtypes = restype, argtypes
    rng = np.random.default_rng(d)
    q = rng.standard_normal((n_head, n_q, d)).astype(np.float32)
    k, v = (rng.standard_normal((n_head_kv, n_kv, d)).astype(np.float16) for _ in range(2))
    mask = np.zeros((-(-n_q // 16) * 16, n_kv), np.float16)  # rows padded to GGML_KQ_MASK_PAD
    for i in range(n_q):
        mask[i, n_kv - n_q + i + 1:] = -np.inf
    ctx = ggml.ggml_init(InitParams(64 << 20, None, False))
    try:
        def tensor(array, ggml_type):
            t = ggml.ggml_new_tensor_4d(ctx, ggml_type, *array.shape[::-1], *[1] * (4 - array.ndim))
            ctypes.memmove(ggml.ggml_get_data(t), array.ctypes.data, array.nbytes)
            return t
        out = ggml.ggml_flash_attn_ext(ctx, tensor(q, F32), tensor(k, F16), tensor(v, F16), tensor(mask, F16),
                                       d ** -0.5, 0.0, 0.0)
        graph = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(graph, out)
        if ggml.ggml_graph_compute_with_ctx(ctx, graph, 2) != 0:
            return float("inf")
        got = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)),
                                    (n_q, n_head, d)).copy()
    finally:
        ggml.ggml_free(ctx)
    error = 0.0
    for h in range(n_head):
        scores = d ** -0.5 * q[h] @ k[h * n_head_kv // n_head].T.astype(np.float32) + mask[:n_q]
        weights = np.exp(scores - scores.max(1, keepdims=True))
        want = weights / weights.sum(1, keepdims=True) @ v[h * n_head_kv // n_head].astype(np.float32)
        error = max(error, float(np.abs(got[:, h] - want).max()))
    return error


def check(libllama: Path) -> dict:
    # RTLD_NOW: an undefined symbol fails here, not at the first call that needs it
    ctypes.CDLL(str(libllama), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    libggml = libllama.parent / "libggml.so"
    ggml = ctypes.CDLL(str(libggml), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    try:
        marked = ctypes.string_at(ctypes.addressof(ctypes.c_char.in_dll(ggml, MARKER))).decode().split()
    except ValueError:
        marked = None  # a build without part 5: every kernel
    defined = kernels(dynamic_symbols(libggml, "--defined-only"))
    undefined = kernels(dynamic_symbols(libggml, "--undefined-only"))
    errors = {d: flash_attention_error(ggml, d) for d in HEAD_SIZES}
    ok = (marked is not None and kernels(f"iqk_fa_{size}i" for size in marked) == defined and not undefined
          and max(errors.values()) < TOLERANCE)
    return {"library": str(libllama), "loads": True, "kept": marked, "kernels": defined, "undefined": undefined,
            "flash_attention_max_error": errors, "libggml_bytes": libggml.stat().st_size, "ok": ok}


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else library_path()
    if path is None or not path.exists():
        print(f"check_ik_flash_attention: no ik library ({path})", file=sys.stderr)
        return 1
    result = check(path)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
