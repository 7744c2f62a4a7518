"""The ik_llama.cpp ctypes declarations against the C header of the pinned wheel: every struct's
size and every field's offset as gcc lays them out, and every declared function's parameter count.
A wrong layout would pass garbage to llama_decode without any error, so this is checked here,
with no model, rather than discovered as wrong logits."""
import ctypes
import re
import shutil
import subprocess
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import pytest

from specdec.backends.bindings import ik_llama
from specdec.types import SpecdecError

PATCH_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "patch_ik_llama_cpp.sh"
STRUCTS = {"llama_model_params": ik_llama.ModelParams, "llama_context_params": ik_llama.ContextParams,
           "llama_batch": ik_llama.Batch}


@pytest.fixture(scope="module")
def header_dir(tmp_path_factory):
    """include/ of the pinned wheel (from pip's cache after `make install`): the header in
    site-packages may be mainline's, since both packages install include/llama.h there."""
    folder = tmp_path_factory.mktemp("ik_wheel")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                    "-d", str(folder), f"{ik_llama.PACKAGE}=={ik_llama.VERSION}"], check=True, timeout=300)
    (wheel,) = folder.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith("include/") and name.endswith(".h"):
                archive.extract(name, folder)
    return folder / "include"


def c_layouts(header_dir, tmp_path) -> dict[str, int]:
    """{"struct": sizeof, "struct.field": offsetof} as gcc computes them from the header."""
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "llama.h"', "int main(void) {"]
    for struct, fields in STRUCTS.items():
        lines.append(f'printf("{struct} %zu\\n", sizeof(struct {struct}));')
        for name, _ in fields._fields_:
            lines.append(f'printf("{struct}.{name} %zu\\n", offsetof(struct {struct}, {name}));')
    lines.append("return 0; }")
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines))
    binary = tmp_path / "layout"
    subprocess.run([shutil.which("gcc") or "cc", "-I", str(header_dir), str(source), "-o", str(binary)],
                   check=True, capture_output=True, text=True, timeout=120)
    output = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    return {key: int(value) for key, value in (line.split() for line in output.splitlines())}


def test_struct_sizes_and_field_offsets_match_the_header(header_dir, tmp_path):
    layouts = c_layouts(header_dir, tmp_path)
    for struct, fields in STRUCTS.items():
        assert ctypes.sizeof(fields) == layouts[struct], struct
        for name, _ in fields._fields_:
            assert getattr(fields, name).offset == layouts[f"{struct}.{name}"], f"{struct}.{name}"


def test_declared_functions_take_as_many_parameters_as_the_header_says(header_dir):
    header = (header_dir / "llama.h").read_text()
    for name, (argtypes, _) in ik_llama.FUNCTIONS.items():
        match = re.search(rf"LLAMA_API[^;(]*\b{name}\s*\(([^;]*?)\)\s*;", header, re.S)
        assert match, f"{name} is not declared in llama.h"
        params = re.sub(r"//[^\n]*", "", match.group(1)).strip()
        count = 0 if params in ("", "void") else params.count(",") + 1
        assert count == len(argtypes), name


def test_the_library_exports_every_declared_function_and_initialises():
    binding = ik_llama.binding()
    assert binding is ik_llama.binding()  # opened once per process
    assert binding.rules(exact=True) == ik_llama.EXACT_RULES and binding.rules(exact=False) == ik_llama.INEXACT_RULES
    assert binding.rules(exact=True, repacked=True) == (
        ik_llama.REPACKED_SHARED_RULES if binding.kv_cells else
        ik_llama.REPACKED_ONE_ROW_EXACT_RULES if binding.one_row_exact else ik_llama.REPACKED_EXACT_RULES)
    assert binding.rules(exact=False, repacked=True) == ik_llama.INEXACT_RULES


def test_repacked_one_row_calls_are_padded_unless_the_library_is_specdecs_patched_build():
    binding = object.__new__(ik_llama.IkLlamaBinding)  # its rules only: no library loaded
    binding._lib = types.SimpleNamespace()  # PyPI's wheel: no marker exported
    assert not binding.one_row_exact and binding.rules(exact=True, repacked=True).min_rows == 2
    binding._lib = types.SimpleNamespace(**{ik_llama.ONE_ROW_EXACT_SYMBOL: object()})
    assert binding.one_row_exact
    assert binding.rules(exact=True, repacked=True) == ik_llama.REPACKED_ONE_ROW_EXACT_RULES
    assert ik_llama.REPACKED_ONE_ROW_EXACT_RULES.min_rows == 1
    assert binding.rules(exact=True) == ik_llama.EXACT_RULES  # weights as stored: the patch changes nothing
    assert binding.rules(exact=False, repacked=True) == ik_llama.INEXACT_RULES


