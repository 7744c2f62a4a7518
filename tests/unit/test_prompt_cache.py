"""Prompt starts parked in the KV cache when their slot moves on (engine/prompt_cache.py): a
conversation whose slot another took is restored from its parked start and processes only the
rest; per tenant; parked starts give way to sequences that need cells, least recently used first.
Texts stay those of each request served alone; the server reports restored starts."""
import httpx
from test_server_scheduling import metric
from test_shared_prompts import BLOCK, alone, run_together

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine, EngineConfig
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


def assert_next_turn_restored_as_resident(engine, answer):
    """Conversation A's next turn on `engine` restores all the slot held of A and its answer, its
    last block in part (the fake computes every position exactly): 59 of 62, as the slot itself
    would have kept, not processed again; the text as served alone."""
    second = turn(CONVERSATION_A + tuple(answer) + (7, 8, 9), method="off")  # multi-row calls: its prompt
    engine.target.eval_calls.clear()
    (tokens, stats), = run_together(engine, [second])
    resident = parking_engine()
    run_together(resident, [turn(CONVERSATION_A)])
    (_, kept), = run_together(resident, [second])
    assert stats["cached_prompt_tokens"] == kept["cached_prompt_tokens"] == 59
    assert tokens == alone(second)
    assert prompt_rows(engine.target) == len(second.prompt_token_ids) - 1 - 59


def test_a_conversation_whose_slot_was_taken_is_restored_from_its_parked_start():
    engine = parking_engine()
    (answer, _), = run_together(engine, [turn(CONVERSATION_A)])
    run_together(engine, [turn(CONVERSATION_B)])  # the one slot moves to another conversation
    assert len(engine.prompt_cache) == 1
    assert_next_turn_restored_as_resident(engine, answer)
    assert engine.prompt_cache.stats.hits == 1 and engine.prompt_cache.stats.tokens_restored == 59


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
    # One slot of 160 positions: 20 blocks. Parked: A in blocks 0..7 (the oldest, the last in
    # part), B in 8..15, then C in 16..18 when A's next turn takes the slot. That turn, with 90
    # tokens to answer, needs 12 blocks above A's start: there only once B and C are dropped, A kept.
    engine = parking_engine(n_ctx=160, max_sequences=1)
    (answer, _), = run_together(engine, [turn(CONVERSATION_A)])
    run_together(engine, [turn(CONVERSATION_B)])
    run_together(engine, [turn(range(200, 210))])
    next_turn = turn(CONVERSATION_A + tuple(answer) + (7, 8, 9), max_tokens=90, method="off")
    (tokens, stats), = run_together(engine, [next_turn])
    assert stats["cached_prompt_tokens"] == 59 and tokens == alone(next_turn)
    assert engine.prompt_cache.stats.evicted == 2 and engine.prompt_cache.stats.hits == 1
    assert len(engine.prompt_cache) == 0  # A taken whole: the slot holds it, to park it again
    assert engine.slots[0].target.tokens[:len(CONVERSATION_A)] == list(CONVERSATION_A)


def test_a_conversation_taken_back_below_others_moves_into_blocks_that_lie_together():
    # Three conversations in turn on one slot of 320 positions (40 blocks). A's next turn takes
    # its parked blocks back (0..7), below B's and C's: its attention would read past theirs at
    # every step, so its cells move into a free run above them, its answer's room after them.
    engine = parking_engine(n_ctx=320, max_sequences=1, cell_bytes=16)
    answers = []
    for conversation in (CONVERSATION_A, CONVERSATION_B, tuple(range(200, 250))):
        (answer, _), = run_together(engine, [turn(conversation)])
        answers.append(answer)
    assert engine.target.gathers == []  # each first turn took free blocks above the others
    next_turn = turn(CONVERSATION_A + tuple(answers[0]) + (7, 8, 9), max_tokens=40, method="off")
    (tokens, stats), = run_together(engine, [next_turn])
    assert stats["cached_prompt_tokens"] == 59 and tokens == alone(next_turn)
    assert engine.target.gathers == [(0, 59)] and engine.prompt_cache.stats.gathered == 1
    held = engine.target.blocks_of(0)
    assert held[0] >= 24 and held == list(range(held[0], held[0] + len(held)))


