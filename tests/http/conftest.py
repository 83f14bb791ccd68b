from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ._helpers import OPEN_STREAMS


@pytest.fixture
async def close_clients() -> AsyncIterator[None]:
    """Close every client stream the test opened through the helpers."""
    yield
    while OPEN_STREAMS:
        await OPEN_STREAMS.pop().aclose()
