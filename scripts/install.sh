#!/usr/bin/env bash
# Idempotent set-up of a virtual environment at .venv. Safe to run again.
#   scripts/install.sh        specdec with ik_llama.cpp's wheel (the main job; SPECDEC_MAINLINE=1 adds mainline)
#   scripts/install.sh test   everything the tests use: both backends, torch's CPU build, Ray Serve, test tools
#
#   ik_llama.cpp   PyPI's prebuilt ik-llama-cpp-python wheel (x86_64, AVX2 kernels): seconds.
#   llama.cpp      llama-cpp-python built from source for this CPU with specdec's exactness switch
#                  (about 6 minutes on a 2-core Zen 4, 11 on a Zen 3; the wheel is cached).
#
# The main job never waits for a compiler where ik's wheel runs: it builds mainline llama.cpp only
# where that wheel cannot run (no AVX2, not x86_64), or when asked (SPECDEC_MAINLINE=1). Asking
# can pay on CPUs with AVX-512, whose kernels ik's AVX2 wheel does not use (measured on a 2-core
# Zen 4: mainline's plain decoding 1.10x ik's); `make profile` then measures both and keeps the
# faster. The tests build it everywhere: they test both backends.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-serve}
case "$MODE" in serve|test) ;; *) echo "usage: scripts/install.sh [serve|test]" >&2; exit 2 ;; esac

LLAMA_CPP_PYTHON_VERSION=0.3.36
IK_LLAMA_CPP_PYTHON_VERSION=0.1.5  # as pinned in pyproject.toml
TORCH_VERSION=2.13.0  # as pinned in pyproject.toml's torch extra
PATCH_LEVEL=1  # bump when scripts/patch_llama_cpp.sh changes
SPECDEC_HOME=${SPECDEC_HOME:-$HOME/.cache/specdec}

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip==24.3.1 2>/dev/null

cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $cpu_flags " == *" $1 "* ]]; }
ik_runs=false
if [ "$(uname -m)" = x86_64 ] && has avx2 && has fma && has f16c; then ik_runs=true; fi

# -- ik_llama.cpp: the prebuilt wheel -----------------------------------------------------------
if $ik_runs; then
  .venv/bin/python -m pip install -q "ik-llama-cpp-python==$IK_LLAMA_CPP_PYTHON_VERSION"
else
  echo "specdec: this CPU cannot run ik_llama.cpp's AVX2 wheel; using mainline llama.cpp" >&2
fi

# -- mainline llama.cpp: built for this CPU -----------------------------------------------------
want_mainline=false
if [ "$MODE" = test ] || ! $ik_runs || [ "${SPECDEC_MAINLINE:-0}" = 1 ]; then want_mainline=true; fi

# CPU-specific build flags: the AVX-512 set where present, AVX2 otherwise, never AMX (its
# llama.cpp path faults here) and never -march=native (a wheel built here must not crash elsewhere).
cmake_args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF"
has avx && cmake_args+=" -DGGML_AVX=ON"
has avx2 && cmake_args+=" -DGGML_AVX2=ON"
has fma && cmake_args+=" -DGGML_FMA=ON"
has f16c && cmake_args+=" -DGGML_F16C=ON"
if has avx512f; then
  cmake_args+=" -DGGML_AVX512=ON"
  has avx512_vnni && cmake_args+=" -DGGML_AVX512_VNNI=ON"
  has avx512vbmi && cmake_args+=" -DGGML_AVX512_VBMI=ON"
  has avx512_bf16 && cmake_args+=" -DGGML_AVX512_BF16=ON"
fi
build_key=$(printf '%s %s %s' "$LLAMA_CPP_PYTHON_VERSION" "$PATCH_LEVEL" "$cmake_args" | sha256sum | cut -c1-16)
wheel_dir="$SPECDEC_HOME/wheels/llama-cpp-python-$build_key"

llama_ok() {
  .venv/bin/python - "$LLAMA_CPP_PYTHON_VERSION" <<'PY' 2>/dev/null
import sys, pathlib, importlib.metadata as md
assert md.version("llama-cpp-python") == sys.argv[1]
import llama_cpp
lib = pathlib.Path(llama_cpp.__file__).parent / "lib"
assert any(b"GGML_CPU_FA_REFERENCE" in p.read_bytes() for p in lib.glob("libggml-cpu*.so*")), "unpatched build"
PY
}

if $want_mainline && ! llama_ok; then
  if ! ls "$wheel_dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "specdec: building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION for this CPU (6 to 11 minutes, once)" >&2
    echo "specdec: CMAKE_ARGS=$cmake_args" >&2
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    .venv/bin/python -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
    src=$(ls -d "$work"/llama_cpp_python-*/)
    bash scripts/patch_llama_cpp.sh "$src"
    mkdir -p "$wheel_dir"
    CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
      .venv/bin/python -m pip wheel -q --no-deps -w "$wheel_dir" "$src"
  fi
  .venv/bin/python -m pip install -q --force-reinstall --no-deps "$wheel_dir"/llama_cpp_python-*.whl
  .venv/bin/python -m pip install -q "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" --find-links "$wheel_dir"
  llama_ok || { echo "specdec: llama-cpp-python install failed its check" >&2; exit 1; }
fi

if [ "$MODE" = serve ]; then
  .venv/bin/python -m pip install -q -e .
  exit 0
fi
# torch before the extras that need it: pinned here, pip takes the CPU wheel on disk (2.13.0+cpu
# sorts above PyPI's 2.13.0, a CUDA build); left to the resolver of `.[test]` it could take either.
# Already installed, pip does nothing.
.venv/bin/python -m pip install -q "torch==$TORCH_VERSION"
.venv/bin/python -m pip install -q -e ".[test]"
