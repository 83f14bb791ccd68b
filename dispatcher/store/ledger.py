"""The usage ledger: one SQLite row per attempt, written off the event loop in batches.

::

    async with open_usage_ledger(data_dir / USAGE_DB_NAME) as ledger:
        ...
        ledger.record(row)        # synchronous, never blocks: safe in `finally:` blocks
        ...
        report = await ledger.query(UsageFilter(since=t0, attribution="key-1"))
    # leaving the block, however it is left, writes what is pending (shielded, with a
    # deadline) and closes the database

A row is one *attempt* of a request, keyed by ``(request_id, attempt)`` and recorded exactly
once, when the attempt ends. :meth:`UsageLedger.record` only appends the row to an in-memory
batch; a writer task owned by the ledger writes batches in one transaction each, in a worker
thread (a ``CapacityLimiter(1)`` keeps the single connection to one thread at a time; queries
go through the same limiter).

Exactly once: ``record`` refuses a key this ledger already holds -- pending, being written, or
among the last ``recent_keys`` written -- with :class:`DuplicateUsageRow`. Older duplicates
(and rows already in the file from an earlier run) meet the table's primary key at write time:
the new row is dropped with an error log and counted in :meth:`UsageLedger.statistics`, and
the other rows of its batch are written as usual.

Write failures never reach the caller of ``record``: a failed transaction is retried with backoff,
then its rows are dropped; both are logged and counted. Memory is bounded by ``max_pending``
(rows beyond it are dropped, logged and counted) and ``recent_keys``.
"""

from __future__ import annotations

import collections
import logging
import operator
import os
import sqlite3
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final, Literal, TypedDict, Unpack, get_args

import attrs
import trio

__all__ = [
    "BILLABLE_TO",
    "DEFAULT_QUERY_LIMIT",
    "EVERY_ROW",
    "FLUSH_TIMEOUT",
    "GROUP_BY",
    "MAX_PENDING",
    "MAX_QUERY_LIMIT",
    "OUTCOMES",
    "RECENT_KEYS",
    "USAGE_DB_NAME",
    "BillableTo",
    "DuplicateUsageRow",
    "ExecutionPath",
    "GroupBy",
    "Outcome",
    "TokenTotals",
    "UsageFilter",
    "UsageGroup",
    "UsageLedger",
    "UsageLedgerStatistics",
    "UsageQuery",
    "UsageReport",
    "UsageRow",
    "UsageSource",
    "UsageTotals",
    "open_usage_ledger",
]

log = logging.getLogger("dispatcher.usage")

USAGE_DB_NAME: Final = "usage.sqlite3"
"""The ledger's file name in the edge's data directory."""
FLUSH_TIMEOUT: Final = 10.0
"""Seconds the ledger may spend writing pending rows when its block is left."""
CLOSE_TIMEOUT: Final = 5.0
"""Seconds for closing the database after that (a WAL checkpoint)."""
RECENT_KEYS: Final = 4096
"""Default number of written keys ``record`` still refuses as duplicates by itself."""
MAX_PENDING: Final = 100_000
"""Default bound on rows waiting to be written."""
MAX_QUERY_LIMIT: Final = 10_000
"""The most rows one query returns (totals always cover every matching row)."""
DEFAULT_QUERY_LIMIT: Final = 1000
"""The rows a query returns when it does not say."""
WRITE_ATTEMPTS: Final = 5
"""Tries of one batch's transaction before its rows are given up."""
RETRY_DELAY: Final = 0.1
"""Seconds before the first retry of a failed transaction; doubles each time."""
SCHEMA_VERSION: Final = 3

ExecutionPath = Literal["normalized", "tunnel"]
UsageSource = Literal["reported", "estimated"]
Outcome = Literal["completed", "failed", "aborted", "cancelled"]
"""How the attempt ended; ``cancelled`` is the client going away."""
BillableTo = Literal["client", "operator"]

