"""The PostgreSQL backends' cases need a real server (``postgres_server``): where none can be
started (no binaries), they are deselected from the run -- unless ``CI`` is set: CI installs
PostgreSQL (``.ci/run``), so there they fail instead of vanishing. The server, if a test
started it, is stopped when the session ends."""

from __future__ import annotations

import os

import pytest

from . import postgres_server
from .backends import POSTGRES


def _on_postgres(item: pytest.Item) -> bool:
    """A contract case of a PostgreSQL backend, or a test taking ``postgres_url``."""
    if "postgres_url" in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get("backend") if callspec is not None else None
    return getattr(backend, "name", None) == POSTGRES


@pytest.hookimpl(trylast=True)  # after -k and -m: "asked for them alone" means that
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = postgres_server.unavailable_reason()
    if reason is None or os.environ.get("CI"):
        return
    ours = [item for item in items if _on_postgres(item)]
    if not ours:
        return
    if len(ours) == len(items):  # asked for them alone: say why they do not run
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=f"PostgreSQL backends: {reason}"))
        return
    config.hook.pytest_deselected(items=ours)
    chosen = set(ours)
    items[:] = [item for item in items if item not in chosen]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    postgres_server.stop()