def test_the_server_reports_a_conversation_moved_into_blocks_that_lie_together():
    backend = FakeBackend(seed=5, prefix_share_block=BLOCK, parked_sequences=4, cell_bytes=16, n_ctx=640, max_sequences=1)
    app = create_app(Engine(backend, n_slots=1), ServerConfig(served_model_name="fake", spec=SpecConfig("off", 0)))
    conversations = ["the cat sat on the mat " * 8, "a dog ran in the park " * 8, "on the mat the cat " * 8]

    def complete(url, prompt, max_tokens=4):
        body = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return httpx.post(url + "/v1/completions", json=body, timeout=30).json()

    with serve_in_thread(app) as (url, _):
        answers = [complete(url, prompt)["choices"][0]["text"] for prompt in conversations]
        assert metric(url, "specdec:prompt_cache_gathered_total") == 0
        # The conversation goes on below the two others, with an answer that needs blocks past its own.
        again = complete(url, conversations[0] + answers[0] + "and then", max_tokens=40)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK
        assert metric(url, "specdec:prompt_cache_gathered_total") == 1 and backend.gathers


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


# On llama.cpp only positions computed in whole prompt chunks are reused (backends/sequence.py):
# a fake with chunks of 4 and blocks of 8 leaves a conversation's reusable start inside a block.
class ChunkedFake(FakeBackend):
    prefill_alignment = 4


CONVERSATION_C = tuple(range(40, 86))  # 46 tokens: its 45-token prefix in whole chunks up to 44, in block 5


def chunked_engine(**kwargs):
    return Engine(ChunkedFake(seed=5, prefix_share_block=BLOCK, parked_sequences=4, **kwargs), n_slots=1)


def resident_cached_tokens(first, second):
    """cached_prompt_tokens of `second` served right after `first`, in the same slot."""
    engine = chunked_engine()
    run_together(engine, [first])
    (_, stats), = run_together(engine, [second])
    return stats["cached_prompt_tokens"]


def test_a_restored_start_brings_back_what_the_slot_would_have_kept_its_last_block_in_part():
    engine = chunked_engine()
    first = turn(CONVERSATION_C)
    (answer, _), = run_together(engine, [first])
    run_together(engine, [turn(CONVERSATION_B)])
    second = turn(CONVERSATION_C + tuple(answer) + (7, 8, 9), method="off")
    (tokens, stats), = run_together(engine, [second])
    assert stats["cached_prompt_tokens"] == resident_cached_tokens(first, second) == 44  # not 40: block 5 too
    assert tokens == alone(second)
    held = [entry.sequence.tokens[:1] for entry in engine.prompt_cache._entries]
    assert [CONVERSATION_C[0]] not in held  # C's start was taken whole: the slot holds it alone


def test_the_very_same_prompt_again_is_restored_whole_as_its_slot_would_have_kept_it():
    engine = chunked_engine()
    first = turn(CONVERSATION_C, max_tokens=4)
    run_together(engine, [first])
    run_together(engine, [turn(CONVERSATION_B)])
    (tokens, stats), = run_together(engine, [first])
    assert stats["cached_prompt_tokens"] == resident_cached_tokens(first, first) == len(CONVERSATION_C) - 1
    assert tokens == alone(first)


def test_a_prompt_diverging_inside_a_parked_start_takes_its_whole_blocks_and_leaves_it_whole():
    engine = chunked_engine()
    first = turn(CONVERSATION_C)
    (answer, _), = run_together(engine, [first])
    run_together(engine, [turn(CONVERSATION_B)])
    edited = turn(CONVERSATION_C[:30] + (7,) * 20, method="off")  # diverges at 30, in block 3
    (tokens, stats), = run_together(engine, [edited])
    assert stats["cached_prompt_tokens"] == 24 and tokens == alone(edited)  # blocks 0..2, shared
    assert any(entry.sequence.tokens == list(CONVERSATION_C[:45]) for entry in engine.prompt_cache._entries)
    second = turn(CONVERSATION_C + tuple(answer) + (7, 8, 9), method="off")
    (tokens, stats), = run_together(engine, [second])
    assert stats["cached_prompt_tokens"] == 44 and tokens == alone(second)


def test_a_slot_keeping_a_common_start_for_its_next_request_parks_the_rest_and_both_stay_exact():
    # The slot holds C; the next request shares C's first 30 tokens (a system prompt): it keeps
    # the whole blocks of them it shares with the parked start (0..2), C's start is parked whole,
    # and C's next turn restores all of it.
    engine = chunked_engine()
    first = turn(CONVERSATION_C)
    (answer, _), = run_together(engine, [first])
    sharing = turn(CONVERSATION_C[:30] + (7,) * 20, method="off")
    (tokens, stats), = run_together(engine, [sharing])
    assert stats["cached_prompt_tokens"] == 24 and tokens == alone(sharing)
    assert len(engine.prompt_cache) == 1
    second = turn(CONVERSATION_C + tuple(answer) + (7, 8, 9), method="off")
    (tokens, stats), = run_together(engine, [second])
    assert stats["cached_prompt_tokens"] == 44 and tokens == alone(second)


