"""What a proposal yields and costs: the one pricing formula of `auto` and of the machine profile.

A proposal of j tokens, position i accepted with chance a_i once 1..i-1 were, yields
E(j) = 1 + a_1 + a_1 a_2 + ... + a_1...a_j tokens (the target's own included) for a verification
round of 1 + j rows, plus the draft model's forwards when it drafted them; plain decoding yields one
token for one row. Tokens per second, E over seconds, is what every option is compared by.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from specdec.backends.cost_model import CostModel
from specdec.drafters.model import MAX_JOINED_CATCH_UP


def expected_tokens(rates: Sequence[float]) -> float:
    """1 + a1 + a1 a2 + ...: the target's own token plus the expected accepted prefix."""
    return cumulative_expected_tokens(rates)[-1]


def cumulative_expected_tokens(rates: Sequence[float]) -> list[float]:
    """[E(0), E(1), ..., E(len(rates))]: what proposing each prefix of the rates yields."""
    totals, total, reach = [1.0], 1.0, 1.0
    for rate in rates:
        reach *= rate
        total += reach
        totals.append(total)
    return totals


def best_uniform_proposal(acceptance: float, max_length: int, target_seconds: Callable[[int], float],
                          draft_step: float = 0.0) -> tuple[int, float]:
    """(length, tokens per second) of the best proposal of 1..max_length tokens, each accepted at
    `acceptance` once the ones before it were, verified in `target_seconds(rows)` and drafted at
    `draft_step` a token (0 for a draft-free source)."""
    rates = {j: expected_tokens([acceptance] * j) / (target_seconds(1 + j) + j * draft_step)
             for j in range(1, max_length + 1)}
    length = max(rates, key=lambda j: rates[j])
    return length, rates[length]


@dataclass(frozen=True)
class RoundCosts:
    """What one round costs this stream, from the machine's measured costs.

    `streams`: the streams sharing the verification forward, each bringing one row, and
    `rows_before` extra rows the streams planned before this one put there; its rows are priced at
    what they add to that forward on top of those, so an option beats plain decoding exactly when it
    raises the whole forward's tokens per second (notebook, "streams sharing forwards"). Priced
    against one row a stream, N streams each saw one row's price where the forward grew by N rows:
    on a curve with a dip (t(8) below t(7)) every stream's row looked free.
    `lag`: committed tokens the draft model's cache lacks. `draft_scale`: what its proposals really
    take over their calibrated price (estimates.DraftTimeScale). `has_draft`: a draft model is there.
    `draft_sharers`: the streams whose draft forwards run together with this one's (itself
    included): each pays its share of a forward of that many rows, d(n) / n.
    """

    cost: CostModel
    streams: int = 1
    has_draft: bool = False
    draft_scale: float = 1.0
    lag: int = 0
    catch_up_horizon: int = 32
    draft_sharers: int = 1
    rows_before: int = 0

    def target(self, rows: int) -> float:
        """Seconds of a round of `rows` rows to this stream: t(rows) alone; shared by N streams
        holding B extra rows already, its share of the plain round, t(N) / N, plus what its further
        rows add, t(N + B + rows - 1) - t(N + B)."""
        if self.streams == 1 and not self.rows_before:
            return self.cost.target(rows)
        held, forward = self.streams + self.rows_before, self.cost.shared  # several sequences' rows
        return forward(self.streams) / self.streams + forward(held + rows - 1) - forward(held)

    def row(self, position: int) -> float:
        """Seconds of verifying the proposal's token at `position` (0-based)."""
        return self.target(position + 2) - self.target(position + 1)

    @property
    def draft_share(self) -> float:
        """This stream's part of a draft forward shared by `draft_sharers` streams."""
        return self.cost.relative(self.draft_sharers) / self.draft_sharers if self.draft_sharers > 1 else 1.0

    @property
    def draft_step(self) -> Optional[float]:
        """One draft-model token at what it really takes; None without a draft model."""
        if not self.has_draft or not self.cost.draft_step_seconds:
            return None
        return self.cost.draft_step_seconds * self.draft_share * self.draft_scale

    def draft_seconds(self, prefix: int, forwards: int, lag: Optional[int] = None) -> float:
        """Calibrated seconds of a draft-model proposal: its first forward evaluates the committed
        tokens its cache lacks, the last one and the n-gram `prefix` together (a lag longer than
        MAX_JOINED_CATCH_UP is processed as a prompt first), every later forward one token."""
        lag = self.lag if lag is None else lag
        catch_up = 0.0
        if lag > MAX_JOINED_CATCH_UP:  # processed alone, as a prompt
            catch_up, lag = self.cost.draft_prompt(lag), 0
        shared = self.cost.draft(lag + 1 + prefix) + (forwards - 1) * (self.cost.draft_step_seconds or 0.0)
        return catch_up + shared * self.draft_share

    def draft(self, prefix: int, forwards: int) -> float:
        """What a round is charged for a draft-model proposal: its own catch-up (at most the one
        token a draft round leaves) in full, a longer backlog spread over `catch_up_horizon` rounds
        (it must be processed before any later draft round too), at the measured time scale."""
        own = self.draft_seconds(prefix, forwards, min(self.lag, 1))
        price = own + (self.draft_seconds(prefix, forwards) - own) / self.catch_up_horizon
        return price * self.draft_scale
