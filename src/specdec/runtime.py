"""Building an engine from command-line style options: model paths, context, threads."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from specdec.engine.engine import Engine, EngineConfig
from specdec.models.registry import DRAFT, TARGET, ModelSpec, default_path
from specdec.types import DEFAULT_METHOD, DEFAULT_NUM_DRAFT_TOKENS, METHODS, SpecdecError


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument("--model", help="target GGUF (default: the pulled Qwen2.5-Coder-1.5B-Instruct Q4_K_M)")
    group.add_argument("--draft-model", help="draft GGUF (default: the pulled Qwen2.5-Coder-0.5B-Instruct Q4_K_M)")
    group.add_argument("--no-draft", action="store_true", help="load no draft model (methods off and ngram only)")
    group.add_argument("--ctx-size", type=int, default=4096, help="context length in tokens (default 4096)")
    group.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    group.add_argument("--inexact", action="store_true",
                       help="LOSSY opt-in: faster kernels whose batched logits may differ from one-token steps")


def add_method_arguments(parser: argparse.ArgumentParser, default_method: str = DEFAULT_METHOD) -> None:
    parser.add_argument("--method", choices=METHODS, default=default_method,
                        help=f"drafter: off (plain decoding), ngram (prompt lookup) or draft (small model); default {default_method}")
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


def load_engine(args: argparse.Namespace, n_slots: int = 1) -> Engine:
    from specdec.backends.llama_cpp import LlamaCppBackend

    exact = not getattr(args, "inexact", False)
    target_path = resolve_model(args.model, TARGET)
    need_draft = not args.no_draft
    draft_path = resolve_model(args.draft_model, DRAFT) if need_draft else None
    target = LlamaCppBackend(target_path, n_ctx=args.ctx_size, n_threads=args.threads, max_sequences=n_slots, exact=exact)
    draft = None
    if draft_path is not None:
        draft = LlamaCppBackend(draft_path, n_ctx=args.ctx_size, n_threads=args.threads, max_sequences=n_slots, exact=exact)
    try:
        return Engine(target, draft, EngineConfig(), n_slots=n_slots)
    except SpecdecError:
        target.close()
        if draft is not None:
            draft.close()
        raise
