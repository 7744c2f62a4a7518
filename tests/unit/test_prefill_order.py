"""The order prompts are processed in (engine/core.py, _prefill): the fewest tokens left first,
whatever order the requests came in, and a prompt passed over PREFILL_PATIENCE steps goes first."""
from specdec.backends.fake import FakeBackend
from specdec.engine.core import PREFILL_PATIENCE, Started
from specdec.engine.engine import Engine
from specdec.types import GenerationRequest, SpecConfig


def request(length, start=1000, max_tokens=4):
    return GenerationRequest(tuple(range(start, start + length)), max_tokens, spec=SpecConfig("off", 0))


def alone(req):
    return Engine(FakeBackend(seed=5), n_slots=1).generate(req).token_ids


def test_a_short_prompt_after_a_long_one_gets_its_first_token_first_and_both_texts_stay_exact():
    engine = Engine(FakeBackend(seed=5), n_slots=2)
    core = engine.core
    long, short = request(300), request(12, start=2000)
    long_handle, short_handle = core.add(long), core.add(short)
    tokens: dict[int, list[int]] = {long_handle: [], short_handle: []}
    started_at: dict[int, int] = {}
    step = 0
    while len(started_at) < 2 or any(len(t) < 4 for t in tokens.values()):
        step += 1
        for handle, item in core.step(prefill_budget=64):
            if isinstance(item, Started):
                started_at[handle] = step
            tokens[handle] += getattr(item, "token_ids", [])
    assert started_at[short_handle] == 1  # in admission order it would wait for the long prompt's five steps
    assert started_at[long_handle] == 5  # 299 tokens at 64 a step, the short prompt's 11 among the first
    assert tokens[long_handle] == alone(long) and tokens[short_handle] == alone(short)


def test_a_long_prompt_passed_over_by_short_ones_goes_first_after_its_patience():
    backend = FakeBackend(seed=5)
    engine = Engine(backend, n_slots=3)
    core = engine.core
    core.add(request(200))  # slot 0, sequence 0
    long_rows = []
    for step in range(PREFILL_PATIENCE + 1):
        if core.free_slots:  # a new short prompt every step, each wanting the whole budget
            core.add(request(17, start=3000 + 100 * step, max_tokens=1))
        core.step(prefill_budget=16)
        long_rows.append(sum(n for seq, n in backend.eval_calls if seq == 0))
    assert long_rows[:PREFILL_PATIENCE] == [0] * PREFILL_PATIENCE
    assert long_rows[PREFILL_PATIENCE] == 16
