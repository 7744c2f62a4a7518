"""Prompt starts parked in the KV cache when their slot moves on (engine/prompt_cache.py): a
conversation whose slot another took is restored from its parked start and processes only the
rest; per tenant; parked starts give way to sequences that need cells, least recently used first.
Texts stay those of each request served alone; the server reports restored starts."""
import httpx
from test_server_scheduling import metric
from test_shared_prompts import BLOCK, alone, run_together

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import GenerationRequest, SpecConfig

CONVERSATION_A = tuple(range(40, 90))  # 50 tokens: six whole blocks of 8
CONVERSATION_B = tuple(range(100, 150))


def parking_engine(n_slots=1, parked=4, **kwargs):
    backend = FakeBackend(seed=5, prefix_share_block=BLOCK, parked_sequences=parked, **kwargs)
    return Engine(backend, n_slots=n_slots)


def turn(prompt, tenant="alice", max_tokens=10, method="ngram"):
    return GenerationRequest(tuple(prompt), max_tokens, spec=SpecConfig(method, 3), tenant=tenant)


def prompt_rows(backend, seq_id=0):
    return sum(n for seq, n in backend.eval_calls if seq == seq_id and n > 1)


def test_a_conversation_whose_slot_was_taken_is_restored_from_its_parked_start():
    engine = parking_engine()
    (answer, _), = run_together(engine, [turn(CONVERSATION_A)])
    run_together(engine, [turn(CONVERSATION_B)])  # the one slot moves to another conversation
    assert len(engine.prompt_cache) == 1
    second = turn(CONVERSATION_A + tuple(answer) + (7, 8, 9), method="off")  # multi-row calls: its prompt
    engine.target.eval_calls.clear()
    (tokens, stats), = run_together(engine, [second])
    # Conversation A's whole blocks, its answer's too (the fake computes every position exactly;
    # on llama.cpp only whole prompt chunks are shared): 56 of 62, not processed again.
    assert stats["cached_prompt_tokens"] == 56
    assert tokens == alone(second)
    assert prompt_rows(engine.target) < len(second.prompt_token_ids) - 56 + BLOCK
    assert engine.prompt_cache.stats.hits == 1 and engine.prompt_cache.stats.tokens_restored == 56


def test_without_parking_the_same_turn_is_processed_from_its_first_token():
    engine = parking_engine(parked=0)
    assert engine.prompt_cache is None
    (answer, _), = run_together(engine, [turn(CONVERSATION_A)])
    run_together(engine, [turn(CONVERSATION_B)])
    (_, stats), = run_together(engine, [turn(CONVERSATION_A + tuple(answer) + (7, 8, 9))])
    assert stats["cached_prompt_tokens"] == 0


def test_a_parked_start_serves_its_own_tenant_only():
    engine = parking_engine()
    run_together(engine, [turn(CONVERSATION_A, tenant="alice")])
    run_together(engine, [turn(CONVERSATION_B, tenant="alice")])
    request = turn(CONVERSATION_A + (7,), tenant="bob")
    (tokens, stats), = run_together(engine, [request])
    assert stats["cached_prompt_tokens"] == 0 and tokens == alone(request)


def test_the_next_turn_on_the_same_slot_parks_nothing():
    engine = parking_engine()
    (answer, _), = run_together(engine, [turn(CONVERSATION_A)])
    (_, stats), = run_together(engine, [turn(CONVERSATION_A + tuple(answer) + (7,))])
    assert len(engine.prompt_cache) == 0 and stats["cached_prompt_tokens"] >= 48


def test_parked_starts_give_way_to_a_sequence_that_needs_cells_and_it_stays_exact():
    # One slot of 160 positions: 20 blocks. Conversations A and B parked hold 7 blocks each, so a
    # prompt of 40 and an answer of 70 (14 blocks) find room only once they are dropped.
    engine = parking_engine(n_ctx=160, max_sequences=1)
    run_together(engine, [turn(CONVERSATION_A)])
    run_together(engine, [turn(CONVERSATION_B)])
    run_together(engine, [turn(range(200, 210))])  # B parked too
    assert len(engine.prompt_cache) == 2
    long = turn(range(300, 340), max_tokens=70, method="off")
    (tokens, stats), = run_together(engine, [long])
    assert tokens == alone(long) and stats["generated_tokens"] == 70
    assert engine.prompt_cache.stats.evicted >= 1


def test_the_parked_start_a_request_adopts_is_spared_while_the_others_make_room_above_it():
    # One slot of 160 positions: 20 blocks. Parked: A in blocks 0..6 (the oldest), B in 7..13, then
    # C in 14..15 when A's next turn takes the slot. That turn, with 90 tokens to answer, needs 12
    # blocks above A's start: there only once B and C are dropped, A kept.
    engine = parking_engine(n_ctx=160, max_sequences=1)
    (answer, _), = run_together(engine, [turn(CONVERSATION_A)])
    run_together(engine, [turn(CONVERSATION_B)])
    run_together(engine, [turn(range(200, 210))])
    next_turn = turn(CONVERSATION_A + tuple(answer) + (7, 8, 9), max_tokens=90, method="off")
    (tokens, stats), = run_together(engine, [next_turn])
    assert stats["cached_prompt_tokens"] == 56 and tokens == alone(next_turn)
    assert engine.prompt_cache.stats.evicted == 2 and engine.prompt_cache.stats.hits == 1
    (kept,) = engine.prompt_cache._entries
    assert kept.sequence.tokens[:len(CONVERSATION_A)] == list(CONVERSATION_A)


def test_the_least_recently_used_start_goes_when_every_spare_id_is_taken():
    engine = parking_engine(parked=2)
    starts = [tuple(range(base, base + 20)) for base in (40, 100, 160, 220)]
    for start in starts:
        run_together(engine, [turn(start, max_tokens=2)])
    assert len(engine.prompt_cache) == 2 and engine.prompt_cache.stats.evicted == 1
    held = sorted(entry.sequence.tokens[0] for entry in engine.prompt_cache._entries)
    assert held == [100, 160]  # 40 went first; 220 is still in the slot


def test_the_server_reports_a_restored_start_in_usage_and_metrics():
    engine = Engine(FakeBackend(seed=5, prefix_share_block=BLOCK, parked_sequences=4), n_slots=1)
    app = create_app(engine, ServerConfig(served_model_name="fake", spec=SpecConfig("off", 0)))
    conversation_a, conversation_b = "the cat sat on the mat " * 8, "a dog ran in the park " * 8

    def complete(url, prompt):
        body = {"model": "fake", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        return httpx.post(url + "/v1/completions", json=body, timeout=30).json()

    with serve_in_thread(app) as (url, _):
        complete(url, conversation_a)
        complete(url, conversation_b)  # the one slot moves on: A's start is parked
        assert metric(url, "specdec:parked_prompts") == 1 and metric(url, "specdec:parked_prompt_tokens") >= BLOCK
        again = complete(url, conversation_a + "and then")
        restored = metric(url, "specdec:prompt_cache_restored_tokens_total")
        assert metric(url, "specdec:prompt_cache_hits_total") == 1 and restored >= BLOCK
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == restored
