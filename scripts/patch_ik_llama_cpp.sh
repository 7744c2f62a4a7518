#!/usr/bin/env bash
# specdec's change to ik-llama-cpp-python's sdist, applied by scripts/install.sh before it builds:
#
# 1. The kernels. With the weights repacked (Q4_K -> Q4_K_R4, Q5_K -> Q5_K_R4, Q6_K -> Q6_K_R4), a
#    matrix product over one row runs a kernel of its own that sums the block minimums and scales
#    in another order than the kernel of 2..64 rows, so a one-token step differs from the same
#    position in a batched verification (8 rows up to 0.58 apart in the logits). The one-row
#    branches are switched off: one row takes the multi-row arithmetic (per row the same
#    operations in the same order), so every row count gives the same logits. The library
#    exports `specdec_one_row_exact`, by which the binding knows it may verify without padding
#    (docs/exactness.md, "The target repacked").
# 2. The build. The package's CMakeLists also builds llama-quantize, whose `common` library
#    needs a script the sdist lacks; specdec needs the libraries only, so quantize is dropped
#    (install.sh builds the `llama` target, which brings ggml).
# 3. Embeddings as input. A one-row llama_decode reads batch.token[0] to tell a warm-up call, even
#    when the batch carries embeddings and no tokens (a null pointer: the process dies), so the
#    check first asks whether there are tokens. The reduced-vocabulary draft (models/
#    reduced_vocabulary.py) feeds embeddings, one row a step; the library exports
#    `specdec_embeddings_one_row`, by which the binding knows it may.
set -euo pipefail
sdist=${1:?usage: patch_ik_llama_cpp.sh IK_LLAMA_CPP_PYTHON_SDIST_DIR}
python3 - "$sdist" <<'PY'
import re
import sys
from pathlib import Path

sdist = Path(sys.argv[1])
kquants = sdist / "vendor/ik_llama.cpp/ggml/src/iqk/iqk_gemm_kquants.cpp"
cmakelists = sdist / "CMakeLists.txt"
build_context = sdist / "vendor/ik_llama.cpp/src/llama-build-context.cpp"
MARKER = 'extern "C" __attribute__((visibility("default"), used)) const char specdec_one_row_exact[] = "specdec_one_row_exact";\n'
ONE_ROW, MULTI_ROW = "if constexpr (nrc_y == 1)", "if constexpr (false && nrc_y == 1)"
# The functions whose one-row branches change the order of operations, and how many each has.
FUNCTIONS = {"inline void process_min_r4_b32(": 1, "static void mul_mat_q6_k_r4_q8_k(": 5}
QUANTIZE = [r"add_subdirectory\(vendor/ik_llama\.cpp/examples/quantize\)\n",
            r"install\(\s*TARGETS llama-quantize[^)]*\)\n"]

text = kquants.read_text()
if MARKER not in text:
    for signature, count in FUNCTIONS.items():
        if text.count(signature) != 1:
            sys.exit(f"patch_ik_llama_cpp.sh: {signature} not found once in {kquants}")
        start = text.index(signature)
        end = text.index("\ntemplate <int nrc_y>", start + 1)
        body = text[start:end]
        if body.count(ONE_ROW) != count:
            sys.exit(f"patch_ik_llama_cpp.sh: {body.count(ONE_ROW)} one-row branches in {signature}, expected {count}")
        text = text[:start] + body.replace(ONE_ROW, MULTI_ROW) + text[end:]
    kquants.write_text(text + "\n// specdec: one-row kernels take the multi-row order (scripts/patch_ik_llama_cpp.sh)\n"
                       + MARKER)

EMBEDDINGS_MARKER = ('extern "C" __attribute__((visibility("default"), used)) '
                     'const char specdec_embeddings_one_row[] = "specdec_embeddings_one_row";\n')
WARMUP, WARMUP_GUARDED = "batch.n_tokens == 1 && (batch.token[0] ==", "batch.n_tokens == 1 && batch.token && (batch.token[0] =="
text = build_context.read_text()
if EMBEDDINGS_MARKER not in text:
    if text.count(WARMUP) != 1:
        sys.exit(f"patch_ik_llama_cpp.sh: the warm-up check not found once in {build_context}")
    build_context.write_text(text.replace(WARMUP, WARMUP_GUARDED)
                             + "\n// specdec: one-row decodes may carry embeddings (scripts/patch_ik_llama_cpp.sh)\n"
                             + EMBEDDINGS_MARKER)

text = cmakelists.read_text()
for pattern in QUANTIZE:
    text, found = re.subn(pattern, "", text)
    if found > 1:
        sys.exit(f"patch_ik_llama_cpp.sh: {pattern} found {found} times in {cmakelists}")
cmakelists.write_text(text)
if re.search(r"^[^#\n]*quantize", text, re.M):
    sys.exit(f"patch_ik_llama_cpp.sh: {cmakelists} still builds llama-quantize")
PY
