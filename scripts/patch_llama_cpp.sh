#!/usr/bin/env bash
# specdec's one change to llama.cpp's CPU backend: an environment switch that sends flash attention
# down its reference path (no KV split for single tokens, no Q tiling for batches), so that its
# result for a query row does not depend on how many rows are evaluated together. Without it a
# one-token step over a KV cache of 512+ cells splits the KV across threads and sums partial
# softmaxes in another order than a batched verification does (docs/exactness.md).
set -euo pipefail
src=${1:?usage: patch_llama_cpp.sh LLAMA_CPP_PYTHON_SOURCE_DIR}
python3 - "$src/vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
before = "    const bool use_ref = params->use_ref;\n"
after = '    const bool use_ref = params->use_ref || getenv("GGML_CPU_FA_REFERENCE") != nullptr;\n'
if after not in text:
    if text.count(before) != 1:
        sys.exit(f"patch_llama_cpp.sh: anchor line not found once in {path}")
    text = "#include <cstdlib>\n" + text.replace(before, after)
    open(path, "w").write(text)
PY
