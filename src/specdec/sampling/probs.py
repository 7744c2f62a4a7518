"""Logits -> the distribution the next token is drawn from.

The same function serves plain and speculative decoding (and the draft model's own proposals), so
temperature, top-k, top-p and min-p shape the target's distribution identically in every method.
Order of the filters: logit_bias, temperature, softmax, top-k, top-p, min-p, renormalise.
"""
from __future__ import annotations

import functools

import numpy as np

from specdec.types import MAX_LOGIT_BIAS, SamplingParams, SpecdecError

_TOP_P_PARTIAL_SORT = 2048  # sort only this many candidates for top-p unless they fall short


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Softmax of one row, as float64 summing to 1. logits: [vocab]. The exponentials are taken in
    float32, the logits' own precision: float64 costs a visible share of a step, paid for every
    verified row and every sampled draft token."""
    z = np.array(logits, dtype=np.float32)
    z -= z.max()  # before scaling: a tiny temperature then sends the others to -inf (the greedy
    with np.errstate(over="ignore"):  # limit), where scaling first gave inf - inf = NaN
        z *= np.float32(min(1.0 / temperature, float(np.finfo(np.float32).max)))
    np.exp(z, out=z)
    probs = z.astype(np.float64)
    probs /= probs.sum()
    return probs


def max_probability(logits: np.ndarray) -> float:
    """softmax(logits).max() without the distribution: 1 / sum(exp(z - max)), in the logits' own
    float32 (the draft model's confidence, every draft step, where a float64 softmax over the
    whole vocabulary is a visible share of the step)."""
    return float(1.0 / np.exp(logits - logits.max()).sum(dtype=np.float64))


def one_hot(index: int, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=np.float64)
    out[index] = 1.0
    return out


@functools.lru_cache(maxsize=256)
def _bias_arrays(logit_bias: tuple[tuple[int, float], ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, values, banned ids) of a canonical logit_bias, built once per distinct bias."""
    ids = np.array([token for token, _ in logit_bias], dtype=np.intp)
    values = np.array([bias for _, bias in logit_bias], dtype=np.float64)
    banned = ids[values <= -MAX_LOGIT_BIAS]
    for array in (ids, values, banned):
        array.setflags(write=False)  # shared through the cache
    return ids, values, banned


def biased_logits(logits: np.ndarray, logit_bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    """One row of logits [vocab] with SamplingParams.logit_bias added: the same array, uncopied,
    when the bias is empty; else a copy. -100 bans a token outright (its logit becomes -inf, at
    any temperature); +100 makes a token all but certain. Raises if nothing is left to generate."""
    if not logit_bias:
        return logits
    ids, values, banned = _bias_arrays(logit_bias)
    if ids[-1] >= logits.shape[-1]:
        raise SpecdecError(f"logit_bias names token id {int(ids[-1])}, "
                           f"but the model's vocabulary has only {logits.shape[-1]} tokens.")
    out = np.array(logits, dtype=np.result_type(logits.dtype, np.float32))
    out[ids] += values.astype(out.dtype)
    out[banned] = -np.inf
    if out.max() == -np.inf:
        raise SpecdecError("logit_bias bans every token that may come next.")
    return out


def token_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampling distribution for one position. logits: [vocab] -> probs [vocab] (float64, sums to 1).

    Greedy (temperature 0) is the one-hot of the argmax, so the lossless acceptance rule reduces to
    "accept while the draft equals the argmax". params.logit_bias is added first (no copy when empty).
    """
    if params.logit_bias:
        logits = biased_logits(logits, params.logit_bias)
    if params.greedy:
        return one_hot(int(np.argmax(logits)), logits.shape[-1])
    probs = softmax(logits, params.temperature)
    if params.top_k and params.top_k < probs.size:
        kth = np.partition(probs, -params.top_k)[-params.top_k]
        probs[probs < kth] = 0.0
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs.max()] = 0.0
    probs /= probs.sum()
    return probs


def _top_p_filter(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one token)."""
    total = probs.sum()
    m = min(_TOP_P_PARTIAL_SORT, probs.size)
    candidates = np.argpartition(probs, -m)[-m:]
    order = candidates[np.argsort(-probs[candidates], kind="stable")]
    cumulative = np.cumsum(probs[order])
    if cumulative[-1] < top_p * total and m < probs.size:  # the partial sort fell short: sort all
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
    keep = int(np.searchsorted(cumulative, top_p * total, side="left")) + 1
    out = np.zeros_like(probs)
    kept = order[:keep]
    out[kept] = probs[kept]
    return out


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from probs [vocab] (need not be normalised) by inverse CDF."""
    return sample_with(probs, rng.random())


def sample_with(probs: np.ndarray, uniform: float) -> int:
    """The index whose CDF interval holds `uniform` in [0, 1): inverse-CDF sampling with given noise."""
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
    return min(index, probs.size - 1)


def position_uniform(seed: int, position: int) -> float:
    """The uniform draw that samples the token at sequence `position` of a request seeded `seed`:
    keyed by position, so what is sampled there never depends on what was drafted before it."""
    return float(np.random.default_rng([seed, position]).random())
