"""Building an engine from command-line style options: backend, model paths, context, threads."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from specdec.backends.base import Backend
from specdec.engine.engine import Engine, EngineConfig
from specdec.machine_profile import BACKENDS, LLAMA_CPP, TORCH, TORCH_DTYPES, saved_choice
from specdec.models.registry import DRAFT, TARGET, ModelSpec, default_path
from specdec.types import DEFAULT_METHOD, DEFAULT_NUM_DRAFT_TOKENS, METHODS, SpecdecError


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument("--backend", choices=BACKENDS, default=None,
                       help="who runs the models: llama.cpp or torch (transformers, for both models); default: "
                            "the choice `specdec calibrate --save` made on this machine, else llama.cpp")
    group.add_argument("--dtype", choices=TORCH_DTYPES, default=TORCH_DTYPES[0],
                       help="torch backend only: weights and activations in bfloat16 (default) or float32; "
                            "without --backend, the saved choice's")
    group.add_argument("--model", help="target GGUF, or for torch also a Hugging Face model folder "
                                       "(default: the pulled Qwen2.5-Coder-1.5B-Instruct Q4_K_M)")
    group.add_argument("--draft-model", help="draft GGUF or, for torch, model folder "
                                             "(default: the pulled Qwen2.5-Coder-0.5B-Instruct Q4_K_M)")
    group.add_argument("--no-draft", action="store_true", help="load no draft model (methods off and ngram only)")
    group.add_argument("--ctx-size", type=int, default=4096, help="context length in tokens (default 4096)")
    group.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    group.add_argument("--inexact", action="store_true",
                       help="LOSSY opt-in: faster kernels whose batched logits may differ from one-token steps")


def add_method_arguments(parser: argparse.ArgumentParser, default_method: str = DEFAULT_METHOD) -> None:
    parser.add_argument("--method", choices=METHODS, default=default_method,
                        help=f"drafter: off (plain decoding), ngram (prompt lookup), draft (small model) or auto (picks per "
                             f"round what this machine's measured costs favour); default {default_method}")
    parser.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS,
                        help=f"tokens proposed per round (default {DEFAULT_NUM_DRAFT_TOKENS})")


def resolve_model(path: Optional[str], spec: ModelSpec) -> Path:
    """A user path as given, or the default model from the cache (verified by size and sha256 stamp)."""
    if path:
        return Path(path)
    from specdec.models.pull import verify_cached

    cached = default_path(spec)
    verify_cached(cached, spec)
    return cached


def resolve_backend(args: argparse.Namespace) -> None:
    """Fill in --backend (and --dtype) when not given: the saved machine profile's choice if it
    was measured on this machine, else llama.cpp. Exactness stays --inexact's: never the profile's."""
    if getattr(args, "backend", None) is not None:
        return
    choice = saved_choice()
    args.backend = choice.backend if choice else LLAMA_CPP
    if choice and choice.dtype:
        args.dtype = choice.dtype


def load_backend(args: argparse.Namespace, path: Path, n_slots: int = 1) -> Backend:
    """One model on the backend that --backend names; torch is imported only for its own."""
    exact = not getattr(args, "inexact", False)
    if getattr(args, "backend", None) == TORCH:
        from specdec.backends.torch_backend import TorchBackend

        return TorchBackend(path, dtype=args.dtype, n_ctx=args.ctx_size, n_threads=args.threads,
                            max_sequences=n_slots, exact=exact)
    from specdec.backends.llama_cpp import LlamaCppBackend

    return LlamaCppBackend(path, n_ctx=args.ctx_size, n_threads=args.threads, max_sequences=n_slots, exact=exact)


def load_engine(args: argparse.Namespace, n_slots: int = 1) -> Engine:
    resolve_backend(args)
    target_path = resolve_model(args.model, TARGET)
    need_draft = not args.no_draft
    draft_path = resolve_model(args.draft_model, DRAFT) if need_draft else None
    target = load_backend(args, target_path, n_slots)
    draft = None
    if draft_path is not None:
        try:
            draft = load_backend(args, draft_path, n_slots)
        except BaseException:
            target.close()
            raise
    try:
        return Engine(target, draft, EngineConfig(), n_slots=n_slots)
    except SpecdecError:
        target.close()
        if draft is not None:
            draft.close()
        raise
