"""Test folders that need something the test command does not have (a real engine, the
agent clients from npm): deselected from a wider run unless configured."""

from __future__ import annotations

from pathlib import Path

import pytest


def deselect_unless(
    configured: bool, folder: Path, reason: str, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """For ``pytest_collection_modifyitems``: unless ``configured``, the tests under
    ``folder`` are left out (:func:`leave_out`)."""
    if configured:
        return
    leave_out(
        [item for item in items if folder in item.path.resolve().parents], reason, config, items
    )


def leave_out(
    ours: list[pytest.Item], reason: str, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """``ours`` (some of ``items``) are deselected from a wider run (one "deselected" count,
    not a line per test), and skipped with ``reason`` when they are all that was asked for."""
    if not ours:
        return
    if len(ours) == len(items):
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=reason))
        return
    config.hook.pytest_deselected(items=ours)
    chosen = set(ours)
    items[:] = [item for item in items if item not in chosen]