OUTCOMES: Final[tuple[Outcome, ...]] = get_args(Outcome)
BILLABLE_TO: Final[tuple[BillableTo, ...]] = get_args(BillableTo)


class DuplicateUsageRow(ValueError):
    """``record`` was given a ``(request_id, attempt)`` this ledger already has."""

    def __init__(self, request_id: str, attempt: int) -> None:
        super().__init__(f"usage of request {request_id!r} attempt {attempt} was already recorded")
        self.request_id = request_id
        self.attempt = attempt


def _at_least(minimum: int) -> Any:
    return attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.ge(minimum))


@attrs.frozen(kw_only=True)
class UsageRow:
    """One attempt of one request, as it ended."""

    request_id: str
    attempt: int = attrs.field(validator=_at_least(1))
    """1-based: the first try is 1, each recovery on another candidate adds one."""
    model_group: str
    """The public model name the client asked for."""
    served_model: str
    """The model name the provider served it under."""
    provider_id: str
    node_id: str
    path: ExecutionPath = attrs.field(validator=attrs.validators.in_(get_args(ExecutionPath)))
    attribution: str | None
    """Whom the usage is for: the client's API key id, or what the embedder passes."""
    prompt_tokens: int = attrs.field(validator=_at_least(0))
    completion_tokens: int = attrs.field(validator=_at_least(0))
    usage_source: UsageSource = attrs.field(validator=attrs.validators.in_(get_args(UsageSource)))
    """``reported`` by the upstream, or ``estimated`` by the edge."""
    outcome: Outcome = attrs.field(validator=attrs.validators.in_(OUTCOMES))
    billable_to: BillableTo = attrs.field(validator=attrs.validators.in_(BILLABLE_TO))
    """``client`` for the committed attempt, ``operator`` for attempts the client never saw."""
    queue_wait_s: float
    ttft_s: float | None
    """Time to first token; None if the attempt produced none."""
    duration_s: float
    ended_at: float
    """Unix time the attempt ended."""
    client_request_id: str | None = None
    """The client's own ``x-request-id``, if it sent one: searchable, never the key (the
    edge generates ``request_id``, so reusing an id cannot hide a request from the ledger)."""
    route: str | None = None
    """The API route the request came in on (``/v1/chat/completions``, ...)."""
    cost_usd: float | None = None
    """What its tokens cost at the price table its request was admitted under
    (``dispatcher.tenants``); None when nothing priced it (rows of older versions)."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.attempt)


_COLUMNS: Final = tuple(field.name for field in attrs.fields(UsageRow))
_row_values = operator.attrgetter(*_COLUMNS)


@attrs.frozen
class TokenTotals:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: TokenTotals) -> TokenTotals:
        return TokenTotals(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
        )


@attrs.frozen(kw_only=True)
class UsageTotals:
    """Sums over every row matching a query (not only the rows returned)."""

    requests: int
    """Distinct request ids."""
    attempts: int
    prompt_tokens: int
    completion_tokens: int
    client: TokenTotals
    """Tokens of attempts billable to the client (the committed ones)."""
    operator: TokenTotals
    """Tokens of attempts the client never saw."""
    estimated: TokenTotals
    """Tokens, of either kind, the edge estimated because the upstream reported none."""
    outcomes: Mapping[Outcome, int]
    """Attempts by outcome; every outcome is present."""
    cost_usd: float = 0.0
    """The cost of the tokens billable to the client."""


GroupBy = Literal["key", "model", "route", "day"]
GROUP_BY: Final[tuple[GroupBy, ...]] = get_args(GroupBy)
_GROUP_COLUMNS: Final[Mapping[GroupBy, str]] = {
    "key": "attribution",
    "model": "model_group",
    "route": "route",
    "day": "date(ended_at, 'unixepoch')",
}


@attrs.frozen(kw_only=True)
class UsageGroup:
    """Sums over the rows of one group of :meth:`UsageLedger.query_groups`: the group's
    values for the dimensions grouped by (the others None), then the sums."""

    key: str | None = None
    """The attribution (the tenant's id)."""
    model: str | None = None
    route: str | None = None
    day: str | None = None
    """The UTC day the attempts ended, ``YYYY-MM-DD``."""
    requests: int
    attempts: int
    prompt_tokens: int
    completion_tokens: int
    client: TokenTotals
    """Tokens billable to the client."""
    cost_usd: float
    """The cost of the tokens billable to the client."""


def _not_before_since(
    instance: UsageFilter, _: attrs.Attribute[float | None], until: float | None
) -> None:
    if until is not None and instance.since is not None and until < instance.since:
        raise ValueError(f"until: before since ({until} < {instance.since})")


@attrs.frozen(kw_only=True)
class UsageFilter:
    """Which rows a query covers: attempts that ended in ``[since, until)`` (unix seconds),
    for one ``attribution``, one model group ``model`` (``model_group``, the name clients
    use) and the client's own request id ``client_request_id``; a filter left None matches
    every row."""

    since: float | None = None
    until: float | None = attrs.field(default=None, validator=_not_before_since)
    attribution: str | None = None
    model: str | None = None
    client_request_id: str | None = None


EVERY_ROW: Final = UsageFilter()
"""The filter that matches every row."""


class FilterFields(TypedDict, total=False):
    """:class:`UsageFilter`'s fields as keyword arguments of the ledger's queries
    (``query(since=t0, model="llama")``), so that mypy checks their names and types."""

    since: float | None
    until: float | None
    attribution: str | None
    model: str | None
    client_request_id: str | None


@attrs.frozen(kw_only=True)
class UsageQuery:
    """A question to the ledger, as ``GET /v1/usage`` asks it
    (``dispatcher.api.usage_report.parse_usage_query``): the rows ``filter`` covers, at most
    ``limit`` of them (:meth:`UsageLedger.query`), and their sums grouped by ``group_by``
    (:meth:`UsageLedger.query_groups`)."""

    filter: UsageFilter = EVERY_ROW
    limit: int = DEFAULT_QUERY_LIMIT
    group_by: tuple[GroupBy, ...] = GROUP_BY


@attrs.frozen(kw_only=True)
class UsageReport:
    """What :meth:`UsageLedger.query` found: the filter and limit it was asked, the totals
    over every matching row, and the rows (newest first), as ``GET /v1/usage`` shows them."""

    filter: UsageFilter
    limit: int
    totals: UsageTotals
    rows: tuple[UsageRow, ...]

    @property
    def truncated(self) -> bool:
        """More rows matched than ``limit``; the totals still cover all of them."""
        return self.totals.attempts > len(self.rows)


@attrs.frozen(kw_only=True)
class UsageLedgerStatistics:
    rows_recorded: int
    """Rows ``record`` accepted."""
    rows_written: int
    """Rows now in the database."""
    rows_pending: int
    """Rows accepted and not yet written (nor given up)."""
    rows_lost: int
    """Rows never written: beyond ``max_pending``, given up after failed retries, or still
    pending when the closing flush ran out of time."""
    batches: int
    """Committed transactions."""
    duplicates_refused: int
    """``record`` calls that raised :class:`DuplicateUsageRow`."""
    duplicates_dropped: int
    """Rows that met an existing row's primary key at write time and were dropped."""
    write_errors: int
    """Failed transactions (each retry counts) and rows the database refused."""


# --------------------------------------------------------------------------- the database
# Synchronous; every call below runs in the ledger's worker thread.

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    model_group TEXT NOT NULL,
    served_model TEXT NOT NULL,
    provider_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    path TEXT NOT NULL,
    attribution TEXT,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    usage_source TEXT NOT NULL,
    outcome TEXT NOT NULL,
    billable_to TEXT NOT NULL,
    queue_wait_s REAL NOT NULL,
    ttft_s REAL,
    duration_s REAL NOT NULL,
    ended_at REAL NOT NULL,
    client_request_id TEXT,
    route TEXT,
    cost_usd REAL,
    PRIMARY KEY (request_id, attempt)
);
CREATE INDEX IF NOT EXISTS usage_ended_at ON usage (ended_at);
CREATE INDEX IF NOT EXISTS usage_client_request_id ON usage (client_request_id);
CREATE INDEX IF NOT EXISTS usage_attribution ON usage (attribution, ended_at);
CREATE INDEX IF NOT EXISTS usage_model_group ON usage (model_group, ended_at);
"""

_INSERT = (
    f"INSERT INTO usage ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
    "ON CONFLICT (request_id, attempt) DO NOTHING"
)


@attrs.frozen
class _WriteResult:
    inserted: int
    duplicates: list[tuple[str, int]]
    refused: list[tuple[tuple[str, int], str]]


def _is_memory(path: str | os.PathLike[str] | None) -> bool:
    return path is None or os.fspath(path) == ":memory:"


class _Database:
    """The one sqlite3 connection, used by one thread at a time."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        if _is_memory(path):
            target = ":memory:"
        else:
            assert path is not None
            file = Path(path).expanduser()
            file.parent.mkdir(parents=True, exist_ok=True)
            target = str(file)
        # isolation_level=None: no implicit transactions, we BEGIN and COMMIT ourselves.
        self._conn = sqlite3.connect(target, check_same_thread=False, isolation_level=None)
        try:
            self._setup(memory=target == ":memory:", name=target)
        except BaseException:
            self._conn.close()
            raise

    def _setup(self, *, memory: bool, name: str) -> None:
        conn = self._conn
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{name}: usage ledger schema version {version} is newer than this "
                f"dispatcher's ({SCHEMA_VERSION})"
            )
        if not memory:
            (mode,) = conn.execute("PRAGMA journal_mode=WAL").fetchone()
            if str(mode).lower() != "wal":
                log.warning("%s: journal_mode is %s, not WAL", name, mode)
        conn.execute("PRAGMA synchronous=NORMAL")
        migrate = ""
        if version == 1:
            # Version 2 added the client's own request id and the route.
            migrate = (
                "ALTER TABLE usage ADD COLUMN client_request_id TEXT; "
                "ALTER TABLE usage ADD COLUMN route TEXT;"
            )
        if version in (1, 2):
            # Version 3 added the cost.
            migrate += "ALTER TABLE usage ADD COLUMN cost_usd REAL;"
        conn.executescript(
            f"BEGIN; {migrate} {_SCHEMA} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;"
        )

    def write(self, rows: Sequence[UsageRow]) -> _WriteResult:
        """Insert ``rows`` in one transaction. A row whose key is already there is skipped and
        reported, as is a row the database refuses; the others are written. Any other error
        rolls the whole batch back and is raised."""
        cursor = self._conn.cursor()
        inserted = 0
        duplicates: list[tuple[str, int]] = []
        refused: list[tuple[tuple[str, int], str]] = []
        cursor.execute("BEGIN")
        try:
            for row in rows:
                try:
                    cursor.execute(_INSERT, _row_values(row))
                except sqlite3.IntegrityError as exc:
                    refused.append((row.key, str(exc)))
                    continue
                if cursor.rowcount == 1:
                    inserted += 1
                else:
                    duplicates.append(row.key)
            cursor.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                self._conn.rollback()
            raise
        finally:
            cursor.close()
        return _WriteResult(inserted, duplicates, refused)

    def query(self, matching: UsageFilter, limit: int) -> UsageReport:
        where, params = _where(matching)
        conn = self._conn
        conn.execute("BEGIN")  # one snapshot for the rows and the totals
        try:
            found = conn.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM usage {where} "
                "ORDER BY ended_at DESC, request_id DESC, attempt DESC LIMIT ?",
                [*params, limit],
            ).fetchall()
            (requests,) = conn.execute(
                f"SELECT COUNT(DISTINCT request_id) FROM usage {where}", params
            ).fetchone()
            groups = conn.execute(
                "SELECT billable_to, outcome, usage_source, COUNT(*), "
                "SUM(prompt_tokens), SUM(completion_tokens), SUM(COALESCE(cost_usd, 0)) "
                f"FROM usage {where} "
                "GROUP BY billable_to, outcome, usage_source",
                params,
            ).fetchall()
        finally:
            conn.execute("COMMIT")
        return UsageReport(
            filter=matching,
            limit=limit,
            totals=_fold_totals(requests, groups),
            rows=tuple(UsageRow(**dict(zip(_COLUMNS, values, strict=True))) for values in found),
        )

    def query_groups(
        self, matching: UsageFilter, group_by: Sequence[GroupBy], billable: bool
    ) -> list[UsageGroup]:
        where, params = _where(matching)
        if billable:
            where = (
                f"{where} AND billable_to = 'client'" if where else ("WHERE billable_to = 'client'")
            )
        dimensions = [_GROUP_COLUMNS[name] for name in group_by]
        selected = "".join(f"{column}, " for column in dimensions)
        grouping = f"GROUP BY {', '.join(dimensions)} ORDER BY {', '.join(dimensions)}"
        found = self._conn.execute(
            f"SELECT {selected}COUNT(DISTINCT request_id), COUNT(*), "
            "SUM(prompt_tokens), SUM(completion_tokens), "
            "SUM(CASE WHEN billable_to = 'client' THEN prompt_tokens ELSE 0 END), "
            "SUM(CASE WHEN billable_to = 'client' THEN completion_tokens ELSE 0 END), "
            "SUM(CASE WHEN billable_to = 'client' THEN COALESCE(cost_usd, 0) ELSE 0 END) "
            f"FROM usage {where} {grouping if dimensions else ''}",
            params,
        ).fetchall()
        groups = []
        for values in found:
            named = dict(zip(group_by, values, strict=False))
            rest = values[len(group_by) :]
            if not rest[1]:
                continue  # no row matched (an aggregate without GROUP BY has one row)
            groups.append(
                UsageGroup(
                    **named,
                    requests=rest[0],
                    attempts=rest[1],
                    prompt_tokens=rest[2],
                    completion_tokens=rest[3],
                    client=TokenTotals(rest[4], rest[5]),
                    cost_usd=rest[6],
                )
            )
        return groups

    def close(self) -> None:
        self._conn.close()


