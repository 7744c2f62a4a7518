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
# 4. Cells chosen by the caller. By default a call's tokens take the first free run of cells, so
#    the cells of sequences decoded together interleave, and attention sums each sequence's
#    cells in SIMD groups that depend on where the others' cells fell (logits up to 0.30 apart
#    from the sequence alone). `specdec_kv_set_cells(ctx, cells, n)` names the cell of each token
#    of the next llama_decode, and the graph stores each token's K and V at its own cell
#    (ggml_set_rows) instead of at one run from the cache head: specdec keeps every sequence in
#    blocks of cells of its own, aligned and in order, so that several sequences share one call
#    and one cache while each is summed as if alone; the call names the cells its attention
#    spans (from the first block of its sequences to their last cell), so idle sequences' cells
#    outside cost it nothing
#    (docs/exactness.md, "Streams sharing a forward").
# 5. Flash-attention kernels for the served head sizes only. ik compiles a translation unit of iqk
#    flash-attention kernels per head-size pair (576_512, 512_512, 320_256, 192_128, 192_192,
#    256_256, 128_128, 96_96, 64_64), the largest objects of the build: specdec runs ik with flash
#    attention off, and the default pair's heads (Qwen2.5-Coder 1.5B: 128, 0.5B: 64) would need
#    only 64_64 and 128_128 if it were on. The others are not compiled (their sources removed from
#    ggml's CMakeLists and the tree), the dispatch no longer names them, and iqk_flash_attn_noalibi
#    declines other head sizes at once, so ggml's own flash attention computes them (slower, never
#    missing; the build takes half the CPU time: docs/usage.md, "The build"). The library exports
#    `specdec_fa_head_sizes` (the kept pairs); scripts/check_ik_flash_attention.py checks a build.
# 6. Cells copied to host memory and back. A prompt start parked in the cache gives way when a
#    running sequence needs its cells; specdec then keeps it in host memory (engine/
#    prompt_cache.py): `specdec_kv_read_cells(ctx, cells, n, dst, size)` copies the K and V of the
#    named cells out, layer by layer (K rows, then V rows or, transposed, each V element's run of
#    cells), and `specdec_kv_write_cells(ctx, seq_id, cells, positions, n, src, size, n_stored)`
#    writes the first n of them into free cells that the sequence then holds at those positions,
#    so the restored cells are the computed ones, bit for bit. `specdec_kv_cell_bytes(ctx)` is one
#    cell's size.
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

# -- 4. cells chosen by the caller ---------------------------------------------------------------
CELLS_MARKER = ('extern "C" __attribute__((visibility("default"), used)) '
                'const char specdec_kv_cells[] = "specdec_kv_cells";\n')
context_h = sdist / "vendor/ik_llama.cpp/src/llama-context.h"
llama_cpp = sdist / "vendor/ik_llama.cpp/src/llama.cpp"


def replace_once(path, old, new):
    text = path.read_text()
    if text.count(old) != 1:
        sys.exit(f"patch_ik_llama_cpp.sh: {old.strip()[:60]!r} not found once in {path}")
    path.write_text(text.replace(old, new))


