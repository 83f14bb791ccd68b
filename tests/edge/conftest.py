"""Fixtures the edge's tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .logs import Captured, captured


@pytest.fixture
def logs() -> Iterator[Captured]:
    """Every record of the ``dispatcher`` loggers, DEBUG and up (the access log included)."""
    yield from captured()