def _where(matching: UsageFilter) -> tuple[str, list[object]]:
    clauses: list[str] = []
    params: list[object] = []
    for clause, value in (
        ("ended_at >= ?", matching.since),
        ("ended_at < ?", matching.until),
        ("attribution = ?", matching.attribution),
        ("model_group = ?", matching.model),
        ("client_request_id = ?", matching.client_request_id),
    ):
        if value is not None:
            clauses.append(clause)
            params.append(value)
    return (f"WHERE {' AND '.join(clauses)}" if clauses else ""), params


def _fold_totals(requests: int, groups: Sequence[Sequence[Any]]) -> UsageTotals:
    attempts = 0
    billable = {who: TokenTotals() for who in BILLABLE_TO}
    estimated = TokenTotals()
    outcomes: dict[Outcome, int] = dict.fromkeys(OUTCOMES, 0)
    cost = 0.0
    for billable_to, outcome, source, count, prompt, completion, row_cost in groups:
        tokens = TokenTotals(prompt, completion)
        attempts += count
        billable[billable_to] += tokens
        if billable_to == "client":
            cost += row_cost
        if source == "estimated":
            estimated += tokens
        outcomes[outcome] = outcomes.get(outcome, 0) + count
    everything = billable["client"] + billable["operator"]
    return UsageTotals(
        requests=requests,
        attempts=attempts,
        prompt_tokens=everything.prompt_tokens,
        completion_tokens=everything.completion_tokens,
        client=billable["client"],
        operator=billable["operator"],
        estimated=estimated,
        outcomes=outcomes,
        cost_usd=cost,
    )