if CELLS_MARKER not in llama_cpp.read_text():
    replace_once(context_h, "    std::vector<llama_kv_cell> cells;\n",
                 "    std::vector<llama_kv_cell> cells;\n"
                 "    // specdec: the cells the next decode's tokens take (set by specdec_kv_set_cells), and those\n"
                 "    // of the batch being computed; empty: the first free run, as ik does\n"
                 "    std::vector<int32_t> specdec_next_cells;\n"
                 "    std::vector<int32_t> specdec_cells;\n"
                 "    uint32_t specdec_next_n_kv = 0; // cells the next decode's attention spans (0: ik's rule)\n"
                 "    uint32_t specdec_next_kv_first = 0; // and the first of them (a multiple of specdec's block)\n"
                 "    uint32_t specdec_kv_first = 0; // that of the batch being computed\n")
    replace_once(context_h, "    struct ggml_tensor * inp_KQ_mask;     // F32 [kv_size, n_batch]\n",
                 "    struct ggml_tensor * inp_KQ_mask;     // F32 [kv_size, n_batch]\n"
                 "    struct ggml_tensor * specdec_k_idxs = nullptr; // I64 [n_batch]: each token's cell (specdec)\n"
                 "    struct ggml_tensor * specdec_v_idxs = nullptr; // I64 [n_embd_v_gqa * n_batch]: each V element's\n")
    replace_once(build_context, "    lctx.inp_pos         = nullptr;\n",
                 "    lctx.inp_pos         = nullptr;\n"
                 "    lctx.specdec_k_idxs  = nullptr;\n"
                 "    lctx.specdec_v_idxs  = nullptr;\n")
    replace_once(build_context, "    const int64_t n_embd_head_k = hparams.n_embd_head_k(il);\n\n    GGML_ASSERT(kv.size == n_ctx);\n",
                 """    const int64_t n_embd_head_k = hparams.n_embd_head_k(il);

    GGML_ASSERT(kv.size == n_ctx);

    if (!kv.specdec_cells.empty()) {
        // specdec: each token's K and V at the cell its caller chose (specdec_kv_set_cells)
        GGML_ASSERT((int32_t) kv.specdec_cells.size() == n_tokens);
        if (!lctx.specdec_k_idxs) {
            lctx.specdec_k_idxs = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens);
            ggml_set_input(lctx.specdec_k_idxs);
        }
        if (k_cur) {
            const int64_t n_embd_k_gqa = n_embd_head_k*n_head_kv;
            ggml_tensor * k_rows = ggml_view_2d(ctx, kv.k_l[il], n_embd_k_gqa, n_ctx,
                    ggml_row_size(kv.k_l[il]->type, n_embd_k_gqa), 0);
            ggml_tensor * k_src = ggml_reshape_2d(ctx, ggml_cont(ctx, k_cur), n_embd_k_gqa, n_tokens);
            lctx.cache_copies[2*il+0].cpy = ggml_set_rows(ctx, k_rows, k_src, lctx.specdec_k_idxs);
            ggml_build_forward_expand(graph, lctx.cache_copies[2*il+0].cpy);
        }
        if (v_cur) {
            ggml_tensor * stored;
            if (!kv.v_trans) {
                ggml_tensor * v_rows = ggml_view_2d(ctx, kv.v_l[il], n_embd_v_gqa, n_ctx,
                        ggml_row_size(kv.v_l[il]->type, n_embd_v_gqa), 0);
                stored = ggml_set_rows(ctx, v_rows, ggml_reshape_2d(ctx, ggml_cont(ctx, v_cur), n_embd_v_gqa, n_tokens),
                        lctx.specdec_k_idxs);
            } else {
                // the transposed V cache: element (d, cell) at d*n_ctx + cell, one element a row
                if (!lctx.specdec_v_idxs) {
                    lctx.specdec_v_idxs = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_embd_v_gqa*n_tokens);
                    ggml_set_input(lctx.specdec_v_idxs);
                }
                GGML_ASSERT(lctx.specdec_v_idxs->ne[0] == n_embd_v_gqa*n_tokens);
                ggml_tensor * v_elems = ggml_view_2d(ctx, kv.v_l[il], 1, n_ctx*n_embd_v_gqa,
                        ggml_element_size(kv.v_l[il]), 0);
                stored = ggml_set_rows(ctx, v_elems, ggml_reshape_2d(ctx, ggml_cont(ctx, v_cur), 1, n_embd_v_gqa*n_tokens),
                        lctx.specdec_v_idxs);
            }
            lctx.cache_copies[2*il+1].cpy = stored;
            ggml_build_forward_expand(graph, stored);
        }
        return;
    }
""")
    replace_once(llama_cpp, "    // otherwise, one cell per token.\n", """    // otherwise, one cell per token.

    cache.specdec_cells.clear();
    cache.specdec_kv_first = 0;
    if (!cache.specdec_next_cells.empty()) {
        // specdec: the cells the caller chose, each free, one per token
        std::vector<int32_t> chosen;
        chosen.swap(cache.specdec_next_cells);
        if (chosen.size() != n_tokens) {
            LLAMA_LOG_ERROR("%s: %d cells chosen for %d tokens\\n", __func__, (int) chosen.size(), (int) n_tokens);
            return false;
        }
        for (uint32_t i = 0; i < n_tokens; i++) {
            if (chosen[i] < 0 || (uint32_t) chosen[i] >= cache.size || cache.cells[chosen[i]].pos >= 0) {
                LLAMA_LOG_ERROR("%s: cell %d is not free\\n", __func__, chosen[i]);
                return false;
            }
        }
        for (uint32_t i = 0; i < n_tokens; i++) {
            GGML_ASSERT(cache.cells[chosen[i]].pos < 0); // a cell chosen twice
            cache.cells[chosen[i]].pos = batch.pos[i];
            for (int32_t j = 0; j < batch.n_seq_id[i]; j++) {
                cache.cells[chosen[i]].seq_id.insert(batch.seq_id[i][j]);
            }
        }
        cache.used += n_tokens;
        cache.head = 0; // the graph stores by cell, not from the head
        cache.n = cache.specdec_next_n_kv;
        cache.specdec_kv_first = cache.specdec_next_kv_first;
        cache.specdec_cells = std::move(chosen);
        return true;
    }
""")
    replace_once(llama_cpp, """                auto max_cell = llama_kv_cache_cell_max(kv_self, pad);
                kv_self.n = std::min(kv_self.size, std::max(pad, GGML_PAD(max_cell, pad)));
""", """                auto max_cell = llama_kv_cache_cell_max(kv_self, pad);
                // specdec: the cells its caller named span the attention (its own sequences' cells)
                if (!kv_self.specdec_cells.empty() && kv_self.n > 0) max_cell = kv_self.n;
                kv_self.n = std::min(kv_self.size - kv_self.specdec_kv_first, std::max(pad, GGML_PAD(max_cell, pad)));
""")
    replace_once(llama_cpp, "    if (batch.pos && lctx.inp_pos) {\n", """    if (lctx.specdec_k_idxs) {
        // specdec: the cell of each token, and of each element of its transposed V
        const auto & cells = kv_self.specdec_cells;
        const int64_t n_tokens = batch.n_tokens;
        GGML_ASSERT((int64_t) cells.size() == n_tokens);
        std::vector<int64_t> idxs(cells.begin(), cells.end());
        ggml_backend_tensor_set(lctx.specdec_k_idxs, idxs.data(), 0, idxs.size()*sizeof(int64_t));
        if (lctx.specdec_v_idxs) {
            const int64_t n_embd_v = lctx.specdec_v_idxs->ne[0]/n_tokens;
            idxs.resize(n_embd_v*n_tokens);
            for (int64_t t = 0; t < n_tokens; ++t) {
                for (int64_t d = 0; d < n_embd_v; ++d) {
                    idxs[t*n_embd_v + d] = d*kv_self.size + cells[t];
                }
            }
            ggml_backend_tensor_set(lctx.specdec_v_idxs, idxs.data(), 0, idxs.size()*sizeof(int64_t));
        }
    }

    if (batch.pos && lctx.inp_pos) {
""")
    text = build_context.read_text()
    k_view = """        ggml_view_3d(ctx, k_cache,
                n_embd_head_k, n_kv, n_head_kv,
                ggml_row_size(k_cache->type, n_embd_head_k)*n_head_kv, //n_embd_k_gqa),
                ggml_row_size(k_cache->type, n_embd_head_k),
                0);
"""
    v_view = """            v = ggml_view_3d(ctx, v_cache,
                    n_kv, n_embd_head_v, n_head_kv,
                    ggml_element_size(v_cache)*n_ctx,
                    ggml_element_size(v_cache)*n_ctx*n_embd_head_v,
                    0);
"""
    for old, new in ((k_view, k_view.replace("                0);", "                ggml_row_size(k_cache->type, n_embd_head_k)*n_head_kv*kv.specdec_kv_first); // specdec: from the window's first cell")),
                     (v_view, v_view.replace("                    0);", "                    ggml_element_size(v_cache)*kv.specdec_kv_first); // specdec"))):
        if text.count(old) != 1:
            sys.exit(f"patch_ik_llama_cpp.sh: an attention view not found once in {build_context}")
        text = text.replace(old, new)
    anchor = "    struct ggml_tensor * cur;\n\n    if (cparams.flash_attn) {\n        GGML_UNUSED(model);"
    if text.count(anchor) != 1:
        sys.exit(f"patch_ik_llama_cpp.sh: the attention branch not found once in {build_context}")
    text = text.replace(anchor, "    GGML_ASSERT(kv.specdec_kv_first == 0 || (!cparams.flash_attn && kv.v_trans)); // specdec: windows only there\n" + anchor)
    build_context.write_text(text)
    text = llama_cpp.read_text()
    start = text.index("    if (lctx.inp_KQ_mask || lctx.inp_KQ_mask_swa) {\n")
    end = text.index("    if (cparams.embeddings && cparams.pooling_type == LLAMA_POOLING_TYPE_MEAN) {", start)
    region = re.sub(r"(lctx\.)?kv_self\.cells\[i\]", lambda m: f"{m[1] or ''}kv_self.cells[{m[1] or ''}kv_self.specdec_kv_first + i]",
                    text[start:end])
    if region.count("specdec_kv_first") < 10:
        sys.exit(f"patch_ik_llama_cpp.sh: the KQ mask's cell reads not found in {llama_cpp}")
    llama_cpp.write_text(text[:start] + region + text[end:])
    llama_cpp.write_text(llama_cpp.read_text() + """
// specdec: the cells the next llama_decode's tokens take, one per token in batch order
// (scripts/patch_ik_llama_cpp.sh, part 4)
// and the cells its attention spans: n_kv from kv_first (the first block of the call's sequences)
extern "C" __attribute__((visibility("default"))) void specdec_kv_set_cells(struct llama_context * ctx, const int32_t * cells, int32_t n, int32_t kv_first, int32_t n_kv) {
    ctx->kv_self.specdec_next_cells.assign(cells, cells + n);
    ctx->kv_self.specdec_next_kv_first = (uint32_t) kv_first;
    ctx->kv_self.specdec_next_n_kv = (uint32_t) n_kv;
}
""" + CELLS_MARKER)

