"""The Redis backends' cases need a real ``redis-server``: without one (and outside CI, whose
``.ci/run`` installs it) they are deselected, never failing the test command."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from . import redis_server

REASON = "redis-server is not installed (apt-get install redis-server)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if redis_server.BINARY is not None or os.environ.get("CI"):
        return
    ours = [item for item in items if "[redis" in item.name or "redis" in item.path.name]
    if not ours:
        return
    if len(ours) == len(items):
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=REASON))
        return
    config.hook.pytest_deselected(items=ours)
    chosen = set(ours)
    items[:] = [item for item in items if item not in chosen]


@pytest.fixture(scope="session", autouse=True)
def _redis_server_stopped() -> Iterator[None]:
    yield
    redis_server.stop()
