"""The lossless acceptance rule (Leviathan et al. 2023; Chen et al. 2023), as pure functions.

Letters follow the Leviathan paper: p is the target's distribution, q the draft's.

For a deterministic proposal (q one-hot at the proposed x: n-gram matches, greedy drafts) the rule
accepts x with probability p(x) and otherwise draws from p without x. `verify_deterministic` does
exactly that by drawing the target's own token at each position and accepting x while they agree:
P(own == x) = p(x), and an own token that differs is distributed as p without x. With noise keyed
by position (the decoder's), the output then never depends on what was proposed.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import numpy as np

from specdec.sampling.probs import sample
from specdec.types import Verdict


def verify(
    draft_tokens: Sequence[int],
    draft_probs: Optional[np.ndarray],
    target_probs: Union[np.ndarray, Callable[[int], np.ndarray]],
    rng: np.random.Generator,
) -> Verdict:
    """Accept a prefix of the draft so that the output is distributed exactly as the target's.

    draft_tokens: [k] proposed ids. draft_probs: [k, vocab] the draft's distribution q at each
    position, or None for a deterministic drafter (q is then one-hot at the proposed token).
    target_probs: [k + 1, vocab] the target's distribution p at each draft position plus one, or
    a function giving row i, asked only for the rows reached (each is a softmax over the whole
    vocabulary: a few milliseconds on a CPU, for rows past a rejection that are never read).

    Position i is accepted with probability min(1, p_i(x) / q_i(x)). On the first rejection the
    recovered token is drawn from norm(max(0, p_i - q_i)); if all k are accepted, the bonus token
    is drawn from p_k.

    Example (one-hot q, greedy target): draft [5, 7, 9], target argmaxes [5, 7, 2, 4]
    -> accepted (5, 7), next_token 2 (the target's own choice where the draft went wrong).
    """
    k = len(draft_tokens)
    if callable(target_probs):
        target_row = target_probs
    else:
        assert target_probs.shape[0] == k + 1, "target_probs must have k + 1 rows"
        target_row = target_probs.__getitem__
    accepted: list[int] = []
    for i, token in enumerate(draft_tokens):
        p_row = target_row(i)
        p = float(p_row[token])
        q = 1.0 if draft_probs is None else float(draft_probs[i][token])
        if q > 0.0 and (p >= q or rng.random() < p / q):
            accepted.append(int(token))
            continue
        # Rejected: draw from the residual norm(max(0, p - q)).
        if draft_probs is None:
            residual = p_row.copy()
            residual[token] = max(0.0, p - 1.0)
        else:
            residual = np.maximum(p_row - draft_probs[i], 0.0)
        if residual.sum() <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual = p_row
        return Verdict(tuple(accepted), sample(residual, rng))
    return Verdict(tuple(accepted), sample(target_row(k), rng))


def verify_deterministic(draft_tokens: Sequence[int], target_token: Callable[[int], int]) -> Verdict:
    """Accept while the draft equals the target's own token at each position (see the module's
    docstring); target_token(i) gives it for draft position i (0..k, k the bonus position) and is
    asked only for the positions reached. Greedy decoding's rule: the target's token is its argmax.
    Example: draft [5, 7, 9], argmaxes [5, 7, 2, 4] -> accepted (5, 7), next_token 2;
    draft [5, 7], argmaxes [5, 7, 8] -> accepted (5, 7), next_token 8 (the bonus token).
    """
    accepted: list[int] = []
    for i, token in enumerate(draft_tokens):
        own = int(target_token(i))
        if own != int(token):
            return Verdict(tuple(accepted), own)
        accepted.append(own)
    return Verdict(tuple(accepted), int(target_token(len(draft_tokens))))