def test_a_start_shorter_than_a_block_is_parked_and_restored():
    engine = chunked_engine()
    first = turn(CONVERSATION_C[:7])  # 6 prompt positions: whole chunks up to 4
    (answer, _), = run_together(engine, [first])
    run_together(engine, [turn(CONVERSATION_B)])
    second = turn(CONVERSATION_C[:7] + tuple(answer) + (7, 8, 9), method="off")
    (tokens, stats), = run_together(engine, [second])
    assert stats["cached_prompt_tokens"] == resident_cached_tokens(first, second) == 4
    assert tokens == alone(second)


# -- copies in host memory --------------------------------------------------------------------------
# A fake whose cells copy out (cell_bytes) and one spare id: the second parked start makes the
# first give way, copied to host memory.
def host_engine(cache_ram_mib=None, cell_bytes=16, parked=1):
    backend = FakeBackend(seed=5, prefix_share_block=BLOCK, parked_sequences=parked, cell_bytes=cell_bytes)
    return Engine(backend, n_slots=1, config=EngineConfig(cache_ram_mib=cache_ram_mib))


def test_a_start_that_gave_way_is_loaded_back_from_host_memory():
    engine = host_engine()
    (answer, _), = run_together(engine, [turn(CONVERSATION_A)])
    run_together(engine, [turn(CONVERSATION_B)])  # A parked
    run_together(engine, [turn(range(200, 230))])  # B parked: the one spare id is A's, so A gives way
    cache = engine.prompt_cache
    assert len(cache) == 1 and cache.saved_count == 1 and cache.stats.saved == 1
    assert cache.saved_bytes == 59 * 16
    assert_next_turn_restored_as_resident(engine, answer)
    assert engine.target.loads == [(0, 59)]
    assert cache.stats.host_hits == 1 and cache.stats.host_tokens_restored == 59
    # The copy stays for the conversation's later turns (B's joined it as A's turn took the slot).
    assert any(saved.sequence.tokens[:50] == CONVERSATION_A for saved in cache._saved)


def test_a_prompt_diverging_inside_a_copy_loads_the_start_they_share():
    engine = host_engine()
    run_together(engine, [turn(CONVERSATION_A)])
    run_together(engine, [turn(CONVERSATION_B)])
    run_together(engine, [turn(range(200, 230))])
    edited = turn(CONVERSATION_A[:30] + (7,) * 20, method="off")
    (tokens, stats), = run_together(engine, [edited])
    assert stats["cached_prompt_tokens"] == 30 and tokens == alone(edited)
    assert engine.target.loads == [(0, 30)]


def test_a_copy_serves_its_own_tenant_only():
    engine = host_engine()
    run_together(engine, [turn(CONVERSATION_A, tenant="alice")])
    run_together(engine, [turn(CONVERSATION_B, tenant="alice")])
    run_together(engine, [turn(range(200, 230), tenant="alice")])
    assert engine.prompt_cache.saved_count == 1
    request = turn(CONVERSATION_A + (7,), tenant="bob")
    (tokens, stats), = run_together(engine, [request])
    assert stats["cached_prompt_tokens"] == 0 and tokens == alone(request) and engine.target.loads == []


def test_copies_stay_within_their_bound_the_least_recently_used_going_first():
    # Cells of 16 KiB: a 50-token start's copy is about 0.8 MiB, so 2 MiB hold two.
    engine = host_engine(cache_ram_mib=2, cell_bytes=16 << 10)
    starts = [tuple(range(base, base + 50)) for base in (20, 80, 140, 200, 260)]
    for start in starts:
        run_together(engine, [turn(start, max_tokens=2)])
    cache = engine.prompt_cache
    # 260 in the slot, 200 parked; 20, 80 and 140 gave way in turn, and 20 was dropped for the bound.
    assert cache.stats.saved == 3 and cache.stats.host_evicted == 1 and cache.saved_count == 2
    assert cache.saved_bytes <= 2 << 20
    assert sorted(saved.sequence.tokens[0] for saved in cache._saved) == [80, 140]


