"""Every backend of the storage seam (``dispatcher/store/seam.py``), as the contract suite opens
it. A new backend is one entry here; it must pass every test of ``tests/store/test_contract_*``
(the shared ones -- Redis, PostgreSQL -- start their own real server in a fixture)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from dispatcher.store.ledger import open_usage_ledger
from dispatcher.store.limits import MemoryLimits
from dispatcher.store.limits_guard import open_guarded_limits
from dispatcher.store.limits_redis import RedisLimits, open_redis_limits
from dispatcher.store.responses import open_response_store
from dispatcher.store.seam import LimitStore, ResponseStore, UsageLedger

from . import postgres_server, redis_server

Clock = Callable[[], float]


@attrs.frozen
class LedgerBackend:
    name: str
    persistent: bool
    """Reopened on the same place, it holds what was committed before."""
    open: Callable[[Path], AbstractAsyncContextManager[UsageLedger]]


@attrs.frozen
class ResponseBackend:
    name: str
    persistent: bool
    open: Callable[..., AbstractAsyncContextManager[ResponseStore]]
    """``open(place, max_entries=, max_bytes=, max_age=, clock=)``."""


@attrs.frozen
class LimitBackend:
    name: str
    open: Callable[[Clock, Clock], AbstractAsyncContextManager[LimitStore[Any]]]
    """``open(clock, wall)``: the store on the test's monotonic and wall clocks."""


def _sqlite_file(place: Path) -> AbstractAsyncContextManager[UsageLedger]:
    return open_usage_ledger(place / "usage.sqlite3")


def _sqlite_memory(place: Path) -> AbstractAsyncContextManager[UsageLedger]:
    return open_usage_ledger(":memory:")


def _responses_file(place: Path, **bounds: Any) -> AbstractAsyncContextManager[ResponseStore]:
    return open_response_store(place / "usage.responses.sqlite3", **bounds)


def _responses_memory(place: Path, **bounds: Any) -> AbstractAsyncContextManager[ResponseStore]:
    return open_response_store(":memory:", **bounds)


@asynccontextmanager
async def _memory_limits(clock: Clock, wall: Clock) -> AsyncIterator[LimitStore[Any]]:
    yield MemoryLimits(clock=clock, wall=wall)


@asynccontextmanager
async def _postgres_ledger(place: Path) -> AsyncIterator[UsageLedger]:
    from dispatcher.store.postgres import open_postgres_ledger

    url = await trio.to_thread.run_sync(postgres_server.schema_url, place)
    # Through its durable outbox, a file at the place: reopened, it is found again.
    async with open_postgres_ledger(url, outbox=place / "outbox.sqlite3") as ledger:
        yield ledger


@asynccontextmanager
async def _postgres_responses(place: Path, **bounds: Any) -> AsyncIterator[ResponseStore]:
    from dispatcher.store.postgres import open_postgres_response_store

    url = await trio.to_thread.run_sync(postgres_server.schema_url, place)
    async with open_postgres_response_store(url, **bounds) as store:
        yield store


POSTGRES = "postgres"
"""The name of the backends on a real PostgreSQL (``postgres_server``): deselected where
none can be started (``conftest.py``)."""

LEDGERS = (
    LedgerBackend("sqlite-file", persistent=True, open=_sqlite_file),
    LedgerBackend("sqlite-memory", persistent=False, open=_sqlite_memory),
    LedgerBackend(POSTGRES, persistent=True, open=_postgres_ledger),
)
RESPONSES = (
    ResponseBackend("sqlite-file", persistent=True, open=_responses_file),
    ResponseBackend("sqlite-memory", persistent=False, open=_responses_memory),
    ResponseBackend(POSTGRES, persistent=True, open=_postgres_responses),
)


@asynccontextmanager
async def _redis_limits(clock: Clock, wall: Clock) -> AsyncIterator[RedisLimits]:
    """A real redis-server (``redis_server.py``), its database emptied for each test."""
    async with open_redis_limits(redis_server.url(), clock=clock, wall=wall) as store:
        await store.client.call("FLUSHDB")
        yield store


@asynccontextmanager
async def _guarded_redis_limits(clock: Clock, wall: Clock) -> AsyncIterator[LimitStore[Any]]:
    """What the edge opens with ``[store] redis_url``: the Redis store behind its guard
    (``dispatcher.store.limits_guard``), Redis answering."""
    async with (
        _redis_limits(clock, wall) as redis,
        open_guarded_limits(redis, "the limit store", answer_within=10.0) as guard,
    ):
        yield guard


LIMITS = (
    LimitBackend("memory", open=_memory_limits),
    LimitBackend("redis", open=_redis_limits),
    LimitBackend("redis-guarded", open=_guarded_redis_limits),
)
