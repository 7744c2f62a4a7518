"""Prompts processed once (engine/core.py): a request takes the start of its prompt that another
slot of the same tenant has computed, in whole blocks, where the backend shares cached positions;
a request whose prompt start an earlier one is still computing waits for it (the choices of an
n > 1 request). Texts stay those of each request served alone."""
from specdec.backends.fake import FakeBackend
from specdec.engine.core import Failed
from specdec.engine.engine import Engine
from specdec.types import GenerationRequest, SamplingParams, SpecConfig, SpecdecError

BLOCK = 8
SYSTEM = tuple(range(40, 90))  # 50 tokens: six whole blocks


def sharing_engine(n_slots=3, **kwargs):
    return Engine(FakeBackend(seed=5, prefix_share_block=BLOCK, **kwargs), n_slots=n_slots)


def req(tail=(), tenant="alice", method="ngram", max_tokens=12, **kwargs):
    return GenerationRequest(SYSTEM + tuple(tail), max_tokens, spec=SpecConfig(method, 3), tenant=tenant, **kwargs)


def run_together(engine, requests, one_a_step=False):
    """Requests added at once (`one_a_step`: one a step, each prompt processed in its own step, so
    their cells lie in that order) and stepped to their ends: each one's (tokens, stats)."""
    core = engine.core
    waiting = list(requests)
    handles = [core.add(waiting.pop(0)) for _ in range(1 if one_a_step else len(waiting))]
    tokens = {h: [] for h in handles}
    stats = {}
    while len(stats) < len(requests):
        for handle, item in core.step():
            if isinstance(item, Failed):
                raise item.error
            tokens[handle] += getattr(item, "token_ids", [])
            if getattr(item, "finish_reason", None) is not None:
                stats[handle] = item.stats
        if waiting:
            handles.append(core.add(waiting.pop(0)))
            tokens[handles[-1]] = []
    return [(tokens[h], stats[h]) for h in handles]


def alone(request):
    return Engine(FakeBackend(seed=5), n_slots=1).generate(request).token_ids


def prompt_rows(backend, seq_id):
    """Tokens the backend evaluated for a sequence in calls of more than one row (prompt chunks,
    under plain decoding)."""
    return sum(n for seq, n in backend.eval_calls if seq == seq_id and n > 1)


def test_choices_of_one_prompt_compute_it_once_and_get_their_own_texts():
    engine = sharing_engine()
    sampled = SamplingParams(temperature=0.9, seed=7)
    # Plain decoding: every call of more than one row is then prompt processing.
    requests = [req(method="off", sampling=sampled), req(method="off", sampling=SamplingParams(temperature=0.9, seed=8)),
                req(method="off")]
    results = run_together(engine, requests)
    for request, (tokens, stats) in zip(requests, results):
        assert tokens == alone(request)
    shared = len(SYSTEM) - 1 - (len(SYSTEM) - 1) % BLOCK  # 48: the whole blocks of the 49-token prefix
    assert [stats["cached_prompt_tokens"] for _, stats in results] == [0, shared, shared]
    assert [source for source, _, _ in engine.target.shared_prefixes] == [0, 0]
    assert prompt_rows(engine.target, 1) < BLOCK and prompt_rows(engine.target, 2) < BLOCK


def test_a_later_request_takes_the_prompt_start_an_idle_slot_holds():
    engine = sharing_engine(n_slots=2)
    run_together(engine, [req((1, 2, 3))])
    (_, first), (tokens, second) = run_together(engine, [req((1, 2, 3)), req((4, 5, 6, 7, 8, 9, 10, 11, 12))])
    assert first["cached_prompt_tokens"] == len(SYSTEM) + 2  # its own slot: the very same prompt
    assert second["cached_prompt_tokens"] == 48  # from the other slot, whole blocks
    assert tokens == alone(req((4, 5, 6, 7, 8, 9, 10, 11, 12)))


def test_another_tenants_prompt_is_never_shared():
    engine = sharing_engine(n_slots=2)
    (_, mine), (_, theirs) = run_together(engine, [req(tenant="alice"), req(tenant="bob")])
    assert mine["cached_prompt_tokens"] == theirs["cached_prompt_tokens"] == 0
    assert not engine.target.shared_prefixes


def test_a_slot_whose_prompt_start_is_shared_serves_a_new_prompt_and_the_sharer_stays_exact():
    engine = sharing_engine(n_slots=2)
    core = engine.core
    run_together(engine, [req((1, 2))])
    short, sharer = req((1, 2), max_tokens=3), req((3, 4), max_tokens=40)
    core.add(short)  # into the slot holding its prompt; the sharer into the other, taking its blocks
    sharing = core.add(sharer)
    # Once `short` is done, its slot gets a prompt diverging inside a shared block: it keeps only
    # the blocks before it and computes the rest in cells of its own, while the sharer goes on.
    diverging = GenerationRequest(SYSTEM[:20] + (7,) * 40, 12, spec=SpecConfig("ngram", 3), tenant="alice")
    tokens, stats, added = {sharing: []}, {}, None
    while len(stats) < 3:
        for handle, item in core.step():
            if isinstance(item, Failed):
                raise item.error
            tokens.setdefault(handle, []).extend(getattr(item, "token_ids", []))
            if getattr(item, "finish_reason", None) is not None:
                stats[handle] = item.stats
        if added is None and core.free_slots:
            added = core.add(diverging)
    assert engine.target.shared_prefixes == [(0, 1, 48)] or engine.target.shared_prefixes == [(1, 0, 48)]
    assert stats[sharing]["cached_prompt_tokens"] == 48
    assert tokens[sharing] == alone(sharer)
    assert stats[added]["cached_prompt_tokens"] == 16  # positions 0..15: the whole blocks before the cut
    assert tokens[added] == alone(diverging)


