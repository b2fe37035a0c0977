"""Plain-text tables for the CLI, benchmarks and examples."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool = True
) -> str:
    """A markdown table (pipes and a rule line), columns padded to their widest cell."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    if markdown:
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return "" if value is None else str(value)
