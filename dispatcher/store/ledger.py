"""The embedded usage ledger: :class:`BatchedLedger`, an outbox of rows written off the event
loop in batches to a :class:`~dispatcher.store.seam.UsageDatabase` (SQLite,
:class:`~dispatcher.store.usage_sqlite.SQLiteUsage`, by default).

::

    async with open_usage_ledger(data_dir / USAGE_DB_NAME) as ledger:
        ...
        ledger.record(row)        # synchronous, never blocks: safe in `finally:` blocks
        ...
        report = await ledger.query(UsageFilter(since=t0, attribution="key-1"))
    # leaving the block, however it is left, writes what is pending (shielded, with a
    # deadline) and closes the database

A row is one *attempt* of a request, keyed by ``(request_id, attempt)`` and recorded exactly
once, when the attempt ends. :meth:`BatchedLedger.record` only appends the row to an in-memory
batch; a writer task owned by the ledger writes batches in one transaction each, in a worker
thread (a ``CapacityLimiter(1)`` keeps the single connection to one thread at a time; queries
go through the same limiter).

Exactly once: ``record`` refuses a key this ledger already holds -- pending, being written, or
among the last ``recent_keys`` written -- with :class:`DuplicateUsageRow`. Older duplicates
(and rows already in the file from an earlier run) meet the table's primary key at write time:
the new row is dropped with an error log and counted in :meth:`BatchedLedger.statistics`, and
the other rows of its batch are written as usual.

Write failures never reach the caller of ``record``: a failed transaction is retried with backoff,
then its rows are dropped; both are logged and counted. Memory is bounded by ``max_pending``
(rows beyond it are dropped, logged and counted) and ``recent_keys``.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Final, Unpack

import attrs
import trio

from .seam import UsageDatabase
from .usage import (
    DEFAULT_QUERY_LIMIT,
    EVERY_ROW,
    GROUP_BY,
    MAX_QUERY_LIMIT,
    DuplicateUsageRow,
    FilterFields,
    GroupBy,
    UsageFilter,
    UsageGroup,
    UsageLedgerStatistics,
    UsageReport,
    UsageRow,
)
from .usage_sqlite import SQLiteUsage

__all__ = [
    "FLUSH_TIMEOUT",
    "MAX_PENDING_ROWS",
    "RECENT_KEYS",
    "BatchedLedger",
    "groups_filter",
    "open_background_nursery",
    "open_batched_ledger",
    "open_usage_ledger",
    "query_filter",
]

log = logging.getLogger("dispatcher.usage")

FLUSH_TIMEOUT: Final = 10.0
"""Seconds the ledger may spend writing pending rows when its block is left."""
_CLOSE_TIMEOUT: Final = 5.0
"""Seconds for closing the database after that (a WAL checkpoint)."""
RECENT_KEYS: Final = 4096
"""Default number of written keys ``record`` still refuses as duplicates by itself."""
MAX_PENDING_ROWS: Final = 100_000
"""Default bound on rows waiting to be written."""
_WRITE_ATTEMPTS: Final = 5
"""Tries of one batch's transaction before its rows are given up."""
_RETRY_DELAY: Final = 0.1
"""Seconds before the first retry of a failed transaction; doubles each time."""


# --------------------------------------------------------------------------- the ledger


