"""Plain-text tables for the checks' results."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["table"]


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """``rows`` under ``header``, each column as wide as its widest cell."""
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)
