"""The hostile-input suite (issue #10): bad input over real sockets, against a real edge with a
legitimate node and a stream held open around every case (see ``_support.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ._support import Edge, edge_config, open_edge


@pytest.fixture
async def edge(
    request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[Edge]:
    """The edge; with the short header, body and hello timeouts for a case marked
    ``short_timeouts`` (generous ones otherwise)."""
    short = request.node.get_closest_marker("short_timeouts") is not None
    async with open_edge(caplog, edge_config(short_timeouts=short)) as running:
        yield running
