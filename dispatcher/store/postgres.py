"""The shared backends on PostgreSQL: the usage ledger (:class:`PostgresUsage` behind the
durable local outbox of :mod:`dispatcher.store.outbox`) and the stored responses
(a :class:`~dispatcher.store.responses.BoundedResponseStore` over PostgreSQL), which several
edges can open on one database.

::

    async with (
        open_postgres_ledger(
            "postgresql://dispatcher@db/dispatcher", outbox=data_dir / "usage-outbox.sqlite3"
        ) as ledger,
        open_postgres_response_store("postgresql://dispatcher@db/dispatcher") as responses,
    ):
        ...

They answer exactly as the embedded SQLite backends do (the contract suite in
``tests/store/`` runs over both). psycopg 3's async API is asyncio-only, so its synchronous
connections (from a ``psycopg_pool.ConnectionPool``) are driven in worker threads
(``trio.to_thread``) under a ``CapacityLimiter`` no wider than the pool. A thread cannot be
cancelled: a call in flight is waited for, bounded by the pool's and the connection's timeouts.

The tables (``dispatcher_usage``, ``dispatcher_responses``) live in the connection's schema
(its ``search_path``), with their versions in ``dispatcher_schema``. Opening a backend migrates
its table forward under a transaction-level advisory lock, so edges starting together migrate
it once; a table newer than this dispatcher's is refused.

This is the only module that imports psycopg: the embedded default never needs it (install
the ``cluster`` extra for these backends).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

import orjson
import psycopg
import trio
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool

from ..errors import StoreUnavailable
from .ledger import MAX_PENDING_ROWS, RECENT_KEYS
from .outbox import OutboxLedger, open_outbox_ledger
from .responses import MAX_STORED, MAX_STORED_AGE, MAX_STORED_BYTES, BoundedResponseStore
from .seam import StoredResponse, WriteResult
from .usage import (
    GroupBy,
    UsageFilter,
    UsageGroup,
    UsageReport,
    UsageRow,
)
from .usage_sqlite import PART_COLUMNS, ROW_COLUMNS, fold_totals, row_values, usage_group

__all__ = [
    "POSTGRES_CONNECT_TIMEOUT",
    "PostgresUnreachable",
    "PostgresUsage",
    "migrate",
    "open_postgres_ledger",
    "open_postgres_response_store",
]

log = logging.getLogger("dispatcher.store.postgres")

POSTGRES_CONNECT_TIMEOUT: Final = 10.0
"""Seconds to wait for a connection (at open, and for each call)."""
_CLOSE_TIMEOUT: Final = 5.0
_MIGRATION_LOCK: Final = 0x7472696F_64697370  # "triodisp": one key for every migration
_EVICT_BATCH: Final = 64

# --------------------------------------------------------------------------- connections


def where_is(url: str) -> str:
    """``url`` without its password, for error messages and logs."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "(an unparsable PostgreSQL URL)"
    host = params.get("host") or "localhost"
    port = params.get("port") or 5432
    return f"postgresql://{params.get('user') or ''}@{host}:{port}/{params.get('dbname') or ''}"


class PostgresUnreachable(RuntimeError):
    """PostgreSQL could not be reached (its message names the server, without a password)."""


def _open_pool(url: str, size: int, timeout: float, *, wait: bool = True) -> ConnectionPool:
    """A pool of ``size`` autocommit connections to ``url``, open and connected: raises
    a :class:`RuntimeError` naming the server when it cannot be reached in ``timeout``.
    Without ``wait``, open and connecting in the background (each call waits ``timeout``
    for a connection)."""
    pool: ConnectionPool = ConnectionPool(
        url,
        min_size=1,
        max_size=size,
        kwargs={"autocommit": True, "connect_timeout": max(1, round(timeout))},
        timeout=timeout,
        open=False,
        name=f"dispatcher {where_is(url)}",
    )
    try:
        pool.open(wait=wait, timeout=timeout)
    except psycopg.OperationalError as exc:
        pool.close()
        raise PostgresUnreachable(
            f"could not connect to PostgreSQL at {where_is(url)} within {timeout:g} s ({exc}): "
            "check that the server runs and that the URL (host, port, user, database) is right"
        ) from exc
    return pool