# -- 6. cells copied to host memory and back -----------------------------------------------------
HOST_MARKER = ('extern "C" __attribute__((visibility("default"), used)) '
               'const char specdec_kv_host[] = "specdec_kv_host";\n')
if HOST_MARKER not in llama_cpp.read_text():
    llama_cpp.write_text(llama_cpp.read_text() + """
// specdec: the K and V of chosen cells copied to host memory and back (scripts/patch_ik_llama_cpp.sh,
// part 6). The layout follows the cells' order, whatever runs they fall in: per layer the K row of
// each cell, then its V row, or for a transposed V each element's value in every cell.
static size_t specdec_cell_bytes(const llama_kv_cache & kv) {
    size_t bytes = 0;
    for (size_t il = 0; il < kv.k_l.size(); ++il) {
        if (kv.k_l[il]) bytes += ggml_nbytes(kv.k_l[il]) / kv.size;
        if (il < kv.v_l.size() && kv.v_l[il]) bytes += ggml_nbytes(kv.v_l[il]) / kv.size;
    }
    return bytes;
}

// The data holds n_stored cells' values laid out as specdec_kv_read_cells writes them; the first n
// are copied (n <= n_stored: a restore may take a start of what was saved).
static void specdec_copy_cells(llama_kv_cache & kv, const int32_t * cells, int32_t n, int32_t n_stored, uint8_t * data, bool out) {
    size_t section = 0; // where the current tensor's rows, or one V element's values, start in data
    auto copy = [&](ggml_tensor * t, size_t stride, size_t base) {
        for (int32_t i = 0; i < n;) {
            int32_t j = i + 1; // a run of consecutive cells in one call
            while (j < n && cells[j] == cells[j - 1] + 1) ++j;
            uint8_t * at = data + section + (size_t) i * stride;
            if (out) ggml_backend_tensor_get(t, at, base + (size_t) cells[i] * stride, (size_t) (j - i) * stride);
            else     ggml_backend_tensor_set(t, at, base + (size_t) cells[i] * stride, (size_t) (j - i) * stride);
            i = j;
        }
        section += (size_t) n_stored * stride;
    };
    for (size_t il = 0; il < kv.k_l.size(); ++il) {
        if (ggml_tensor * k = kv.k_l[il]) copy(k, ggml_nbytes(k) / kv.size, 0);
        ggml_tensor * v = il < kv.v_l.size() ? kv.v_l[il] : nullptr;
        if (!v) continue;
        if (!kv.v_trans) {
            copy(v, ggml_nbytes(v) / kv.size, 0);
        } else {
            const size_t element = ggml_element_size(v);
            const int64_t n_embd = ggml_nelements(v) / kv.size;
            for (int64_t d = 0; d < n_embd; ++d) copy(v, element, (size_t) d * kv.size * element);
        }
    }
}

extern "C" __attribute__((visibility("default"))) size_t specdec_kv_cell_bytes(struct llama_context * ctx) {
    return specdec_cell_bytes(ctx->kv_self);
}

// the cells' K and V into dst (size: n cells' bytes); false if a cell is out of range or empty
extern "C" __attribute__((visibility("default"))) bool specdec_kv_read_cells(struct llama_context * ctx, const int32_t * cells, int32_t n, void * dst, size_t size) {
    llama_kv_cache & kv = ctx->kv_self;
    if (n < 0 || size != (size_t) n * specdec_cell_bytes(kv)) return false;
    for (int32_t i = 0; i < n; ++i) {
        if (cells[i] < 0 || (uint32_t) cells[i] >= kv.size || kv.cells[cells[i]].pos < 0) return false;
    }
    specdec_copy_cells(kv, cells, n, n, (uint8_t *) dst, true);
    return true;
}

// the first n of the n_stored cells in src (from specdec_kv_read_cells; size: n_stored cells' bytes)
// into free cells, which seq_id then holds at `positions`; false, and nothing written, if a cell
// is out of range or taken
extern "C" __attribute__((visibility("default"))) bool specdec_kv_write_cells(struct llama_context * ctx, int32_t seq_id, const int32_t * cells, const int32_t * positions, int32_t n, const void * src, size_t size, int32_t n_stored) {
    llama_kv_cache & kv = ctx->kv_self;
    if (n < 0 || n > n_stored || size != (size_t) n_stored * specdec_cell_bytes(kv)) return false;
    std::set<int32_t> seen;
    for (int32_t i = 0; i < n; ++i) {
        if (cells[i] < 0 || (uint32_t) cells[i] >= kv.size || kv.cells[cells[i]].pos >= 0 || !seen.insert(cells[i]).second) return false;
    }
    specdec_copy_cells(kv, cells, n, n_stored, (uint8_t *) const_cast<void *>(src), false);
    for (int32_t i = 0; i < n; ++i) {
        kv.cells[cells[i]].pos = positions[i];
        kv.cells[cells[i]].seq_id.insert(seq_id);
    }
    kv.used += n;
    return true;
}
""" + HOST_MARKER)

