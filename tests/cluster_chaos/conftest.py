"""The cluster soak needs a real ``redis-server`` and PostgreSQL (Debian's packages, as
``tests/store`` does): where one cannot be started (no binaries), it is deselected from the
run -- unless ``CI`` is set: CI installs both (``.ci/run``), so there it fails instead of
vanishing. The test command runs its 300-request version; ``nox -s cluster-chaos`` the long
one (``CLUSTER_CHAOS_REQUESTS``, default 2,000 there)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.optional import leave_out
from tests.store import postgres_server, redis_server

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(trylast=True)  # after -k and -m: "asked for them alone" means that
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("CI"):
        return
    reason = postgres_server.unavailable_reason()
    if reason is None and redis_server.BINARY is None:
        reason = "redis-server is not installed (apt-get install redis-server)"
    if reason is not None:
        ours = [item for item in items if HERE in item.path.resolve().parents]
        leave_out(ours, f"the cluster soak: {reason}", config, items)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    postgres_server.stop()