def query_filter(where: UsageFilter, limit: int, filters: FilterFields) -> UsageFilter:
    """A query's filter (``where`` with ``filters`` over it), its ``limit`` checked: what
    every ledger's :meth:`~BatchedLedger.query` takes."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, got {limit!r}")
    if not 0 <= limit <= MAX_QUERY_LIMIT:
        raise ValueError(f"limit must be between 0 and {MAX_QUERY_LIMIT}, got {limit}")
    return attrs.evolve(where, **filters)


def groups_filter(
    where: UsageFilter, group_by: Sequence[GroupBy], filters: FilterFields
) -> tuple[UsageFilter, tuple[GroupBy, ...]]:
    """A grouped query's filter and grouping, checked: what every ledger's
    :meth:`~BatchedLedger.query_groups` takes."""
    unknown = [name for name in group_by if name not in GROUP_BY]
    if unknown or len(set(group_by)) != len(group_by):
        raise ValueError(f"group_by: expected distinct names of {GROUP_BY}, got {group_by}")
    return attrs.evolve(where, **filters), tuple(group_by)


class BatchedLedger:
    """Records attempts and answers usage queries: the embedded
    :class:`~dispatcher.store.seam.UsageLedger`. Create it with :func:`open_usage_ledger`."""

    def __init__(
        self,
        database: UsageDatabase,
        *,
        batch_interval: float,
        max_batch: int,
        recent_keys: int,
        max_pending: int,
    ) -> None:
        self._db = database
        self._limiter = trio.CapacityLimiter(1)
        self._batch_interval = batch_interval
        self._max_batch = max_batch
        self._recent_keys = recent_keys
        self._max_pending = max_pending
        self._pending: list[UsageRow] = []
        # Keys of the pending rows (the newest ones) and of up to `recent_keys` written rows,
        # in recording order, so the oldest written ones are forgotten first.
        self._keys: set[tuple[str, int]] = set()
        self._key_order: collections.deque[tuple[str, int]] = collections.deque()
        self._kick = trio.Event()  # rows became pending, a batch filled up, or a flush waits
        self._progress = trio.Event()  # a batch was settled
        self._flush_waiters = 0
        self._failures = 0  # consecutive failed transactions of the head batch
        self._closed = False
        self._overflowing = False
        self._accepted = 0
        self._settled = 0
        self._written = 0
        self._lost = 0
        self._batches = 0
        self._duplicates_refused = 0
        self._duplicates_dropped = 0
        self._write_errors = 0

    # ------------------------------------------------------------------ public

    def record(self, row: UsageRow) -> None:
        """Queue ``row`` for writing. Synchronous and never blocks, so it can be called from
        a ``finally:`` block, even in a cancelled scope.

        Raises :class:`DuplicateUsageRow` if this ledger already has the row's key (see the
        module docstring for how far back it looks), and ``trio.ClosedResourceError`` once the
        ledger's block has been left.
        """
        if self._closed:
            raise trio.ClosedResourceError("the usage ledger is closed")
        key = (row.request_id, row.attempt)
        if key in self._keys:
            self._duplicates_refused += 1
            raise DuplicateUsageRow(row.request_id, row.attempt)
        pending = self._pending
        if len(pending) >= self._max_pending:
            self._lost += 1
            if not self._overflowing:
                self._overflowing = True
                log.error(
                    "usage ledger: %d rows are waiting to be written; dropping new rows "
                    "until the writer catches up",
                    len(pending),
                )
            return
        self._keys.add(key)
        self._key_order.append(key)
        pending.append(row)
        self._accepted += 1
        if len(pending) == 1 or len(pending) == self._max_batch:
            self._kick.set()

    async def flush(self) -> None:
        """Wait until every row recorded before this call is written (or given up, see
        :meth:`statistics`)."""
        if self._closed:
            raise trio.ClosedResourceError("the usage ledger is closed")
        target = self._accepted
        if self._settled >= target:
            await trio.lowlevel.checkpoint()
            return
        self._flush_waiters += 1
        self._kick.set()
        try:
            while self._settled < target:
                if self._closed:
                    raise trio.ClosedResourceError("the usage ledger closed before the flush")
                await self._progress.wait()
        finally:
            self._flush_waiters -= 1

    async def query(
        self,
        where: UsageFilter = EVERY_ROW,
        /,
        *,
        limit: int = DEFAULT_QUERY_LIMIT,
        **filters: Unpack[FilterFields],
    ) -> UsageReport:
        """The rows ``where`` covers, newest first, at most ``limit`` of them; totals over
        every matching row. ``filters`` are :class:`UsageFilter`'s fields by name, over
        ``where``'s (``query(since=t0, model="llama")``). Everything recorded before the call
        is included."""
        where = query_filter(where, limit, filters)
        await self.flush()
        return await trio.to_thread.run_sync(self._db.query, where, limit, limiter=self._limiter)

    async def query_groups(
        self,
        where: UsageFilter = EVERY_ROW,
        /,
        *,
        group_by: Sequence[GroupBy] = GROUP_BY,
        billable: bool = False,
        **filters: Unpack[FilterFields],
    ) -> list[UsageGroup]:
        """Sums of the rows ``where`` (and ``filters``, as :meth:`query` takes them) covers
        (only rows billable to the client with ``billable``), grouped by ``group_by`` (any
        of :data:`GROUP_BY`, none: one group of every row), ordered by the groups' values.
        Everything recorded before the call is included."""
        where, grouping = groups_filter(where, group_by, filters)
        await self.flush()
        return await trio.to_thread.run_sync(
            self._db.query_groups, where, grouping, billable, limiter=self._limiter
        )

    async def billable_spend(self, since: float) -> list[UsageGroup]:
        """What was billed to clients since ``since``, per key and UTC day."""
        return await self.query_groups(group_by=("key", "day"), since=since, billable=True)

    def statistics(self) -> UsageLedgerStatistics:
        return UsageLedgerStatistics(
            rows_recorded=self._accepted,
            rows_written=self._written,
            rows_pending=len(self._pending),
            rows_lost=self._lost,
            batches=self._batches,
            duplicates_refused=self._duplicates_refused,
            duplicates_dropped=self._duplicates_dropped,
            write_errors=self._write_errors,
        )

    # ------------------------------------------------------------------ the writer

    async def _serve_writer(self) -> None:
        while True:
            await self._wait_for_batch()
            await self._write_head_batch()

    async def _wait_kick(self) -> None:
        await self._kick.wait()
        self._kick = trio.Event()

    async def _wait_for_batch(self) -> None:
        """Until rows are pending, then up to ``batch_interval`` more for the batch to fill,
        unless it is full already or someone waits in :meth:`flush`."""
        while not self._pending:
            await self._wait_kick()
        with trio.move_on_after(self._batch_interval):
            while self._flush_waiters == 0 and len(self._pending) < self._max_batch:
                await self._wait_kick()

    async def _write_head_batch(self) -> None:
        """Write the oldest ``max_batch`` pending rows. The rows stay pending (their keys
        refused by ``record``) until their transaction has ended; a cancellation while it
        runs waits for the thread, so the outcome is never lost."""
        batch = self._pending[: self._max_batch]
        try:
            result = await trio.to_thread.run_sync(self._db.write, batch, limiter=self._limiter)
        except self._db.errors as exc:
            self._write_errors += 1
            self._failures += 1
            if self._failures < _WRITE_ATTEMPTS:
                delay = _RETRY_DELAY * 2 ** (self._failures - 1)
                log.warning(
                    "usage ledger: writing %d rows failed (%s); retrying in %.1f s",
                    len(batch),
                    exc,
                    delay,
                )
                await trio.sleep(delay)
                return
            log.exception(
                "usage ledger: writing %d rows failed %d times; they are lost",
                len(batch),
                self._failures,
            )
            self._lost += len(batch)
            self._settle(len(batch))
            return
        self._batches += 1
        self._written += result.inserted
        for request_id, attempt in result.duplicates:
            log.error(
                "usage ledger: request %r attempt %d is already in the database; "
                "the new row was dropped",
                request_id,
                attempt,
            )
        self._duplicates_dropped += len(result.duplicates)
        for (request_id, attempt), reason in result.refused:
            log.error(
                "usage ledger: the database refused request %r attempt %d: %s",
                request_id,
                attempt,
                reason,
            )
        self._write_errors += len(result.refused)
        self._lost += len(result.refused)
        self._settle(len(batch))

    def _settle(self, count: int) -> None:
        """The oldest ``count`` pending rows are done with: written, dropped or lost."""
        self._failures = 0
        del self._pending[:count]
        self._settled += count
        self._overflowing = False
        keep = len(self._pending) + self._recent_keys
        while len(self._key_order) > keep:
            self._keys.discard(self._key_order.popleft())
        self._progress.set()
        self._progress = trio.Event()

    async def _drain(self) -> None:
        while self._pending:
            await self._write_head_batch()

    def _close(self) -> None:
        self._closed = True
        if self._pending:
            log.error(
                "usage ledger: closing with %d rows not written; they are lost",
                len(self._pending),
            )
            self._lost += len(self._pending)
            self._pending.clear()
        self._progress.set()  # wake flush() waiters; they see the ledger closed


@asynccontextmanager
async def open_background_nursery(reason: str) -> AsyncIterator[trio.Nursery]:
    """A nursery for a store's background tasks around the block that uses the store:
    leaving the block cancels them (with ``reason``), and what the block raised comes out
    as it was raised, not wrapped in a group. The tasks raise nothing but bugs (they log and
    count their failures)."""
    unwrapped: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                yield nursery
            finally:
                nursery.cancel_scope.cancel(reason=reason)
    except BaseExceptionGroup as group:
        # The group holds what the block raised, beside Cancelled if it was cancelled from
        # outside. Give the caller that exception as it was raised.
        raised = [exc for exc in group.exceptions if not isinstance(exc, trio.Cancelled)]
        if len(raised) != 1:
            raise
        unwrapped = raised[0]
    if unwrapped is not None:
        raise unwrapped  # outside the `except`, so its __context__ is left as it was


@asynccontextmanager
async def open_usage_ledger(
    path: str | os.PathLike[str] | None = ":memory:",
    *,
    batch_interval: float = 0.05,
    max_batch: int = 500,
    recent_keys: int = RECENT_KEYS,
    max_pending: int = MAX_PENDING_ROWS,
) -> AsyncIterator[BatchedLedger]:
    """A usage ledger on the SQLite file ``path`` (created, with its directory, if missing),
    or on a private in-memory database for ``":memory:"`` or None.

    The writer waits up to ``batch_interval`` seconds after a row is recorded for more to
    come (not at all when ``max_batch`` are pending or someone flushes), then writes up to
    ``max_batch`` rows in one transaction.
    Leaving the block -- normally, with an error or by cancellation -- writes every pending
    row (shielded, at most :data:`FLUSH_TIMEOUT` seconds) and closes the database.
    """
    async with open_batched_ledger(
        functools.partial(SQLiteUsage, path),
        batch_interval=batch_interval,
        max_batch=max_batch,
        recent_keys=recent_keys,
        max_pending=max_pending,
    ) as ledger:
        yield ledger


@asynccontextmanager
async def open_batched_ledger(
    connect: Callable[[], UsageDatabase],
    *,
    batch_interval: float = 0.05,
    max_batch: int = 500,
    recent_keys: int = RECENT_KEYS,
    max_pending: int = MAX_PENDING_ROWS,
) -> AsyncIterator[BatchedLedger]:
    """A :class:`BatchedLedger` over the database ``connect()`` opens (called in a worker
    thread), as :func:`open_usage_ledger` describes; a shared backend
    (:mod:`dispatcher.store.postgres`) opens its ledger through this too."""
    if batch_interval < 0 or max_batch < 1 or recent_keys < 0 or max_pending < 1:
        raise ValueError(
            "batch_interval must be >= 0, max_batch >= 1, recent_keys >= 0, max_pending >= 1"
        )
    database = await trio.to_thread.run_sync(connect)
    ledger = BatchedLedger(
        database,
        batch_interval=batch_interval,
        max_batch=max_batch,
        recent_keys=recent_keys,
        max_pending=max_pending,
    )
    try:
        async with open_background_nursery("usage ledger closing") as nursery:
            nursery.start_soon(ledger._serve_writer)
            yield ledger
    finally:
        with trio.move_on_after(FLUSH_TIMEOUT, shield=True):
            await ledger._drain()
        ledger._close()
        with trio.move_on_after(_CLOSE_TIMEOUT, shield=True) as closing:
            await trio.to_thread.run_sync(database.close, limiter=ledger._limiter)
        if closing.cancelled_caught:
            log.error("usage ledger: the database was not closed in %g s", _CLOSE_TIMEOUT)
