"""Stored responses of the Responses API: a bounded SQLite store beside the usage ledger.

::

    async with open_response_store(beside_ledger(config.usage_db)) as store:
        await store.put(response, conversation, owner)     # False: too big to keep at all
        stored = await store.get(response_id, owner)       # None: not there for this owner
        await store.delete(response_id, owner)

``open_dispatcher`` opens it beside the ledger (the ledger's file name with ``.responses``
before its suffix, :func:`beside_ledger`; in memory when the ledger is) and owns its lifetime;
the front end reaches it through the seam (``EdgeServices.response_store``).

Bounds, oldest first out: at most ``max_entries`` responses, at most ``max_bytes`` of their
JSON together (each with its conversation), none older than ``max_age`` seconds by ``clock``
(wall-clock time: the file outlives the process). A response bigger than ``max_bytes`` alone
is not kept. A response is found only by its ``owner`` (the API key id that created it; None
when the edge has no keys): another owner's is not there.

Every database call runs in a worker thread, one at a time (a ``CapacityLimiter(1)`` over the
one connection), as the ledger's do. A call is not abandoned when its caller is cancelled: the
thread finishes it, so a write's outcome is never lost. The JSON is encoded and decoded on the
caller's side of the thread hop only where it must be (the size bound needs the encoded size).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import attrs
import orjson
import trio

from ..wire import JSONObject
from .seam import ResponseDatabase, ResponseStoreStatistics, StoredResponse

__all__ = [
    "MAX_STORED",
    "MAX_STORED_AGE",
    "MAX_STORED_BYTES",
    "BoundedResponseStore",
    "beside_ledger",
    "open_response_store",
]

log = logging.getLogger("dispatcher.responses_store")

MAX_STORED: Final = 10_000
"""Default bound on stored responses."""
MAX_STORED_BYTES: Final = 64 * 1024 * 1024
"""Default bound on the stored responses' size (their JSON, conversation included)."""
MAX_STORED_AGE: Final = 24 * 3600.0
"""Default age in seconds past which a stored response is forgotten."""
_CLOSE_TIMEOUT: Final = 5.0
"""Seconds for closing the database when the store's block is left."""
_SCHEMA_VERSION: Final = 1
_EVICT_BATCH: Final = 64


def beside_ledger(usage_db: str | None) -> str:
    """The store's file beside the ledger's ``usage_db``: ``usage.sqlite3`` ->
    ``usage.responses.sqlite3``; ``":memory:"`` when the ledger is in memory (None or
    ``":memory:"``)."""
    if usage_db is None or usage_db == ":memory:":
        return ":memory:"
    path = Path(usage_db)
    return str(path.with_name(f"{path.stem}.responses{path.suffix}"))


# --------------------------------------------------------------------------- the database
# Synchronous; every call below runs in the store's worker thread.

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT,
    stored_at REAL NOT NULL,
    size INTEGER NOT NULL,
    response BLOB NOT NULL,
    conversation BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_stored_at ON responses (stored_at);
"""


class _Database:
    """The one sqlite3 connection, used by one thread at a time; it keeps the count and the
    size of what it holds."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        target = os.fspath(path)
        memory = target == ":memory:"
        if not memory:
            file = Path(target).expanduser()
            file.parent.mkdir(parents=True, exist_ok=True)
            target = str(file)
        self._conn = sqlite3.connect(target, check_same_thread=False, isolation_level=None)
        try:
            (version,) = self._conn.execute("PRAGMA user_version").fetchone()
            if version > _SCHEMA_VERSION:
                raise RuntimeError(
                    f"{target}: response store schema version {version} is newer than this "
                    f"dispatcher's ({_SCHEMA_VERSION})"
                )
            if not memory:
                self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(
                f"BEGIN; {_SCHEMA} PRAGMA user_version={_SCHEMA_VERSION}; COMMIT;"
            )
            entries, size = self._conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses"
            ).fetchone()
            self.entries: int = entries
            self.bytes: int = size
        except BaseException:
            self._conn.close()
            raise

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
        """Keep one response (replacing one of the same id), then forget what is past the
        bounds, oldest first, in one transaction. Returns how many were forgotten."""
        conn = self._conn
        size = len(response) + len(conversation)
        evicted = 0
        conn.execute("BEGIN IMMEDIATE")
        try:
            entries, total = self.entries, self.bytes
            old = conn.execute("SELECT size FROM responses WHERE id = ?", (response_id,)).fetchone()
            if old is not None:
                conn.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                entries, total = entries - 1, total - old[0]
            (count, freed) = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses WHERE stored_at <= ?",
                (horizon,),
            ).fetchone()
            if count:
                conn.execute("DELETE FROM responses WHERE stored_at <= ?", (horizon,))
                entries, total, evicted = entries - count, total - freed, evicted + count
            conn.execute(
                "INSERT INTO responses (id, owner, stored_at, size, response, conversation) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (response_id, owner, now, size, response, conversation),
            )
            entries, total = entries + 1, total + size
            while entries > max_entries or total > max_bytes:
                oldest = conn.execute(
                    "SELECT seq, size FROM responses ORDER BY seq LIMIT ?", (_EVICT_BATCH,)
                ).fetchall()
                gone = []
                for seq, freed in oldest:
                    if entries <= max_entries and total <= max_bytes:
                        break
                    gone.append((seq,))
                    entries, total, evicted = entries - 1, total - freed, evicted + 1
                conn.executemany("DELETE FROM responses WHERE seq = ?", gone)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise
        self.entries, self.bytes = entries, total
        return evicted

    def get(self, response_id: str, owner: str | None, horizon: float) -> StoredResponse | None:
        found = self._conn.execute(
            "SELECT response, conversation, size, stored_at FROM responses "
            "WHERE id = ? AND owner IS ? AND stored_at > ?",
            (response_id, owner, horizon),
        ).fetchone()
        if found is None:
            return None
        response, conversation, size, stored_at = found
        return StoredResponse(
            orjson.loads(response), tuple(orjson.loads(conversation)), size, stored_at, owner
        )

    def delete(self, response_id: str, owner: str | None, horizon: float) -> bool:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            found = conn.execute(
                "DELETE FROM responses WHERE id = ? AND owner IS ? AND stored_at > ? "
                "RETURNING size",
                (response_id, owner, horizon),
            ).fetchone()
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise
        if found is None:
            return False
        self.entries -= 1
        self.bytes -= found[0]
        return True

    def close(self) -> None:
        self._conn.close()


