"""A durable local outbox in front of a shared usage ledger: :class:`OutboxLedger`, opened with
:func:`open_outbox_ledger` (the PostgreSQL ledger, :func:`~.postgres.open_postgres_ledger`,
is one).

::

    record(row) ──▶ BatchedLedger ──(batches)──▶ outbox (SQLite, on the edge's disk)
                                                     │  forwarder: oldest first, one
                                                     ▼  transaction per batch
                          query / query_groups ──▶ the shared database (PostgreSQL)

:meth:`OutboxLedger.record` hands the row to a :class:`~.ledger.BatchedLedger` whose database
is the outbox: a local SQLite file (WAL, ``synchronous=FULL``: a batch is on the disk once
its transaction returns, so neither a SIGKILL nor a power cut loses it; the fsync is paid
once per batch, not per row). A forwarder task, owned by the ledger's block, moves the rows
to the shared database in outbox order (``seq``), one batch per transaction, and deletes
them from the outbox only after that transaction committed.

Nothing is dropped for an outage: while the shared database cannot be reached the forwarder
retries with a capped backoff for as long as it takes, and rows accumulate in the outbox
(bounded by the disk). A WARNING is logged once per outage, an INFO when the outbox has
drained after it. Nothing is doubled: the shared table is keyed by ``(request_id, attempt)``
and skips a key it has, so a batch sent again (after a crash between its commit and the
outbox's delete, or a commit whose answer was lost) is harmless; the outbox marks each batch
before sending it, so a row found already there after being sent is counted as delivered,
not as a duplicate. The outbox itself keeps one row per key (a second row for a key it holds
is dropped as a duplicate, as the embedded ledger drops one). A row the shared database
refuses (a NUL in text, for PostgreSQL) can never be written: it moves to the outbox's
``refused`` table, for an operator, and is counted lost.

Rows an earlier process left in the outbox (it was killed, or closed while the database was
down) are forwarded first when the ledger opens on the same file again. Rows still in the
:class:`~.ledger.BatchedLedger`'s memory (at most ``batch_interval``, 50 ms by default) are
lost with a SIGKILL, as with the embedded ledger.

Reads go to the shared database: :meth:`OutboxLedger.flush` waits until every row recorded
before it is there, and the queries flush first. When the shared database cannot be reached
they raise :class:`~dispatcher.errors.StoreUnavailable` (503 for ``GET /v1/usage``) instead
of waiting the outage out; the rows stay safe in the outbox.

Opening never waits for the shared database beyond one connection attempt: when it cannot be
reached (``unreachable`` errors) the ledger opens anyway, records into the outbox, and the
forwarder connects when it comes back. Any other error of that first attempt (a schema newer
than this dispatcher's) is raised by the open. Leaving the block moves the memory's rows to
the outbox, then, if the shared database is reachable, forwards the outbox (shielded, at most
:data:`~.ledger.FLUSH_TIMEOUT` seconds); what is left stays in the outbox for the next open.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final, TypeVar, Unpack

import attrs
import orjson
import trio

from ..errors import StoreUnavailable
from .ledger import (
    FLUSH_TIMEOUT,
    MAX_PENDING_ROWS,
    RECENT_KEYS,
    BatchedLedger,
    groups_filter,
    open_background_nursery,
    open_batched_ledger,
    query_filter,
)
from .seam import UsageDatabase, WriteResult
from .usage import (
    DEFAULT_QUERY_LIMIT,
    EVERY_ROW,
    GROUP_BY,
    FilterFields,
    GroupBy,
    UsageFilter,
    UsageGroup,
    UsageLedgerStatistics,
    UsageReport,
    UsageRow,
)
from .usage_sqlite import ROW_COLUMNS, row_values

__all__ = ["Outbox", "OutboxLedger", "open_outbox_ledger"]

log = logging.getLogger("dispatcher.usage")
_T = TypeVar("_T")

RETRY_FIRST: Final = 0.1
"""Seconds before the forwarder's first retry after a failure; doubled each time..."""
RETRY_CAP: Final = 5.0
"""...up to this: the longest the forwarder waits between two tries, however long the
outage."""
_CLOSE_TIMEOUT: Final = 5.0
_SCHEMA_VERSION: Final = 1
_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: the order rows are forwarded in
    request_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    sent INTEGER NOT NULL DEFAULT 0,        -- times a transaction carrying it was begun
    row BLOB NOT NULL,                      -- the UsageRow's fields, JSON
    UNIQUE (request_id, attempt)
);
CREATE TABLE IF NOT EXISTS refused (
    seq INTEGER PRIMARY KEY,
    request_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    reason TEXT NOT NULL,
    refused_at REAL NOT NULL,
    row BLOB NOT NULL
);
"""


def _encode(row: UsageRow) -> bytes:
    return orjson.dumps(dict(zip(ROW_COLUMNS, row_values(row), strict=True)))


def _decode(blob: bytes) -> UsageRow:
    return UsageRow(**orjson.loads(blob))


@attrs.frozen
class _Batch:
    """The oldest rows of the outbox, as the forwarder took them."""

    last_seq: int
    rows: list[UsageRow]
    resent: frozenset[tuple[str, int]]
    """Keys a transaction was begun for before: found in the shared database, they are a
    resend, not a duplicate."""


# --------------------------------------------------------------------------- the outbox file


class Outbox:
    """The outbox: one SQLite connection, used from worker threads under a lock.

    :meth:`write` makes it the :class:`~dispatcher.store.seam.UsageDatabase` of the
    :class:`~.ledger.BatchedLedger` in front; its :meth:`close` is the ledger's own business
    (the forwarder still reads the outbox after the batched writer has closed), so
    :meth:`close_database` is the one that closes it."""

    errors: tuple[type[Exception], ...] = (sqlite3.Error,)

    def __init__(self, path: str | os.PathLike[str]) -> None:
        target = os.fspath(path)
        if target != ":memory:":
            file = Path(target).expanduser()
            file.parent.mkdir(parents=True, exist_ok=True)
            target = str(file)
        self.name = target
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(target, check_same_thread=False, isolation_level=None)
        try:
            self._setup(memory=target == ":memory:")
        except BaseException:
            self._conn.close()
            raise
        self.last_seq = self._one("SELECT COALESCE(MAX(seq), 0) FROM outbox")
        self.depth = self._one("SELECT COUNT(*) FROM outbox")
        self.on_write: Callable[[], None] = lambda: None
        """Called (from the writing thread) after rows went in."""

    def _one(self, sql: str) -> int:
        (value,) = self._conn.execute(sql).fetchone()
        return int(value)

    def _setup(self, *, memory: bool) -> None:
        conn = self._conn
        version = self._one("PRAGMA user_version")
        if version > _SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.name}: usage outbox schema version {version} is newer than this "
                f"dispatcher's ({_SCHEMA_VERSION}): run the newer dispatcher on it"
            )
        if not memory:
            (mode,) = conn.execute("PRAGMA journal_mode=WAL").fetchone()
            if str(mode).lower() != "wal":
                log.warning("%s: journal_mode is %s, not WAL", self.name, mode)
        conn.execute("PRAGMA synchronous=FULL")
        conn.executescript(f"BEGIN; {_SCHEMA} PRAGMA user_version={_SCHEMA_VERSION}; COMMIT;")

    def write(self, rows: Sequence[UsageRow]) -> WriteResult:
        """Keep ``rows`` at the end of the outbox, in one transaction: a key the outbox
        holds already is skipped and reported."""
        inserted = 0
        duplicates: list[tuple[str, int]] = []
        with self._lock:
            cursor = self._conn.cursor()
            cursor.execute("BEGIN")
            try:
                last = self.last_seq
                for row in rows:
                    cursor.execute(
                        "INSERT INTO outbox (request_id, attempt, row) VALUES (?, ?, ?) "
                        "ON CONFLICT (request_id, attempt) DO NOTHING",
                        (row.request_id, row.attempt, _encode(row)),
                    )
                    if cursor.rowcount == 1:
                        inserted += 1
                        last = int(cursor.lastrowid or last)
                    else:
                        duplicates.append(row.key)
                cursor.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.rollback()
                raise
            finally:
                cursor.close()
            self.last_seq = last
            self.depth += inserted
        if inserted:
            self.on_write()
        return WriteResult(inserted, duplicates, [])

    def take(self, limit: int) -> _Batch | None:
        """The oldest ``limit`` rows, marked as sent (in the same transaction); None when
        the outbox is empty."""
        with self._lock, self._conn:
            self._conn.execute("BEGIN")
            found = self._conn.execute(
                "SELECT seq, sent, row FROM outbox ORDER BY seq LIMIT ?", (limit,)
            ).fetchall()
            if not found:
                return None
            last_seq = found[-1][0]
            self._conn.execute("UPDATE outbox SET sent = sent + 1 WHERE seq <= ?", (last_seq,))
        rows = [_decode(blob) for _, _, blob in found]
        resent = frozenset(row.key for row, (_, sent, _) in zip(rows, found, strict=True) if sent)
        return _Batch(last_seq, rows, resent)

    def delivered(self, batch: _Batch, refused: Sequence[tuple[tuple[str, int], str]]) -> None:
        """``batch`` is committed in the shared database: forget it, but for the rows it
        ``refused``, which move to the ``refused`` table."""
        now = time.time()
        with self._lock, self._conn:
            self._conn.execute("BEGIN")
            for (request_id, attempt), reason in refused:
                self._conn.execute(
                    "INSERT OR REPLACE INTO refused (seq, request_id, attempt, reason, "
                    "refused_at, row) SELECT seq, request_id, attempt, ?, ?, row FROM outbox "
                    "WHERE request_id = ? AND attempt = ?",
                    (reason, now, request_id, attempt),
                )
            gone = self._conn.execute(
                "DELETE FROM outbox WHERE seq <= ?", (batch.last_seq,)
            ).rowcount
            self.depth -= gone

    def query(self, matching: UsageFilter, limit: int) -> UsageReport:
        raise NotImplementedError("the outbox is not read: the shared database answers")

    def query_groups(
        self, matching: UsageFilter, group_by: tuple[GroupBy, ...], billable: bool
    ) -> list[UsageGroup]:
        raise NotImplementedError("the outbox is not read: the shared database answers")

    def close(self) -> None:
        """Nothing: see the class docstring."""

    def close_database(self) -> None:
        with self._lock:
            self._conn.close()


# --------------------------------------------------------------------------- the forwarder


class _Forwarder:
    """Moves the outbox's rows to the shared database, oldest first, and connects to it
    (again and again until it answers). Its state is what the ledger's reads consult."""

    def __init__(
        self,
        outbox: Outbox,
        connect: Callable[[], UsageDatabase],
        *,
        where: str,
        unreachable: tuple[type[Exception], ...],
        max_batch: int,
    ) -> None:
        self._outbox = outbox
        self._connect = connect
        self._where = where
        self._unreachable = unreachable
        self._max_batch = max_batch
        self.remote: UsageDatabase | None = None
        self.limiter = trio.CapacityLimiter(2)  # the forwarder's call and one query
        self.failure: Exception | None = None
        """Why the last try failed; None once one succeeded."""
        self._outage_since: float | None = None
        self._forwarded_in_outage = 0
        self.delivered_seq = 0
        """Every row of the outbox with a ``seq`` up to this is in the shared database."""
        self._kick = trio.Event()
        self._progress = trio.Event()
        self.inserted = 0
        self.resent = 0
        self.duplicates = 0
        self.refused = 0
        self.batches = 0
        self.errors = 0
        self.errors_in_a_row = 0

    # ------------------------------------------------------------------ what reads see

    def kick(self) -> None:
        self._kick.set()

    def unavailable(self) -> StoreUnavailable:
        cause = f" ({self.failure})" if self.failure is not None else ""
        state = "has not answered yet" if self.remote is None else "cannot be reached"
        return StoreUnavailable(
            f"the usage ledger's database ({self._where}) {state}{cause}; "
            f"{self._outbox.depth} recorded rows wait in this edge's outbox and are written "
            "when it returns: retry later"
        )

    async def wait_delivered(self, seq: int) -> None:
        """Until the outbox's rows up to ``seq`` are in the shared database; raises
        :class:`StoreUnavailable` at once while it cannot be reached."""
        while self.delivered_seq < seq:
            if self.failure is not None:
                raise self.unavailable()
            self.kick()
            await self._progress.wait()
        await trio.lowlevel.checkpoint()

    # ------------------------------------------------------------------ the task

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect (reporting started after the first try, unless it failed for another
        reason than ``unreachable``: that is raised), then forward for ever."""
        delay = RETRY_FIRST
        first = True
        while self.remote is None:
            try:
                self.remote = await trio.to_thread.run_sync(self._connect, limiter=self.limiter)
            except Exception as exc:
                if first and not isinstance(exc, self._unreachable):
                    raise
                self._failed(exc)
            if first:
                first = False
                task_status.started()
            if self.remote is None:
                await trio.sleep(delay)
                delay = min(delay * 2, RETRY_CAP)
        self._succeeded()
        while True:
            await self.forward_once()

    async def forward_once(self) -> None:
        """Forward the oldest batch, or wait for rows; after a failure, back off."""
        assert self.remote is not None
        if self._outbox.depth == 0:
            await self._kick.wait()
            self._kick = trio.Event()
            return
        batch = await trio.to_thread.run_sync(self._outbox.take, self._max_batch)
        if batch is None:
            self._outbox.depth = 0  # (cannot happen: the count is kept under the lock)
            return
        try:
            result = await trio.to_thread.run_sync(
                self.remote.write, batch.rows, limiter=self.limiter
            )
        except self.remote.errors as exc:
            self.errors += 1
            self._failed(exc)
            delay = min(RETRY_FIRST * 2 ** (self.errors_in_a_row - 1), RETRY_CAP)
            await trio.sleep(delay)
            return
        await trio.to_thread.run_sync(self._outbox.delivered, batch, result.refused)
        self._account(batch, result)
        self.delivered_seq = batch.last_seq
        self._succeeded()
        self._progress.set()
        self._progress = trio.Event()

    async def drain(self) -> None:
        """Until what the outbox holds now is in the shared database, unless that cannot be
        reached (then at once)."""
        try:
            await self.wait_delivered(self._outbox.last_seq)
        except StoreUnavailable:
            pass

    # ------------------------------------------------------------------ bookkeeping

    def _failed(self, exc: Exception) -> None:
        self.errors_in_a_row += 1
        self.failure = exc
        self._progress.set()  # waiting reads see the failure
        self._progress = trio.Event()
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self._forwarded_in_outage = 0
            log.warning(
                "usage ledger: the database %s cannot be reached (%s); rows are kept in the "
                "outbox %s (%d now) and written when it returns",
                self._where,
                str(exc).strip() or type(exc).__name__,
                self._outbox.name,
                self._outbox.depth,
            )

    def _succeeded(self) -> None:
        self.errors_in_a_row = 0
        self.failure = None
        if self._outage_since is not None and self._outbox.depth == 0:
            log.info(
                "usage ledger: the database %s is back; the outbox has drained after %.1f s",
                self._where,
                time.monotonic() - self._outage_since,
            )
            self._outage_since = None

    def _account(self, batch: _Batch, result: WriteResult) -> None:
        self.batches += 1
        self.inserted += result.inserted
        for key in result.duplicates:
            if key in batch.resent:
                self.resent += 1  # an earlier transaction committed it: delivered
                continue
            self.duplicates += 1
            log.error(
                "usage ledger: request %r attempt %d is already in the database; "
                "the new row was dropped",
                *key,
            )
        for (request_id, attempt), reason in result.refused:
            log.error(
                "usage ledger: the database refused request %r attempt %d: %s; the row is "
                "kept in the outbox's refused table (%s)",
                request_id,
                attempt,
                reason,
                self._outbox.name,
            )
        self.refused += len(result.refused)


# --------------------------------------------------------------------------- the ledger


class OutboxLedger:
    """A :class:`~dispatcher.store.seam.UsageLedger` whose rows go through a durable local
    outbox to a shared database (see the module docstring). Create it with
    :func:`open_outbox_ledger`."""

    def __init__(self, writer: BatchedLedger, outbox: Outbox, forwarder: _Forwarder) -> None:
        self._writer = writer
        self._outbox = outbox
        self._forwarder = forwarder

    def record(self, row: UsageRow) -> None:
        """Queue ``row`` for the outbox: :meth:`BatchedLedger.record`'s promises (never
        blocks; :class:`~dispatcher.store.usage.DuplicateUsageRow`,
        ``trio.ClosedResourceError``)."""
        self._writer.record(row)

    async def flush(self) -> None:
        """Wait until every row recorded before the call is in the shared database (or
        given up). Raises :class:`~dispatcher.errors.StoreUnavailable` if the shared
        database cannot be reached: the rows are safe in the outbox."""
        await self._writer.flush()
        await self._forwarder.wait_delivered(self._outbox.last_seq)

    async def query(
        self,
        where: UsageFilter = EVERY_ROW,
        /,
        *,
        limit: int = DEFAULT_QUERY_LIMIT,
        **filters: Unpack[FilterFields],
    ) -> UsageReport:
        """:meth:`BatchedLedger.query`, read from the shared database (every edge's rows)."""
        where = query_filter(where, limit, filters)
        await self.flush()
        return await self._read(lambda remote: remote.query(where, limit))

    async def query_groups(
        self,
        where: UsageFilter = EVERY_ROW,
        /,
        *,
        group_by: Sequence[GroupBy] = GROUP_BY,
        billable: bool = False,
        **filters: Unpack[FilterFields],
    ) -> list[UsageGroup]:
        """:meth:`BatchedLedger.query_groups`, read from the shared database."""
        where, grouping = groups_filter(where, group_by, filters)
        await self.flush()
        return await self._read(lambda remote: remote.query_groups(where, grouping, billable))

    async def billable_spend(self, since: float) -> list[UsageGroup]:
        """What was billed to clients since ``since``, per key and UTC day, in the shared
        database: what every edge's budgets are seeded from."""
        return await self.query_groups(group_by=("key", "day"), since=since, billable=True)

    async def _read(self, call: Callable[[UsageDatabase], _T]) -> _T:
        remote = self._forwarder.remote
        if remote is None:
            raise self._forwarder.unavailable()
        try:
            return await trio.to_thread.run_sync(call, remote, limiter=self._forwarder.limiter)
        except remote.errors as exc:
            raise StoreUnavailable(
                f"reading the usage ledger's database failed ({str(exc).strip()}): retry later"
            ) from exc

    def statistics(self) -> UsageLedgerStatistics:
        """The batched writer's counts (``rows_recorded``, ``duplicates_refused``, rows lost
        before the outbox), with the shared database's: ``rows_written`` are the rows this
        ledger delivered there, ``batches`` its transactions, ``rows_in_outbox`` the rows
        waiting for it."""
        mine = self._writer.statistics()
        forwarder = self._forwarder
        return UsageLedgerStatistics(
            rows_recorded=mine.rows_recorded,
            rows_written=forwarder.inserted + forwarder.resent,
            rows_pending=mine.rows_pending + self._outbox.depth,
            rows_lost=mine.rows_lost + forwarder.refused,
            batches=forwarder.batches,
            duplicates_refused=mine.duplicates_refused,
            duplicates_dropped=mine.duplicates_dropped + forwarder.duplicates,
            write_errors=mine.write_errors + forwarder.errors + forwarder.refused,
            rows_in_outbox=self._outbox.depth,
        )


@asynccontextmanager
async def open_outbox_ledger(
    connect: Callable[[], UsageDatabase],
    outbox: str | os.PathLike[str],
    *,
    where: str,
    unreachable: tuple[type[Exception], ...],
    batch_interval: float = 0.05,
    max_batch: int = 500,
    recent_keys: int = RECENT_KEYS,
    max_pending: int = MAX_PENDING_ROWS,
) -> AsyncIterator[OutboxLedger]:
    """An :class:`OutboxLedger` keeping its rows in the SQLite file ``outbox`` (created,
    with its directory, if missing; ``":memory:"`` keeps them in memory, not durable) and
    forwarding them to the database ``connect()`` opens (in a worker thread; ``where`` names
    it in logs and errors, without secrets). ``connect`` raising one of ``unreachable`` means
    the database is down: the ledger opens anyway and connects when it comes back. The other
    arguments are :func:`~.ledger.open_usage_ledger`'s; ``max_batch`` bounds the forwarder's
    transactions too."""
    box = await trio.to_thread.run_sync(Outbox, outbox)
    forwarder = _Forwarder(box, connect, where=where, unreachable=unreachable, max_batch=max_batch)
    token = trio.lowlevel.current_trio_token()
    box.on_write = lambda: token.run_sync_soon(forwarder.kick)
    if box.depth:
        log.info(
            "usage ledger: %d rows left in the outbox %s by an earlier run are forwarded first",
            box.depth,
            box.name,
        )
    try:
        async with open_background_nursery("usage ledger closing") as nursery:
            await nursery.start(forwarder.serve)
            try:
                async with open_batched_ledger(
                    lambda: box,
                    batch_interval=batch_interval,
                    max_batch=max_batch,
                    recent_keys=recent_keys,
                    max_pending=max_pending,
                ) as writer:
                    yield OutboxLedger(writer, box, forwarder)
            finally:
                # The writer's block has put its rows in the outbox: forward them while the
                # database answers (the nursery's exit then stops the forwarder).
                with trio.move_on_after(FLUSH_TIMEOUT, shield=True):
                    await forwarder.drain()
    finally:
        if box.depth:
            log.warning(
                "usage ledger: closing with %d rows in the outbox %s; they are written when "
                "the ledger opens on it again",
                box.depth,
                box.name,
            )
        with trio.move_on_after(_CLOSE_TIMEOUT, shield=True) as closing:
            if forwarder.remote is not None:
                await trio.to_thread.run_sync(forwarder.remote.close)
            await trio.to_thread.run_sync(box.close_database)
        if closing.cancelled_caught:
            log.error("usage ledger: the databases were not closed in %g s", _CLOSE_TIMEOUT)