def test_without_host_memory_a_start_that_gave_way_is_processed_again():
    engine = host_engine(cache_ram_mib=0)
    (answer, _), = run_together(engine, [turn(CONVERSATION_A)])
    run_together(engine, [turn(CONVERSATION_B)])
    run_together(engine, [turn(range(200, 230))])
    assert engine.prompt_cache.saved_count == 0 and engine.prompt_cache.stats.evicted == 1
    (_, stats), = run_together(engine, [turn(CONVERSATION_A + tuple(answer) + (7,))])
    assert stats["cached_prompt_tokens"] == 0


class FailingLoads(FakeBackend):
    """A fake whose copies in host memory never load (a library that refuses the cells back)."""

    def load_positions(self, seq_id, cells, length):
        super().load_positions(seq_id, cells, length)  # some cells written, then the failure
        raise RuntimeError("the library could not copy cells back")


def test_a_copy_that_does_not_load_is_dropped_and_the_prompt_processed_again():
    backend = FailingLoads(seed=5, prefix_share_block=BLOCK, parked_sequences=1, cell_bytes=16)
    engine = Engine(backend, n_slots=1)
    (answer, _), = run_together(engine, [turn(CONVERSATION_A)])
    run_together(engine, [turn(CONVERSATION_B)])
    run_together(engine, [turn(range(200, 230))])  # A gives way: copied to host memory
    cache = engine.prompt_cache
    assert cache.saved_count == 1
    second = turn(CONVERSATION_A + tuple(answer) + (7, 8, 9), method="off")
    (tokens, stats), = run_together(engine, [second])
    assert tokens == alone(second) and stats["cached_prompt_tokens"] == 0
    assert backend.loads == [(0, 59)]  # it was tried
    assert cache.stats.host_failed == 1 and cache.stats.host_hits == 0 and cache.stats.hits == 0
    assert not any(saved.sequence.tokens[:50] == CONVERSATION_A for saved in cache._saved)


