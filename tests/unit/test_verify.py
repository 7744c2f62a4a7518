"""The acceptance rule: exact small cases and a Monte-Carlo check that the output is distributed
exactly as the target's, for the first position and for the position after a rejection; also for
deterministic proposals verified against the target's own position-keyed samples."""
import numpy as np
import pytest

from specdec.sampling.probs import position_uniform, sample, sample_with, token_distribution
from specdec.sampling.verify import verify, verify_deterministic
from specdec.types import SamplingParams


def one_hot(i, n):
    v = np.zeros(n)
    v[i] = 1.0
    return v


def greedy(draft, argmaxes):
    """Greedy verification: the target's own token at each position is its argmax."""
    return verify_deterministic(draft, argmaxes.__getitem__)


def test_greedy_examples():
    v = greedy([5, 7, 9], [5, 7, 2, 4])
    assert v.accepted_tokens == (5, 7) and v.next_token == 2
    v = greedy([5, 7], [5, 7, 8])
    assert v.accepted_tokens == (5, 7) and v.next_token == 8
    v = greedy([], [3])
    assert v.accepted_tokens == () and v.next_token == 3
    v = greedy([1, 2], [0, 2, 2])
    assert v.accepted_tokens == () and v.next_token == 0


def test_k0_samples_the_target():
    rng = np.random.default_rng(0)
    target = np.array([[0.0, 1.0, 0.0]])
    assert verify([], None, target, rng).next_token == 1


def test_full_acceptance_gives_bonus_from_last_row():
    rng = np.random.default_rng(0)
    target = np.stack([one_hot(2, 4), one_hot(3, 4), one_hot(1, 4)])
    draft = np.stack([one_hot(2, 4), one_hot(3, 4)])
    v = verify([2, 3], draft, target, rng)
    assert v.accepted_tokens == (2, 3) and v.next_token == 1


def test_first_position_rejection_draws_from_residual():
    rng = np.random.default_rng(0)
    # p puts no mass on the drafted token 0, so it is always rejected; residual = p.
    target = np.stack([np.array([0.0, 0.5, 0.5]), one_hot(0, 3)])
    draft = np.stack([one_hot(0, 3)])
    for _ in range(50):
        v = verify([0], draft, target, rng)
        assert v.accepted_tokens == () and v.next_token in (1, 2)


def test_p_equals_q_always_accepts():
    rng = np.random.default_rng(1)
    p = np.array([0.2, 0.3, 0.5])
    target = np.stack([p, p, p])
    for _ in range(200):
        token_a, token_b = rng.choice(3, p=p), rng.choice(3, p=p)
        v = verify([token_a, token_b], np.stack([p, p]), target, rng)
        assert v.num_accepted == 2


def test_disjoint_support_always_rejects_and_recovers_from_target():
    rng = np.random.default_rng(2)
    p = np.array([0.0, 0.0, 0.4, 0.6])
    q = np.array([0.5, 0.5, 0.0, 0.0])
    for _ in range(200):
        v = verify([int(rng.choice(4, p=q))], q[None], np.stack([p, p]), rng)
        assert v.num_accepted == 0 and v.next_token in (2, 3)


def test_one_hot_draft_matches_greedy_rule_when_target_is_one_hot():
    rng = np.random.default_rng(3)
    target = np.stack([one_hot(4, 6), one_hot(1, 6), one_hot(5, 6)])
    v = verify([4, 2], None, target, rng)
    assert v.accepted_tokens == (4,) and v.next_token == 1
    assert greedy([4, 2], [4, 1, 5]) == v


def test_target_rows_given_by_a_function_are_computed_only_up_to_the_rejection():
    """Rows past the first rejection are never read (a softmax over the vocabulary each); the
    verdict and the generator's draws are the same as with every row stacked."""
    p = np.array([0.1, 0.2, 0.3, 0.4])
    rows = np.stack([p, one_hot(2, 4), p, p])
    draft = np.stack([p, one_hot(1, 4), p])  # position 2 drafts 1 where the target has 2: rejected
    for seed in range(20):
        asked = []
        lazy = verify([3, 1, 0], draft, lambda i: asked.append(i) or rows[i], np.random.default_rng(seed))
        stacked = verify([3, 1, 0], draft, rows, np.random.default_rng(seed))
        assert lazy == stacked
        assert asked == list(range(lazy.num_accepted + 1))


def _tv_bound(n_draws, n_outcomes, confidence_z=4.5):
    # Total-variation distance of an empirical distribution: each cell's standard error is at most
    # 0.5/sqrt(n); summing a z-sigma deviation over the cells and halving bounds TV with ample margin.
    return 0.5 * n_outcomes * confidence_z * 0.5 / np.sqrt(n_draws)


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_output_distribution_equals_target_monte_carlo(deterministic_draft):
    """First emitted token and the token after it (which follows a rejection or an acceptance) are
    distributed as the target's, for a draft distribution q unlike p."""
    rng = np.random.default_rng(1234)
    vocab = 4
    p1 = np.array([0.1, 0.2, 0.3, 0.4])  # target at position 1
    p2 = np.array([0.5, 0.1, 0.1, 0.3])  # target at position 2 (independent of position 1 here)
    p3 = np.array([0.25, 0.25, 0.25, 0.25])
    q1 = np.array([0.4, 0.3, 0.2, 0.1])
    q2 = np.array([0.1, 0.1, 0.7, 0.1])
    n = 40_000
    first = np.zeros(vocab)
    second = np.zeros(vocab)
    second_after_rejection = np.zeros(vocab)
    rejections = 0
    for _ in range(n):
        if deterministic_draft:
            d = [2, 2]
            v = verify(d, None, np.stack([p1, p2, p3]), rng)
        else:
            d = [int(rng.choice(vocab, p=q1)), int(rng.choice(vocab, p=q2))]
            v = verify(d, np.stack([q1, q2]), np.stack([p1, p2, p3]), rng)
        out = [*v.accepted_tokens, v.next_token]
        first[out[0]] += 1
        if len(out) >= 2:
            second[out[1]] += 1
        else:
            # Rejected at position 1: the plain target would draw position 2 from p2 next.
            rejections += 1
            token = sample(p2, rng)
            second[token] += 1
            second_after_rejection[token] += 1
    tv_first = 0.5 * np.abs(first / n - p1).sum()
    tv_second = 0.5 * np.abs(second / n - p2).sum()
    assert tv_first < _tv_bound(n, vocab), tv_first
    assert tv_second < _tv_bound(n, vocab), tv_second
    # The recovered token itself (position 1 after a rejection) follows norm(max(0, p1 - q1)) and
    # together with accepted draws gives p1, which the first check covers; make sure rejections occurred.
    assert rejections > n * 0.1


