#!/usr/bin/env bash
# Idempotent set-up of a virtual environment at .venv. Safe to run again.
#   scripts/install.sh        specdec with ik_llama.cpp (the main job; SPECDEC_MAINLINE=1 adds mainline)
#   scripts/install.sh test   everything the tests use: both backends, torch's CPU build, Ray Serve, test tools
#
#   ik_llama.cpp   ik-llama-cpp-python built from PyPI's sdist with specdec's patch (x86_64,
#                  AVX2 or AVX-512 kernels; minutes, cached; the main job does it in the background).
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
IK_PATCH_LEVEL=7  # bump when scripts/patch_ik_llama_cpp.sh changes
SPECDEC_HOME=${SPECDEC_HOME:-$HOME/.cache/specdec}

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip==24.3.1 2>/dev/null

cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $cpu_flags " == *" $1 "* ]]; }
ik_runs=false
if [ "$(uname -m)" = x86_64 ] && has avx2 && has fma && has f16c; then ik_runs=true; fi

# specdec builds two packages from source with a patch each; a build's wheel is cached in a folder
# named by package, version, patch level and CMake flags.
build_dir() { echo "$SPECDEC_HOME/wheels/$1-$(printf '%s %s %s' "$2" "$3" "$4" | sha256sum | cut -c1-16)"; }

# Whether PACKAGE==VERSION is installed as specdec's build: a library matching GLOB in MODULE's
# lib/ holds MARKER, a string the patch adds.
patched_build_installed() {
  .venv/bin/python - "$@" <<'PY' 2>/dev/null
import importlib, importlib.metadata as md, pathlib, sys
package, version, module, pattern, marker = sys.argv[1:]
assert md.version(package) == version
lib = pathlib.Path(importlib.import_module(module).__file__).parent / "lib"
assert any(marker.encode() in p.read_bytes() for p in lib.glob(pattern)), "unpatched build"
PY
}

# -- ik_llama.cpp: specdec's build from its sdist, PyPI's wheel until it is ready ----------------
# The patch (scripts/patch_ik_llama_cpp.sh) makes one-row steps on repacked weights sum like
# batched rows, so that the fastest plain decoding and batched verification agree bit for bit.
# Built for the instruction sets this CPU has of the two ik's kernels know: AVX2 (FMA, F16C), or
# AVX-512 with VNNI, VL, BW and DQ (ik compiles its AVX-512 matrix kernels only with all five);
# the flags are named, never -march=native, and the build says which it needs (lib/cpu-flags),
# so a cached build never runs on a CPU without them. No flash-attention kernels for quantized
# KV caches, nor for head sizes the default pair lacks (the patch's part 5; specdec runs ik
# without flash attention).
# The main job never waits for the compiler (minutes: docs/usage.md, "The build"): it installs
# PyPI's prebuilt wheel at once and builds in the background; the server switches to the build
# when it is done (server/upgrade.py) and later starts use it. The tests build in the foreground.
ik_cpu_flags="avx2 fma f16c"
ik_cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
if has avx512f && has avx512bw && has avx512vl && has avx512dq && has avx512_vnni; then
  ik_cpu_flags+=" avx512f avx512bw avx512vl avx512dq avx512_vnni"
  ik_cmake_args+=" -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DCMAKE_C_FLAGS='-mavx512vl -mavx512dq' -DCMAKE_CXX_FLAGS='-mavx512vl -mavx512dq'"
  has avx512vbmi && { ik_cpu_flags+=" avx512vbmi"; ik_cmake_args+=" -DGGML_AVX512_VBMI=ON"; }
  has avx512_bf16 && { ik_cpu_flags+=" avx512_bf16"; ik_cmake_args+=" -DGGML_AVX512_BF16=ON"; }
else
  ik_cmake_args+=" -DGGML_AVX512=OFF"
