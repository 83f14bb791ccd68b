"""The PostgreSQL ledger's durable local outbox (``dispatcher/store/outbox.py``) on a real
server: PostgreSQL stopped mid-load loses and doubles nothing and gets every row in order when
it returns; a SIGKILLed edge's outbox is written when the ledger opens on it again; a batch
sent again after a crash between PostgreSQL's commit and the outbox's delete doubles nothing;
an edge starts while PostgreSQL is down and its reads say so."""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import attrs
import orjson
import psycopg
import pytest
import trio

from dispatcher.errors import StoreUnavailable
from dispatcher.store.outbox import Outbox
from dispatcher.store.postgres import PostgresUsage, open_postgres_ledger
from dispatcher.store.usage import MAX_QUERY_LIMIT

from . import postgres_server
from .test_contract_ledger import T0, row


@pytest.fixture
def postgres_url(tmp_path: Path) -> str:
    return postgres_server.schema_url(tmp_path)


@contextmanager
def halted() -> Iterator[None]:
    """The session's server stopped (as by a crash) for the block, started again after it."""
    postgres_server.halt()
    try:
        yield
    finally:
        postgres_server.resume()


def keys_in_commit_order(url: str) -> list[tuple[str, int]]:
    """Every row's key in PostgreSQL, in the order the rows were committed (their inserting
    transaction's id; rows of one transaction in their insertion order)."""
    with psycopg.connect(url, autocommit=True) as conn:
        found = conn.execute(
            "SELECT request_id, attempt FROM dispatcher_usage ORDER BY xmin::text::bigint, ctid"
        ).fetchall()
    return [(request_id, attempt) for request_id, attempt in found]


async def flushed_when_back(ledger: object, *, within: float = 60) -> None:
    """Flush until it succeeds: the forwarder retries on its own backoff (at most
    ``RETRY_CAP`` seconds apart); a flush while it cannot reach the server raises."""
    from dispatcher.store.outbox import OutboxLedger

    assert isinstance(ledger, OutboxLedger)
    with trio.fail_after(within):
        while True:
            try:
                await ledger.flush()
                return
            except StoreUnavailable:
                await trio.sleep(0.2)