def migrate(url: str, *, connect_timeout: float = POSTGRES_CONNECT_TIMEOUT) -> list[str]:
    """Bring every table of the shared backends on ``url`` to this dispatcher's version
    (what opening them does too): a line per component saying what was done. Blocking: for
    ``dispatcher migrate`` (or a worker thread). Raises :class:`PostgresUnreachable`, or a
    :class:`RuntimeError` for tables newer than this dispatcher's."""
    where = where_is(url)
    pool = _open_pool(url, 1, connect_timeout)
    lines = []
    try:
        with pool.connection() as conn:
            for component, steps in (("usage", _USAGE_STEPS), ("responses", _RESPONSES_STEPS)):
                before, after = _migrate(conn, component, steps, where)
                done = f"migrated from version {before}" if before < after else "up to date"
                lines.append(f"{where}: {component} tables at version {after} ({done})")
    finally:
        pool.close()
    return lines


def _migrate(
    conn: psycopg.Connection[Any], component: str, steps: Sequence[str], where: str
) -> tuple[int, int]:
    """Bring ``component``'s tables to version ``len(steps)`` (``steps[i]`` makes version
    ``i + 1``), in one transaction under the migration lock: (the version before, after)."""
    latest = len(steps)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS dispatcher_schema "
            "(component TEXT PRIMARY KEY, version INTEGER NOT NULL)"
        )
        found = conn.execute(
            "SELECT version FROM dispatcher_schema WHERE component = %s", (component,)
        ).fetchone()
        version: int = found[0] if found else 0
        if version > latest:
            raise RuntimeError(
                f"{where}: the {component} tables are at schema version {version}, newer than "
                f"this dispatcher's ({latest}): run the newer dispatcher, or a database of "
                "this version"
            )
        for step in steps[version:]:
            conn.execute(step)
        if version < latest:
            conn.execute(
                "INSERT INTO dispatcher_schema (component, version) VALUES (%s, %s) "
                "ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version",
                (component, latest),
            )
            log.info(
                "%s: %s tables migrated from version %d to %d", where, component, version, latest
            )
    return version, latest


# --------------------------------------------------------------------------- the usage ledger

_USAGE_STEPS: Final = (
    # Version 1: the SQLite ledger's version 3. Text compares as bytes (COLLATE "C"), as in
    # SQLite, whatever the database's locale: the order of the rows and the groups is one.
    """
    CREATE TABLE dispatcher_usage (
        request_id TEXT COLLATE "C" NOT NULL,
        attempt INTEGER NOT NULL,
        model_group TEXT COLLATE "C" NOT NULL,
        served_model TEXT NOT NULL,
        provider_id TEXT NOT NULL,
        node_id TEXT NOT NULL,
        path TEXT NOT NULL,
        attribution TEXT COLLATE "C",
        prompt_tokens BIGINT NOT NULL,
        completion_tokens BIGINT NOT NULL,
        usage_source TEXT NOT NULL,
        outcome TEXT NOT NULL,
        billable_to TEXT NOT NULL,
        queue_wait_s DOUBLE PRECISION NOT NULL,
        ttft_s DOUBLE PRECISION,
        duration_s DOUBLE PRECISION NOT NULL,
        ended_at DOUBLE PRECISION NOT NULL,
        client_request_id TEXT,
        route TEXT COLLATE "C",
        cost_usd DOUBLE PRECISION,
        PRIMARY KEY (request_id, attempt)
    );
    CREATE INDEX dispatcher_usage_ended_at ON dispatcher_usage (ended_at);
    CREATE INDEX dispatcher_usage_client_request_id ON dispatcher_usage (client_request_id);
    CREATE INDEX dispatcher_usage_attribution ON dispatcher_usage (attribution, ended_at);
    CREATE INDEX dispatcher_usage_model_group ON dispatcher_usage (model_group, ended_at);
    """,
    # Version 2: the SQLite ledger's version 4, the parts of the prompt and the completion
    # (0 in older rows).
    """
    ALTER TABLE dispatcher_usage
        ADD COLUMN cached_tokens BIGINT NOT NULL DEFAULT 0,
        ADD COLUMN cache_write_tokens BIGINT NOT NULL DEFAULT 0,
        ADD COLUMN reasoning_tokens BIGINT NOT NULL DEFAULT 0;
    """,
)
_PART_SUMS: Final = ", ".join(f"SUM({column})::BIGINT" for column in PART_COLUMNS)