# -- 5. flash-attention kernels for the served head sizes only ----------------------------------
KEEP_FA_HEAD_SIZES = ("64_64", "128_128")  # Dk_Dv: the default pair's 0.5B draft and 1.5B target
FA_MARKER = ('extern "C" __attribute__((visibility("default"), used)) '
             f'const char specdec_fa_head_sizes[] = "{" ".join(KEEP_FA_HEAD_SIZES)}";\n')
ggml_src = sdist / "vendor/ik_llama.cpp/ggml/src"
ggml_cmake, dispatch = ggml_src / "CMakeLists.txt", ggml_src / "iqk/iqk_mul_mat.cpp"
flash_attn, templates = ggml_src / "iqk/iqk_flash_attn.cpp", ggml_src / "iqk/fa/iqk_fa_templates.h"
FA_SOURCE = re.compile(r"[ \t]*iqk/fa/iqk_fa_(\d+_\d+)\.cpp\n")
FA_CALL = re.compile(r"^[ \t]*if \(Dk == (\d+) && Dv == (\d+)\) \{\n[ \t]*return iqk_fa_\1_\2\(.*?\n[ \t]*\}\n\n?", re.S | re.M)

text = ggml_cmake.read_text()
for size in KEEP_FA_HEAD_SIZES:
    if text.count(f"iqk/fa/iqk_fa_{size}.cpp") != 1:
        sys.exit(f"patch_ik_llama_cpp.sh: iqk/fa/iqk_fa_{size}.cpp not listed once in {ggml_cmake}")
