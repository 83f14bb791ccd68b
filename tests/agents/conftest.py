"""``tests/agents``: the real agent clients -- Codex CLI and Claude Code, from npm -- run
non-interactively against a real edge and node (``nox -s agents``, ``docs/agents.md``).

Everything here is deselected unless ``DISPATCHER_AGENTS_BIN`` names a folder holding the
clients' ``codex`` and ``claude`` executables (an npm ``node_modules/.bin``), which the nox
session sets after installing the pinned versions; the test command does not. The stack (an
edge and a node process serving ``node.toml``'s echo models) is started once per session.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.optional import deselect_unless

from .stack import AgentStack, open_stack

BIN_ENV = "DISPATCHER_AGENTS_BIN"
HERE = Path(__file__).resolve().parent
REASON = f"the real agent clients: run `nox -s agents` (or set {BIN_ENV})"


def _configured() -> bool:
    return bool(os.environ.get(BIN_ENV))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    deselect_unless(_configured(), HERE, REASON, config, items)


@pytest.fixture(scope="session")
def agents() -> Iterator[AgentStack]:
    """The edge and the node, and where the clients are."""
    clients = Path(os.environ[BIN_ENV])
    with (
        tempfile.TemporaryDirectory(prefix="agents-") as scratch,
        open_stack(Path(scratch), clients) as stack,
    ):
        yield stack
