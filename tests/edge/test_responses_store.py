"""The Responses API's store (``dispatcher.responses_store``): SQLite beside the usage ledger,
its bounds (count, bytes, age) and per-key visibility, and stored responses surviving a
restart of the dispatcher when the ledger is a file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx
import pytest
import trio

from dispatcher.config import EdgeConfig, ResponsesSettings
from dispatcher.edge import open_dispatcher
from dispatcher.store.responses import beside_ledger, open_response_store


def test_the_store_sits_beside_the_ledger() -> None:
    assert beside_ledger(None) == ":memory:"
    assert beside_ledger(":memory:") == ":memory:"
    assert beside_ledger("/var/lib/d/usage.sqlite3") == "/var/lib/d/usage.responses.sqlite3"
    assert beside_ledger("ledger") == "ledger.responses"


async def test_the_store_bounds_its_bytes() -> None:
    async with open_response_store(max_bytes=400) as store:
        small = {"id": "resp_a", "output": []}
        assert await store.put(small, [])
        assert not await store.put({"id": "resp_big", "pad": "x" * 500}, [])  # alone over
        assert await store.get("resp_big") is None
        assert await store.put({"id": "resp_b", "pad": "y" * 360}, [])
        assert await store.get("resp_a") is None  # the older one made room
        assert store.statistics().bytes <= 400
        assert store.statistics().evicted == 1
        assert await store.delete("resp_b")
        assert not await store.delete("resp_b")
        assert (len(store), store.statistics().bytes) == (0, 0)


async def test_the_store_bounds_its_count_oldest_first_and_replaces_by_id() -> None:
    async with open_response_store(max_entries=3) as store:
        for n in range(5):
            await store.put({"id": f"resp_{n}", "n": n}, [{"type": "message", "n": n}])
        assert [await store.get(f"resp_{n}") is not None for n in range(5)] == [
            False,
            False,
            True,
            True,
            True,
        ]
        await store.put({"id": "resp_2", "n": "again"}, [])  # replaced: now the newest
        await store.put({"id": "resp_5"}, [])
        assert await store.get("resp_3") is None
        found = await store.get("resp_2")
        assert found is not None
        assert (found.response, found.conversation) == ({"id": "resp_2", "n": "again"}, ())
        assert len(store) == 3


async def test_the_store_forgets_by_age() -> None:
    now = [1000.0]
    async with open_response_store(max_age=60, clock=lambda: now[0]) as store:
        await store.put({"id": "resp_old"}, [])
        now[0] += 30
        await store.put({"id": "resp_new"}, [])
        now[0] += 31
        assert await store.get("resp_old") is None  # past its age: never read
        assert not await store.delete("resp_old")
        assert await store.get("resp_new") is not None
        await store.put({"id": "resp_later"}, [])  # a write forgets what is past its age
        assert (len(store), store.statistics().evicted) == (2, 1)


async def test_a_response_is_only_its_owners() -> None:
    async with open_response_store() as store:
        await store.put({"id": "resp_a"}, [], owner="key-a")
        await store.put({"id": "resp_open"}, [])
        assert await store.get("resp_a", "key-b") is None
        assert await store.get("resp_a") is None  # no key is not any key
        assert not await store.delete("resp_a", "key-b")
        assert await store.get("resp_a", "key-a") is not None
        assert await store.get("resp_open", "key-a") is None
        assert await store.get("resp_open") is not None


async def test_a_closed_store_refuses_calls() -> None:
    async with open_response_store() as store:
        pass
    with pytest.raises(trio.ClosedResourceError):
        await store.get("resp_a")


async def test_a_store_file_keeps_its_responses_and_bounds_across_opens(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "usage.responses.sqlite3"
    async with open_response_store(path, max_entries=2) as store:
        for n in range(3):
            await store.put({"id": f"resp_{n}"}, [{"n": n}], owner="key-a")
    async with open_response_store(path, max_entries=2) as store:
        assert len(store) == 2
        assert await store.get("resp_0", "key-a") is None
        kept = await store.get("resp_2", "key-a")
        assert kept is not None
        assert kept.conversation == ({"n": 2},)
        await store.put({"id": "resp_3"}, [], owner="key-a")
        assert await store.get("resp_1", "key-a") is None


async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    sqlite3.connect(path).execute("PRAGMA user_version=99").connection.close()
    with pytest.raises(RuntimeError, match="newer"):
        async with open_response_store(path):
            pass


async def test_stored_responses_survive_a_restart_of_the_dispatcher(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """Two dispatchers one after the other on the same ``usage_db``: the second finds the
    first's stored response (GET, previous_response_id), per key; the file is beside the
    ledger's; the config's bounds apply."""
    config = EdgeConfig(
        port=0,
        usage_db=str(tmp_path / "usage.sqlite3"),
        api_keys=("sk-a", "sk-b"),
        responses=ResponsesSettings(max_stored=2),
    )
    a = {"authorization": "Bearer sk-a"}
    b = {"authorization": "Bearer sk-b"}

    ids: list[str] = []
    async with open_dispatcher(config) as dispatcher:
        await dispatcher.attach_local_node()
        server = await nursery.start(dispatcher.serve)
        url = f"http://127.0.0.1:{server.address.port}"
        async with httpx.AsyncClient(base_url=url) as client:
            for text in ("alpha beta", "gamma", "delta"):
                created = await client.post(
                    "/v1/responses", json={"model": "echo", "input": text}, headers=a
                )
                assert created.status_code == 200, created.text
                ids.append(created.json()["id"])
        server.shutdown()
    assert (tmp_path / "usage.responses.sqlite3").exists()

    async with open_dispatcher(config) as dispatcher:
        await dispatcher.attach_local_node()
        server = await nursery.start(dispatcher.serve)
        url = f"http://127.0.0.1:{server.address.port}"
        async with httpx.AsyncClient(base_url=url) as client:
            fetched = await client.get(f"/v1/responses/{ids[2]}", headers=a)
            assert fetched.status_code == 200, fetched.text
            assert fetched.json()["output"][0]["content"][0]["text"] == "delta"
            other = await client.get(f"/v1/responses/{ids[2]}", headers=b)
            assert other.status_code == 404
            assert other.json()["error"]["code"] == "response_not_found"
            # max_stored = 2: the first was forgotten before the restart.
            first = await client.get(f"/v1/responses/{ids[0]}", headers=a)
            assert first.status_code == 404
            chained = await client.post(
                "/v1/responses",
                json={"model": "echo", "input": "epsilon", "previous_response_id": ids[1]},
                headers=a,
            )
            assert chained.status_code == 200, chained.text
            # The stored conversation ("gamma" and its answer) was prepended.
            assert chained.json()["usage"]["input_tokens"] == 1 + 1 + 1
        server.shutdown()
