"""The adaptive method's tunables, in one place; the defaults are the measured settings (the
figures behind each are in docs/notebook.md)."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.drafters.policy.priors import DRAFT_PRIOR

MAX_MATCH = 16  # the longest match the request's own suffix index looks for (14+ is accepted 98 %)


@dataclass(frozen=True)
class PolicyConfig:
    # Speculate only where it beats plain decoding's tokens per second by this fraction.
    margin: float = 0.02
    max_match: int = MAX_MATCH
    # The draft model's per-token acceptance before a request shows its own (data/drafting_priors.json),
    # worth this many observations: fewer let one early rejection price it out for good
    # (notebook, "the draft model pays").
    draft_prior: float = DRAFT_PRIOR
    draft_prior_weight: float = 8.0
    # Observations each evidence-keyed prior of the draft-free sources is worth in a request.
    evidence_prior_weight: float = 4.0
    # A draft backlog beyond one round's own lag is an investment spread over this many rounds
    # (notebook, "its catch-up priced right").
    catch_up_horizon: int = 32
    # The draft's measured/priced time scale: the median of the last `draft_scale_window` ratios,
    # the window seeded with `draft_scale_prior` ratios of 1 and each ratio clipped to
    # `draft_scale_range`, so that no one stalled proposal prices the draft out for good
    # (notebook, "its catch-up priced right" and "the draft model pays").
    draft_scale_window: int = 9
    draft_scale_prior: int = 4
    draft_scale_range: tuple[float, float] = (0.5, 3.0)
    # A prompt the draft processes within this many target steps is processed right after the first
    # token (never before it: issue 43), when the draft pays at its prior over proposals of up to
    # `eager_draft_k` tokens; a longer one waits for the draft's first proposal (notebook, "the
    # draft's prompt with the target's").
    eager_draft_prompt_steps: float = 12.0
    eager_draft_k: int = 4
    # The draft's confidence calibration (accepted / confidence) starts at this many accepted
    # tokens for as much confidence.
    confidence_prior: float = 1.0

    def __post_init__(self):
        low, high = self.draft_scale_range
        if self.margin < 0 or self.max_match < 1 or self.catch_up_horizon < 1 or not 0 < low <= high \
                or self.draft_scale_window < 1 or self.draft_scale_prior < 0 or self.eager_draft_k < 1 \
                or self.confidence_prior <= 0:
            raise ValueError(f"invalid policy configuration: {self}")
