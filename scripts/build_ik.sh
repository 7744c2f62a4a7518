#!/usr/bin/env bash
# Builds ik-llama-cpp-python from PyPI's sdist with specdec's patch into a wheel folder (once per
# version, patch level and CMake flags; scripts/install.sh decides when, in the foreground or not).
#   scripts/build_ik.sh PYTHON VERSION WHEEL_DIR CMAKE_ARGS CPU_FLAGS
# On success WHEEL_DIR holds the wheel, `unpacked/` (its files, loadable beside an older build
# already in the process: the server switches to it there) and `cpu-flags` (what the build's
# kernels need); on failure WHEEL_DIR/FAILED. Progress goes to WHEEL_DIR/build.log.
set -uo pipefail
python=${1:?python} version=${2:?version} wheel_dir=${3:?wheel dir} cmake_args=${4:?cmake args} cpu_flags=${5:?cpu flags}
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$wheel_dir"
rm -f "$wheel_dir/FAILED"
log="$wheel_dir/build.log"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
{
  echo "specdec: building ik_llama.cpp $version with specdec's patch; CMAKE_ARGS=$cmake_args"
  # --no-binary for this package only: its build tools come as wheels, not built from source too.
  "$python" -m pip download -q --no-deps --no-binary ik-llama-cpp-python -d "$work" "ik-llama-cpp-python==$version" &&
    tar -xzf "$work"/ik_llama_cpp_python-*.tar.gz -C "$work" &&
    bash "$here/patch_ik_llama_cpp.sh" "$(ls -d "$work"/ik_llama_cpp_python-*/)" &&
    CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
      "$python" -m pip wheel -v --no-deps --config-settings=build.targets=llama -w "$work/out" \
      "$(ls -d "$work"/ik_llama_cpp_python-*/)" 2>&1 | { grep --line-buffered -E '^ *\[ *[0-9]+(%|/[0-9]+)\]' || true; } &&
    wheel=$(ls "$work"/out/ik_llama_cpp_python-*.whl) &&
    "$python" -m zipfile -e "$wheel" "$work/unpacked" &&
    echo "$cpu_flags" > "$work/unpacked/ik_llama_cpp/lib/cpu-flags" &&
    rm -rf "$wheel_dir/unpacked" && mv "$work/unpacked" "$wheel_dir/unpacked" &&
    echo "$cpu_flags" > "$wheel_dir/cpu-flags" &&
    mv "$wheel" "$wheel_dir/"  # last: a wheel in the folder means the build is complete
} >> "$log" 2>&1
status=$?
if [ $status != 0 ] || ! ls "$wheel_dir"/ik_llama_cpp_python-*.whl >/dev/null 2>&1; then
  touch "$wheel_dir/FAILED"
  echo "specdec: the ik_llama.cpp build failed (log: $log)" >> "$log"
  exit 1
fi
echo "specdec: ik_llama.cpp built: $(ls "$wheel_dir"/ik_llama_cpp_python-*.whl)" >> "$log"
