"""The cross-request history: a bounded suffix index per tenant, drafting text seen before."""
from fakes.clock import FakeClock
from specdec.backends.fake import FakeBackend
from specdec.drafters.history import CrossRequestCache, TenantHistory, tenant_of_api_key
from specdec.engine.engine import Engine
from specdec.types import GenerationRequest, SpecConfig


def test_continues_the_longest_match_from_earlier_requests():
    history = TenantHistory(min_match=2)
    history.add([5, 6, 7, 8, 9])
    assert history.continuation([1, 5, 6], 2).tokens == (7, 8)
    assert history.continuation([1, 5, 6], 5).tokens == (7, 8, 9)
    history.add([5, 6, 1])
    assert history.continuation([5, 6], 3).tokens == (1,)  # 7 and 1 once each: the latest wins the tie
    history.add([5, 6, 1])
    history.add([4, 5, 6, 7])
    assert history.continuation([0, 5, 6], 1).tokens == (7,)  # 1 twice, 7 twice: the latest wins the tie
    history.add([5, 6, 1])
    assert history.continuation([0, 5, 6], 1).tokens == (1,)  # 1 three times against 7 twice
    assert history.continuation([4, 5, 6], 1).tokens == (7,)  # the 3-token match is longer
    assert history.continuation([9, 9], 3).tokens == ()
    assert history.continuation([6], 3).tokens == ()  # shorter than min_match


def test_histories_are_bounded():
    history = TenantHistory(min_match=2, max_tokens=10)
    history.add(list(range(8)))
    history.add(list(range(100, 108)))
    assert len(history) == 8  # the older request was dropped
    assert history.continuation([0, 1], 2).tokens == ()
    assert history.continuation([100, 101], 2).tokens == (102, 103)
    history.add(list(range(200, 230)))  # longer than the bound: its last 10 tokens are kept
    assert len(history) == 10 and history.continuation([220, 221], 1).tokens == (222,)
    cache = CrossRequestCache(max_tenants=2)
    for tenant in ("a", "b", "c"):
        cache.for_tenant(tenant).add([1, 2, 3, 4, 5, 6])
    assert cache.sizes() == (2, 12)
    assert len(cache.for_tenant("a")) == 0  # "a" was dropped when "c" arrived


def test_tenants_never_see_each_others_text():
    cache = CrossRequestCache()
    cache.for_tenant(tenant_of_api_key("key-one")).add([1, 2, 3, 4, 5, 6])
    assert cache.for_tenant(tenant_of_api_key("key-one")).continuation([1, 2, 3, 4], 2).tokens == (5, 6)
    assert cache.for_tenant(tenant_of_api_key("key-two")).continuation([1, 2, 3, 4], 2).tokens == ()
    assert cache.for_tenant(None).continuation([1, 2, 3, 4], 2).tokens == ()
    assert "key-one" not in tenant_of_api_key("key-one")  # the key itself is not kept
    cache.reset()
    assert cache.for_tenant(tenant_of_api_key("key-one")).continuation([1, 2, 3, 4], 2).tokens == ()


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
