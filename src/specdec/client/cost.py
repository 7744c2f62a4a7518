"""What a batch cost, in two views that never invent a price.

Token pricing: a price table gives each model separate input and output prices in USD per million
tokens; cost = prompt_tokens × input / 10^6 + completion_tokens × output / 10^6. specdec ships a
default table (specdec/data/prices.json); a user file overrides it model by model.

Compute pricing (self-hosting): cost = price per machine-hour × wall hours, and the same cost per
million tokens generated (and per million tokens processed, prompt included).

Example: 2,000 prompt + 500 completion tokens at $0.15 / $0.60 per million cost
0.0003 + 0.0003 = $0.0006; 90 seconds on a $2.00/h machine cost $0.05, which for those 500
generated tokens is $100 per million generated tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Mapping, Optional, Union

from specdec.types import SpecdecError

PER_MILLION = 1_000_000


@dataclass(frozen=True)
class TokenPrice:
    input_per_million: float  # USD per million prompt tokens
    output_per_million: float  # USD per million completion tokens
    source: Optional[str] = None


@dataclass(frozen=True)
class TokenCost:
    input_usd: float
    output_usd: float

    @property
    def total_usd(self) -> float:
        return self.input_usd + self.output_usd


@dataclass(frozen=True)
class ComputeCost:
    machine_hour_usd: float
    wall_seconds: float
    total_usd: float
    per_million_output_usd: Optional[float]  # None when no token was generated
    per_million_total_usd: Optional[float]


def token_cost(price: TokenPrice, prompt_tokens: int, completion_tokens: int) -> TokenCost:
    return TokenCost(prompt_tokens * price.input_per_million / PER_MILLION,
                     completion_tokens * price.output_per_million / PER_MILLION)


def compute_cost(machine_hour_usd: float, wall_seconds: float, completion_tokens: int,
                 prompt_tokens: int = 0) -> ComputeCost:
    total = machine_hour_usd * wall_seconds / 3600.0
    processed = completion_tokens + prompt_tokens
    return ComputeCost(machine_hour_usd, wall_seconds, total,
                       total * PER_MILLION / completion_tokens if completion_tokens else None,
                       total * PER_MILLION / processed if processed else None)


class PriceTable:
    """Token prices by model name. Lookup is exact first, then case-insensitive."""

    def __init__(self, prices: Mapping[str, TokenPrice]):
        self.prices = dict(prices)
        self._folded = {name.lower(): price for name, price in self.prices.items()}

    def lookup(self, model: Optional[str]) -> Optional[TokenPrice]:
        if not model:
            return None
        return self.prices.get(model) or self._folded.get(model.lower())

    def merged(self, overrides: "PriceTable") -> "PriceTable":
        return PriceTable({**self.prices, **overrides.prices})


def parse_price_table(data: object, origin: str) -> PriceTable:
    """A table from `{"models": {name: {"input_per_million": x, "output_per_million": y}}}`, or the
    same mapping without the "models" wrapper. Keys starting with "_" are comments."""
    if not isinstance(data, dict):
        raise SpecdecError(f"{origin}: a price table must be a JSON object.")
    models = data.get("models", data)
    if not isinstance(models, dict):
        raise SpecdecError(f"{origin}: \"models\" must map model names to prices.")
    prices = {}
    for name, entry in models.items():
        if name.startswith("_"):
            continue
        try:
            price = TokenPrice(float(entry["input_per_million"]), float(entry["output_per_million"]), entry.get("source"))
        except (TypeError, KeyError, ValueError, AttributeError):
            raise SpecdecError(f"{origin}: model {name!r} needs numeric input_per_million and output_per_million.") from None
        if price.input_per_million < 0 or price.output_per_million < 0:
            raise SpecdecError(f"{origin}: model {name!r} has a negative price.")
        prices[name] = price
    return PriceTable(prices)


def default_price_table() -> PriceTable:
    text = resources.files("specdec").joinpath("data").joinpath("prices.json").read_text(encoding="utf-8")
    return parse_price_table(json.loads(text), "specdec/data/prices.json")


def load_price_table(user_file: Optional[Union[str, Path]] = None) -> PriceTable:
    """The shipped table, with the user's file (if any) overriding it model by model."""
    table = default_price_table()
    if user_file is None:
        return table
    path = Path(user_file)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecdecError(f"price file {path} not found.") from None
    except ValueError as exc:
        raise SpecdecError(f"price file {path} is not valid JSON: {exc}.") from None
    return table.merged(parse_price_table(data, str(path)))
