"""What every report shares: one summary of a list of numbers, one set of cell formatters, and
Markdown tables. Used by the batch report (client/report.py) and the benchmark reports
(bench/report.py, bench/serving.py); what each report says stays in its own module."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

LINEAR = "linear"  # numpy's linear interpolation between the two nearest ranks
NEAREST_RANK = "nearest"  # a value that occurred (bench --server's published tables used it)
PERCENTILES = (25, 50, 75, 90, 95, 99)


def percentiles(values: Sequence[float], qs: Sequence[float], method: str = LINEAR) -> list[float]:
    """The `qs` percentiles (0 to 100) of `values`.

    Example: [1, 2, 3, 4] at (50, 95, 99) -> [2.5, 3.85, 3.97]; with NEAREST_RANK -> [2, 4, 4].
    """
    return [float(v) for v in np.percentile(np.asarray(values, dtype=np.float64), qs, method=method)]


@dataclass(frozen=True)
class Spread:
    """A list of numbers summarized; each report shows the fields it wants (`fields`)."""

    count: int
    mean: float
    median: float  # the middle value, or the mean of the two middle ones, whatever the method
    min: float
    max: float
    p25: float
    p50: float
    p75: float
    p90: float
    p95: float
    p99: float


def spread(values: Sequence[float], method: str = LINEAR) -> Optional[Spread]:
    """Count, mean, median, range and PERCENTILES of `values`; None when there are none.

    Example: [40, 10, 30, 20] -> mean 25, median 25, p25 17.5, p75 32.5, p90 37, p95 38.5, min 10, max 40.
    """
    if not len(values):
        return None
    array = np.asarray(values, dtype=np.float64)
    return Spread(len(values), float(np.mean(array)), float(np.median(array)), float(array.min()),
                  float(array.max()), *percentiles(values, PERCENTILES, method))


def fields(summary: Optional[Spread], names: Sequence[str]) -> dict:
    """The named fields of a spread as a dict, each None when there were no values."""
    return {name: None if summary is None else getattr(summary, name) for name in names}


# -- cells -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cells:
    """Table cells for one report; `missing` stands where a value is None."""

    missing: str = "—"

    def number(self, value: Optional[float], spec: str = ".2f", suffix: str = "") -> str:
        """Example: number(1.234) -> "1.23"; number(2, ".1f", "×") -> "2.0×"; number(None) -> missing."""
        return self.missing if value is None else format(value, spec) + suffix

    def span(self, low: Optional[float], high: Optional[float], spec: str = ".2f") -> str:
        """Example: span(1, 2.5) -> "1.00–2.50"."""
        return self.missing if low is None else f"{format(low, spec)}–{format(high, spec)}"

    def change(self, value: Optional[float]) -> str:
        """A relative change as a signed percentage. Example: -0.25 -> "-25.0 %"."""
        return self.missing if value is None else f"{value * 100:+.1f} %"

    def usd(self, value: Optional[float]) -> str:
        """Cents for a dollar or more, six decimals below. Example: 1234.5 -> "$1,234.50"; 0.0012 -> "$0.001200"."""
        if value is None:
            return self.missing
        return f"${value:,.2f}" if abs(value) >= 1 else f"${value:.6f}"


# -- tables ------------------------------------------------------------------------------------------

def markdown_row(cells: Sequence[object]) -> str:
    """Example: ["a", 1] -> "| a | 1 |"; an empty cell is one space wide: ["", "b"] -> "| | b |"."""
    return "|" + "|".join(f" {cell} " if cell != "" else " " for cell in cells) + "|"


def markdown_table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a Markdown table: the header, its rule, then one line per row."""
    return [markdown_row(header), "|" + "---|" * len(header), *(markdown_row(row) for row in rows)]
