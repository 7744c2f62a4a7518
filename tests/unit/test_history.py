"""The cross-request n-gram cache: bounded tables, one per tenant, drafting text generated before."""
from fakes.clock import FakeClock
from specdec.backends.fake import FakeBackend
from specdec.drafters.history import CrossRequestCache, NgramHistory, tenant_of_api_key
from specdec.engine.engine import Engine
from specdec.types import GenerationRequest, SpecConfig


def test_lookup_returns_what_followed_the_last_ngram_most_recently():
    history = NgramHistory(order=2, span=3)
    history.add([5, 6, 7, 8, 9])
    assert history.lookup([1, 5, 6], 2) == (7, 8)
    assert history.lookup([1, 5, 6], 5) == (7, 8, 9)
    history.add([5, 6, 1])
    assert history.lookup([5, 6], 3) == (1,)  # the latest continuation wins
    assert history.lookup([9, 9], 3) == ()
    assert history.lookup([6], 3) == ()  # shorter than the order


def test_tables_are_bounded():
    history = NgramHistory(order=2, span=2, max_entries=10)
    history.add(list(range(100)))
    assert len(history) == 10
    assert history.lookup([96, 97], 2) == (98, 99)
    assert history.lookup([0, 1], 2) == ()  # the oldest were dropped
    cache = CrossRequestCache(max_tenants=2)
    for tenant in ("a", "b", "c"):
        cache.for_tenant(tenant).add([1, 2, 3, 4])
    assert len(cache.for_tenant("a")) == 0  # "a" was dropped when "c" arrived


def test_tenants_never_see_each_others_text():
    cache = CrossRequestCache(order=2)
    cache.for_tenant(tenant_of_api_key("key-one")).add([1, 2, 3, 4])
    assert cache.for_tenant(tenant_of_api_key("key-one")).lookup([1, 2], 2) == (3, 4)
    assert cache.for_tenant(tenant_of_api_key("key-two")).lookup([1, 2], 2) == ()
    assert cache.for_tenant(None).lookup([1, 2], 2) == ()
    assert "key-one" not in tenant_of_api_key("key-one")  # the key itself is not kept
    cache.reset()
    assert cache.for_tenant(tenant_of_api_key("key-one")).lookup([1, 2], 2) == ()


def test_a_repeated_request_drafts_from_the_tenants_cache_and_stays_exact():
    clock = FakeClock()
    # Near-free verification, so `auto` speculates whenever a source is often right.
    engine = Engine(FakeBackend(seed=7, clock=clock, step_cost=0.05, token_cost=0.0005), clock=clock)
    ids = tuple(engine.encode_prompt("x", chat=True))

    def run(tenant):
        return engine.generate(GenerationRequest(ids, 40, spec=SpecConfig("auto", 4), tenant=tenant))

    first = run("alice")
    again = run("alice")
    other = run("bob")
    assert again.token_ids == first.token_ids == other.token_ids
    assert any(choice.startswith("cache") for choice in again.stats["choices"])
    assert not any(choice.startswith("cache") for choice in first.stats["choices"])
    assert not any(choice.startswith("cache") for choice in other.stats["choices"])
    engine.reset_cross_request_state()
    assert not any(choice.startswith("cache") for choice in run("alice").stats["choices"])
