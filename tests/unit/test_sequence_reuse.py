"""Prefix caching on a backend whose numbers depend on the batch a position was computed in:
prompts are processed in aligned chunks and only whole chunks (or the very same prompt) are
reused, so a request's output never depends on what its slot held before."""
from specdec.backends.base import aligned_chunks
from specdec.backends.fake import FakeBackend
from specdec.backends.sequence import CachedSequence
from specdec.engine.engine import Engine
from specdec.types import GenerationRequest, SpecConfig


class ChunkedFakeBackend(FakeBackend):
    prefill_alignment = 4


def test_aligned_chunks_end_on_multiples_of_the_alignment():
    assert aligned_chunks(128, 150, 64) == [(0, 64), (64, 64), (128, 22)]
    assert aligned_chunks(4, 9, 4) == [(0, 4), (4, 4), (8, 1)]
    assert aligned_chunks(6, 1, 4) == [(0, 1)]
    assert aligned_chunks(0, 0, 4) == []
    assert aligned_chunks(3, 10, 1) == [(0, 10)]


def test_only_whole_prompt_chunks_are_reused():
    sequence = CachedSequence(ChunkedFakeBackend(), aligned_reuse=True)
    prompt = list(range(10, 21))  # 11 tokens: chunks [0, 4), [4, 8) and a partial [8, 11)
    assert sequence.prefill(prompt) == 0
    assert sequence.reusable_prefix(prompt) == 11  # the very same prompt: all of it
    assert sequence.reusable_prefix(prompt + [99]) == 8  # longer: the partial chunk is recomputed
    assert sequence.reusable_prefix(prompt[:6] + [77]) == 4  # diverges inside the second chunk
    sequence.extend([21, 22])  # decode steps are never reusable by another prompt
    assert sequence.reusable_prefix(prompt + [21, 22, 23]) == 8
    sequence.truncate(9)  # cuts into the partial chunk: it no longer serves even its own prompt
    assert sequence.reusable_prefix(prompt) == 8


def test_without_alignment_every_common_token_is_reused():
    sequence = CachedSequence(FakeBackend(), aligned_reuse=True)
    sequence.prefill([1, 2, 3, 4, 5])
    sequence.extend([6])
    assert sequence.reusable_prefix([1, 2, 3, 4, 5, 6, 7]) == 6


def test_engine_core_prefill_chunks_stop_on_chunk_boundaries():
    backend = ChunkedFakeBackend()
    engine = Engine(backend, n_slots=1)
    prompt = tuple(range(30, 50))
    request = GenerationRequest(prompt, 4, spec=SpecConfig("off", 0))
    reference = Engine(ChunkedFakeBackend(), n_slots=1).generate(request)
    # A budget of 6 prompt tokens a step: every prefill call must start on a chunk boundary.
    core = engine.core
    core.add(request)
    starts, tokens, finished = [], [], False
    while not finished:
        starts.append(len(engine.slots[0].target.tokens))
        for _, item in core.step(prefill_budget=6):
            tokens += getattr(item, "token_ids", [])
            finished = finished or getattr(item, "finish_reason", None) is not None
    prompt_starts = [start for start in starts if start < len(prompt) - 1]
    assert all(start % 4 == 0 for start in prompt_starts)
    assert len(prompt_starts) > 1
    prefill_calls = [n for seq, n in backend.eval_calls]
    assert all(n % 4 == 0 for n in prefill_calls[:len(prompt_starts) - 1])
    assert tokens == reference.token_ids