def test_recovered_token_follows_residual_distribution():
    rng = np.random.default_rng(99)
    p = np.array([0.1, 0.2, 0.3, 0.4])
    q = np.array([0.4, 0.3, 0.2, 0.1])
    residual = np.maximum(p - q, 0)
    residual /= residual.sum()  # [0, 0, 1/3, 2/3]
    counts = np.zeros(4)
    n = 0
    for _ in range(30_000):
        d = int(rng.choice(4, p=q))
        v = verify([d], q[None], np.stack([p, p]), rng)
        if v.num_accepted == 0:
            counts[v.next_token] += 1
            n += 1
    assert n > 3000
    assert 0.5 * np.abs(counts / n - residual).sum() < _tv_bound(n, 4)


def test_token_distribution_filters():
    logits = np.log(np.array([0.05, 0.1, 0.15, 0.3, 0.4]))
    greedy = token_distribution(logits, SamplingParams(temperature=0))
    assert greedy.tolist() == [0, 0, 0, 0, 1]
    top_k = token_distribution(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(top_k, [0, 0, 0, 0.3 / 0.7, 0.4 / 0.7])
    top_p = token_distribution(logits, SamplingParams(temperature=1.0, top_p=0.65))
    np.testing.assert_allclose(top_p, [0, 0, 0, 0.3 / 0.7, 0.4 / 0.7])
    min_p = token_distribution(logits, SamplingParams(temperature=1.0, min_p=0.5))  # keep p >= 0.2
    np.testing.assert_allclose(min_p, [0, 0, 0, 0.3 / 0.7, 0.4 / 0.7])
    hot = token_distribution(logits, SamplingParams(temperature=2.0))
    expected = np.sqrt([0.05, 0.1, 0.15, 0.3, 0.4])
    np.testing.assert_allclose(hot, expected / expected.sum())


def test_a_tiny_temperature_tends_to_greedy_without_overflow():
    # logits / 1e-310 overflow to inf; the distribution must still be the argmax's, not NaNs.
    logits = np.array([1.0, 3.0, -np.inf, 2.0], dtype=np.float32)
    with np.errstate(invalid="raise", divide="raise"):
        dist = token_distribution(logits, SamplingParams(temperature=1e-310))
    assert dist.tolist() == [0, 1, 0, 0]


def test_top_p_falls_back_to_full_sort_on_flat_distributions():
    logits = np.zeros(5000)
    dist = token_distribution(logits, SamplingParams(temperature=1.0, top_p=0.8999))
    assert (dist > 0).sum() == 4500
    np.testing.assert_allclose(dist.sum(), 1.0)


def test_deterministic_proposals_against_position_keyed_samples_follow_the_target_monte_carlo():
    """Leviathan's rule for a one-hot q: x is accepted with probability p(x), and a rejection yields
    p without x; and every seed gives the token plain sampling would give at that position."""
    p = np.stack([np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.5, 0.1, 0.1, 0.3])])
    n, draft = 40_000, [2, 0]
    first, accepted_first, after_rejection = np.zeros(4), 0, np.zeros(4)
    asked = []
    for seed in range(n):
        def own(i):
            asked.append(i)
            return sample_with(p[i], position_uniform(seed, 100 + i))

        v = verify_deterministic(draft[:1], own)
        plain = sample_with(p[0], position_uniform(seed, 100))
        out = [*v.accepted_tokens, v.next_token]
        assert out[0] == plain  # the proposal never changes what is sampled at a position
        first[out[0]] += 1
        if v.num_accepted:
            accepted_first += 1
        else:
            after_rejection[v.next_token] += 1
    assert 0.5 * np.abs(first / n - p[0]).sum() < _tv_bound(n, 4)
    assert abs(accepted_first / n - 0.3) < 4 * np.sqrt(0.3 * 0.7 / n)  # p(x) for x = 2
    residual = np.array([0.1, 0.2, 0.0, 0.4]) / 0.7
    assert after_rejection[2] == 0
    assert 0.5 * np.abs(after_rejection / after_rejection.sum() - residual).sum() < _tv_bound(int(after_rejection.sum()), 4)
    asked.clear()
    verify_deterministic([3, 3, 3], lambda i: asked.append(i) or 1)
    assert asked == [0]  # rows after the first rejection are never sampled


def test_position_uniform_is_keyed_by_seed_and_position():
    assert position_uniform(5, 10) == position_uniform(5, 10)
    draws = {position_uniform(seed, position) for seed in range(3) for position in range(50)}
    assert len(draws) == 150 and all(0.0 <= u < 1.0 for u in draws)
