"""The hostile-input suite (issue #10): bad input over real sockets, against a real edge with a
legitimate node and a stream held open around every case (see ``_support.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ._support import Edge, open_edge


@pytest.fixture
async def edge(caplog: pytest.LogCaptureFixture) -> AsyncIterator[Edge]:
    async with open_edge(caplog) as running:
        yield running
