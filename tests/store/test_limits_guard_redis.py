"""The edge's failure mode over the Redis limit store (:mod:`dispatcher.store.limits_guard`,
issue #23) against a real ``redis-server`` of the test's own that stops (connection refused)
or freezes (SIGSTOP: no answer within any deadline), then comes back:

* ``refuse``: with Redis gone an admission gets the 503 within about the deadline, the next
  ones at once (no checkpoint), one WARNING for the whole outage; a reservation admitted
  before is released without error; a key without limits is served; after Redis returns,
  admissions go to it again within seconds;
* a frozen Redis: the admission that waited is refused at its deadline; the writes posted
  meanwhile (a release, and the release of the admission whose answer was lost) are written
  once it answers, so its places are free again;
* ``local``: each limit divided by ``edge_count`` holds while Redis is down, loudly (a
  WARNING every ``warn_every``); what a request decided on the edge spends reaches Redis's
  budgets once it answers.

Real time, short deadlines (never autojump with real sockets)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from dispatcher.config import Limits
from dispatcher.errors import LimitStoreUnavailable, StoreUnavailable
from dispatcher.store.ledger import open_usage_ledger
from dispatcher.store.limits_guard import (
    Guarded,
    GuardedLimits,
    Mode,
    open_guarded_limits,
    store_place,
)
from dispatcher.store.limits_redis import RedisLimits, open_redis_limits
from dispatcher.store.seam import Hold, Refusal, StoreUnreachable

from .redis_server import BINARY, RedisServer, own_server

pytestmark = pytest.mark.skipif(BINARY is None, reason="no redis-server")

DEADLINE = 0.3
"""``[store] timeout_s`` of these tests."""
COMMAND_TIMEOUT = 1.0
"""The Redis store's own deadline for one command."""
BACK_WITHIN = 5.0
"""Seconds within which admissions must go to Redis again after it returns (issue #23)."""


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with own_server() as server:
        yield server


@asynccontextmanager
async def guarded(
    server: RedisServer, mode: Mode = "refuse", edge_count: int = 1, **options: Any
) -> AsyncIterator[tuple[RedisLimits, GuardedLimits]]:
    async with (
        open_redis_limits(server.url, command_timeout=COMMAND_TIMEOUT) as redis,
        open_guarded_limits(
            redis,
            f"the limit store ({store_place(server.url)})",
            mode=mode,
            edge_count=edge_count,
            answer_within=DEADLINE,
            probe_every=0.1,
            **options,
        ) as guard,
    ):
        yield redis, guard


def hold(request_id: str, tenant: str = "t1", tokens: int = 10, **limits: Any) -> Hold:
    return Hold(request_id, tenant, Limits(**limits), tokens, 0.0)


async def at_once(guard: GuardedLimits, asked: Hold) -> Guarded | Refusal:
    """``guard.admit(asked)`` that must not wait: a checkpoint would raise Cancelled."""
    with trio.CancelScope() as scope:
        scope.cancel()
        return await guard.admit(asked)
    raise AssertionError("the admission waited")


async def back(guard: GuardedLimits) -> None:
    """Wait (at most :data:`BACK_WITHIN` seconds) until admissions go to Redis again."""
    with trio.fail_after(BACK_WITHIN):
        while not guard.up:
            await trio.sleep(0.02)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name.startswith("dispatcher.store") and record.levelno >= logging.WARNING
    ]


