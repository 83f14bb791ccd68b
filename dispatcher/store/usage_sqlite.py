"""The usage ledger's embedded database: one SQLite file (or a private in-memory database),
one connection, synchronous -- the batch writer (:mod:`.ledger`) calls it in a worker thread,
one call at a time. It implements :class:`~dispatcher.store.seam.UsageDatabase`.

Rows are keyed by ``(request_id, attempt)``: a row whose key is already in the file is skipped
and reported (never a second row for one attempt). The schema is versioned
(``PRAGMA user_version``) and migrated forward in place; a newer file is refused.
"""

from __future__ import annotations

import logging
import operator
import os
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from .seam import WriteResult
from .usage import (
    BILLABLE_TO,
    OUTCOMES,
    GroupBy,
    Outcome,
    TokenTotals,
    UsageFilter,
    UsageGroup,
    UsageReport,
    UsageRow,
    UsageTotals,
)

__all__ = [
    "PART_COLUMNS",
    "ROW_COLUMNS",
    "USAGE_DB_NAME",
    "SQLiteUsage",
    "fold_totals",
    "row_values",
    "usage_group",
]

log = logging.getLogger("dispatcher.usage")

USAGE_DB_NAME: Final = "usage.sqlite3"
"""The ledger's file name in the edge's data directory."""
_SCHEMA_VERSION: Final = 4

_GROUP_COLUMNS: Final[Mapping[GroupBy, str]] = {
    "key": "attribution",
    "model": "model_group",
    "route": "route",
    "day": "date(ended_at, 'unixepoch')",
}
ROW_COLUMNS: Final = tuple(field.name for field in attrs.fields(UsageRow))
"""The ledger's columns, a :class:`UsageRow`'s fields in order (every SQL backend's)."""
row_values: Final[Callable[[UsageRow], tuple[Any, ...]]] = operator.attrgetter(*ROW_COLUMNS)
"""A row's values in :data:`ROW_COLUMNS`' order."""
PART_COLUMNS: Final = ("cached_tokens", "cache_write_tokens", "reasoning_tokens")
"""The counts that are parts of the prompt's and the completion's (schema 4)."""
_PART_SUMS: Final = ", ".join(f"SUM({column})" for column in PART_COLUMNS)

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
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    cache_write_tokens INTEGER NOT NULL DEFAULT 0,
    reasoning_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (request_id, attempt)
);
CREATE INDEX IF NOT EXISTS usage_ended_at ON usage (ended_at);
CREATE INDEX IF NOT EXISTS usage_client_request_id ON usage (client_request_id);
CREATE INDEX IF NOT EXISTS usage_attribution ON usage (attribution, ended_at);
CREATE INDEX IF NOT EXISTS usage_model_group ON usage (model_group, ended_at);
"""

_INSERT = (
    f"INSERT INTO usage ({', '.join(ROW_COLUMNS)}) VALUES ({', '.join('?' * len(ROW_COLUMNS))}) "
    "ON CONFLICT (request_id, attempt) DO NOTHING"
)


def _is_memory(path: str | os.PathLike[str] | None) -> bool:
    return path is None or os.fspath(path) == ":memory:"


class SQLiteUsage:
    """The one sqlite3 connection, used by one thread at a time."""

    errors: tuple[type[Exception], ...] = (sqlite3.Error,)
    """What a failed write raises (the writer retries it, then gives the batch up)."""

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
        if version > _SCHEMA_VERSION:
            raise RuntimeError(
                f"{name}: usage ledger schema version {version} is newer than this "
                f"dispatcher's ({_SCHEMA_VERSION})"
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
        if version in (1, 2, 3):
            # Version 4 added the cached, cache-write and reasoning tokens (0 in older rows).
            migrate += "".join(
                f"ALTER TABLE usage ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0;"
                for column in PART_COLUMNS
            )
        conn.executescript(
            f"BEGIN; {migrate} {_SCHEMA} PRAGMA user_version={_SCHEMA_VERSION}; COMMIT;"
        )

    def write(self, rows: Sequence[UsageRow]) -> WriteResult:
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
                    cursor.execute(_INSERT, row_values(row))
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
        return WriteResult(inserted, duplicates, refused)

    def query(self, matching: UsageFilter, limit: int) -> UsageReport:
        where, params = _where(matching)
        conn = self._conn
        conn.execute("BEGIN")  # one snapshot for the rows and the totals
        try:
            found = conn.execute(
                f"SELECT {', '.join(ROW_COLUMNS)} FROM usage {where} "
                "ORDER BY ended_at DESC, request_id DESC, attempt DESC LIMIT ?",
                [*params, limit],
            ).fetchall()
            (requests,) = conn.execute(
                f"SELECT COUNT(DISTINCT request_id) FROM usage {where}", params
            ).fetchone()
            groups = conn.execute(
                "SELECT billable_to, outcome, usage_source, COUNT(*), "
                "SUM(prompt_tokens), SUM(completion_tokens), SUM(COALESCE(cost_usd, 0)), "
                f"{_PART_SUMS} FROM usage {where} "
                "GROUP BY billable_to, outcome, usage_source",
                params,
            ).fetchall()
        finally:
            conn.execute("COMMIT")
        return UsageReport(
            filter=matching,
            limit=limit,
            totals=fold_totals(requests, groups),
            rows=tuple(UsageRow(**dict(zip(ROW_COLUMNS, values, strict=True))) for values in found),
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
            "SUM(CASE WHEN billable_to = 'client' THEN COALESCE(cost_usd, 0) ELSE 0 END), "
            f"{_PART_SUMS} FROM usage {where} {grouping if dimensions else ''}",
            params,
        ).fetchall()
        return [group for values in found if (group := usage_group(group_by, values)) is not None]

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


def usage_group(group_by: Sequence[GroupBy], values: Sequence[Any]) -> UsageGroup | None:
    """One row of a grouped query -- the group's values, then the distinct requests, the
    attempts, the prompt and completion tokens, the client's and its cost, the cached,
    cache-write and reasoning tokens -- or None for the row an aggregate without GROUP BY
    gives when nothing matched."""
    named = dict(zip(group_by, values, strict=False))
    rest = values[len(group_by) :]
    if not rest[1]:
        return None
    return UsageGroup(
        **named,
        requests=rest[0],
        attempts=rest[1],
        prompt_tokens=rest[2],
        completion_tokens=rest[3],
        client=TokenTotals(rest[4], rest[5]),
        cost_usd=rest[6],
        cached_tokens=rest[7],
        cache_write_tokens=rest[8],
        reasoning_tokens=rest[9],
    )


def fold_totals(requests: int, groups: Sequence[Sequence[Any]]) -> UsageTotals:
    """The totals of a query from its distinct requests and its rows grouped by
    ``billable_to, outcome, usage_source`` (count, prompt, completion, cost, cached,
    cache-write, reasoning)."""
    attempts = 0
    parts = [0, 0, 0]
    billable = {who: TokenTotals() for who in BILLABLE_TO}
    estimated = TokenTotals()
    outcomes: dict[Outcome, int] = dict.fromkeys(OUTCOMES, 0)
    cost = 0.0
    for billable_to, outcome, source, count, prompt, completion, row_cost, *counts in groups:
        tokens = TokenTotals(prompt, completion)
        parts = [total + more for total, more in zip(parts, counts, strict=True)]
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
        cached_tokens=parts[0],
        cache_write_tokens=parts[1],
        reasoning_tokens=parts[2],
    )
