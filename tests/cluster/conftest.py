"""Several real edges (``dispatcher serve`` processes) sharing a real ``redis-server`` and a
real PostgreSQL: ``nox -s cluster`` runs these (``DISPATCHER_CLUSTER=1``); a wider run leaves
them out (they start several processes per test and take a minute)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.optional import deselect_unless

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    deselect_unless(
        os.environ.get("DISPATCHER_CLUSTER") == "1",
        HERE,
        "several edges on real Redis and PostgreSQL: nox -s cluster",
        config,
        items,
    )