_GROUP_COLUMNS: Final[Mapping[GroupBy, str]] = {
    "key": "attribution",
    "model": "model_group",
    "route": "route",
    "day": "to_char(to_timestamp(ended_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
}
_INSERT: Final = (
    f"INSERT INTO dispatcher_usage ({', '.join(ROW_COLUMNS)}) "
    f"VALUES ({', '.join(['%s'] * len(ROW_COLUMNS))}) "
    "ON CONFLICT (request_id, attempt) DO NOTHING RETURNING 1"
)
_REFUSED: Final = (psycopg.DataError, psycopg.IntegrityError)
"""What the database raises for a row it will not take (the row is lost, not retried)."""


class PostgresUsage:
    """The ledger's :class:`~dispatcher.store.seam.UsageDatabase` on PostgreSQL: a pool of
    synchronous connections, called from worker threads."""

    errors: tuple[type[Exception], ...] = (psycopg.Error,)
    """What a failed call raises (the pool's timeout is a ``psycopg.OperationalError``)."""

    def __init__(self, url: str, *, connect_timeout: float = POSTGRES_CONNECT_TIMEOUT) -> None:
        self._where = where_is(url)
        self._pool = _open_pool(url, 2, connect_timeout)
        try:
            with self._pool.connection() as conn:
                _migrate(conn, "usage", _USAGE_STEPS, self._where)
        except BaseException:
            self._pool.close()
            raise

    def write(self, rows: Sequence[UsageRow]) -> WriteResult:
        """Insert ``rows`` in one transaction, as :class:`~.usage_sqlite.SQLiteUsage` does: a
        key already there is skipped and reported, a row the database refuses is reported
        and the others are written; any other error rolls the batch back and is raised."""
        values = [row_values(row) for row in rows]
        with self._pool.connection() as conn, conn.transaction():
            try:
                # One round trip for the batch (a pipeline), in a savepoint: if the database
                # refuses a row, the batch is written again one row at a time.
                with conn.transaction(), conn.cursor() as cursor:
                    cursor.executemany(_INSERT, values, returning=True)
                    outcomes: list[bool | str] = []
                    while True:
                        outcomes.append(cursor.rowcount == 1)
                        if not cursor.nextset():
                            break
            except _REFUSED:
                outcomes = [_insert_alone(conn, params) for params in values]
        inserted = 0
        duplicates: list[tuple[str, int]] = []
        refused: list[tuple[tuple[str, int], str]] = []
        for row, outcome in zip(rows, outcomes, strict=True):
            if isinstance(outcome, str):
                refused.append((row.key, outcome))
            elif outcome:
                inserted += 1
            else:
                duplicates.append(row.key)
        return WriteResult(inserted, duplicates, refused)

    def query(self, matching: UsageFilter, limit: int) -> UsageReport:
        where, params = _where(matching)
        with self._pool.connection() as conn, conn.transaction():
            # One snapshot for the rows and the totals.
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            found = conn.execute(
                f"SELECT {', '.join(ROW_COLUMNS)} FROM dispatcher_usage {where} "
                "ORDER BY ended_at DESC, request_id DESC, attempt DESC LIMIT %s",
                [*params, limit],
            ).fetchall()
            requests_row = conn.execute(
                f"SELECT COUNT(DISTINCT request_id) FROM dispatcher_usage {where}", params
            ).fetchone()
            groups = conn.execute(
                "SELECT billable_to, outcome, usage_source, COUNT(*), "
                "SUM(prompt_tokens)::BIGINT, SUM(completion_tokens)::BIGINT, "
                f"SUM(COALESCE(cost_usd, 0)), {_PART_SUMS} "
                f"FROM dispatcher_usage {where} "
                "GROUP BY billable_to, outcome, usage_source",
                params,
            ).fetchall()
        assert requests_row is not None
        return UsageReport(
            filter=matching,
            limit=limit,
            totals=fold_totals(requests_row[0], groups),
            rows=tuple(UsageRow(**dict(zip(ROW_COLUMNS, values, strict=True))) for values in found),
        )

    def query_groups(
        self, matching: UsageFilter, group_by: tuple[GroupBy, ...], billable: bool
    ) -> list[UsageGroup]:
        where, params = _where(matching)
        if billable:
            where = (
                f"{where} AND billable_to = 'client'" if where else "WHERE billable_to = 'client'"
            )
        dimensions = [_GROUP_COLUMNS[name] for name in group_by]
        selected = "".join(f"{column}, " for column in dimensions)
        # SQLite puts NULL first in ascending order; PostgreSQL last unless told.
        grouping = (
            f"GROUP BY {', '.join(dimensions)} "
            f"ORDER BY {', '.join(f'{column} NULLS FIRST' for column in dimensions)}"
        )
        with self._pool.connection() as conn:
            found = conn.execute(
                f"SELECT {selected}COUNT(DISTINCT request_id), COUNT(*), "
                "SUM(prompt_tokens)::BIGINT, SUM(completion_tokens)::BIGINT, "
                "SUM(CASE WHEN billable_to = 'client' THEN prompt_tokens ELSE 0 END)::BIGINT, "
                "SUM(CASE WHEN billable_to = 'client' THEN completion_tokens ELSE 0 END)::BIGINT, "
                "SUM(CASE WHEN billable_to = 'client' THEN COALESCE(cost_usd, 0) ELSE 0 END), "
                f"{_PART_SUMS} FROM dispatcher_usage {where} {grouping if dimensions else ''}",
                params,
            ).fetchall()
        return [group for values in found if (group := usage_group(group_by, values)) is not None]

    def close(self) -> None:
        self._pool.close()


