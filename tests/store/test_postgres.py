"""What the PostgreSQL backends do beyond the contract suite (which they pass too): edges that
open one database together migrate it once, a newer schema is refused, an unreachable server
is named (never its password), a row the database refuses costs only that row, and two edges
on one database share the ledger and the responses' bounds. And the embedded default never
imports psycopg."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import attrs
import psycopg
import pytest
import trio

from dispatcher.errors import StoreUnavailable
from dispatcher.store.postgres import (
    _USAGE_STEPS,
    PostgresUnreachable,
    PostgresUsage,
    open_postgres_ledger,
    open_postgres_response_store,
)
from dispatcher.store.seam import WriteResult
from dispatcher.store.usage import EVERY_ROW, MAX_QUERY_LIMIT, UsageRow
from dispatcher.store.usage_sqlite import PART_COLUMNS

from . import postgres_server
from .test_contract_ledger import row
from .test_contract_responses import CONVERSATION, Clock, response


@pytest.fixture
def postgres_url(tmp_path: Path) -> str:
    """A schema of its own on the session's server (``conftest.py`` deselects the tests
    that take this where no server can be started)."""
    return postgres_server.schema_url(tmp_path)


def versions(url: str) -> list[tuple[str, int]]:
    with psycopg.connect(url, autocommit=True) as conn:
        found = conn.execute("SELECT component, version FROM dispatcher_schema ORDER BY 1")
        return [(name, version) for name, version in found.fetchall()]


async def test_edges_opening_one_database_together_migrate_it_once(postgres_url: str) -> None:
    """Eight edges open the ledger and the response store of a fresh database at once: the
    advisory lock lets one create the tables, the others find them."""
    edges = 8
    start = threading.Barrier(edges)
    failures: list[BaseException] = []

    def open_ledger_database() -> None:
        start.wait()
        try:
            PostgresUsage(postgres_url).close()
        except BaseException as exc:
            failures.append(exc)

    async def open_store() -> None:
        async with open_postgres_response_store(postgres_url):
            pass

    async with trio.open_nursery() as nursery:
        for _ in range(edges):
            nursery.start_soon(trio.to_thread.run_sync, open_ledger_database)
            nursery.start_soon(open_store)
    assert failures == []
    assert versions(postgres_url) == [("responses", 1), ("usage", 2)]


async def test_a_version_1_ledger_gains_the_parts_of_its_counts(postgres_url: str) -> None:
    """Version 2 of the usage table added the cached, cache-write and reasoning tokens: a
    table of version 1 is migrated at open, its rows with 0 of each."""
    old = row("old-1", cost_usd=0.5)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE dispatcher_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL)"
        )
        conn.execute(_USAGE_STEPS[0])
        conn.execute("INSERT INTO dispatcher_schema VALUES ('usage', 1)")
        columns = [c for c in attrs.fields_dict(UsageRow) if c not in PART_COLUMNS]
        conn.execute(
            f"INSERT INTO dispatcher_usage ({', '.join(columns)}) "
            f"VALUES ({', '.join(['%s'] * len(columns))})",
            [getattr(old, c) for c in columns],
        )
    new = row("new-1", cached_tokens=6, cache_write_tokens=2, reasoning_tokens=15)
    async with open_postgres_ledger(postgres_url, outbox=":memory:") as ledger:
        ledger.record(new)
        report = await ledger.query()
        (group,) = await ledger.query_groups(group_by=())
    assert sorted(report.rows, key=lambda r: r.request_id) == [new, old]
    totals = report.totals
    assert (totals.cached_tokens, totals.cache_write_tokens, totals.reasoning_tokens) == (6, 2, 15)
    assert (group.cached_tokens, group.cache_write_tokens, group.reasoning_tokens) == (6, 2, 15)
    assert versions(postgres_url) == [("usage", 2)]
    # An edge of the previous release, still running, names only the columns it knows.
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO dispatcher_usage ({', '.join(columns)}) "
            f"VALUES ({', '.join(['%s'] * len(columns))})",
            [getattr(attrs.evolve(old, request_id="older-edge"), c) for c in columns],
        )
    async with open_postgres_ledger(postgres_url, outbox=":memory:") as ledger:
        found = await ledger.query()
    assert attrs.evolve(old, request_id="older-edge") in found.rows


async def test_a_newer_schema_is_refused(postgres_url: str) -> None:
    async with open_postgres_ledger(postgres_url, outbox=":memory:"):
        pass
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("UPDATE dispatcher_schema SET version = 99 WHERE component = 'usage'")
    with pytest.raises(
        RuntimeError, match=r"schema version 99, newer than this dispatcher's \(2\)"
    ):
        async with open_postgres_ledger(postgres_url, outbox=":memory:"):
            pass


def test_an_unreachable_server_is_named_without_its_password() -> None:
    port = postgres_server._free_port()  # nothing listens there
    url = f"postgresql://edge:s3cret@127.0.0.1:{port}/ledger"
    with pytest.raises(PostgresUnreachable) as raised:
        PostgresUsage(url, connect_timeout=1.0)
    message = str(raised.value)
    assert f"postgresql://edge@127.0.0.1:{port}/ledger" in message
    assert "s3cret" not in message
    assert "check that the server runs" in message


def test_a_refused_row_costs_only_itself(postgres_url: str) -> None:
    """PostgreSQL refuses a NUL in text (SQLite takes it): that row is reported refused, a
    key already written and one repeated within the batch are reported duplicates, and the
    rest of the batch is written, in the one transaction."""
    database = PostgresUsage(postgres_url)
    try:
        assert database.write([row("old")]) == WriteResult(1, [], [])
        bad = row("bad", client_request_id="x\x00y")
        result = database.write([row("a"), bad, row("old"), row("b"), row("a", prompt_tokens=9)])
        assert (result.inserted, result.duplicates) == (2, [("old", 1), ("a", 1)])
        [(key, reason)] = result.refused
        assert key == ("bad", 1)
        assert "NUL" in reason
        # Without a refused row the batch goes in one pipeline: the same duplicates.
        assert database.write([row("c"), row("a"), row("c")]) == WriteResult(
            1, [("a", 1), ("c", 1)], []
        )
        report = database.query(EVERY_ROW, MAX_QUERY_LIMIT)
        assert sorted(r.request_id for r in report.rows) == ["a", "b", "c", "old"]
        assert next(r for r in report.rows if r.request_id == "a").prompt_tokens == 10
    finally:
        database.close()


async def test_two_edges_share_one_ledger(postgres_url: str) -> None:
    async with (
        open_postgres_ledger(postgres_url, outbox=":memory:") as first,
        open_postgres_ledger(postgres_url, outbox=":memory:") as second,
    ):
        first.record(row("r1"))
        await first.flush()
        seen = await second.query()
        assert [r.key for r in seen.rows] == [("r1", 1)]
        second.record(row("r1", prompt_tokens=999))  # the other edge's key: dropped on write
        second.record(row("r2"))
        await second.flush()
        assert second.statistics().duplicates_dropped == 1
        report = await first.query()
        assert sorted((r.key, r.prompt_tokens) for r in report.rows) == [
            (("r1", 1), 10),
            (("r2", 1), 10),
        ]


async def test_two_edges_share_the_responses_and_their_bounds(postgres_url: str) -> None:
    clock = Clock()
    async with (
        open_postgres_response_store(postgres_url, max_entries=3, clock=clock) as first,
        open_postgres_response_store(postgres_url, max_entries=3, clock=clock) as second,
    ):
        await first.put(response("resp_0"), CONVERSATION, "alice")
        await first.put(response("resp_1"), CONVERSATION, "alice")
        found = await second.get("resp_1", "alice")
        assert found is not None
        assert found.response == response("resp_1")
        await second.put(response("resp_2"), CONVERSATION, "bob")
        await second.put(response("resp_3"), CONVERSATION, "bob")  # the fourth: one goes
        assert await first.get("resp_0", "alice") is None  # the oldest, put by the other edge
        assert await first.get("resp_3", "bob") is not None
        assert second.statistics().entries == 3
        assert second.statistics().evicted == 1
        assert await second.delete("resp_1", "alice")
        assert await first.get("resp_1", "alice") is None


def test_the_embedded_default_never_imports_psycopg() -> None:
    """Every module of dispatcher/ but the PostgreSQL backends imports without psycopg: the
    README's ``dispatcher serve`` needs no PostgreSQL client."""
    code = """
import pkgutil, importlib, sys
import dispatcher
for module in pkgutil.walk_packages(dispatcher.__path__, "dispatcher."):
    if module.name not in ("dispatcher.store.postgres", "dispatcher.__main__"):
        importlib.import_module(module.name)
leaked = sorted(name for name in sys.modules if name.split(".")[0] in ("psycopg", "psycopg_pool"))
assert not leaked, leaked
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def _migrate(tmp_path: Path, config: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "edge.toml").write_text(config)
    return subprocess.run(
        [sys.executable, "-m", "dispatcher", "migrate", "--config", str(tmp_path / "edge.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_dispatcher_migrate_creates_the_tables_then_finds_them_up_to_date(
    tmp_path: Path,
) -> None:
    server = postgres_server.server_url()
    name = "migrate_" + tmp_path.name.lower().replace("-", "_")[-40:]
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = server.rsplit("/", 1)[0] + f"/{name}"
    where = url  # no password in it: shown whole
    config = f'[store]\ndatabase_url = "{url}"\n'
    first = _migrate(tmp_path, config)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == [
        f"{where}: usage tables at version 2 (migrated from version 0)",
        f"{where}: responses tables at version 1 (migrated from version 0)",
    ]
    again = _migrate(tmp_path, config)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [
        f"{where}: usage tables at version 2 (up to date)",
        f"{where}: responses tables at version 1 (up to date)",
    ]


def test_dispatcher_migrate_without_a_database_says_there_is_nothing_to_do(
    tmp_path: Path,
) -> None:
    result = _migrate(tmp_path, "")
    assert result.returncode == 2
    assert result.stderr.startswith("dispatcher: nothing to migrate: [store] names no database_url")


async def test_the_response_store_opens_while_postgres_is_down_and_serves_once_it_is_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The edge starts with its database down: the store opens (a WARNING names the
    server), a call says the store cannot be reached (503), and once the server answers the
    tables are migrated on the first call and the store works."""
    url = await trio.to_thread.run_sync(postgres_server.schema_url, tmp_path)
    await trio.to_thread.run_sync(postgres_server.halt)
    halted = True
    try:
        async with open_postgres_response_store(url, connect_timeout=1.0) as store:
            with pytest.raises(StoreUnavailable, match="stored responses' database"):
                await store.get("resp_0", "alice")
            await trio.to_thread.run_sync(postgres_server.resume)
            halted = False
            with trio.fail_after(30):
                while True:
                    try:
                        await store.put(response("resp_0"), CONVERSATION, "alice")
                        break
                    except StoreUnavailable:
                        await trio.sleep(0.2)
            found = await store.get("resp_0", "alice")
            assert found is not None
            assert found.response == response("resp_0")
            assert store.statistics().entries == 1
    finally:
        if halted:
            await trio.to_thread.run_sync(postgres_server.resume)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("stored responses" in w and "could not connect" in w for w in warnings)
