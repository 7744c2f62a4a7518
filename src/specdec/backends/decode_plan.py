"""Which rows go into which llama_decode call: a pure function of the requests and a library's
measured kernel rules (bindings/base.py KernelRules), so that the rules are testable without a model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specdec.backends.base import aligned_chunks
from specdec.backends.bindings.base import KernelRules


@dataclass(frozen=True)
class Row:
    request: int  # index of the (seq_id, start, tokens) request this row evaluates
    seq_id: int
    position: int
    token: int
    pad: bool = False  # fills a call up to the rules' min_rows: its logits are dropped, its cell removed


def plan_calls(requests: Sequence[tuple[int, int, Sequence[int]]], *, prefill: bool, rules: KernelRules,
               capacity: int) -> list[list[Row]]:
    """The rows of each llama_decode call, in order, that evaluate every (seq_id, start, tokens).

    Exact prompt processing (prefill_alignment > 1) runs each sequence alone, in chunks aligned to
    the rules' alignment; other evaluations pack rows of several sequences into one call unless
    each sequence has a context of its own. No call holds more than `capacity` rows (the batch's
    size), nor more than max_decode_rows when logits are wanted.

    Example: requests [(0, 10, [a, b, c, d]), (1, 3, [e, f])], max_decode_rows 3, one shared
    context -> [[0@10 a, 0@11 b, 0@12 c], [0@13 d, 1@3 e, 1@4 f]] (seq@position token).

    A call shorter than min_rows is padded with its last row's token at the next positions of
    that row's sequence: min_rows 2, [(0, 10, [a])] -> [[0@10 a, 0@11 a (pad)]].
    """
    return [pad_call(call, rules.min_rows) for call in _unpadded_calls(requests, prefill, rules, capacity)]


def pad_call(call: list[Row], min_rows: int) -> list[Row]:
    last = call[-1]
    return call + [Row(last.request, last.seq_id, last.position + offset, last.token, pad=True)
                   for offset in range(1, min_rows - len(call) + 1)]


def _unpadded_calls(requests, prefill: bool, rules: KernelRules, capacity: int) -> list[list[Row]]:
    rows = [[Row(index, seq_id, start + offset, int(token)) for offset, token in enumerate(tokens)]
            for index, (seq_id, start, tokens) in enumerate(requests)]
    if prefill and rules.prefill_alignment > 1:
        alignment = rules.prefill_alignment
        size = max(alignment, min(rules.max_prefill_rows or capacity, capacity) // alignment * alignment)
        calls = []
        for (_, start, tokens), sequence_rows in zip(requests, rows):
            calls += [sequence_rows[offset:offset + length]
                      for offset, length in aligned_chunks(start, len(tokens), rules.prefill_alignment, size)]
        return calls
    size = capacity if prefill else min(rules.max_decode_rows or capacity, capacity)
    groups = rows if rules.context_per_sequence else [[row for sequence_rows in rows for row in sequence_rows]]
    return [group[i:i + size] for group in groups for i in range(0, len(group), size)]