def _insert_alone(conn: psycopg.Connection[Any], params: Sequence[Any]) -> bool | str:
    """One row in a savepoint of its own: True written, False a duplicate, or why the
    database refused it."""
    try:
        with conn.transaction(), conn.cursor() as cursor:
            cursor.execute(_INSERT, params)
            return cursor.rowcount == 1
    except _REFUSED as exc:
        return str(exc).strip()


def _where(matching: UsageFilter) -> tuple[str, list[object]]:
    clauses: list[str] = []
    params: list[object] = []
    for clause, value in (
        ("ended_at >= %s", matching.since),
        ("ended_at < %s", matching.until),
        ("attribution = %s", matching.attribution),
        ("model_group = %s", matching.model),
        ("client_request_id = %s", matching.client_request_id),
    ):
        if value is not None:
            clauses.append(clause)
            params.append(value)
    return (f"WHERE {' AND '.join(clauses)}" if clauses else ""), params


@asynccontextmanager
async def open_postgres_ledger(
    url: str,
    *,
    outbox: str | os.PathLike[str],
    connect_timeout: float = POSTGRES_CONNECT_TIMEOUT,
    batch_interval: float = 0.05,
    max_batch: int = 500,
    recent_keys: int = RECENT_KEYS,
    max_pending: int = MAX_PENDING_ROWS,
) -> AsyncIterator[OutboxLedger]:
    """A usage ledger on the PostgreSQL database ``url`` (a libpq URL or ``key=value``
    string), through a durable local outbox: the SQLite file ``outbox`` on this edge's disk
    (``":memory:"`` for tests: not durable). See :mod:`dispatcher.store.outbox`: rows
    recorded while PostgreSQL is down or slow wait in the outbox and are written, in order,
    when it returns; rows a killed edge left there are written when it opens again.

    The edge starts while PostgreSQL is down: when the server cannot be reached within
    ``connect_timeout`` seconds, the ledger opens anyway (a WARNING names the server) and
    connects when it comes back; until then its reads raise
    :class:`~dispatcher.errors.StoreUnavailable`. Tables newer than this dispatcher's are
    refused with a :class:`RuntimeError` at open."""
    async with open_outbox_ledger(
        lambda: PostgresUsage(url, connect_timeout=connect_timeout),
        outbox,
        where=where_is(url),
        unreachable=(PostgresUnreachable, psycopg.OperationalError),
        batch_interval=batch_interval,
        max_batch=max_batch,
        recent_keys=recent_keys,
        max_pending=max_pending,
    ) as ledger:
        yield ledger


