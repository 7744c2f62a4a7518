"""What the batch report (client/report.py) and the benchmark reports (bench/report.py,
bench/serving.py) share: percentiles under one convention, and Markdown tables. The reports
themselves stay apart: they report different things."""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


def percentiles(values: Sequence[float], qs: Sequence[float]) -> list[float]:
    """The `qs` percentiles (0 to 100) of `values`, by numpy's linear interpolation.

    Example: [1, 2, 3, 4] at (50, 95, 99) -> [2.5, 3.85, 3.97].
    """
    return [float(v) for v in np.percentile(np.asarray(values, dtype=np.float64), qs)]


def markdown_row(cells: Sequence[object]) -> str:
    """Example: ["a", 1] -> "| a | 1 |"; an empty cell is one space wide: ["", "b"] -> "| | b |"."""
    return "|" + "|".join(f" {cell} " if cell != "" else " " for cell in cells) + "|"


def markdown_table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a Markdown table: the header, its rule, then one line per row."""
    return [markdown_row(header), "|" + "---|" * len(header), *(markdown_row(row) for row in rows)]