fi
ik_cmake_args+=" -DGGML_IQK_FA_ALL_QUANTS=OFF -DCMAKE_INSTALL_RPATH=\$ORIGIN"
ik_wheel_dir=$(build_dir ik-llama-cpp-python "$IK_LLAMA_CPP_PYTHON_VERSION" "$IK_PATCH_LEVEL" "$ik_cmake_args")
ik_pending="$SPECDEC_HOME/builds/ik-pending"  # names the folder of a build the server may switch to
ik_lib_dir() { .venv/bin/python -c 'import ik_llama_cpp, os; print(os.path.dirname(ik_llama_cpp.__file__) + "/lib")' 2>/dev/null; }
ik_patched() {  # this very build (version, patch level, flags) is the one installed
  [ "$(cat "$(ik_lib_dir)/specdec-build" 2>/dev/null)" = "$(basename "$ik_wheel_dir")" ]
}
install_ik_build() {  # the built wheel into the venv, with the flags it needs beside its library
  .venv/bin/python -m pip install -q --force-reinstall --no-deps "$ik_wheel_dir"/ik_llama_cpp_python-*.whl &&
    cp "$ik_wheel_dir/cpu-flags" "$(ik_lib_dir)/cpu-flags" &&
    basename "$ik_wheel_dir" > "$(ik_lib_dir)/specdec-build"
}
ik_built() { ls "$ik_wheel_dir"/ik_llama_cpp_python-*.whl >/dev/null 2>&1; }
build_ik() { bash scripts/build_ik.sh .venv/bin/python "$IK_LLAMA_CPP_PYTHON_VERSION" "$ik_wheel_dir" "$ik_cmake_args" "$ik_cpu_flags"; }

if $ik_runs; then
  # A server started before the build was installed switches to it (server/upgrade.py); from now
  # on the venv has it.
  ik_patched && rm -f "$ik_pending"
  if ! ik_patched; then
    if ! ik_built && [ "$MODE" = test ]; then
      echo "specdec: building ik_llama.cpp $IK_LLAMA_CPP_PYTHON_VERSION with specdec's patch (log: $ik_wheel_dir/build.log)" >&2
      build_ik || { echo "specdec: the patched ik_llama.cpp build failed; the tests need it" >&2; tail -20 "$ik_wheel_dir/build.log" >&2; exit 1; }
    fi
    if ik_built; then
      install_ik_build
    else
      .venv/bin/python -m pip install -q --no-deps "ik-llama-cpp-python==$IK_LLAMA_CPP_PYTHON_VERSION"  # PyPI's wheel meanwhile
      if [ -e "$ik_wheel_dir/FAILED" ]; then
        echo "specdec: building ik_llama.cpp failed before ($ik_wheel_dir/build.log); serving on PyPI's wheel" \
             "(repacked one-row steps padded; remove $ik_wheel_dir/FAILED to try again)" >&2
      elif ! pgrep -f "build_ik.sh .* $ik_wheel_dir " >/dev/null; then
        mkdir -p "$(dirname "$ik_pending")" "$ik_wheel_dir"
        echo "$ik_wheel_dir" > "$ik_pending"
        echo "specdec: building ik_llama.cpp with specdec's patch in the background (log: $ik_wheel_dir/build.log);" \
             "serving on PyPI's wheel until it is done, then on the build" >&2
        # Low priority: the server keeps the cores whenever it decodes.
        nohup nice -n 19 bash -c "$(declare -f build_ik install_ik_build ik_lib_dir); \
          $(declare -p IK_LLAMA_CPP_PYTHON_VERSION ik_wheel_dir ik_cmake_args ik_cpu_flags ik_pending); \
          build_ik && install_ik_build" > /dev/null 2>&1 < /dev/null &
      fi
    fi
  fi
  .venv/bin/python -m pip install -q "ik-llama-cpp-python==$IK_LLAMA_CPP_PYTHON_VERSION"  # its dependencies
else
  echo "specdec: this CPU cannot run ik_llama.cpp's AVX2 kernels; using mainline llama.cpp" >&2
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
wheel_dir=$(build_dir llama-cpp-python "$LLAMA_CPP_PYTHON_VERSION" "$PATCH_LEVEL" "$cmake_args")
llama_ok() {
  patched_build_installed llama-cpp-python "$LLAMA_CPP_PYTHON_VERSION" llama_cpp "libggml-cpu*.so*" GGML_CPU_FA_REFERENCE
}

if $want_mainline && ! llama_ok; then
  if ! ls "$wheel_dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "specdec: building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION for this CPU (6 to 11 minutes, once)" >&2
    echo "specdec: CMAKE_ARGS=$cmake_args" >&2
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    .venv/bin/python -m pip download -q --no-deps --no-binary llama-cpp-python -d "$work" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
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
# The playground's browser tests drive Debian's headless Chromium (tests/unit/test_playground_browser.py):
# installed where this runs as root with apt; elsewhere those tests skip and say why.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "specdec: installing Chromium for the playground's browser tests" >&2
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; }; } ||
    echo "specdec: could not install Chromium; the browser tests will skip" >&2
fi