# --------------------------------------------------------------------------- stored responses

_RESPONSES_STEPS: Final = (
    """
    CREATE TABLE dispatcher_responses (
        seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        owner TEXT,
        stored_at DOUBLE PRECISION NOT NULL,
        size BIGINT NOT NULL,
        response BYTEA NOT NULL,
        conversation BYTEA NOT NULL
    );
    CREATE INDEX dispatcher_responses_stored_at ON dispatcher_responses (stored_at);
    """,
)
_POOL_SIZE: Final = 4
"""Connections (and worker threads) of one response store."""


class _ResponsesDatabase:
    """The response store's pool; every method runs in a worker thread and returns the
    table's count and size as its transaction left them."""

    def __init__(self, url: str, connect_timeout: float) -> None:
        self.where = where_is(url)
        self.entries = self.bytes = 0
        self._ready = False
        self._readying = threading.Lock()
        try:
            self._pool = _open_pool(url, _POOL_SIZE, connect_timeout)
        except PostgresUnreachable as exc:
            # The edge starts all the same: the pool connects in the background, and the
            # tables are migrated on the first call that reaches the server.
            log.warning("stored responses: %s; until it answers, they cannot be read", exc)
            self._pool = _open_pool(url, _POOL_SIZE, connect_timeout, wait=False)
            return
        try:
            with self._connection():
                pass  # migrated now, at start, while the server answers
        except BaseException:
            self._pool.close()
            raise

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection of the pool, on tables migrated to this dispatcher's version; the
        database unreachable (or the pool out of connections past its timeout) is
        :class:`~dispatcher.errors.StoreUnavailable`."""
        try:
            with self._pool.connection() as conn:
                if not self._ready:
                    with self._readying:
                        if not self._ready:
                            _migrate(conn, "responses", _RESPONSES_STEPS, self.where)
                            self.entries, self.bytes = _count(conn)
                            self._ready = True
                yield conn
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(
                f"the stored responses' database ({self.where}) cannot be reached: {exc}"
            ) from exc

    def put(
        self,
        response_id: str,
        owner: str | None,
        response: bytes,
        conversation: bytes,
        now: float,
        horizon: float,
        max_entries: int,
        max_bytes: int,
    ) -> int:
        """As the SQLite store's ``put``; the table is locked against other puts (other
        edges' too) for the transaction, so the bounds hold across edges."""
        size = len(response) + len(conversation)
        evicted = 0
        with self._connection() as conn, conn.transaction():
            conn.execute("LOCK TABLE dispatcher_responses IN SHARE ROW EXCLUSIVE MODE")
            conn.execute("DELETE FROM dispatcher_responses WHERE id = %s", (response_id,))
            aged = conn.execute(
                "DELETE FROM dispatcher_responses WHERE stored_at <= %s", (horizon,)
            ).rowcount
            evicted += max(aged, 0)
            conn.execute(
                "INSERT INTO dispatcher_responses "
                "(id, owner, stored_at, size, response, conversation) "
                "VALUES (%s, %s, %s, %s, %s, %s)",
                (response_id, owner, now, size, response, conversation),
            )
            entries, total = _count(conn)
            while entries > max_entries or total > max_bytes:
                oldest = conn.execute(
                    "SELECT seq, size FROM dispatcher_responses ORDER BY seq LIMIT %s",
                    (_EVICT_BATCH,),
                ).fetchall()
                gone = []
                for seq, freed in oldest:
                    if entries <= max_entries and total <= max_bytes:
                        break
                    gone.append(seq)
                    entries, total, evicted = entries - 1, total - freed, evicted + 1
                conn.execute("DELETE FROM dispatcher_responses WHERE seq = ANY(%s)", (gone,))
        self.entries, self.bytes = entries, total
        return evicted

    def get(self, response_id: str, owner: str | None, horizon: float) -> StoredResponse | None:
        with self._connection() as conn:
            found = conn.execute(
                "SELECT response, conversation, size, stored_at FROM dispatcher_responses "
                "WHERE id = %s AND owner IS NOT DISTINCT FROM %s AND stored_at > %s",
                (response_id, owner, horizon),
            ).fetchone()
        if found is None:
            return None
        response, conversation, size, stored_at = found
        return StoredResponse(
            orjson.loads(response), tuple(orjson.loads(conversation)), size, stored_at, owner
        )

    def delete(self, response_id: str, owner: str | None, horizon: float) -> bool:
        with self._connection() as conn, conn.transaction():
            deleted = conn.execute(
                "DELETE FROM dispatcher_responses "
                "WHERE id = %s AND owner IS NOT DISTINCT FROM %s AND stored_at > %s",
                (response_id, owner, horizon),
            ).rowcount
            self.entries, self.bytes = _count(conn)
        return deleted > 0

    def close(self) -> None:
        self._pool.close()


