"""Command-line options that ``python -m bench`` hands to the sections that take them.

A section whose ``run`` has a parameter named ``options`` is called as
``run(options=RunOptions(...))``; the others as ``run()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunOptions:
    quick: bool = False
    """``--quick``: a smoke run (fewer requests, fewer cells)."""
    n: tuple[int, ...] = field(default_factory=tuple)
    """``--n N`` (repeatable): the ``streams`` section's stream counts; empty: its default."""
