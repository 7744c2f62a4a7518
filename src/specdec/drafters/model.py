"""Drafting with a small model that shares the target's tokenizer."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.drafters.base import Drafter
from specdec.engine.sequence import CachedSequence
from specdec.sampling.probs import sample, token_distribution
from specdec.types import Proposal, SamplingParams


class ModelDrafter(Drafter):
    """Runs the draft model autoregressively for k steps.

    Its KV cache is kept in step with the target's by prefix: before each proposal, the cache is
    cut back to the longest prefix it shares with the committed text and the rest is evaluated,
    so rejected draft tokens are rolled back and accepted ones are never evaluated twice.
    Greedy requests draft the argmax (a one-hot q); sampled requests sample from the draft's
    distribution under the same sampling parameters and pass it along as q.
    """

    name = "draft"

    def __init__(self, sequence: CachedSequence):
        self.sequence = sequence

    def begin(self, prompt: Sequence[int]) -> None:
        self.sequence.prefill(list(prompt[:-1]))

    def propose(self, context, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Proposal:
        if k <= 0:
            return Proposal(())
        context = list(context)
        # Catch up in full batches (after a rollback, or the prompt on first use); the last token
        # is evaluated on its own because its logits start the draft.
        self.sequence.prefill(context[:-1])
        logits = self.sequence.extend(context[-1:])[-1]
        tokens: list[int] = []
        probs: list[np.ndarray] = []
        for i in range(k):
            if sampling.greedy:
                token = int(np.argmax(logits))
            else:
                dist = token_distribution(logits, sampling)
                token = sample(dist, rng)
                probs.append(dist)
            tokens.append(token)
            if i < k - 1:
                logits = self.sequence.extend([token])[-1]
        return Proposal(tuple(tokens), np.stack(probs) if probs else None, "draft")
