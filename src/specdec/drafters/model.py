"""Drafting with a small model that shares the target's tokenizer."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Callable, Generator, Optional, Sequence

import numpy as np

from specdec.backends.sequence import CachedSequence
from specdec.drafters.base import DraftForward, Drafter, DraftReply, DraftSteps, run_alone
from specdec.drafters.history import TenantHistory
from specdec.sampling.probs import max_probability, one_hot, sample, token_distribution
from specdec.types import Proposal, SamplingParams

if TYPE_CHECKING:
    from specdec.grammar.constraint import Constraint


class Extent(enum.Enum):
    """How far a model draft goes at one position, decided before its token is drawn."""

    STOP = "stop"  # leave this position's token out: the proposal ends before it
    LAST = "last"  # propose this token, then stop without running the draft for the next one
    MORE = "more"  # propose it and run the draft for the next position


# keep_drafting(position, confidence) -> Extent at `position` (0-based in the proposal); confidence
# is the draft model's probability of its most likely token there. The draft step that produced
# this position is already paid; the one for the next position is paid only on MORE.
KeepDrafting = Callable[[int, float], Extent]
# Committed tokens the draft's cache lacks that are evaluated in one forward with the last token
# (their logits are copied out too, so a longer lag goes through prompt processing instead).
MAX_JOINED_CATCH_UP = 16


class ModelDrafter(Drafter):
    """Runs the draft model autoregressively for up to k steps.

    Its KV cache is kept in step with the target's by prefix: before each proposal, the cache is
    cut back to the longest prefix it shares with the committed text and the rest is evaluated,
    so rejected draft tokens are rolled back and accepted ones are never evaluated twice.
    Greedy requests draft the argmax (a one-hot q); sampled requests sample from the draft's
    distribution under the same sampling parameters and pass it along as q.

    `prefix` makes it a hybrid: tokens another source already proposed (an n-gram match) are
    evaluated in one batch and the model continues after them; their q is one-hot, as for any
    deterministic proposal, so the acceptance rule stays exact.
    """

    name = "draft"

    def __init__(self, sequence: CachedSequence, clock: Callable[[], float] = time.perf_counter):
        self.sequence = sequence
        self.clock = clock
        self.seconds = 0.0  # the last proposal's draft time (propose_steps)
        self._resumed = 0.0

    def prefill(self, prompt_prefix: Sequence[int]) -> None:
        self.sequence.prefill(list(prompt_prefix))

    def begin(self, prompt: Sequence[int], history: Optional[TenantHistory] = None) -> None:
        self.sequence.prefill(list(prompt[:-1]))

    def lag(self, context: Sequence[int]) -> int:
        """The committed tokens of `context` (all but its last) that this draft's cache lacks: what
        its next proposal has to catch up on. Changes nothing."""
        if not context:
            return 0
        return len(context) - 1 - self.sequence.reusable_prefix(context[:-1])

    def propose(self, context, k: int, sampling: SamplingParams, rng: np.random.Generator,
                guide: Optional["Constraint"] = None, *, prefix: Sequence[int] = (),
                keep_drafting: Optional[KeepDrafting] = None) -> Proposal:
        return run_alone(self.propose_steps(context, k, sampling, rng, guide, prefix=prefix,
                                            keep_drafting=keep_drafting), self.clock)

    def propose_steps(self, context, k: int, sampling: SamplingParams, rng: np.random.Generator,
                      guide: Optional["Constraint"] = None, *, prefix: Sequence[int] = (),
                      keep_drafting: Optional[KeepDrafting] = None) -> DraftSteps:
        """The proposal's draft forwards are yielded (base.DraftSteps); `seconds` adds up its own
        time: its share of them, and the rest of its work (a catch-up on a long lag among it)."""
        self.seconds, self._resumed = 0.0, self.clock()
        proposal = yield from self._draft(context, k, sampling, rng, guide, prefix, keep_drafting)
        self.seconds += self.clock() - self._resumed
        return proposal

    def _draft(self, context, k: int, sampling: SamplingParams, rng: np.random.Generator,
               guide: Optional["Constraint"], prefix: Sequence[int],
               keep_drafting: Optional[KeepDrafting]) -> DraftSteps:
        source = "hybrid" if prefix else "draft"
        prefix = tuple(int(t) for t in prefix[:k])
        if guide is not None:
            prefix = prefix[:guide.admissible(prefix)]
        if k <= 0:
            return Proposal(())
        context = list(context)
        # Catch up on what was committed since the last proposal in the same forward as the last
        # token (and any prefix), whose logits start the draft: one call a round, not two. A long
        # lag (the prompt, on first use) is processed in full batches without logits first.
        lag = context[self.sequence.reuse_prefix(context[:-1]):-1]
        if len(lag) > MAX_JOINED_CATCH_UP:
            self.sequence.prefill(context[:-1])
            lag = []
        logits = yield from self._forward([*lag, context[-1], *prefix])
        tokens: list[int] = list(prefix)
        probs: list[np.ndarray] = [] if sampling.greedy else [one_hot(t, logits.shape[-1]) for t in prefix]
        while len(tokens) < k:
            if guide is not None:  # q is then the masked distribution the token is drawn from
                allowed = guide.allowed_after(tokens)
                if allowed.sum() <= 1:  # nothing or a forced token: the generation proposes those itself
                    break
                logits = np.where(allowed, logits, np.float32(-np.inf))
            dist = None if sampling.greedy else token_distribution(logits, sampling)
            extent = Extent.MORE
            if keep_drafting is not None:
                # Decided before drawing the token, from the distribution alone: a stop that
                # depended on the drawn token would bias which tokens get verified (not exact).
                confidence = max_probability(logits) if dist is None else float(dist.max())
                extent = keep_drafting(len(tokens), confidence)
                if extent is Extent.STOP:
                    break
            token = int(np.argmax(logits)) if dist is None else sample(dist, rng)
            tokens.append(token)
            if dist is not None:
                probs.append(dist)
            if extent is Extent.LAST or (guide is not None and guide.is_end(token)):
                break
            if len(tokens) < k:
                logits = yield from self._forward([token])
        return Proposal(tuple(tokens), np.stack(probs) if probs else None, source)

    def _forward(self, tokens: Sequence[int]) -> Generator[DraftForward, DraftReply, np.ndarray]:
        self.seconds += self.clock() - self._resumed
        reply = yield DraftForward(self.sequence, tuple(tokens))
        self._resumed = self.clock()
        self.seconds += reply.seconds
        return reply.logits
