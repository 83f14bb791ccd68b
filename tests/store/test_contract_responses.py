"""The response store's contract (:class:`~dispatcher.store.seam.ResponseStore`), run over
every backend (``tests/store/backends.py``): found by id and owner only, every bound at its
edge (entries, bytes, age), concurrent writers, a reopened store keeping what it held."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import trio

from .backends import RESPONSES, ResponseBackend


class Clock:
    """The store's wall clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=RESPONSES, ids=lambda backend: backend.name)
def backend(request: pytest.FixtureRequest) -> ResponseBackend:
    chosen: ResponseBackend = request.param
    return chosen


def response(response_id: str, text: str = "hi") -> dict[str, Any]:
    return {"id": response_id, "object": "response", "output_text": text}


CONVERSATION = ({"role": "user", "content": "hello"},)


def size_of(resp: dict[str, Any], conversation: tuple[dict[str, Any], ...] = CONVERSATION) -> int:
    return len(orjson.dumps(resp)) + len(orjson.dumps(list(conversation)))


def store_of(backend: ResponseBackend, place: Path, clock: Clock, **bounds: Any) -> Any:
    bounds.setdefault("max_entries", 100)
    bounds.setdefault("max_bytes", 1 << 20)
    bounds.setdefault("max_age", 3600.0)
    return backend.open(place, clock=clock, **bounds)


async def test_a_response_is_found_by_its_id_and_owner_only(
    backend: ResponseBackend, tmp_path: Path
) -> None:
    async with store_of(backend, tmp_path, Clock()) as store:
        assert await store.put(response("resp_a"), CONVERSATION, "alice")
        assert await store.put(response("resp_b"), CONVERSATION, None)
        found = await store.get("resp_a", "alice")
        assert found is not None
        assert found.response == response("resp_a")
        assert found.conversation == CONVERSATION
        assert found.owner == "alice"
        assert found.size == size_of(response("resp_a"))
        assert await store.get("resp_a", "bob") is None
        assert await store.get("resp_a", None) is None  # no key is not every key
        assert await store.get("resp_b", None) is not None
        assert await store.get("resp_b", "alice") is None
        assert not await store.delete("resp_a", "bob")
        assert await store.delete("resp_a", "alice")
        assert not await store.delete("resp_a", "alice")
        assert await store.get("resp_a", "alice") is None
        assert store.statistics().entries == 1


async def test_putting_an_id_again_replaces_it(backend: ResponseBackend, tmp_path: Path) -> None:
    async with store_of(backend, tmp_path, Clock()) as store:
        await store.put(response("resp_a", "one"), CONVERSATION, "alice")
        await store.put(response("resp_a", "two"), CONVERSATION, "alice")
        found = await store.get("resp_a", "alice")
        assert found is not None
        assert found.response["output_text"] == "two"
        stats = store.statistics()
        assert stats.entries == 1
        assert stats.bytes == size_of(response("resp_a", "two"))


async def test_the_entry_bound_forgets_the_oldest_first(
    backend: ResponseBackend, tmp_path: Path
) -> None:
    async with store_of(backend, tmp_path, Clock(), max_entries=3) as store:
        for i in range(3):
            await store.put(response(f"resp_{i}"), CONVERSATION)
        assert store.statistics().evicted == 0  # at the bound, nothing goes
        await store.put(response("resp_3"), CONVERSATION)
        assert await store.get("resp_0") is None
        assert all([await store.get(f"resp_{i}") is not None for i in (1, 2, 3)])
        stats = store.statistics()
        assert (stats.entries, stats.evicted) == (3, 1)


async def test_the_byte_bound_at_its_edge(backend: ResponseBackend, tmp_path: Path) -> None:
    one = size_of(response("resp_0"))
    async with store_of(backend, tmp_path, Clock(), max_bytes=2 * one) as store:
        assert await store.put(response("resp_0"), CONVERSATION)
        assert await store.put(response("resp_1"), CONVERSATION)
        assert store.statistics().bytes == 2 * one  # exactly at the bound: kept
        assert await store.put(response("resp_2"), CONVERSATION)
        assert await store.get("resp_0") is None
        assert store.statistics().bytes == 2 * one
        huge = response("resp_huge", "x" * (2 * one))
        assert not await store.put(huge, CONVERSATION)  # bigger than the bound alone
        assert await store.get("resp_huge") is None
        assert await store.get("resp_1") is not None  # and nothing was evicted for it


async def test_the_age_bound_at_its_edge(backend: ResponseBackend, tmp_path: Path) -> None:
    clock = Clock()
    async with store_of(backend, tmp_path, clock, max_age=60.0) as store:
        await store.put(response("resp_a"), CONVERSATION)
        clock.now += 59.999
        assert await store.get("resp_a") is not None
        clock.now += 0.001  # exactly max_age old: gone
        assert await store.get("resp_a") is None
        assert not await store.delete("resp_a")


async def test_concurrent_writers_and_readers(backend: ResponseBackend, tmp_path: Path) -> None:
    async with store_of(backend, tmp_path, Clock()) as store:

        async def writer(owner: str) -> None:
            for i in range(10):
                assert await store.put(response(f"{owner}-{i}"), CONVERSATION, owner)
                assert await store.get(f"{owner}-{i}", owner) is not None

        async with trio.open_nursery() as nursery:
            for owner in ("a", "b", "c", "d"):
                nursery.start_soon(writer, owner)
        assert store.statistics().entries == 40


@pytest.mark.parametrize(
    "backend", [b for b in RESPONSES if b.persistent], ids=lambda backend: backend.name
)
async def test_a_reopened_store_keeps_what_it_held(
    backend: ResponseBackend, tmp_path: Path
) -> None:
    clock = Clock()
    async with store_of(backend, tmp_path, clock) as store:
        await store.put(response("resp_a"), CONVERSATION, "alice")
        await store.put(response("resp_b"), CONVERSATION, "alice")
        await store.delete("resp_b", "alice")
    async with store_of(backend, tmp_path, clock) as store:
        found = await store.get("resp_a", "alice")
        assert found is not None
        assert found.response == response("resp_a")
        assert await store.get("resp_b", "alice") is None
        assert store.statistics().entries == 1
        assert store.statistics().bytes == size_of(response("resp_a"))
