"""Cost arithmetic on hand-computed cases, and the price table (shipped default, user overrides)."""
from __future__ import annotations

import json

import pytest

from specdec.client.cost import (
    PriceTable,
    TokenPrice,
    compute_cost,
    default_price_table,
    load_price_table,
    parse_price_table,
    token_cost,
)
from specdec.types import SpecdecError


def test_input_and_output_priced_separately():
    # 2,000,000 prompt tokens at $0.15/M = $0.30; 500,000 completion tokens at $0.60/M = $0.30.
    cost = token_cost(TokenPrice(0.15, 0.60), prompt_tokens=2_000_000, completion_tokens=500_000)
    assert cost.input_usd == pytest.approx(0.30)
    assert cost.output_usd == pytest.approx(0.30)
    assert cost.total_usd == pytest.approx(0.60)
    # Swapping the counts changes the price: the two sides are not blended.
    swapped = token_cost(TokenPrice(0.15, 0.60), prompt_tokens=500_000, completion_tokens=2_000_000)
    assert swapped.total_usd == pytest.approx(0.075 + 1.20)


def test_small_counts():
    # 1,234 prompt tokens at $2.50/M and 56 completion tokens at $10/M.
    cost = token_cost(TokenPrice(2.50, 10.00), 1234, 56)
    assert cost.input_usd == pytest.approx(0.003085)
    assert cost.output_usd == pytest.approx(0.00056)


def test_compute_pricing():
    # 90 seconds at $2.00 per machine-hour = $0.05; 500 generated tokens → $100 per million generated;
    # 500 + 1,500 prompt tokens processed → $25 per million tokens.
    cost = compute_cost(2.00, 90.0, completion_tokens=500, prompt_tokens=1500)
    assert cost.total_usd == pytest.approx(0.05)
    assert cost.per_million_output_usd == pytest.approx(100.0)
    assert cost.per_million_total_usd == pytest.approx(25.0)
    # An hour at $3.60 generating 36,000 tokens (10 tok/s): $100 per million generated tokens.
    assert compute_cost(3.60, 3600, 36_000).per_million_output_usd == pytest.approx(100.0)
    idle = compute_cost(1.0, 10.0, 0)
    assert idle.per_million_output_usd is None and idle.per_million_total_usd is None


def test_shipped_table_has_no_invented_price_for_specdecs_model():
    table = default_price_table()
    assert table.lookup("qwen2.5-coder-1.5b-instruct-q4_k_m") is None
    for name, price in table.prices.items():
        assert price.input_per_million >= 0 and price.output_per_million >= 0 and price.source, name


def test_user_file_overrides_per_model(tmp_path):
    default = default_price_table()
    some_model = next(iter(default.prices))
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"models": {
        "my-model": {"input_per_million": 0.1, "output_per_million": 0.2},
        some_model: {"input_per_million": 9, "output_per_million": 99},
    }}))
    table = load_price_table(path)
    assert table.lookup("my-model") == TokenPrice(0.1, 0.2)
    assert table.lookup("MY-MODEL") == TokenPrice(0.1, 0.2)  # case-insensitive fallback
    assert table.lookup(some_model).output_per_million == 99
    assert len(table.prices) == len(default.prices) + 1


def test_flat_table_and_comments_accepted():
    table = parse_price_table({"_comment": "x", "m": {"input_per_million": 1, "output_per_million": 2}}, "f")
    assert table.prices == {"m": TokenPrice(1.0, 2.0)}


@pytest.mark.parametrize("data, message", [
    ({"models": {"m": {"input_per_million": 1}}}, "needs numeric"),
    ({"models": {"m": {"input_per_million": "a", "output_per_million": 1}}}, "needs numeric"),
    ({"models": {"m": {"input_per_million": -1, "output_per_million": 1}}}, "negative"),
    ([], "JSON object"),
])
def test_bad_price_tables(data, message):
    with pytest.raises(SpecdecError, match=message):
        parse_price_table(data, "prices.json")


def test_bad_price_files(tmp_path):
    with pytest.raises(SpecdecError, match="not found"):
        load_price_table(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    with pytest.raises(SpecdecError, match="not valid JSON"):
        load_price_table(bad)


def test_lookup_of_nothing():
    assert PriceTable({}).lookup(None) is None and PriceTable({}).lookup("x") is None
