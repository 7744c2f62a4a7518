"""What a forward costs on this machine, measured: the target over n tokens, the draft per token.

Calibrated in a few seconds on a scratch prompt, then kept up to date online from the timings of
real rounds (an exponential moving average per n), so the adaptive policy prices what it proposes
with this machine's numbers rather than assumed ones. One-token steps are observed every round,
longer forwards rarely, so a change in t(1) (a longer context makes every forward dearer) rescales
the whole curve, keeping v(n) = t(n)/t(1): otherwise v(n) would drift low as contexts grow and
speculation would look cheaper than it is.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Optional

from specdec.backends.sequence import CachedSequence

CALIBRATION_TEXT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n" * 2
# How far a calibration may stray before it is taken for noise (the machine busy with something
# else while it measured) rather than this machine's costs: v(n) a little below 1 or below an
# earlier size's, and t(1) within a factor of the last good model's, are a VM's ordinary drift.
V_FLOOR = 0.95
V_DROP = 0.7  # v(n) at least this share of the largest v(m), m < n: kernels favour some row counts
T1_FACTOR = 2.0


class CalibrationInterrupted(Exception):
    """calibrate() stopped early because `interrupted()` said so; the caches are left empty."""


@dataclass
class CostModel:
    target_seconds: dict[int, float]  # n -> seconds of one target forward over n tokens
    draft_step_seconds: Optional[float] = None  # one draft-model token, None without a draft model
    draft_prefill_seconds: Optional[float] = None  # per token when the draft model catches up in a batch
    smoothing: float = 0.1  # weight of a new observation in the moving average
    observations: dict[int, int] = field(default_factory=dict)
    # n rows over several sequences -> seconds, as measured while serving (not saved): what a round
    # shared by several streams costs, which one sequence's calibration prices only roughly.
    shared_seconds: dict[int, float] = field(default_factory=dict)

    def target(self, n: int) -> float:
        """Seconds for n tokens; beyond the measured range, extrapolate the last step linearly."""
        if n in self.target_seconds:
            return self.target_seconds[n]
        known = sorted(self.target_seconds)
        if n < known[0]:
            return self.target_seconds[known[0]]
        last, before = known[-1], known[-2] if len(known) > 1 else known[-1]
        slope = (self.target_seconds[last] - self.target_seconds[before]) / max(1, last - before)
        return self.target_seconds[last] + slope * (n - last)

    def shared(self, n: int) -> float:
        """Seconds of one forward of n rows over several sequences: as measured while serving,
        where it was, else as one sequence's n rows."""
        return self.shared_seconds.get(n) or self.target(n)

    def observe_shared(self, n: int, seconds: float) -> None:
        """A forward of n rows over several sequences took `seconds`: moved towards it from one
        sequence's price, so one odd forward does not set the price."""
        self.shared_seconds[n] = (1 - self.smoothing) * self.shared(n) + self.smoothing * seconds

    def relative(self, n: int) -> float:
        """v(n) = t(n) / t(1)."""
        return self.target(n) / self.target(1)

    def draft(self, n: int) -> float:
        """Seconds of one draft-model forward over n tokens: its step times the target's v(n). The
        two run the same kernels, so their curves agree (docs/notebook.md, "the draft's prompt with
        the target's")."""
        return (self.draft_step_seconds or 0.0) * self.relative(n)

    def draft_prompt(self, n: int) -> float:
        """Seconds of processing n tokens on the draft model in batches, as a prompt: its measured
        per-token rate, or its step where that was not measured."""
        return n * (self.draft_prefill_seconds or self.draft_step_seconds or 0.0)

    def observe_target(self, n: int, seconds: float) -> None:
        old = self.target_seconds.get(n)
        new = seconds if old is None else (1 - self.smoothing) * old + self.smoothing * seconds
        if n == 1 and old:
            scale = new / old  # every forward, the draft's too, costs that much more (or less) now
            self.target_seconds = {m: t * scale for m, t in self.target_seconds.items()}
            self.shared_seconds = {m: t * scale for m, t in self.shared_seconds.items()}
            if self.draft_step_seconds:
                self.draft_step_seconds *= scale
            if self.draft_prefill_seconds:
                self.draft_prefill_seconds *= scale
        self.target_seconds[n] = new
        self.observations[n] = self.observations.get(n, 0) + 1

    def summary(self) -> str:
        """One line: t(1) and v(n), e.g. "t(1) 43.1 ms, v(2..8) 1.90 2.71 ...; draft step 14.2 ms"."""
        v = " ".join(f"{self.relative(n):.2f}" for n in sorted(self.target_seconds) if n > 1)
        draft = f"; draft step {self.draft_step_seconds * 1e3:.1f} ms" if self.draft_step_seconds else ""
        return f"t(1) {self.target(1) * 1e3:.1f} ms, v(2..{max(self.target_seconds)}) {v}{draft}"

    def to_json(self) -> dict:
        """Everything needed to price proposals again later (`from_json`); keys as strings for JSON."""
        return {"target_seconds": {str(n): t for n, t in sorted(self.target_seconds.items())},
                "draft_step_seconds": self.draft_step_seconds, "draft_prefill_seconds": self.draft_prefill_seconds}

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        target_seconds = {int(n): float(t) for n, t in data["target_seconds"].items()}
        if 1 not in target_seconds or any(t <= 0 for t in target_seconds.values()):
            raise ValueError("a cost model needs a positive one-token time")
        return cls(target_seconds, data.get("draft_step_seconds"), data.get("draft_prefill_seconds"))

    @classmethod
    def median_of(cls, costs: list["CostModel"]) -> "CostModel":
        """Each cost the median of several calibrations' (of one setup, taken at different times)."""
        def median(values):
            values = [value for value in values if value is not None]
            return statistics.median(values) if values else None

        sizes = set.intersection(*(set(cost.target_seconds) for cost in costs))
        return cls({n: median([cost.target_seconds[n] for cost in costs]) for n in sorted(sizes)},
                   median([cost.draft_step_seconds for cost in costs]),
                   median([cost.draft_prefill_seconds for cost in costs]))

    def as_dict(self) -> dict:
        t1 = self.target(1)
        return {
            "target_step_seconds": t1,
            "v": {n: self.target_seconds[n] / t1 for n in sorted(self.target_seconds)},
            "draft_step_seconds": self.draft_step_seconds,
            "draft_cost_ratio": (self.draft_step_seconds / t1) if self.draft_step_seconds else None,
        }


