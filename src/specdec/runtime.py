"""Building an engine from the configuration (specdec/config.py): its models on the registry's backend."""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Optional

from specdec.backends.base import Backend
from specdec.backends.context_size import MIB, ContextPlan, kv_shape, machine_memory, plan_context, weights_bytes
from specdec.backends.registry import IK_LLAMA_CPP, BackendConfig, ModelConfig, backend_entry, default_backend
from specdec.engine.engine import Engine, EngineConfig
from specdec.models.registry import DRAFT, TARGET, ModelSpec, default_path
from specdec.types import SpecdecError

logger = logging.getLogger("specdec.context")


def backend_config(backend: Optional[str] = None, dtype: Optional[str] = None, exact: bool = True,
                   repacked: bool = False) -> BackendConfig:
    """The named backend (with `dtype`, the first of its own by default), or else the saved
    per-machine choice if it was measured on this machine, or else the rule of `default_config`.
    Exactness stays the caller's: never the profile's."""
    from specdec.machine_profile import saved_choice

    if backend is None:
        choice = saved_choice() or default_config()
        return replace(choice, exact=exact, repacked=choice.repacked or repacked)
    entry = backend_entry(backend)
    if repacked and not entry.repacks:
        raise SpecdecError(f"--repacked applies to ik_llama.cpp only, not {backend}.")
    if dtype is not None and entry.dtypes and dtype not in entry.dtypes:
        raise SpecdecError(f"unknown dtype {dtype!r} for {backend}; choose {' or '.join(entry.dtypes)}.")
    return BackendConfig(backend, (dtype or entry.dtypes[0]) if entry.dtypes else None, exact, repacked)


def chosen_by_rule(backend: Optional[str] = None) -> bool:
    """Whether the backend configuration is the rule's (none named, no measured profile): a
    server may then move to a better build of the same library (server/upgrade.py)."""
    from specdec.machine_profile import saved_choice

    return backend is None and saved_choice() is None


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


def resolve_model(path: Optional[str], spec: ModelSpec) -> Path:
    """A user path as given, or the default model from the cache (verified by size and sha256 stamp)."""
    if path:
        return Path(path)
    from specdec.models.pull import verify_cached

    cached = default_path(spec)
    verify_cached(cached, spec)
    return cached


def context_plan(config: ModelConfig, target: Path, draft: Optional[Path], n_slots: int) -> ContextPlan:
    """The context per slot for `config.ctx_size` (None: auto) on this machine's memory, from
    both models' metadata (backends/context_size.py)."""
    dtype_bytes = 4 if config.backend.dtype == "float32" else 2
    paths = [target, *([draft] if draft is not None else [])]
    shapes = [kv_shape(path, dtype_bytes) for path in paths]
    known = [shape for shape in shapes if shape is not None]
    return plan_context(config.ctx_size, slots=n_slots, shapes=known if len(known) == len(shapes) else [],
                        weights=sum(weights_bytes(path) for path in paths), memory=machine_memory())


def load_backend(config: ModelConfig, path: Path, n_slots: int = 1, draft: bool = False) -> Backend:
    """One model on the configured backend (`draft`: as the draft model, whose logits only shape
    proposals); each backend imports its libraries only when loaded."""
    return backend_entry(config.backend.backend).load(path, config, n_slots, draft)


def load_engine(config: ModelConfig, n_slots: int = 1, engine: Optional[EngineConfig] = None) -> Engine:
    """The engine on `config`'s models, `n_slots` sequences at once, with `engine`'s settings
    (None: the defaults). Ray replicas call it (or a test's stand-in) with the same arguments."""
    target_path = resolve_model(config.target, TARGET)
    draft_path = resolve_model(config.draft, DRAFT) if config.load_draft else None
    plan = context_plan(config, target_path, draft_path, n_slots)
    (logger.warning if plan.warning else logger.info)(plan.line() + (f"; {plan.warning}" if plan.warning else ""))
    config = replace(config, ctx_size=plan.per_slot)  # kept by the engine: a reload (upgrade.py) keeps its size
    target = load_backend(config, target_path, n_slots)
    draft = None
    if draft_path is not None:
        try:
            draft = load_backend(config, draft_path, n_slots, draft=True)
        except BaseException:
            target.close()
            raise
    try:
        loaded = Engine(target, draft, engine or EngineConfig(), n_slots=n_slots, model_config=config)
    except SpecdecError:
        target.close()
        if draft is not None:
            draft.close()
        raise
    cache = loaded.prompt_cache
    if cache is not None:
        if not cache.host_bytes:
            host = "none kept in host memory (--cache-ram 0)"
        elif not target.copies_cells:
            host = "none kept in host memory (this build cannot copy cells out)"
        else:
            host = f"those that give way kept in up to {cache.host_bytes / MIB:,.0f} MiB of host memory (--cache-ram)"
            if loaded.draft_copies is not None:
                host += f", the draft model's in {loaded.draft_copies.host_bytes / MIB:,.0f} MiB more"
        logger.info(f"prompt cache: up to {cache.capacity} conversations' starts parked in the KV cache; {host}")
        if loaded.prompt_cache_folder is not None:
            logger.info(f"prompt cache: {cache.saved_count} starts read from {loaded.prompt_cache_folder}")
    return loaded