def test_the_packages_own_library_override_is_honoured(monkeypatch, tmp_path):
    library = tmp_path / "libllama.so"
    monkeypatch.setenv("IK_LLAMA_CPP_LIB_PATH", str(library))
    assert ik_llama.library_path() == library
    assert not ik_llama.installed()  # no such file
    library.write_bytes(b"")
    assert ik_llama.installed() == ik_llama.cpu_runs(library)


def test_a_build_for_instructions_this_cpu_lacks_is_not_installed_nor_opened(monkeypatch, tmp_path):
    """specdec's build names the instruction sets its kernels need beside the library; a cached
    build carried to a CPU without them is refused with one clear line, never loaded (SIGILL)."""
    library = tmp_path / "libllama.so"
    library.write_bytes(b"")
    monkeypatch.setenv("IK_LLAMA_CPP_LIB_PATH", str(library))
    monkeypatch.setattr(ik_llama, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setattr(ik_llama.platform, "machine", lambda: "x86_64")
    assert ik_llama.required_cpu_flags(library) == ik_llama.WHEEL_CPU_FLAGS and ik_llama.installed()
    (tmp_path / "cpu-flags").write_text("avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni\n")
    assert not ik_llama.installed()
    with pytest.raises(SpecdecError, match="avx512_vnni avx512bw avx512dq avx512f avx512vl"):
        ik_llama.IkLlamaBinding(library)


# The sdist's parts the patch changes, cut down: the two kernels' one-row branches (the real file
# is ik_llama.cpp's ggml/src/iqk/iqk_gemm_kquants.cpp; the install builds from it and checks the
# marker) and the package's CMakeLists.txt.
KQUANTS = """template <int nrc_y>
inline void process_min_r4_b32(int ibl) {
    if constexpr (nrc_y == 1) { one(); } else { many(); }
}

template <int nrc_y>
static void mul_mat_q6_k_r4_q8_k(int n) {
""" + "    if constexpr (nrc_y == 1) { one(); } else { many(); }\n" * 5 + """}

template <int nrc_y>
static void mul_mat_q2_k_r4_q8_k(int n) {
    if constexpr (nrc_y == 1) { untouched(); }
}
"""
CMAKELISTS = """add_subdirectory(vendor/ik_llama.cpp)

# Build llama-quantize (for IQ4_KT quantization support)
add_subdirectory(vendor/ik_llama.cpp/examples/quantize)

install(
    TARGETS llama ggml
    LIBRARY DESTINATION ik_llama_cpp/lib
)

install(
    TARGETS llama-quantize
    RUNTIME DESTINATION ik_llama_cpp/bin
)
"""
# ik_llama.cpp's src/llama-build-context.cpp around its warm-up check, cut down.
BUILD_CONTEXT = """void llm_build_context::init() {
    lctx.inp_pos         = nullptr;
}

void llm_build_context::llm_build_kv_store(int il) {
    const int64_t n_embd_head_k = hparams.n_embd_head_k(il);

    GGML_ASSERT(kv.size == n_ctx);
    store_from_head();
}

static ggml_tensor * llm_build_kqv(const llama_kv_cache & kv) {
    struct ggml_tensor * k =
        ggml_view_3d(ctx, k_cache,
                n_embd_head_k, n_kv, n_head_kv,
                ggml_row_size(k_cache->type, n_embd_head_k)*n_head_kv, //n_embd_k_gqa),
                ggml_row_size(k_cache->type, n_embd_head_k),
                0);
    struct ggml_tensor * cur;

    if (cparams.flash_attn) {
        GGML_UNUSED(model);
    } else {
        if (kv.v_trans) {
            v = ggml_view_3d(ctx, v_cache,
                    n_kv, n_embd_head_v, n_head_kv,
                    ggml_element_size(v_cache)*n_ctx,
                    ggml_element_size(v_cache)*n_ctx*n_embd_head_v,
                    0);
        }
    }
}

ggml_cgraph * llm_build_context::build_qwen2() {
    bool is_warming_up = lctx.n_eval == 0 && (batch.n_tokens == 1 && (batch.token[0] == ((bos != -1) ? bos : eos)));
}
"""
# ik_llama.cpp's src/llama-context.h and src/llama.cpp where part 4 (cells chosen by the caller) goes, cut down.
CONTEXT_H = """struct llama_kv_cache {
    std::vector<llama_kv_cell> cells;
};
struct llama_context {
    struct ggml_tensor * inp_KQ_mask;     // F32 [kv_size, n_batch]
};
"""
LLAMA_CPP = """static bool llama_kv_cache_find_slot() {
    // otherwise, one cell per token.
}
static void llama_set_inputs() {
    if (batch.pos && lctx.inp_pos) {
    }
    if (lctx.inp_KQ_mask || lctx.inp_KQ_mask_swa) {
        auto f = [&lctx] (int i) { return lctx.kv_self.cells[i].pos + lctx.kv_self.cells[i].pos + lctx.kv_self.cells[i].pos; };
        float g = lctx.kv_self.cells[i].pos + lctx.kv_self.cells[i].pos + lctx.kv_self.cells[i].pos;
        float h = lctx.kv_self.cells[i].pos + lctx.kv_self.cells[i].pos + kv_self.cells[i].pos;
        float e = lctx.kv_self.cells[i].pos;
    }
    if (cparams.embeddings && cparams.pooling_type == LLAMA_POOLING_TYPE_MEAN) {
        use(kv_self.cells[i]);
    }
}
static int llama_decode_internal() {
                auto max_cell = llama_kv_cache_cell_max(kv_self, pad);
                kv_self.n = std::min(kv_self.size, std::max(pad, GGML_PAD(max_cell, pad)));
}
"""


# ik_llama.cpp's ggml/src where part 5 (flash-attention kernels for the served head sizes) goes, cut down.
FA_SIZES = ("576_512", "128_128", "96_96", "64_64")
GGML_CMAKELISTS = """    set(GGML_SOURCES_IQK_MM iqk/iqk_mul_mat.cpp
                            iqk/iqk_flash_attn.cpp
""" + "".join(f"                            iqk/fa/iqk_fa_{size}.cpp\n" for size in FA_SIZES) + """\
                            iqk/iqk_gemm_floats.cpp)
    set(GGML_HEADERS_IQK_MM iqk/fa/iqk_fa_templates.h)
"""
FA_DISPATCH = """bool iqk_flash_attn_impl(int int_type_k, int Dk, int Dv, float * M, float * S) {
    if (!mask || nk1%32 != 0) return false;
""" + "".join("""
    if (Dk == {0} && Dv == {1}) {{
        return iqk_fa_{0}_{1}(int_type_k, int_type_v, nq1, nk1,
                q, k, v, mask, scale, softcap, qkv, sinksf, M, S);
    }}
""".format(*size.split("_")) for size in FA_SIZES) + """
    return false;
}
"""
FA_TEMPLATES = "#define IQK_FA_CASE(name) bool name(int int_type_k)\n\n" + "".join(
    f"IQK_FA_CASE(iqk_fa_{size});\n" for size in FA_SIZES) + "\n#endif\n"
FLASH_ATTN = """extern "C" IQK_API bool iqk_flash_attn_noalibi(int type_q, int type_mask, float max_bias, int Dk, int Dv) {

    if (type_q != 0 || type_mask != 1 || max_bias > 0) return false;

    repack_and_wait_for_the_other_threads();
}
"""


def write_sdist(root):
    """The cut-down sdist: every file the patch changes, in its place."""
    files = {"vendor/ik_llama.cpp/ggml/src/iqk/iqk_gemm_kquants.cpp": KQUANTS,
             "vendor/ik_llama.cpp/src/llama-build-context.cpp": BUILD_CONTEXT,
             "vendor/ik_llama.cpp/src/llama-context.h": CONTEXT_H, "vendor/ik_llama.cpp/src/llama.cpp": LLAMA_CPP,
             "CMakeLists.txt": CMAKELISTS, "vendor/ik_llama.cpp/ggml/src/CMakeLists.txt": GGML_CMAKELISTS,
             "vendor/ik_llama.cpp/ggml/src/iqk/iqk_mul_mat.cpp": FA_DISPATCH,
             "vendor/ik_llama.cpp/ggml/src/iqk/iqk_flash_attn.cpp": FLASH_ATTN,
             "vendor/ik_llama.cpp/ggml/src/iqk/fa/iqk_fa_templates.h": FA_TEMPLATES}
    files.update({f"vendor/ik_llama.cpp/ggml/src/iqk/fa/iqk_fa_{size}.cpp": f"IQK_FA_CASE(iqk_fa_{size}) {{}}\n"
                  for size in FA_SIZES})
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def run_patch(sdist):
    return subprocess.run(["bash", str(PATCH_SCRIPT), str(sdist)], capture_output=True, text=True, timeout=60)


def test_the_patch_sends_one_row_down_the_multi_row_branch_and_builds_the_libraries_only(tmp_path):
    write_sdist(tmp_path)
    kquants = tmp_path / "vendor" / "ik_llama.cpp" / "ggml" / "src" / "iqk" / "iqk_gemm_kquants.cpp"
    build_context = tmp_path / "vendor" / "ik_llama.cpp" / "src" / "llama-build-context.cpp"
    llama_cpp = build_context.parent / "llama.cpp"
    cmakelists = tmp_path / "CMakeLists.txt"
    assert run_patch(tmp_path).returncode == 0
    patched = kquants.read_text()
    assert patched.count("if constexpr (false && nrc_y == 1)") == 6
    assert "if constexpr (nrc_y == 1) { untouched(); }" in patched  # other kernels keep theirs
    assert patched.count(ik_llama.ONE_ROW_EXACT_SYMBOL) == 2  # the exported name and its value
    warm_up = build_context.read_text()  # a one-row batch of embeddings has no batch.token to read
    assert "batch.n_tokens == 1 && batch.token && (batch.token[0] ==" in warm_up
    assert warm_up.count(ik_llama.EMBEDDINGS_ONE_ROW_SYMBOL) == 2
    placed = llama_cpp.read_text()  # tokens stored at the cells the caller names
    assert placed.count(ik_llama.KV_CELLS_SYMBOL) == 2 and "specdec_kv_set_cells" in placed
    # the mask's columns from the attention window's first cell, and nothing outside the mask's code
    assert placed.count("lctx.kv_self.cells[lctx.kv_self.specdec_kv_first + i]") == 9
    assert placed.count(" kv_self.cells[kv_self.specdec_kv_first + i]") == 1 and "use(kv_self.cells[i])" in placed
    assert "n_head_kv*kv.specdec_kv_first" in warm_up and "ggml_element_size(v_cache)*kv.specdec_kv_first" in warm_up
    assert "ggml_set_rows" in warm_up and "specdec_next_cells" in (build_context.parent / "llama-context.h").read_text()
    build = cmakelists.read_text()
    assert "TARGETS llama ggml" in build
    assert not [line for line in build.splitlines() if "quantize" in line and not line.startswith("#")]
    assert run_patch(tmp_path).returncode == 0 and kquants.read_text() == patched  # idempotent
    assert cmakelists.read_text() == build and build_context.read_text() == warm_up and llama_cpp.read_text() == placed
    kquants.write_text(KQUANTS.replace("if constexpr (nrc_y == 1) { one(); }", "{ one(); }", 1))  # another version
    failed = run_patch(tmp_path)
    assert failed.returncode != 0 and "one-row branches in inline void process_min_r4_b32(" in failed.stderr


FA_HEAD_SIZES_SYMBOL = "specdec_fa_head_sizes"  # what part 5 exports: the head sizes it kept


def assert_flash_attention_for_the_served_head_sizes_only(sdist):
    ggml = sdist / "vendor" / "ik_llama.cpp" / "ggml" / "src"
    listed = re.findall(r"iqk/fa/iqk_fa_(\d+_\d+)\.cpp", (ggml / "CMakeLists.txt").read_text())
    assert listed == ["128_128", "64_64"]  # compiled: the default pair's heads (1.5B: 128, 0.5B: 64)
    assert sorted(p.name for p in (ggml / "iqk" / "fa").glob("*.cpp")) == ["iqk_fa_128_128.cpp", "iqk_fa_64_64.cpp"]
    dispatch = (ggml / "iqk" / "iqk_mul_mat.cpp").read_text()  # nothing calls a kernel that is not built
    assert sorted(re.findall(r"iqk_fa_(\d+_\d+)\(", dispatch)) == ["128_128", "64_64"]
    assert "if (Dk == 64 && Dv == 64) {" in dispatch and "if (Dk == 96" not in dispatch
    assert sorted(re.findall(r"IQK_FA_CASE\(iqk_fa_(\d+_\d+)\);", (ggml / "iqk/fa/iqk_fa_templates.h").read_text())) \
        == ["128_128", "64_64"]
    flash_attn = (ggml / "iqk" / "iqk_flash_attn.cpp").read_text()
    declined = "    if (!((Dk == 64 && Dv == 64) || (Dk == 128 && Dv == 128))) return false;\n"
    # other head sizes go to ggml's own flash attention before any of ik's work (repacking, barriers)
    assert flash_attn.count(declined) == 1
    assert flash_attn.index("max_bias > 0) return false;") < flash_attn.index(declined) < flash_attn.index("repack")
    assert f'{FA_HEAD_SIZES_SYMBOL}[] = "64_64 128_128";' in flash_attn


def test_the_patch_compiles_flash_attention_kernels_for_the_served_head_sizes_only(tmp_path):
    write_sdist(tmp_path)
    assert run_patch(tmp_path).returncode == 0
    assert_flash_attention_for_the_served_head_sizes_only(tmp_path)
    ggml = tmp_path / "vendor" / "ik_llama.cpp" / "ggml" / "src"
    patched = {path: path.read_text() for path in ggml.rglob("*") if path.is_file()}
    assert run_patch(tmp_path).returncode == 0  # idempotent
    assert {path: path.read_text() for path in ggml.rglob("*") if path.is_file()} == patched
    (ggml / "iqk" / "fa" / "iqk_fa_64_64.cpp").unlink()
    (ggml / "CMakeLists.txt").write_text(GGML_CMAKELISTS.replace("iqk/fa/iqk_fa_64_64.cpp", ""))  # another version
    failed = run_patch(tmp_path)
    assert failed.returncode != 0 and "iqk/fa/iqk_fa_64_64.cpp not listed once" in failed.stderr


def test_the_patch_applies_to_the_pinned_sdist(tmp_path):
    """The real sources: every part finds what it changes (pip's cache keeps the download)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ik_llama.PACKAGE,
                    "-d", str(tmp_path), f"{ik_llama.PACKAGE}=={ik_llama.VERSION}"], check=True, timeout=600)
    (archive,) = tmp_path.glob("*.tar.gz")
    wanted = re.compile(r"[^/]+/(CMakeLists\.txt|vendor/ik_llama\.cpp/(src|ggml/src)/.*)$")
    with tarfile.open(archive) as sdist:
        sdist.extractall(tmp_path, members=[m for m in sdist.getmembers() if wanted.match(m.name)], filter="data")
    (root,) = (path for path in tmp_path.iterdir() if path.is_dir())
    patched = run_patch(root)
    assert patched.returncode == 0, patched.stderr
    assert_flash_attention_for_the_served_head_sizes_only(root)
    markers = {"ggml/src/iqk/iqk_gemm_kquants.cpp": ik_llama.ONE_ROW_EXACT_SYMBOL,
               "src/llama-build-context.cpp": ik_llama.EMBEDDINGS_ONE_ROW_SYMBOL,
               "src/llama.cpp": ik_llama.KV_CELLS_SYMBOL}
    for name, marker in markers.items():
        assert marker in (root / "vendor" / "ik_llama.cpp" / name).read_text(), name
    assert run_patch(root).returncode == 0  # idempotent on the real sources too


def test_the_build_has_flash_attention_kernels_for_the_served_head_sizes_only():
    """The library the binding opens (IK_LLAMA_CPP_LIB_PATH to check another build), where it is
    specdec's build with part 5: it loads, and libggml.so has the kept kernels, no others."""
    path = ik_llama.library_path()
    if path is None or not path.exists() or not ik_llama.cpu_runs(path):
        pytest.skip("no ik_llama.cpp library this CPU runs")
    if FA_HEAD_SIZES_SYMBOL.encode() not in (path.parent / "libggml.so").read_bytes():
        pytest.skip(f"{path} is not a build with the patch's part 5 (scripts/install.sh builds it)")
    checked = subprocess.run([sys.executable, str(PATCH_SCRIPT.parent / "check_ik_flash_attention.py"), str(path)],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert '"kernels": ["64_64", "128_128"]' in checked.stdout
