"""The ik_llama.cpp ctypes declarations against the C header of the pinned wheel: every struct's
size and every field's offset as gcc lays them out, and every declared function's parameter count.
A wrong layout would pass garbage to llama_decode without any error, so this is checked here,
with no model, rather than discovered as wrong logits."""
import ctypes
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from specdec.backends.bindings import ik_llama

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
    assert binding.rules(exact=True, repacked=True) == ik_llama.REPACKED_EXACT_RULES
    assert binding.rules(exact=False, repacked=True) == ik_llama.INEXACT_RULES