ggml_cmake.write_text(FA_SOURCE.sub(lambda m: m[0] if m[1] in KEEP_FA_HEAD_SIZES else "", text))
for source in (ggml_src / "iqk/fa").glob("iqk_fa_*_*.cpp"):
    if source.stem.removeprefix("iqk_fa_") not in KEEP_FA_HEAD_SIZES:
        source.unlink()
text = dispatch.read_text()
text = FA_CALL.sub(lambda m: m[0] if f"{m[1]}_{m[2]}" in KEEP_FA_HEAD_SIZES else "", text)
calls = set(re.findall(r"return iqk_fa_(\d+_\d+)\(", text))
if calls != set(KEEP_FA_HEAD_SIZES):
    sys.exit(f"patch_ik_llama_cpp.sh: {dispatch} calls the kernels {sorted(calls)}, expected {KEEP_FA_HEAD_SIZES}")
dispatch.write_text(text)
text = templates.read_text()
templates.write_text(re.sub(r"IQK_FA_CASE\(iqk_fa_(\d+_\d+)\);\n",
                            lambda m: m[0] if m[1] in KEEP_FA_HEAD_SIZES else "", text))
if FA_MARKER not in flash_attn.read_text():
    kept = " || ".join("(Dk == {} && Dv == {})".format(*size.split("_")) for size in KEEP_FA_HEAD_SIZES)
    replace_once(flash_attn, "    if (type_q != 0 || type_mask != 1 || max_bias > 0) return false;\n",
                 "    if (type_q != 0 || type_mask != 1 || max_bias > 0) return false;\n"
                 "    // specdec: iqk kernels for these head sizes only; ggml's own flash attention for the others\n"
                 f"    if (!({kept})) return false;\n")
    flash_attn.write_text(flash_attn.read_text()
                          + "\n// specdec: flash-attention kernels for these head sizes only (scripts/patch_ik_llama_cpp.sh, part 5)\n"
                          + FA_MARKER)
PY