def _count(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    found = conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(size), 0)::BIGINT FROM dispatcher_responses"
    ).fetchone()
    assert found is not None
    return found[0], found[1]


@asynccontextmanager
async def open_postgres_response_store(
    url: str,
    *,
    max_entries: int = MAX_STORED,
    max_bytes: int = MAX_STORED_BYTES,
    max_age: float = MAX_STORED_AGE,
    clock: Callable[[], float] = time.time,
    connect_timeout: float = POSTGRES_CONNECT_TIMEOUT,
) -> AsyncIterator[BoundedResponseStore]:
    """A response store on the PostgreSQL database ``url``, bounded as
    :func:`~dispatcher.store.responses.open_response_store`'s. Leaving the block closes
    the pool (shielded, at most :data:`_CLOSE_TIMEOUT` seconds, after the calls in flight)."""
    if max_entries < 1 or max_bytes < 1 or max_age <= 0:
        raise ValueError("max_entries and max_bytes must be >= 1, max_age > 0")
    database = await trio.to_thread.run_sync(_ResponsesDatabase, url, connect_timeout)
    store = BoundedResponseStore(
        database,
        max_entries=max_entries,
        max_bytes=max_bytes,
        max_age=max_age,
        clock=clock,
        limiter=trio.CapacityLimiter(_POOL_SIZE),
    )
    try:
        yield store
    finally:
        store.closed = True
        with trio.move_on_after(_CLOSE_TIMEOUT, shield=True) as waiting:
            # Every place of the limiter: the calls in flight end first.
            for _ in range(_POOL_SIZE):
                await store.limiter.acquire_on_behalf_of(object())
        if waiting.cancelled_caught:
            log.error(
                "response store: calls to %s still run after %g s; closing its pool anyway",
                database.where,
                _CLOSE_TIMEOUT,
            )
        # The pool closes under a call still in flight too (its connection is closed when
        # returned); pool.close bounds its own wait for its worker threads.
        with trio.move_on_after(_CLOSE_TIMEOUT, shield=True):
            await trio.to_thread.run_sync(database.close)
