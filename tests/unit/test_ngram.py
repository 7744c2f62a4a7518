from specdec.drafters.ngram import NgramIndex, find_ngram_continuation


def test_docstring_example():
    assert find_ngram_continuation([1, 2, 3, 9, 1, 2], k=2, max_ngram=2) == (3, 9)


def test_prefers_longest_ngram_then_most_recent_match():
    # suffix (7, 1, 2): only the 3-gram at index 4 matches (-> 5); the 2-gram (1, 2) alone
    # would match more recently at index 8 (-> 6).
    context = [0, 1, 2, 4, 7, 1, 2, 5, 1, 2, 6, 7, 1, 2]
    assert find_ngram_continuation(context, k=1, max_ngram=3) == (5,)
    assert find_ngram_continuation(context, k=1, max_ngram=2) == (6,)


def test_no_match_and_k_zero():
    assert find_ngram_continuation([1, 2, 3, 4], k=3) == ()
    assert find_ngram_continuation([1, 1, 1], k=0) == ()


def test_continuation_is_truncated_at_the_end_of_context():
    assert find_ngram_continuation([5, 6, 5], k=4, max_ngram=1) == (6, 5)


def test_min_ngram_respected():
    assert find_ngram_continuation([1, 2, 3, 9, 1, 2], k=1, max_ngram=3, min_ngram=3) == ()


def test_the_incremental_index_answers_as_the_full_scan_while_the_context_grows():
    import numpy as np


    rng = np.random.default_rng(3)
    for max_ngram, min_ngram in ((3, 1), (2, 1), (3, 2), (1, 1)):
        index = NgramIndex(max_ngram, min_ngram)
        context = [int(t) for t in rng.integers(0, 4, 3)]  # a small alphabet: many matches
        for _ in range(120):
            for k in (1, 3):
                assert index.continuation(context, k) == find_ngram_continuation(context, k, max_ngram, min_ngram)
            context.extend(int(t) for t in rng.integers(0, 4, int(rng.integers(1, 4))))  # 1-3 tokens a round


def test_the_index_starts_afresh_for_another_or_rewritten_context():

    index = NgramIndex(max_ngram=2)
    first = [1, 2, 3, 9, 1, 2]
    assert index.continuation(first, 2) == (3, 9)
    other = [1, 2, 7, 1, 2]
    assert index.continuation(other, 1) == (7,)
    other[-1] = 5  # rewritten in place: its last token no longer matches what was indexed
    other.append(2)
    assert index.continuation(other, 1) == find_ngram_continuation(other, 1, 2)


def test_the_index_reports_the_length_of_the_match_behind_its_continuation():
    index = NgramIndex(max_ngram=4)
    assert index.match([5, 1, 2, 3, 9, 1, 2, 3], 2) == (3, (9, 1))  # the docstring's example
    assert index.match([5, 1, 2, 3, 9, 1, 2, 3, 7], 2) == (0, ())  # 7 never occurred before
    assert NgramIndex(max_ngram=2).match([5, 1, 2, 3, 9, 1, 2, 3], 2) == (2, (9, 1))  # capped at max_ngram
