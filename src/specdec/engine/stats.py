"""Per-generation statistics, defined once. Every interface (CLI JSON, server usage, benchmark
records) reports these keys.

`choices` counts what was proposed in each round ("ngram:k2", "draft:k4", or "none" for a plain
step), so the adaptive method's decisions are visible; `sources` sums each source's rounds,
drafted and accepted tokens, so its acceptance can be told apart from the others'.

Conventions: acceptance_rate = accepted / drafted; mean_acceptance_length = 1 + accepted /
draft_rounds (it counts the target's own token of each round); tokens_per_second = generated
tokens / decode time, where decode time = total - prompt processing. A ratio whose denominator is
zero is None (JSON null), never NaN.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


def _ratio(numerator: float, denominator: float) -> Optional[float]:
    return numerator / denominator if denominator else None


@dataclass
class GenerationStats:
    method: str
    num_draft_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # reused from the prefix cache, not processed again
    generated_tokens: int = 0
    draft_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    choices: dict[str, int] = field(default_factory=dict)  # per round: "source:kN", or "none"
    sources: dict[str, dict[str, int]] = field(default_factory=dict)  # source -> rounds, drafted, accepted
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # every target forward after the prompt (plain steps included)
    prompt_seconds: float = 0.0
    ttft_seconds: Optional[float] = None
    total_seconds: float = 0.0

    def record_round(self, drafted: int, accepted: int, source: str = "") -> None:
        choice = f"{source or self.method}:k{drafted}" if drafted else "none"
        self.choices[choice] = self.choices.get(choice, 0) + 1
        if drafted == 0:
            return
        self.draft_rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        totals = self.sources.setdefault(source or self.method, {"rounds": 0, "drafted": 0, "accepted": 0})
        totals["rounds"] += 1
        totals["drafted"] += drafted
        totals["accepted"] += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def record_forced(self, proposed: int, accepted: int) -> None:
        """Tokens the grammar forced into a round's proposal (no drafter proposed them)."""
        totals = self.sources.setdefault("grammar", {"rounds": 0, "drafted": 0, "accepted": 0})
        totals["rounds"] += 1
        totals["drafted"] += proposed
        totals["accepted"] += accepted

    def as_dict(self) -> dict:
        decode_seconds = self.total_seconds - self.prompt_seconds
        return {
            "method": self.method,
            "num_draft_tokens": self.num_draft_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "draft_rounds": self.draft_rounds,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": _ratio(self.accepted_tokens, self.drafted_tokens),
            "mean_acceptance_length": (1 + self.accepted_tokens / self.draft_rounds) if self.draft_rounds else None,
            "accepted_per_position": list(self.accepted_per_position),
            "choices": dict(self.choices),
            "sources": {source: dict(totals) for source, totals in self.sources.items()},
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "prompt_seconds": self.prompt_seconds,
            "ttft_seconds": self.ttft_seconds,
            "total_seconds": self.total_seconds,
            "tokens_per_second": _ratio(self.generated_tokens, decode_seconds) if decode_seconds > 0 else None,
        }
