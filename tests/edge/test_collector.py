"""The daemon's collector settings (issue #12): ``tune_collector_for_serving`` freezes what
start-up left and makes full collections rare, keeping the young generations' thresholds.
It changes the whole process, so each check restores the collector it found."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from dispatcher.edge import SERVING_FULL_COLLECTION_THRESHOLD, tune_collector_for_serving


@pytest.fixture
def collector() -> Iterator[tuple[int, int, int]]:
    before = gc.get_threshold()
    try:
        yield before
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_start_up_objects_are_frozen_and_full_collections_rare(
    collector: tuple[int, int, int],
) -> None:
    young, middle, _ = collector
    tune_collector_for_serving()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (young, middle, SERVING_FULL_COLLECTION_THRESHOLD)
    assert gc.isenabled()


def test_young_cycles_are_still_collected(collector: tuple[int, int, int]) -> None:
    tune_collector_for_serving()

    class Node:
        other: object

    first, second = Node(), Node()
    first.other, second.other = second, first
    del first, second
    assert gc.collect(0) + gc.collect(1) >= 2
