"""Backends by name, and the model configuration a command parses once from its options.

A backend is registered with how to tell whether its libraries are installed (looked up, never
imported: `specdec --help` must not load torch) and how to load one model on it. Adding a backend
is one entry here plus its module; the command line, `specdec calibrate --configs all` and the
per-machine choice (machine_profile.py) pick it up from the registry.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from importlib.util import find_spec
from pathlib import Path
from typing import Callable, Optional

from specdec.backends.base import Backend
from specdec.backends.context_size import FLOOR
from specdec.types import SpecdecError

INEXACT = "inexact"
REPACKED = "repacked"


@dataclass(frozen=True)
class ModelConfig:
    """How a command loads its models: backend configuration, files, context and threads."""

    backend: "BackendConfig"
    target: Optional[str] = None  # a GGUF file (or, for torch, a model folder); None: the pulled default
    draft: Optional[str] = None
    load_draft: bool = True
    # Tokens per slot; None: auto, the trained length within a KV budget that fits this machine,
    # settled by runtime.load_engine (backends/context_size.py) before any model loads.
    ctx_size: Optional[int] = None
    threads: Optional[int] = None  # None: every core this process may use
    # Tokens the draft model scores (models/reduced_vocabulary.py) where its library can; 0: all.
    # 32,768 cover 96 % of the target's greedy Spec-Bench text for 0.77 of the full draft's step.
    draft_vocabulary: int = 32768
    backend_by_rule: bool = False  # no --backend and no measured profile: runtime.default_config's choice

    @property
    def n_ctx(self) -> int:
        """The context per slot the backends get: the settled size (a loader that settles none
        gets the floor that auto never goes below)."""
        return self.ctx_size if self.ctx_size is not None else FLOOR

    def with_backend(self, backend: "BackendConfig") -> "ModelConfig":
        return replace(self, backend=backend)

    def without_draft(self) -> "ModelConfig":
        return replace(self, load_draft=False)


@dataclass(frozen=True)
class BackendEntry:
    name: str
    summary: str  # one line for --help
    installed: Callable[[], bool]
    # (model path, configuration, slots, whether it is the draft model) -> backend
    load: Callable[[Path, ModelConfig, int, bool], Backend]
    dtypes: tuple[str, ...] = ()  # --dtype choices, the first being the default; () where it does not apply
    repacks: bool = False  # whether the target may load with its weights repacked (--repacked)


REGISTRY: dict[str, BackendEntry] = {}


def register(entry: BackendEntry) -> BackendEntry:
    REGISTRY[entry.name] = entry
    return entry


def backend_entry(name: str) -> BackendEntry:
    entry = REGISTRY.get(name)
    if entry is None:
        raise SpecdecError(f"unknown backend {name!r}; choose {', '.join(REGISTRY)}.")
    return entry


@dataclass(frozen=True)
class BackendConfig:
    """A backend, its dtype (where it has a choice), whether the target's weights are repacked
    (where the backend can) and whether verification is exact."""

    backend: str
    dtype: Optional[str] = None
    exact: bool = True
    repacked: bool = False

    @property
    def label(self) -> str:
        """"ik_llama.cpp", "ik_llama.cpp:repacked", "llama.cpp:inexact", "torch:float32:inexact"."""
        return ":".join([self.backend, *([self.dtype] if self.dtype else []), *([REPACKED] if self.repacked else []),
                         *([] if self.exact else [INEXACT])])

    @classmethod
    def parse(cls, text: str) -> "BackendConfig":
        backend, *rest = text.strip().split(":")
        entry = backend_entry(backend)
        exact = INEXACT not in rest
        repacked = REPACKED in rest
        if repacked and not entry.repacks:
            raise SpecdecError(f"{backend} has no repacked weight layout; drop :{REPACKED} from {text!r}.")
        rest = [part for part in rest if part not in (INEXACT, REPACKED)]
        dtype = None
        if entry.dtypes:
            dtype = rest.pop(0) if rest else entry.dtypes[0]
            if dtype not in entry.dtypes:
                raise SpecdecError(f"unknown dtype {dtype!r} in {text!r}; choose {' or '.join(entry.dtypes)}.")
        if rest:
            raise SpecdecError(f"cannot read configuration {text!r}; e.g. {', '.join(example_labels())}.")
        return cls(backend, dtype, exact, repacked)


def example_labels() -> list[str]:
    return [name + (":" + entry.dtypes[-1] if entry.dtypes else "") for name, entry in REGISTRY.items()] + \
        [f"{next(iter(REGISTRY))}:{INEXACT}"]


def installed_configs() -> list[BackendConfig]:
    """Every configuration whose libraries are installed: each backend exact and inexact, per dtype
    and weight layout."""
    configs = []
    for name, entry in REGISTRY.items():
        if entry.installed():
            configs += [BackendConfig(name, dtype, exact, repacked) for dtype in (entry.dtypes or (None,))
                        for repacked in ((False, True) if entry.repacks else (False,)) for exact in (True, False)]
    return configs


def default_backend() -> str:
    """Without a saved per-machine choice: the first installed of DEFAULT_ORDER."""
    for name in DEFAULT_ORDER:
        if backend_entry(name).installed():
            return name
    raise SpecdecError(f"no backend is installed; run `make install` (it installs {DEFAULT_ORDER[0]}).")


# -- the registered backends ------------------------------------------------------------------
def _llama_family(binding_module: str) -> Callable[[Path, ModelConfig, int, bool], Backend]:
    def load(path: Path, config: ModelConfig, n_slots: int, draft: bool) -> Backend:
        from specdec.backends.llama_family import LlamaFamilyBackend

        binding = importlib.import_module(binding_module).binding()
        vocabulary = None
        if draft and config.draft_vocabulary and binding.embeddings_one_row:
            from specdec.models import reduced_vocabulary
            from specdec.models.registry import models_dir

            vocabulary = reduced_vocabulary.prepare(path, models_dir() / "derived", config.draft_vocabulary)
        return LlamaFamilyBackend(binding, path, n_ctx=config.n_ctx, n_threads=config.threads,
                                  max_sequences=n_slots, exact=config.backend.exact, proposals_only=draft,
                                  repack=config.backend.repacked and not draft, vocabulary=vocabulary)

    return load


def _load_torch(path: Path, config: ModelConfig, n_slots: int, draft: bool) -> Backend:
    from specdec.backends.torch_backend import TorchBackend

    return TorchBackend(path, dtype=config.backend.dtype, n_ctx=config.n_ctx, n_threads=config.threads,
                        max_sequences=n_slots, exact=config.backend.exact)


def _installed(binding_module: str) -> Callable[[], bool]:
    def installed() -> bool:
        return importlib.import_module(binding_module).installed()  # a lookup: loads no library

    return installed


IK_BINDING = "specdec.backends.bindings.ik_llama"
MAINLINE_BINDING = "specdec.backends.bindings.llama_cpp_python"
IK_LLAMA_CPP = register(BackendEntry(
    "ik_llama.cpp", "ik_llama.cpp (ik-llama-cpp-python, built by specdec): CPU kernels whose batched rows cost little more than one",
    _installed(IK_BINDING), _llama_family(IK_BINDING), repacks=True))
LLAMA_CPP = register(BackendEntry(
    "llama.cpp", "mainline llama.cpp (llama-cpp-python, built for this CPU)",
    _installed(MAINLINE_BINDING), _llama_family(MAINLINE_BINDING)))
TORCH = register(BackendEntry(
    "torch", "PyTorch + transformers, both models (pip install 'specdec[torch]')",
    lambda: find_spec("torch") is not None and find_spec("transformers") is not None, _load_torch,
    dtypes=("bfloat16", "float32")))

# Measured (docs/notebook.md, "Backends"): the order in which commands without --backend and
# without a saved per-machine choice look for an installed backend.
DEFAULT_ORDER = ("ik_llama.cpp", "llama.cpp", "torch")
