"""The llama.cpp family's call planning (backends/decode_plan.py) and aligned prompt chunks
(backends/base.py), on hand-worked cases and as properties over many request shapes."""
import random

import pytest

from specdec.backends.base import aligned_chunks
from specdec.backends.bindings import ik_llama, llama_cpp_python
from specdec.backends.bindings.base import KernelRules
from specdec.backends.decode_plan import Row, plan_calls

SHARED = KernelRules(max_decode_rows=3, prefill_alignment=64, max_prefill_rows=64, flash_attn=True)
PER_SEQUENCE = KernelRules(max_decode_rows=31, prefill_alignment=64, flash_attn=False, context_per_sequence=True)
ANY = KernelRules(max_decode_rows=None, prefill_alignment=1, flash_attn=True)


def shape(calls):
    """[[(seq_id, position), ...] per call]."""
    return [[(row.seq_id, row.position) for row in call] for call in calls]


def test_aligned_chunks_on_hand_worked_cases():
    assert aligned_chunks(128, 150, 64) == [(0, 64), (64, 64), (128, 22)]
    assert aligned_chunks(100, 150, 64) == [(0, 28), (28, 64), (92, 58)]
    assert aligned_chunks(128, 150, 64, max_rows=128) == [(0, 128), (128, 22)]
    assert aligned_chunks(0, 700, 64, max_rows=512) == [(0, 512), (512, 188)]
    assert aligned_chunks(0, 1000, 1, max_rows=512) == [(0, 512), (512, 488)]
    assert aligned_chunks(5, 10, 1) == [(0, 10)]
    assert aligned_chunks(5, 0, 64) == []
    with pytest.raises(ValueError):
        aligned_chunks(0, 100, 64, max_rows=100)


@pytest.mark.parametrize("max_rows", [None, 64, 128, 512])
def test_aligned_chunks_end_on_boundaries_and_a_cached_prefix_of_whole_chunks_changes_nothing(max_rows):
    """Every chunk but the last ends at a multiple of 64 and holds at most max_rows rows; with
    chunks of at most 64 rows (mainline's rule), processing a prompt from a cached 64-multiple
    gives exactly the chunks that processing it from scratch gives beyond that point."""
    rng = random.Random(3)
    for _ in range(300):
        length = rng.randrange(1, 2000)
        chunks = aligned_chunks(0, length, 64, max_rows)
        assert sum(n for _, n in chunks) == length
        assert all((offset + n) % 64 == 0 for offset, n in chunks[:-1])
        assert all(n <= (max_rows or 64) for _, n in chunks)
        cached = rng.randrange(0, length + 1) // 64 * 64
        resumed = [(cached + offset, n) for offset, n in aligned_chunks(cached, length - cached, 64, max_rows)]
        if max_rows in (None, 64):
            assert resumed == [(offset, n) for offset, n in chunks if offset >= cached]


def test_exact_decode_on_a_shared_context_packs_sequences_in_pieces_of_at_most_three_rows():
    calls = plan_calls([(0, 10, [1, 2, 3, 4]), (1, 3, [5, 6])], prefill=False, rules=SHARED, capacity=512)
    assert shape(calls) == [[(0, 10), (0, 11), (0, 12)], [(0, 13), (1, 3), (1, 4)]]
    assert calls[1][1] == Row(request=1, seq_id=1, position=3, token=5)


def test_a_context_per_sequence_never_mixes_sequences_in_one_call():
    requests = [(0, 10, list(range(40))), (2, 3, [5, 6]), (1, 0, [7])]
    calls = plan_calls(requests, prefill=False, rules=PER_SEQUENCE, capacity=512)
    assert [len(call) for call in calls] == [31, 9, 2, 1]
    assert all(len({row.seq_id for row in call}) == 1 for call in calls)
    assert [row.token for call in calls for row in call] == [*range(40), 5, 6, 7]  # order kept


def test_exact_prefill_runs_each_sequence_alone_in_aligned_chunks():
    calls = plan_calls([(0, 100, list(range(150))), (1, 0, list(range(70)))], prefill=True, rules=SHARED, capacity=512)
    assert [(call[0].seq_id, call[0].position, len(call)) for call in calls] == \
        [(0, 100, 28), (0, 128, 64), (0, 192, 58), (1, 0, 64), (1, 64, 6)]
    per_sequence = plan_calls([(3, 0, list(range(700)))], prefill=True, rules=PER_SEQUENCE, capacity=512)
    assert [len(call) for call in per_sequence] == [512, 188]  # no max_prefill_rows: aligned chunks up to the batch


def test_calls_shorter_than_min_rows_are_padded_at_the_next_positions_of_their_last_sequence():
    rules = ik_llama.REPACKED_EXACT_RULES
    assert rules.min_rows == 2
    (call,) = plan_calls([(3, 10, [42])], prefill=False, rules=rules, capacity=512)
    assert call == [Row(0, 3, 10, 42), Row(0, 3, 11, 42, pad=True)]
    two = plan_calls([(3, 10, [42, 43])], prefill=False, rules=rules, capacity=512)
    assert not any(row.pad for row in two[0])
    # a prompt whose aligned chunks leave one row at either end: those chunks get a pad each
    chunks = plan_calls([(0, 63, list(range(66)))], prefill=True, rules=rules, capacity=512)
    assert [(len(call), sum(row.pad for row in call)) for call in chunks] == [(2, 1), (64, 0), (2, 1)]
    assert [row.position for row in chunks[0]] == [63, 64] and [row.position for row in chunks[2]] == [128, 129]


def test_inexact_calls_fill_the_batch():
    requests = [(0, 0, list(range(600))), (1, 0, list(range(100)))]
    assert [len(call) for call in plan_calls(requests, prefill=True, rules=ANY, capacity=512)] == [512, 188]
    assert [len(call) for call in plan_calls(requests, prefill=False, rules=ANY, capacity=256)] == [256, 256, 188]


def test_every_row_is_planned_once_in_order_within_each_request():
    rng = random.Random(7)
    for rules in (SHARED, PER_SEQUENCE, ANY, llama_cpp_python.EXACT_RULES, ik_llama.EXACT_RULES, ik_llama.INEXACT_RULES,
                  ik_llama.REPACKED_EXACT_RULES):
        for prefill in (False, True):
            requests = [(seq, rng.randrange(0, 300), [rng.randrange(100) for _ in range(rng.randrange(0, 90))])
                        for seq in rng.sample(range(8), rng.randrange(1, 5))]
            calls = plan_calls(requests, prefill=prefill, rules=rules, capacity=128)
            assert all(rules.min_rows <= len(call) <= 128 for call in calls)
            if not prefill and rules.max_decode_rows:
                assert all(len(call) <= max(rules.max_decode_rows, rules.min_rows) for call in calls)
            for call in calls:  # pads only close a call, after a real row of their own sequence
                real = [row for row in call if not row.pad]
                assert real and call[:len(real)] == real
                assert all(pad.seq_id == real[-1].seq_id and pad.position == real[-1].position + i + 1
                           for i, pad in enumerate(call[len(real):]))
            for index, (seq_id, start, tokens) in enumerate(requests):
                rows = [row for call in calls for row in call if row.request == index and not row.pad]
                assert [(row.seq_id, row.position, row.token) for row in rows] == \
                    [(seq_id, start + i, token) for i, token in enumerate(tokens)]