async def test_refuse_while_redis_is_stopped_then_serve_again(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dispatcher.store")
    async with guarded(server) as (_, guard):
        before = await guard.admit(hold("r0", rpm=100))
        assert isinstance(before, Guarded)
        assert not before.local
        server.stop()

        with trio.fail_after(DEADLINE + 2), pytest.raises(LimitStoreUnavailable) as info:
            await guard.admit(hold("r1", rpm=100))
        error = info.value
        assert (error.status, error.code) == (503, "limit_store_unavailable")
        assert error.retry_after is not None
        assert error.retry_after > 0
        assert "limit store" in error.message
        assert str(server.port) not in error.message  # the client is not told where
        for n in range(2, 30):  # decided at once: no request waits for a dead store
            with pytest.raises(LimitStoreUnavailable):
                await at_once(guard, hold(f"r{n}", rpm=100))

        guard.release(before, answered=False)  # admitted before: released without error
        free = await at_once(guard, hold("free"))  # a key without limits: nothing to check
        assert isinstance(free, Guarded)
        assert free.local
        guard.release(free, answered=False)

        stats = guard.statistics()
        assert (stats.up, stats.outages, stats.refused) == (False, 1, 29)
        assert stats.pending + stats.parked >= 1  # the release waits for Redis
        [warning] = warnings(caplog)  # one for the outage, not one per refusal
        assert f"127.0.0.1:{server.port}" in warning
        assert "not answering" in warning
        assert "503" in warning

        server.start()
        await back(guard)
        after = await guard.admit(hold("r-after", rpm=100))
        assert isinstance(after, Guarded)
        assert not after.local
        assert guard.statistics().outages == 1
    [ended] = [r.getMessage() for r in caplog.records if "answers again" in r.getMessage()]
    assert "29 requests refused" in ended
    assert len(warnings(caplog)) == 1


async def test_a_frozen_redis_is_refused_at_the_deadline_and_its_writes_land_after(
    server: RedisServer,
) -> None:
    """SIGSTOP: an admission waits ``timeout_s``, not forever. The first request's release
    is posted meanwhile; the second's script runs when the server wakes, after its command
    gave up (its answer lost). Both places are free once Redis answers, else
    ``max_concurrent = 1`` would refuse the next request of either key."""
    async with guarded(server) as (redis, guard):
        first = await guard.admit(hold("r1", max_concurrent=1))
        assert isinstance(first, Guarded)
        server.pause()
        with trio.fail_after(DEADLINE + 2), pytest.raises(LimitStoreUnavailable):
            await guard.admit(hold("r2", tenant="t2", max_concurrent=1))
        guard.release(first, answered=False)  # never blocks
        assert redis.statistics().pending + redis.statistics().parked >= 1
        await trio.sleep(COMMAND_TIMEOUT + 0.2)  # r2's command gives up: its answer is lost
        server.resume()  # ... and its script runs now, taking t2's one place
        await back(guard)
        for asked in hold("r3", max_concurrent=1), hold("r4", tenant="t2", max_concurrent=1):
            again = await guard.admit(asked)
            assert isinstance(again, Guarded), again
            assert not again.local
        assert redis.statistics().lost == 0


async def test_a_write_alone_finds_redis_down(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """No admission asks while Redis is frozen, only a release is posted: its failure starts
    the outage (one WARNING, its retries not each logged), the release is held back rather
    than given up after its tries, and lands once Redis answers."""
    caplog.set_level(logging.INFO, logger="dispatcher.store")
    async with guarded(server) as (redis, guard):
        held = await guard.admit(hold("r1", max_concurrent=1))
        assert isinstance(held, Guarded)
        server.pause()
        guard.release(held, answered=False)
        with trio.fail_after(COMMAND_TIMEOUT + 2):
            while guard.up:
                await trio.sleep(0.02)
        await trio.sleep(0.3)
        assert redis.statistics().parked == 1
        server.resume()
        await back(guard)
        again = await guard.admit(hold("r2", max_concurrent=1))
        assert isinstance(again, Guarded), again
        assert redis.statistics().lost == 0
    assert len(warnings(caplog)) == 1


async def test_local_divides_each_limit_by_the_edge_count(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """rpm = 4 over 2 edges: this edge admits 2 while Redis is down, refuses the third for
    its RPM with its share in the headers, warns every ``warn_every`` while it lasts; what
    the two spend is in Redis's budgets once it answers."""
    caplog.set_level(logging.INFO, logger="dispatcher.store")
    async with guarded(server, "local", edge_count=2, warn_every=0.2) as (redis, guard):
        server.pause()
        with trio.fail_after(DEADLINE + 2):
            first = await guard.admit(hold("r1", rpm=4, budget_tokens_day=1000))
        second = await at_once(guard, hold("r2", rpm=4, budget_tokens_day=1000))
        third = await at_once(guard, hold("r3", rpm=4, budget_tokens_day=1000))
        assert isinstance(first, Guarded)
        assert isinstance(second, Guarded)
        assert first.local
        assert second.local
        assert isinstance(third, Refusal)
        assert third.limit == "rpm"
        assert (b"x-ratelimit-limit-requests", b"2") in third.headers
        other = await at_once(guard, hold("o1", tenant="t2", rpm=4))  # another key's share
        assert isinstance(other, Guarded)
        assert guard.in_flight("t1") == 2
        guard.settle(first, 1, 30, 0.0)
        guard.settle(first, 1, 30, 0.0)  # settled once
        guard.release(first, answered=True)
        guard.release(second, answered=False)
        assert guard.in_flight("t1") == 0
        await trio.sleep(1.2)  # the prober's rounds: a ping that times out, then a pause
        alarms = warnings(caplog)
        assert "divided by edge_count = 2" in alarms[0]
        assert len([a for a in alarms if "still not answering" in a]) >= 2
        stats = guard.statistics()
        assert (stats.up, stats.local, stats.refused) == (False, 4, 0)

        server.resume()
        await back(guard)
        await redis.refresh("t1")
        assert redis.spent("t1").tokens_day == 30  # the outage's spend counts in Redis
        again = await guard.admit(hold("r4", rpm=4))
        assert isinstance(again, Guarded)
        assert not again.local


async def test_the_guard_closes_while_redis_is_down(server: RedisServer) -> None:
    """Leaving the block during an outage ends the prober and gives up what is parked
    (counted), without waiting for a server that does not answer."""
    async with guarded(server) as (redis, guard):
        held = await guard.admit(hold("r1", rpm=5))
        assert isinstance(held, Guarded)
        server.stop()
        with pytest.raises(LimitStoreUnavailable):
            await guard.admit(hold("r2", rpm=5))
        guard.release(held, answered=False)
    assert redis.statistics().lost >= 1
    assert redis.statistics().parked == 0


async def test_redis_down_at_start_is_an_outage_and_seeding_waits_for_it(
    server: RedisServer,
) -> None:
    """Seeding the budgets is the edge's first call: with Redis down the edge starts in its
    failure mode (an outage: refused here) and seeding raises ``StoreUnavailable`` naming the
    store (its address without the password), which the tenants' driver tries again."""
    async with guarded(server) as (_, guard):
        server.stop()
        async with open_usage_ledger(":memory:") as ledger:
            with pytest.raises(
                StoreUnavailable, match=r"the limit store \(redis://127\.0\.0\.1:\d+/0\)"
            ):
                await guard.seed(ledger)
            statistics = guard.statistics
            assert not statistics().up
            with pytest.raises(LimitStoreUnavailable):
                await guard.admit(hold("r1", rpm=5))
            server.start()
            with trio.fail_after(5):
                while not statistics().up:
                    await trio.sleep(0.1)
            await guard.seed(ledger)
            assert isinstance(await guard.admit(hold("r2", rpm=5)), Guarded)


async def test_the_store_times_out_on_its_own_once_the_guard_is_gone(server: RedisServer) -> None:
    """While the guard is open it bounds every admission (the store opens no timeout of its
    own); once it is closed, an admission to a server that does not answer fails on the
    store's own deadline, not never."""
    async with open_redis_limits(server.url, command_timeout=COMMAND_TIMEOUT) as redis:
        async with open_guarded_limits(redis, "the limit store", answer_within=DEADLINE) as guard:
            assert bound(redis) == DEADLINE
            assert isinstance(await guard.admit(hold("r1", rpm=10)), Guarded)
        assert bound(redis) is None
        server.pause()
        try:
            with trio.fail_after(COMMAND_TIMEOUT + 5), pytest.raises(StoreUnreachable):
                await redis.admit(hold("r2", rpm=10))
        finally:
            server.resume()


def bound(store: RedisLimits) -> float | None:
    """The bound the store was promised (read through a call: mypy would keep the
    attribute's value narrowed across the guard's block)."""
    return store.admit_bounded_by
