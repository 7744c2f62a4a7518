"""Building an engine from a command's options: parsed once into a ModelConfig, loaded by the registry."""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Optional

from specdec.backends.base import Backend
from specdec.backends.registry import (IK_LLAMA_CPP, REGISTRY, BackendConfig, ModelConfig, backend_entry,
                                      default_backend)
from specdec.engine.engine import Engine, EngineConfig
from specdec.models.reduced_vocabulary import ROW_MULTIPLE
from specdec.models.registry import DRAFT, TARGET, ModelSpec, default_path
from specdec.types import DEFAULT_METHOD, DEFAULT_NUM_DRAFT_TOKENS, METHODS, SpecdecError

DTYPES = sorted({dtype for entry in REGISTRY.values() for dtype in entry.dtypes})


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument("--backend", choices=list(REGISTRY), default=None,
                       help="who runs the models: " + "; ".join(f"{name}: {entry.summary}" for name, entry in REGISTRY.items())
                            + ". Default: the choice `specdec calibrate --configs all --save` made on this machine, "
                              "else specdec's ik_llama.cpp build with repacked weights, else the first installed of "
                            + ", ".join(REGISTRY))
    group.add_argument("--dtype", choices=DTYPES, default=None,
                       help="torch backend only: weights and activations in bfloat16 (default) or float32; "
                            "without --backend, the saved choice's")
    group.add_argument("--model", help="target GGUF, or for torch also a Hugging Face model folder "
                                       "(default: the pulled Qwen2.5-Coder-1.5B-Instruct Q4_K_M)")
    group.add_argument("--draft-model", help="draft GGUF or, for torch, model folder "
                                             "(default: the pulled Qwen2.5-Coder-0.5B-Instruct Q4_K_M)")
    group.add_argument("--no-draft", action="store_true", help="load no draft model (methods off and ngram only)")
    group.add_argument("--draft-vocabulary", type=int, default=ModelConfig.draft_vocabulary, metavar="N",
                       help="the draft model scores only the N most frequent tokens, a cheaper step (ik_llama.cpp "
                            "built by specdec; lossless: only proposals change); 0: all "
                            f"(default {ModelConfig.draft_vocabulary})")
    group.add_argument("--ctx-size", type=int, default=4096, help="context length in tokens (default 4096)")
    group.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    group.add_argument("--repacked", action="store_true",
                       help="ik_llama.cpp only: the target's weights repacked row-interleaved at load (faster at every "
                            "row count; exact at every row count with specdec's ik build, from 2 rows with PyPI's wheel, "
                            "whose one-token steps then carry a padding row); without --backend, the saved choice's")
    group.add_argument("--inexact", action="store_true",
                       help="LOSSY opt-in: faster kernels whose batched logits may differ from one-token steps")


def add_method_arguments(parser: argparse.ArgumentParser, default_method: str = DEFAULT_METHOD) -> None:
    parser.add_argument("--method", choices=METHODS, default=default_method,
                        help=f"drafter: off (plain decoding), ngram (prompt lookup), draft (small model) or auto (picks per "
                             f"round what this machine's measured costs favour); default {default_method}")
    parser.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS,
                        help=f"tokens proposed per round (default {DEFAULT_NUM_DRAFT_TOKENS})")


def backend_config(args: argparse.Namespace) -> BackendConfig:
    """--backend, --dtype and --repacked, or else the saved per-machine choice if it was measured on
    this machine, or else the rule of `default_config`. Exactness stays --inexact's: never the profile's."""
    from specdec.machine_profile import saved_choice

    exact = not getattr(args, "inexact", False)
    dtype = getattr(args, "dtype", None)
    repacked = getattr(args, "repacked", False)
    if getattr(args, "backend", None) is None:
        choice = saved_choice() or default_config()
        return replace(choice, exact=exact, repacked=choice.repacked or repacked)
    entry = backend_entry(args.backend)
    if repacked and not entry.repacks:
        raise SpecdecError(f"--repacked applies to ik_llama.cpp only, not {args.backend}.")
    return BackendConfig(args.backend, (dtype or entry.dtypes[0]) if entry.dtypes else None, exact, repacked)


def chosen_by_rule(args: argparse.Namespace) -> bool:
    """Whether the backend configuration is the rule's (no --backend, no measured profile): a
    server may then move to a better build of the same library (server/upgrade.py)."""
    from specdec.machine_profile import saved_choice

    return getattr(args, "backend", None) is None and saved_choice() is None


def default_config() -> BackendConfig:
    """Without a measured profile (`make profile`), the rule the measurements agree on: with
    specdec's ik_llama.cpp build, its weights repacked (faster at every row count on every CPU
    measured, docs/results.md); else the first installed backend as it stores its weights
    (PyPI's ik wheel would pad every repacked one-token step)."""
    backend = default_backend()
    if backend == IK_LLAMA_CPP.name:
        from specdec.backends.bindings.ik_llama import binding

        if binding().one_row_exact:
            return BackendConfig(backend, repacked=True)
    return BackendConfig.parse(backend)


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The command's model options, parsed once; the rest of the program reads only this."""
    if args.ctx_size < 16:
        raise SpecdecError("--ctx-size must be at least 16.")
    if args.threads is not None and args.threads < 1:
        raise SpecdecError("--threads must be at least 1.")
    vocabulary = getattr(args, "draft_vocabulary", ModelConfig.draft_vocabulary)
    if vocabulary < 0 or vocabulary % ROW_MULTIPLE:
        raise SpecdecError(f"--draft-vocabulary must be 0 (all tokens) or a positive multiple of {ROW_MULTIPLE}.")
    return ModelConfig(backend=backend_config(args), target=args.model, draft=args.draft_model,
                       load_draft=not args.no_draft, ctx_size=args.ctx_size, threads=args.threads,
                       draft_vocabulary=vocabulary, backend_by_rule=chosen_by_rule(args))


def resolve_model(path: Optional[str], spec: ModelSpec) -> Path:
    """A user path as given, or the default model from the cache (verified by size and sha256 stamp)."""
    if path:
        return Path(path)
    from specdec.models.pull import verify_cached

    cached = default_path(spec)
    verify_cached(cached, spec)
    return cached


def load_backend(config: ModelConfig, path: Path, n_slots: int = 1, draft: bool = False) -> Backend:
    """One model on the configured backend (`draft`: as the draft model, whose logits only shape
    proposals); each backend imports its libraries only when loaded."""
    return backend_entry(config.backend.backend).load(path, config, n_slots, draft)


def load_engine(config: ModelConfig, n_slots: int = 1) -> Engine:
    target_path = resolve_model(config.target, TARGET)
    draft_path = resolve_model(config.draft, DRAFT) if config.load_draft else None
    target = load_backend(config, target_path, n_slots)
    draft = None
    if draft_path is not None:
        try:
            draft = load_backend(config, draft_path, n_slots, draft=True)
        except BaseException:
            target.close()
            raise
    try:
        return Engine(target, draft, EngineConfig(), n_slots=n_slots, model_config=config)
    except SpecdecError:
        target.close()
        if draft is not None:
            draft.close()
        raise