async def test_an_outage_mid_load_loses_and_doubles_nothing(
    postgres_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rows recorded before, during and after PostgreSQL is stopped all arrive, once each,
    in the order they were recorded; ``record`` never fails; reads during the outage raise
    ``StoreUnavailable`` naming the server; the outage is logged once, its end too."""
    caplog.set_level(logging.INFO, logger="dispatcher.usage")
    recorded: list[tuple[str, int]] = []
    async with open_postgres_ledger(
        postgres_url, outbox=tmp_path / "outbox.sqlite3", connect_timeout=2
    ) as ledger:

        async def load(prefix: str, count: int) -> None:
            for i in range(count):
                r = row(f"{prefix}-{i:03d}", ended_at=T0 + len(recorded))
                ledger.record(r)
                recorded.append(r.key)
                await trio.sleep(0.002)

        await load("before", 100)
        await ledger.flush()
        with halted():
            await load("during", 150)  # some may reach PostgreSQL before it stops
            with trio.fail_after(30):
                while ledger.statistics().rows_in_outbox == 0:
                    await trio.sleep(0.05)
            with trio.fail_after(10), pytest.raises(StoreUnavailable, match="edge's outbox"):
                await ledger.flush()  # raises, does not wait the outage out
            with pytest.raises(StoreUnavailable) as raised:
                await ledger.query()
            assert raised.value.status == 503
            await load("still-down", 50)
            assert ledger.statistics().rows_in_outbox > 0
        await load("after", 50)
        await flushed_when_back(ledger)
        stats = ledger.statistics()
        report = await ledger.query(limit=MAX_QUERY_LIMIT)
    assert report.totals.attempts == len(recorded) == 350
    assert keys_in_commit_order(postgres_url) == recorded
    assert (stats.rows_written, stats.rows_lost, stats.duplicates_dropped) == (350, 0, 0)
    assert (stats.rows_pending, stats.rows_in_outbox) == (0, 0)
    assert stats.write_errors >= 1
    warnings = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert any("the outbox has drained" in r.getMessage() for r in caplog.records)


CHILD = """
import sys, time, trio
from dispatcher.store.postgres import open_postgres_ledger
sys.path.insert(0, {root!r})
from tests.store.test_contract_ledger import row

async def main(url, outbox, count):
    async with open_postgres_ledger(url, outbox=outbox, connect_timeout=1) as ledger:
        for i in range(count):
            ledger.record(row(f"killed-{{i:03d}}"))
            await trio.sleep(0)
        while ledger.statistics().rows_in_outbox < count:
            await trio.sleep(0.01)
        print("in the outbox", flush=True)
        await trio.sleep_forever()

trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
"""


async def test_a_killed_edge_s_outbox_is_written_when_it_opens_again(
    postgres_url: str, tmp_path: Path
) -> None:
    """A child edge records 200 rows while PostgreSQL is unreachable and is SIGKILLed with
    them in its outbox; the ledger opened again on the same file writes each once."""
    outbox = tmp_path / "outbox.sqlite3"
    dead = f"postgresql://postgres@127.0.0.1:{postgres_server._free_port()}/postgres"
    root = str(Path(__file__).resolve().parents[2])
    with halted():  # the edge's own server is down too: nothing reaches PostgreSQL
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD.format(root=root), dead, str(outbox), "200"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            line = await trio.to_thread.run_sync(child.stdout.readline)
            assert line.strip() == "in the outbox"
        finally:
            os.kill(child.pid, signal.SIGKILL)
            await trio.to_thread.run_sync(child.wait)
            if child.stdout is not None:
                child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    async with open_postgres_ledger(postgres_url, outbox=outbox) as ledger:
        await ledger.flush()
        stats = ledger.statistics()
    expected = [(f"killed-{i:03d}", 1) for i in range(200)]
    assert keys_in_commit_order(postgres_url) == expected
    assert (stats.rows_written, stats.duplicates_dropped, stats.rows_in_outbox) == (200, 0, 0)


async def test_a_resend_after_a_crash_between_commit_and_delete_doubles_nothing(
    postgres_url: str, tmp_path: Path
) -> None:
    """An outbox whose first batch PostgreSQL committed before the process died (the rows
    were taken, so marked sent, and not deleted): the ledger sends it again, PostgreSQL
    skips it, and those rows count as delivered; a row never sent whose key PostgreSQL
    already has is a true duplicate, dropped and counted."""
    path = tmp_path / "outbox.sqlite3"
    database = PostgresUsage(postgres_url)
    box = Outbox(path)
    try:
        box.write([row(f"r{i}") for i in range(10)])
        batch = box.take(6)
        assert batch is not None
        assert database.write(batch.rows).inserted == 6  # committed; then the edge died
        database.write([row("elsewhere")])  # another edge's row
        box.write([row("elsewhere", prompt_tokens=999)])  # the same key, never sent
    finally:
        box.close_database()
        database.close()
    async with open_postgres_ledger(postgres_url, outbox=path) as ledger:
        await ledger.flush()
        report = await ledger.query(limit=MAX_QUERY_LIMIT)
        stats = ledger.statistics()
    assert sorted(r.request_id for r in report.rows) == sorted(
        [f"r{i}" for i in range(10)] + ["elsewhere"]
    )
    assert next(r for r in report.rows if r.request_id == "elsewhere").prompt_tokens == 10
    assert (stats.rows_written, stats.duplicates_dropped, stats.rows_in_outbox) == (10, 1, 0)


async def test_an_edge_starts_while_postgres_is_down_and_its_reads_say_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No server at the URL: the ledger opens (a WARNING names the server, never its
    password), takes rows into the outbox, and its reads raise ``StoreUnavailable``
    naming the server; closing does not wait for the server, and the rows stay."""
    port = postgres_server._free_port()  # nothing listens there
    url = f"postgresql://edge:s3cret@127.0.0.1:{port}/ledger"
    outbox = tmp_path / "outbox.sqlite3"
    with trio.fail_after(30):
        async with open_postgres_ledger(url, outbox=outbox, connect_timeout=1.0) as ledger:
            ledger.record(row("kept"))
            while ledger.statistics().rows_in_outbox == 0:
                await trio.sleep(0.01)
            with pytest.raises(StoreUnavailable) as raised:
                await ledger.billable_spend(T0)
    message = str(raised.value)
    assert f"postgresql://edge@127.0.0.1:{port}/ledger" in message
    assert "has not answered yet" in message
    assert "s3cret" not in message
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"postgresql://edge@127.0.0.1:{port}/ledger cannot be reached" in logged
    assert "s3cret" not in logged
    box = Outbox(outbox)
    try:
        assert box.depth == 1
    finally:
        box.close_database()


async def test_rows_an_earlier_release_left_in_the_outbox_have_no_parts(
    postgres_url: str, tmp_path: Path
) -> None:
    """An outbox row is its fields as JSON: one written before the cached, cache-write and
    reasoning tokens existed lacks them, and arrives with 0 of each beside a row of now,
    which keeps its own."""
    path = tmp_path / "outbox.sqlite3"
    box = Outbox(path)
    try:
        box.write([row("now", cached_tokens=4, cache_write_tokens=1, reasoning_tokens=9)])
    finally:
        box.close_database()
    old = row("before")
    fields = {
        name: value
        for name, value in attrs.asdict(old).items()
        if name not in ("cached_tokens", "cache_write_tokens", "reasoning_tokens")
    }
    with closing(sqlite3.connect(path)) as conn:
        conn.execute(
            "INSERT INTO outbox (request_id, attempt, row) VALUES (?, ?, ?)",
            ("before", 1, orjson.dumps(fields)),
        )
        conn.commit()
    async with open_postgres_ledger(postgres_url, outbox=path) as ledger:
        await ledger.flush()
        report = await ledger.query()
    found = {r.request_id: r for r in report.rows}
    assert found["before"] == old
    parts = (found["now"].cached_tokens, found["now"].cache_write_tokens)
    assert (*parts, found["now"].reasoning_tokens) == (4, 1, 9)