# --------------------------------------------------------------------------- the store


@attrs.define(eq=False)
class BoundedResponseStore:
    """Stored responses (see the module docstring) over a
    :class:`~dispatcher.store.seam.ResponseDatabase` -- SQLite here, PostgreSQL in
    :mod:`.postgres` --, which it calls in worker threads, at most ``limiter``'s tokens at
    once: the :class:`~dispatcher.store.seam.ResponseStore` both backends are. Create it with
    :func:`open_response_store` (or
    :func:`~dispatcher.store.postgres.open_postgres_response_store`)."""

    _db: ResponseDatabase = attrs.field(alias="database")
    max_entries: int
    max_bytes: int
    max_age: float
    _clock: Callable[[], float]
    limiter: trio.CapacityLimiter = attrs.field(factory=lambda: trio.CapacityLimiter(1))
    """The calls in flight (one per token); closing waits for them."""
    _evicted: int = attrs.field(init=False, default=0)
    closed: bool = attrs.field(init=False, default=False)
    """Set when the opener's block is left: every call from then on raises."""

    def __len__(self) -> int:
        return self._db.entries

    def statistics(self) -> ResponseStoreStatistics:
        return ResponseStoreStatistics(
            entries=self._db.entries, bytes=self._db.bytes, evicted=self._evicted
        )

    async def _run(self, func: Callable[..., Any], *args: Any) -> Any:
        if self.closed:
            raise trio.ClosedResourceError("the response store is closed")
        return await trio.to_thread.run_sync(func, *args, limiter=self.limiter)

    async def put(
        self,
        response: JSONObject,
        conversation: Sequence[JSONObject],
        owner: str | None = None,
    ) -> bool:
        """Keep ``response`` (by its ``id``) for ``owner``; False if it is too big to keep at
        all. Once this returns, :meth:`get` finds it."""
        encoded = orjson.dumps(response)
        history = orjson.dumps(list(conversation))
        if len(encoded) + len(history) > self.max_bytes:
            await trio.lowlevel.checkpoint()
            return False
        now = self._clock()
        evicted: int = await self._run(
            self._db.put,
            response["id"],
            owner,
            encoded,
            history,
            now,
            now - self.max_age,
            self.max_entries,
            self.max_bytes,
        )
        self._evicted += evicted
        return True

    async def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """The response stored as ``response_id`` for ``owner``, unless it is past its age."""
        found: StoredResponse | None = await self._run(
            self._db.get, response_id, owner, self._clock() - self.max_age
        )
        return found

    async def delete(self, response_id: str, owner: str | None = None) -> bool:
        """Forget ``owner``'s response ``response_id``; False if it was not there."""
        deleted: bool = await self._run(
            self._db.delete, response_id, owner, self._clock() - self.max_age
        )
        return deleted


@asynccontextmanager
async def open_response_store(
    path: str | os.PathLike[str] = ":memory:",
    *,
    max_entries: int = MAX_STORED,
    max_bytes: int = MAX_STORED_BYTES,
    max_age: float = MAX_STORED_AGE,
    clock: Callable[[], float] = time.time,
) -> AsyncIterator[BoundedResponseStore]:
    """A response store on the SQLite file ``path`` (created, with its directory, if
    missing; what it held before is kept within the bounds), or on a private in-memory
    database for ``":memory:"``. Leaving the block closes the database (shielded, at most
    :data:`_CLOSE_TIMEOUT` seconds, after any call in flight)."""
    if max_entries < 1 or max_bytes < 1 or max_age <= 0:
        raise ValueError("max_entries and max_bytes must be >= 1, max_age > 0")
    database = await trio.to_thread.run_sync(_Database, path)
    store = BoundedResponseStore(
        database, max_entries=max_entries, max_bytes=max_bytes, max_age=max_age, clock=clock
    )
    try:
        yield store
    finally:
        store.closed = True
        with trio.move_on_after(_CLOSE_TIMEOUT, shield=True) as closing:
            await trio.to_thread.run_sync(database.close, limiter=store.limiter)
        if closing.cancelled_caught:
            log.error("response store: the database was not closed in %g s", _CLOSE_TIMEOUT)