def test_the_server_reports_copies_in_host_memory():
    backend = FakeBackend(seed=5, prefix_share_block=BLOCK, parked_sequences=1, cell_bytes=16)
    app = create_app(Engine(backend, n_slots=1), ServerConfig(served_model_name="fake", spec=SpecConfig("off", 0)))
    conversations = ["the cat sat on the mat " * 8, "a dog ran in the park " * 8, "on the mat the cat " * 8]

    def complete(url, prompt):
        body = {"model": "fake", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        return httpx.post(url + "/v1/completions", json=body, timeout=30).json()

    with serve_in_thread(app) as (url, _):
        for prompt in conversations:
            complete(url, prompt)
        held = metric(url, "specdec:prompt_cache_host_bytes")
        assert metric(url, "specdec:prompt_cache_host_prompts") == 1 and held >= BLOCK * 16
        again = complete(url, conversations[0] + "and then")
        loaded = metric(url, "specdec:prompt_cache_host_restored_tokens_total")
        assert metric(url, "specdec:prompt_cache_host_hits_total") == 1 and loaded >= BLOCK
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded


def test_the_draft_models_copy_of_a_conversation_comes_back_with_it():
    target = FakeBackend(seed=5, prefix_share_block=BLOCK, parked_sequences=1, cell_bytes=16)
    draft = FakeBackend(seed=5, cell_bytes=8)
    engine = Engine(target, draft, n_slots=1, config=EngineConfig(cache_ram_mib=4))
    copies = engine.draft_copies  # a quarter of --cache-ram
    assert copies is not None and copies.host_bytes == 1 << 20 and engine.prompt_cache.host_bytes == 3 << 20
    (answer, _), = run_together(engine, [turn(CONVERSATION_A, method="draft")])
    held = list(draft.cached_tokens(0))
    run_together(engine, [turn(CONVERSATION_B, method="draft")])  # the slot's draft sequence copied first
    assert copies.saved_count == 1 and copies._saved[0].sequence.tokens == tuple(held)
    assert draft.cached_tokens(0)[:50] == list(CONVERSATION_B)
    # Another tenant's conversation loads nothing of alice's.
    run_together(engine, [turn(CONVERSATION_A + tuple(answer), tenant="bob", method="draft")])
    assert draft.loads == []
    second = turn(CONVERSATION_A + tuple(answer) + (7, 8, 9), method="draft")
    draft.eval_calls.clear()
    (tokens, _), = run_together(engine, [second])
    loaded = copies.stats.host_tokens_restored
    assert draft.loads == [(0, loaded)] and loaded >= len(CONVERSATION_A)
    # The draft did not process the conversation again (it would be 62 rows), and the text is the
    # request's alone.
    assert prompt_rows(draft) < len(CONVERSATION_A) // 2
    assert tokens == Engine(FakeBackend(seed=5), FakeBackend(seed=5)).generate(second).token_ids



def test_the_server_reports_the_draft_models_copies():
    target = FakeBackend(seed=5, prefix_share_block=BLOCK, parked_sequences=1, cell_bytes=16)
    engine = Engine(target, FakeBackend(seed=5, cell_bytes=8), n_slots=1)
    app = create_app(engine, ServerConfig(served_model_name="fake", spec=SpecConfig("draft", 3)))
    conversations = ["the cat sat on the mat " * 8, "a dog ran in the park " * 8]

    def complete(prompt):
        body = {"model": "fake", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        return httpx.post(url + "/v1/completions", json=body, timeout=30).json()

    with serve_in_thread(app) as (url, _):
        for prompt in conversations:
            complete(prompt)
        assert metric(url, "specdec:prompt_cache_draft_host_bytes") > 0  # the first one's draft, copied
        assert metric(url, "specdec:prompt_cache_draft_host_hits_total") == 0
        complete(conversations[0] + "and then")
        assert metric(url, "specdec:prompt_cache_draft_host_hits_total") == 1
        assert metric(url, "specdec:prompt_cache_host_load_failures_total") == 0

# -- across restarts ---------------------------------------------------------------------------------
def kept_engine(folder, n_ctx=2048):
    backend = FakeBackend(seed=5, prefix_share_block=BLOCK, parked_sequences=1, cell_bytes=16, n_ctx=n_ctx)
    return Engine(backend, n_slots=1, config=EngineConfig(prompt_cache_dir=str(folder)))


def test_conversations_held_at_a_stop_are_loaded_by_the_next_start(tmp_path):
    engine = kept_engine(tmp_path)
    (answer, _), = run_together(engine, [turn(CONVERSATION_A)])
    run_together(engine, [turn(CONVERSATION_B, tenant="bob")])  # A parked, B in the slot
    assert engine.write_prompt_cache() == 2
    assert {path.stat().st_mode & 0o777 for path in engine.prompt_cache_folder.iterdir()} == {0o600}
    restarted = kept_engine(tmp_path)
    assert restarted.prompt_cache.saved_count == 2 and restarted.prompt_cache_folder == engine.prompt_cache_folder
    second = turn(CONVERSATION_A + tuple(answer) + (7, 8, 9), method="off")
    (tokens, stats), = run_together(restarted, [second])
    assert stats["cached_prompt_tokens"] == 59 and tokens == alone(second)
    assert restarted.target.loads == [(0, 59)]
    # Tenants stay apart: alice's start does not serve bob, bob's own does.
    (_, stats), = run_together(restarted, [turn(CONVERSATION_A + (7,), tenant="bob")])
    assert stats["cached_prompt_tokens"] == 0
    (tokens, stats), = run_together(restarted, [turn(CONVERSATION_B + (7,), tenant="bob", method="off")])
    assert stats["cached_prompt_tokens"] >= 48 and tokens == alone(turn(CONVERSATION_B + (7,), tenant="bob", method="off"))


def test_another_setup_reads_nothing_and_a_damaged_file_is_skipped(tmp_path):
    engine = kept_engine(tmp_path)
    run_together(engine, [turn(CONVERSATION_A)])
    run_together(engine, [turn(CONVERSATION_B)])
    engine.write_prompt_cache()
    other = kept_engine(tmp_path, n_ctx=1024)  # another context: another folder
    assert other.prompt_cache_folder != engine.prompt_cache_folder and other.prompt_cache.saved_count == 0
    first = sorted(engine.prompt_cache_folder.iterdir())[0]
    first.write_bytes(first.read_bytes()[:100])
    assert kept_engine(tmp_path).prompt_cache.saved_count == 1


def test_a_server_writes_its_conversations_when_it_stops_and_the_next_one_serves_them(tmp_path):
    prompt = "the cat sat on the mat " * 8

    def complete(url, text):
        body = {"model": "fake", "prompt": text, "max_tokens": 4, "temperature": 0}
        return httpx.post(url + "/v1/completions", json=body, timeout=30).json()

    def server():
        return serve_in_thread(create_app(kept_engine(tmp_path), ServerConfig(served_model_name="fake",
                                                                                spec=SpecConfig("off", 0))))

    with server() as (url, _):
        first = complete(url, prompt)
    with server() as (url, _):
        again = complete(url, prompt + first["choices"][0]["text"] + " and then")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK
        assert metric(url, "specdec:prompt_cache_host_hits_total") == 1
