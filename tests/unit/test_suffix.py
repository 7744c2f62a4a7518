"""The suffix index behind `auto`'s draft-free sources: longest matches, every occurrence,
frequency-weighted continuations with their evidence, sequences kept apart, bounds."""
import random
from collections import Counter

from specdec.drafters.suffix import MAX_OCCURRENCES, Evidence, SuffixIndex


def brute_force(sequences, context, max_match, min_match=1):
    """(longest match length, Counter of the tokens that followed its occurrences)."""
    for m in range(min(max_match, len(context)), min_match - 1, -1):
        pattern = list(context[-m:])
        nexts = Counter(s[i + m] for s in sequences for i in range(len(s) - m) if s[i:i + m] == pattern)
        if nexts:
            return m, nexts
    return 0, Counter()


def test_the_docstrings_example():
    index = SuffixIndex()
    sequence = [1, 2, 3, 9, 1, 2, 4, 1, 2, 3]
    index.add_sequence(sequence)
    continuation = index.continuation([7, 1, 2], 2)
    assert continuation.tokens == (3, 9)
    assert continuation.evidence == (Evidence(2, 2, 3), Evidence(3, 1, 1))
    assert [e.agreement for e in continuation.evidence] == ["majority", "single"]


def test_agreement_classes():
    assert [Evidence(1, s, n).agreement for s, n in ((1, 1), (3, 3), (2, 3), (1, 3), (2, 4))] == \
        ["single", "unanimous", "majority", "split", "split"]


def test_matches_and_counts_equal_a_brute_force_search():
    rng = random.Random(3)
    for trial in range(200):
        sequences = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(rng.randrange(1, 4))]
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        max_match, min_match = rng.choice(((16, 1), (6, 1), (8, 3))), None
        max_match, min_match = max_match
        key_max = rng.choice((max_match, min_match))
        index = SuffixIndex(max_match=max_match, min_match=min_match, key_max=key_max)
        for sequence in sequences:
            index.add_sequence(sequence)
        length, nexts = brute_force(sequences, context, max_match, min_match)
        continuation = index.continuation(context, 3)
        if not nexts:
            assert continuation.tokens == (), trial
            continue
        first = continuation.evidence[0]
        assert first.match_length == length, trial
        assert (first.support, first.occurrences) == (max(nexts.values()), sum(nexts.values())), trial
        assert nexts[continuation.tokens[0]] == max(nexts.values()), trial


def test_a_continuation_never_crosses_into_the_next_sequence():
    index = SuffixIndex()
    index.add_sequence([5, 6, 7])
    index.add_sequence([8, 9])
    assert index.continuation([5, 6], 4).tokens == (7,)
    assert index.continuation([7], 4).tokens == ()  # 7 ended its sequence: 8 never followed it
    assert index.continuation([7, 8], 4).tokens == (9,)


def test_longer_matches_than_the_keys_are_measured_backwards():
    # Keys of 2 tokens; the occurrence sharing 4 tokens with the context wins over a 2-token one.
    index = SuffixIndex(max_match=8, min_match=2, key_max=2)
    index.add_sequence([1, 2, 3, 4, 50])
    index.add_sequence([9, 9, 3, 4, 60])
    continuation = index.continuation([0, 1, 2, 3, 4], 2)
    assert continuation.tokens == (50,) and continuation.match_length == 4
    assert index.continuation([3], 2).tokens == ()  # shorter than min_match


def test_tracking_a_growing_context_equals_indexing_it_afresh():
    rng = random.Random(5)
    context = [rng.randrange(5) for _ in range(30)]
    tracked, growing = SuffixIndex(), []
    for end in range(2, len(context) + 1):
        if end < 10:
            tracked.track(context[:end])  # a new object each time: indexed afresh
        else:
            growing.extend(context[len(growing):end])
            tracked.track(growing)  # one object that grows: only its new tokens are indexed
        fresh = SuffixIndex()
        fresh.add_sequence(context[:end])
        assert tracked.continuation(context[:end], 4) == fresh.continuation(context[:end], 4)
    tracked.track([9, 9, 9])  # another context: indexed afresh
    assert len(tracked) == 3


def test_occurrences_and_tokens_are_bounded():
    index = SuffixIndex()
    index.add_sequence([1, 2] * 200)
    assert index.continuation([1], 1).evidence[0].occurrences == MAX_OCCURRENCES
    bounded = SuffixIndex(max_tokens=10)
    bounded.add_sequence(list(range(8)))
    bounded.add_sequence(list(range(100, 104)))  # 12 > 10: the oldest sequence goes
    assert len(bounded) == 4
    assert bounded.continuation([0, 1], 2).tokens == ()
    assert bounded.continuation([100, 101], 2).tokens == (102, 103)


def test_candidates_are_what_followed_each_occurrence_of_the_longest_match():
    index = SuffixIndex()
    index.add_sequence([1, 2, 3, 9, 1, 2, 4, 1, 2, 3])
    index.add_sequence([1, 2])
    assert index.candidates([7, 1, 2], 2) == [(3, 9), (4, 1), (3,)]  # the first sequence ends after 3; [1, 2] alone has no continuation
    assert index.candidates([5], 2) == []
