"""The shared backends' cases need real servers: PostgreSQL (``postgres_server``) and
``redis-server`` (``redis_server``). Where one cannot be started (no binaries), its cases are
deselected from the run -- unless ``CI`` is set: CI installs both (``.ci/run``), so there
they fail instead of vanishing. A server a test started is stopped when the session ends."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.optional import leave_out

from . import postgres_server, redis_server
from .backends import POSTGRES

REDIS_REASON = "redis-server is not installed (apt-get install redis-server)"


def _on_postgres(item: pytest.Item) -> bool:
    """A contract case of a PostgreSQL backend, or a test taking ``postgres_url``."""
    if "postgres_url" in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get("backend") if callspec is not None else None
    return getattr(backend, "name", None) == POSTGRES


def _on_redis(item: pytest.Item) -> bool:
    return "[redis" in item.name or "redis" in item.path.name


@pytest.hookimpl(trylast=True)  # after -k and -m: "asked for them alone" means that
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("CI"):
        return
    reason = postgres_server.unavailable_reason()
    if reason is not None:
        ours = [item for item in items if _on_postgres(item)]
        leave_out(ours, f"PostgreSQL backends: {reason}", config, items)
    if redis_server.BINARY is None:
        leave_out([item for item in items if _on_redis(item)], REDIS_REASON, config, items)


@pytest.fixture(scope="session", autouse=True)
def _redis_server_stopped() -> Iterator[None]:
    yield
    redis_server.stop()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    postgres_server.stop()