def test_without_sharing_each_slot_computes_its_own_prompt():
    engine = Engine(FakeBackend(seed=5), n_slots=2)
    results = run_together(engine, [req(method="off"), req(method="off")])
    assert [stats["cached_prompt_tokens"] for _, stats in results] == [0, 0]
    assert prompt_rows(engine.target, 1) >= len(SYSTEM) - 1


class NoRoomFor(FakeBackend):
    """A shared cache with no room left for one sequence's next positions (cell_blocks.py's error)."""

    def __init__(self, seq_id, **kwargs):
        super().__init__(**kwargs)
        self.full_for = seq_id

    def reserve(self, seq_id, end):
        if seq_id == self.full_for and end > len(SYSTEM) + 2:
            raise SpecdecError(f"the shared KV cache has no free block after sequence {seq_id}'s last one")


def test_a_sequence_the_cache_cannot_place_fails_alone_and_the_forward_goes_on():
    engine = Engine(NoRoomFor(1, seed=5), n_slots=2)
    core = engine.core
    kept, cut = core.add(req((1, 2, 3), method="off")), core.add(req((4, 5, 6), method="off"))
    tokens, outcome = [], {}
    while len(outcome) < 2:
        for handle, item in core.step():
            if isinstance(item, Failed):
                outcome[handle] = item.error
                continue
            if handle == kept:
                tokens += getattr(item, "token_ids", [])
            if getattr(item, "finish_reason", None) is not None:
                outcome[handle] = item.finish_reason
    assert outcome[kept] == "length" and tokens == alone(req((1, 2, 3), method="off"))
    assert isinstance(outcome[cut], SpecdecError) and "no free block" in str(outcome[cut])


def test_a_prompt_start_with_no_room_above_it_is_processed_from_scratch_in_lower_blocks():
    # Two slots of 64 positions: 16 blocks of 8. Slot 0's first prompt takes blocks 0..7; A's
    # prompt blocks 8..14, its answer block 15. B, into slot 0 (its blocks free again), shares
    # SYSTEM's 6 blocks with A (8..13) but then needs two blocks above 13 for its prompt and
    # answer, where only block 15 is ever free: processed from scratch in blocks 0..7, it fits.
    engine = sharing_engine(n_slots=2, n_ctx=64, max_sequences=2)
    core = engine.core
    first = GenerationRequest(tuple(range(100, 160)), 2, spec=SpecConfig("off", 0), tenant="alice")
    a, b = req((1, 2, 3), method="off", max_tokens=11), req(tuple(range(1, 11)), method="off", max_tokens=4)
    handles = [core.add(first)]
    tokens, outcome = {}, {}
    while len(outcome) < 3:
        for handle, item in core.step():
            if isinstance(item, Failed):
                outcome[handle] = item.error
                continue
            tokens.setdefault(handle, []).extend(getattr(item, "token_ids", []))
            if getattr(item, "finish_reason", None) is not None:
                outcome[handle] = item.finish_reason
        if len(handles) == 1:  # after the first prompt, so A's lies above it (shorter prompts go first)
            handles.append(core.add(a))
        elif handles[0] in outcome and len(handles) == 2:
            assert handles[1] not in outcome  # A still decodes: B's forwards are A's too
            handles.append(core.add(b))
    assert [outcome[handle] for handle in handles] == ["length"] * 3
    assert tokens[handles[1]] == alone(a) and tokens[handles[2]] == alone(b)
    assert not engine.target.shared_prefixes  # B computed its own prompt


def test_a_slot_with_no_room_above_its_own_prompt_start_processes_the_prompt_from_scratch():
    # Three slots of 62 positions: 23 blocks of 8, all taken: X 0..7, A 8..14, C 15..22. Then Z
    # takes X's slot (X's blocks but one free again) and A's next turn keeps A's start (8..14) in
    # A's slot, where its answer needs a block above 14: C holds them all. From scratch, in
    # blocks 1..8, it fits.
    engine = sharing_engine(n_slots=3, n_ctx=62, max_sequences=3)
    x = GenerationRequest(tuple(range(100, 160)), 2, spec=SpecConfig("off", 0), tenant="alice")
    c = GenerationRequest(tuple(range(200, 260)), 2, spec=SpecConfig("off", 0), tenant="alice")
    a = req((1, 2, 3), method="off", max_tokens=3)
    _, (answer, _), _ = run_together(engine, [x, a, c], one_a_step=True)
    next_turn = req((1, 2, 3) + tuple(answer) + (7, 8, 9), method="off", max_tokens=4)
    z = GenerationRequest((5, 6, 7), 6, spec=SpecConfig("off", 0), tenant="bob")
    (tokens, stats), (z_tokens, _) = run_together(engine, [next_turn, z])
    assert tokens == alone(next_turn) and stats["cached_prompt_tokens"] == 0
    assert z_tokens == alone(z)
