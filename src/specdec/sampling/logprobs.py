"""Log-probabilities the API reports: log_softmax of the target's raw logits row.

Temperature 1 and no sampling filter (top-k, top-p, min-p): the model's own distribution, as
OpenAI and vLLM report it. No logit_bias either (vLLM's default raw logprobs): the bias changes
which token is chosen, not the model's probabilities reported for it. Verification already
computed the row of every committed token, and exact verification makes that row the same in
every speculative method, so the values are too.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.types import TokenLogprob

# What OpenAI and vLLM report for a token the distribution gives no mass (JSON has no -Infinity).
MIN_LOGPROB = -9999.0
MAX_TOP_LOGPROBS = 20


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """One row of logits [vocab] -> log-probabilities [vocab] (float64)."""
    z = np.asarray(logits, dtype=np.float64)
    top = z.max()
    if not np.isfinite(top):  # every logit -inf (or a NaN): no distribution to speak of
        return np.full(z.shape, -np.inf)
    shifted = z - top
    return shifted - np.log(np.exp(shifted).sum())


def _finite(value: float) -> float:
    return float(value) if np.isfinite(value) else MIN_LOGPROB


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """The chosen token's log-probability under one row, and the row's `top` most likely tokens
    (most likely first; ties by token id, so the order never depends on the sort's whims)."""
    logprobs = log_softmax(logits)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        count = min(top, logprobs.size)
        candidates = np.argpartition(-logprobs, count - 1)[:count] if count < logprobs.size else np.arange(count)
        # A tie at the cut: argpartition picks among equals arbitrarily; take the lowest ids instead.
        cut = logprobs[candidates].min()
        candidates = np.union1d(candidates, np.flatnonzero(logprobs == cut))
        order = sorted(candidates.tolist(), key=lambda t: (-logprobs[t], t))[:count]
        alternatives = tuple((int(t), _finite(logprobs[t])) for t in order)
    return TokenLogprob(int(token), _finite(logprobs[token]), alternatives)


def token_logprobs(rows: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """tokens[i]'s entry under rows[i]: rows [>= len(tokens), vocab]."""
    return [token_logprob(rows[i], token, top) for i, token in enumerate(tokens)]