def implausibility(cost: CostModel, last_good: Optional[CostModel] = None) -> Optional[str]:
    """Why `cost` cannot be this machine's costs (None: it can): a longer forward never costs less
    than a shorter one beyond noise, and t(1) does not move by a factor between calibrations."""
    sizes = sorted(n for n in cost.target_seconds if n > 1)
    highest, at = 1.0, 1
    for n in sizes:
        v = cost.relative(n)
        if v < V_FLOOR:
            return f"v({n}) {v:.2f} is below 1"
        if v < V_DROP * highest:
            return f"v({n}) {v:.2f} is below v({at}) {highest:.2f}"
        if v > highest:
            highest, at = v, n
    if last_good is not None:
        ratio = cost.target(1) / last_good.target(1)
        if not 1 / T1_FACTOR <= ratio <= T1_FACTOR:
            return (f"t(1) {cost.target(1) * 1e3:.1f} ms is {ratio:.1f}x the last good model's "
                    f"{last_good.target(1) * 1e3:.1f} ms")
    return None


def calibrate(
    target: CachedSequence,
    draft: Optional[CachedSequence],
    max_tokens: int = 16,
    repeats: int = 4,
    clock: Callable[[], float] = time.perf_counter,
    interrupted: Optional[Callable[[], bool]] = None,
) -> CostModel:
    """Time target forwards over 1..max_tokens tokens (and draft steps) after a scratch prompt
    (calibration_steps). About 15 s for the default pair on a 2-core CPU.

    Leaves both caches empty. `interrupted` is asked between forwards (a server calibrating at an
    idle moment stops for a request): once it says so, CalibrationInterrupted is raised.
    """
    steps = calibration_steps(target, draft, max_tokens, repeats, clock)
    try:
        while True:
            next(steps)
            if interrupted is not None and interrupted():
                steps.close()
                target.clear()
                if draft is not None:
                    draft.clear()
                raise CalibrationInterrupted()
    except StopIteration as done:
        return done.value


def calibration_steps(
    target: CachedSequence,
    draft: Optional[CachedSequence],
    max_tokens: int = 16,
    repeats: int = 4,
    clock: Callable[[], float] = time.perf_counter,
) -> Generator[None, None, CostModel]:
    """calibrate()'s forwards, yielding before each timed pair (or draft step), so that a caller
    may run them a few at a time between other work on the same thread (a server measuring a new
    build between the old one's rounds); returns the model and leaves both caches empty.

    Each n is timed right after a one-token forward, and v(n) is the median over repeats of the
    two's ratio, sizes taken in reverse order on odd repeats: on a VM whose step time drifts by
    20 %, ratios of independent minima (lucky one-token steps) made v(n) look dearer by up to 15 %.
    """
    n_ctx = target.backend.n_ctx
    max_tokens = max(1, min(max_tokens, n_ctx // 2 - 1))
    prompt = target.backend.tokenize(CALIBRATION_TEXT, add_special=False)
    prompt = prompt[: min(64, n_ctx - max_tokens - 1)]  # a short scratch prompt that fits any context
    probe = (prompt * max_tokens)[:max_tokens]

    def timed(tokens) -> float:
        target.truncate(len(prompt))
        t0 = clock()
        target.extend(tokens)
        return clock() - t0

    one_token: list[float] = []
    ratios: dict[int, list[float]] = {n: [] for n in range(2, max_tokens + 1)}
    yield
    target.clear()
    target.prefill(prompt)
    for repeat in range(repeats):
        sizes = range(2, max_tokens + 1) if repeat % 2 == 0 else range(max_tokens, 1, -1)
        for n in sizes:
            yield
            step = timed(probe[:1])
            one_token.append(step)
            ratios[n].append(timed(probe[:n]) / step)
    target.clear()
    t1 = statistics.median(one_token)
    target_seconds = {1: t1, **{n: t1 * statistics.median(values) for n, values in ratios.items()}}
    draft_step = draft_prefill = None
    if draft is not None:
        yield
        draft.clear()
        t0 = clock()
        draft.prefill(prompt)
        draft_prefill = (clock() - t0) / len(prompt)
        samples = []
        for token in probe:
            yield
            t0 = clock()
            draft.extend([token])
            samples.append(clock() - t0)
        draft_step = statistics.median(samples)
        draft.clear()
    return CostModel(target_seconds, draft_step, draft_prefill)
