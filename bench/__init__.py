"""Benchmarks: ``python -m bench`` (or ``nox -s bench``) prints every section's table.

A section is a module listed in ``bench.__main__.SECTIONS`` that defines::

    async def run() -> Sequence[Table]: ...
    TIME_LIMIT: float = 120.0  # optional: seconds before the section is cut off

Sections run one after another under one ``trio.run``; see ``bench/README.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Table", "fmt_int", "render"]


@dataclass
class Table:
    """One block of results: a title, column headings, rows of cells, notes below."""

    title: str
    columns: Sequence[str]
    rows: list[Sequence[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def fmt_int(value: float) -> str:
    """``12345.6`` -> ``"12,346"``."""
    return f"{value:,.0f}"


def render(table: Table) -> str:
    """The table as aligned plain text (first column left-aligned, the others too)."""
    cells = [list(table.columns), *[list(row) for row in table.rows]]
    width = max(len(row) for row in cells)
    for row in cells:
        row.extend([""] * (width - len(row)))
    sizes = [max(len(row[i]) for row in cells) for i in range(width)]

    def line(row: Sequence[str]) -> str:
        return "  ".join(cell.ljust(size) for cell, size in zip(row, sizes, strict=True)).rstrip()

    out = [f"== {table.title} ==", line(cells[0]), "  ".join("-" * s for s in sizes)]
    out.extend(line(row) for row in cells[1:])
    out.extend(f"  * {note}" for note in table.notes)
    return "\n".join(out)