# --------------------------------------------------------------------------- the ledger


class UsageLedger:
    """Records attempts and answers usage queries. Create it with :func:`open_usage_ledger`."""

    def __init__(
        self,
        database: _Database,
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
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(f"limit must be an int, got {limit!r}")
        if not 0 <= limit <= MAX_QUERY_LIMIT:
            raise ValueError(f"limit must be between 0 and {MAX_QUERY_LIMIT}, got {limit}")
        where = attrs.evolve(where, **filters)
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
        unknown = [name for name in group_by if name not in GROUP_BY]
        if unknown or len(set(group_by)) != len(group_by):
            raise ValueError(f"group_by: expected distinct names of {GROUP_BY}, got {group_by}")
        where = attrs.evolve(where, **filters)
        await self.flush()
        return await trio.to_thread.run_sync(
            self._db.query_groups, where, tuple(group_by), billable, limiter=self._limiter
        )

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
        except sqlite3.Error as exc:
            self._write_errors += 1
            self._failures += 1
            if self._failures < WRITE_ATTEMPTS:
                delay = RETRY_DELAY * 2 ** (self._failures - 1)
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
async def open_usage_ledger(
    path: str | os.PathLike[str] | None = ":memory:",
    *,
    batch_interval: float = 0.05,
    max_batch: int = 500,
    recent_keys: int = RECENT_KEYS,
    max_pending: int = MAX_PENDING,
) -> AsyncIterator[UsageLedger]:
    """A usage ledger on the SQLite file ``path`` (created, with its directory, if missing),
    or on a private in-memory database for ``":memory:"`` or None.

    The writer waits up to ``batch_interval`` seconds after a row is recorded for more to
    come (not at all when ``max_batch`` are pending or someone flushes), then writes up to
    ``max_batch`` rows in one transaction.
    Leaving the block -- normally, with an error or by cancellation -- writes every pending
    row (shielded, at most :data:`FLUSH_TIMEOUT` seconds) and closes the database.
    """
    if batch_interval < 0 or max_batch < 1 or recent_keys < 0 or max_pending < 1:
        raise ValueError(
            "batch_interval must be >= 0, max_batch >= 1, recent_keys >= 0, max_pending >= 1"
        )
    database = await trio.to_thread.run_sync(_Database, path)
    ledger = UsageLedger(
        database,
        batch_interval=batch_interval,
        max_batch=max_batch,
        recent_keys=recent_keys,
        max_pending=max_pending,
    )
    try:
        unwrapped: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ledger._serve_writer)
                try:
                    yield ledger
                finally:
                    nursery.cancel_scope.cancel(reason="usage ledger closing")
        except BaseExceptionGroup as group:
            # The writer raises nothing but bugs (it logs and counts write errors), so the
            # group holds what the block raised, beside Cancelled if it was cancelled from
            # outside. Give the caller that exception as it was raised, not wrapped.
            raised = [exc for exc in group.exceptions if not isinstance(exc, trio.Cancelled)]
            if len(raised) != 1:
                raise
            unwrapped = raised[0]
        if unwrapped is not None:
            raise unwrapped  # outside the `except`, so its __context__ is left as it was
    finally:
        with trio.move_on_after(FLUSH_TIMEOUT, shield=True):
            await ledger._drain()
        ledger._close()
        with trio.move_on_after(CLOSE_TIMEOUT, shield=True) as closing:
            await trio.to_thread.run_sync(database.close, limiter=ledger._limiter)
        if closing.cancelled_caught:
            log.error("usage ledger: the database was not closed in %g s", CLOSE_TIMEOUT)
