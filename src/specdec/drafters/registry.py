"""Drafting methods by name: the one table the engine, the request validation and the CLIs read.

A *method* is what a request or a command asks for (`speculative_decoding.method`, `--method`);
the engine builds one drafter per slot from the method's factory. Adding a method is adding one
entry here, or `register(Method(...))` from a plugin before the engine is built (docs/usage.md,
"Adding a drafter").

A proposal's *source* is what a round's tokens are credited to (`RoundOutcome.source`, the
`speculative` stream extension): `auto` chooses among the sources it may offer and prices each by
its kind (SOURCES below); a plain method's drafter credits its own name.

This module imports no drafter at load time (each factory imports its own), so the low layers
(types.py's validation, the HTTP client's CLI) can read the names without loading the drafters.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Optional

if TYPE_CHECKING:
    from specdec.backends.cost_model import CostModel
    from specdec.backends.sequence import CachedSequence
    from specdec.drafters.base import Drafter
    from specdec.engine.engine import EngineConfig


@dataclass(frozen=True)
class SlotParts:
    """What the engine hands a factory to build one slot's drafter. The tenant's cross-request
    history is not here: a generation passes it to `Drafter.begin`, request by request."""

    config: "EngineConfig"
    target: "CachedSequence"
    draft: Optional["CachedSequence"]  # None: no draft model loaded
    drafters: Mapping[str, "Drafter"]  # the slot's drafters built before this one, in registry order
    cost_model: Optional["CostModel"] = None  # given to `calibrated` methods only
    clock: Callable[[], float] = time.perf_counter


@dataclass(frozen=True)
class Method:
    """One drafting method: its name, what it needs, and how a slot's drafter is built."""

    name: str
    description: str  # one line, for help texts and docs
    build: Callable[[SlotParts], "Drafter"]
    needs_draft: bool = False  # refused without a draft model (and not built)
    uses_draft: bool = False  # proposes with the draft model where one is loaded: load it for this method
    calibrated: bool = False  # built once the engine measured this machine's costs (on first use)
    options: tuple[str, ...] = field(default=())  # the EngineConfig fields its drafter reads

    @property
    def wants_draft(self) -> bool:
        """Whether a command running this method should load the draft model."""
        return self.needs_draft or self.uses_draft


# Registration order is the order names are listed in (help texts, error messages, `engine.methods`).
_METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in _METHODS:
        raise ValueError(f"drafting method {method.name!r} is already registered.")
    _METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    del _METHODS[name]


def method_names() -> tuple[str, ...]:
    """Every registered method's name, a function (not a tuple) so a method registered later counts."""
    return tuple(_METHODS)


def methods() -> tuple[Method, ...]:
    return tuple(_METHODS.values())


def get(name: str) -> Optional[Method]:
    return _METHODS.get(name)


def wants_draft(name: str) -> bool:
    """Whether running method `name` should load the draft model (False for an unknown name)."""
    method = _METHODS.get(name)
    return method is not None and method.wants_draft


def calibrated(name: str) -> bool:
    """Whether method `name` prices with the machine's measured costs (`auto`): calibrate first."""
    method = _METHODS.get(name)
    return method is not None and method.calibrated


# -- the built-in methods ------------------------------------------------------------------------
def _off(parts: SlotParts) -> "Drafter":
    from specdec.drafters.base import NoDrafter

    return NoDrafter()


def _ngram(parts: SlotParts) -> "Drafter":
    from specdec.drafters.ngram import NgramDrafter

    return NgramDrafter(parts.config.ngram_max, parts.config.ngram_min)


def _draft(parts: SlotParts) -> "Drafter":
    from specdec.drafters.model import ModelDrafter

    assert parts.draft is not None  # needs_draft: never built without one
    return ModelDrafter(parts.draft, clock=parts.clock)


def _auto(parts: SlotParts) -> "Drafter":
    from specdec.drafters.auto import AutoDrafter
    from specdec.drafters.model import ModelDrafter

    assert parts.cost_model is not None  # calibrated: built with the measured costs
    model = parts.drafters.get("draft")  # shares the slot's model drafter (and its draft cache)
    return AutoDrafter(parts.cost_model, model if isinstance(model, ModelDrafter) else None,
                       clock=parts.clock, config=parts.config.policy)


OFF = register(Method("off", "plain target decoding, the baseline every speedup is measured against", _off))
NGRAM = register(Method("ngram", "continuations of the request's own text (suffix match)", _ngram,
                        options=("ngram_max", "ngram_min")))
DRAFT = register(Method("draft", "the draft model proposes k tokens", _draft, needs_draft=True))
AUTO = register(Method("auto", "each round, the source expected to give the most tokens per second, or none",
                       _auto, uses_draft=True, calibrated=True, options=("policy",)))


# -- proposal sources ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """What a round's proposal came from. `auto` offers the `offered` ones and prices each by kind:
    a draft-free source by its acceptance priors per evidence (priors.py), a model source by the
    draft model's per-token time and acceptance."""

    name: str
    description: str
    model: bool  # drafted (at least in part) by the draft model
    history: bool = False  # may copy text from the tenant's earlier requests
    offered: bool = True  # one of `auto`'s options (the grammar's forced tokens are not)


SOURCES = (
    Source("ngram", "the request's own text continued", model=False),
    Source("cache", "the tenant's earlier requests continued", model=False, history=True),
    Source("draft", "the draft model drafting 1..k tokens", model=True),
    Source("hybrid", "the draft model continuing the first tokens of a draft-free offer", model=True, history=True),
    Source("grammar", "tokens the grammar forced (no drafter proposed them)", model=False, offered=False),
)
DRAFT_FREE = tuple(source.name for source in SOURCES if source.offered and not source.model)  # ("ngram", "cache")
MODEL_SOURCES = tuple(source.name for source in SOURCES if source.offered and source.model)  # ("draft", "hybrid")
# Proposals that may copy a cross-request history: hidden from a request without a tenant.
HISTORY_SOURCES = frozenset(source.name for source in SOURCES if source.history)
