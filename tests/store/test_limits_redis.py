"""What the Redis limit store (:mod:`dispatcher.store.limits_redis`) adds to the contract
(``test_contract_limits.py`` runs it too), against a real ``redis-server``
(``redis_server.py``):

* it decides what :class:`~dispatcher.store.limits.LimitCounters` decides: the same refusals
  (limit, message, ``Retry-After``, headers), the same headers, the same spend, over random
  sequences of admissions, settles, releases, spends and the passing of time;
* several edges (stores on one server) share one set of limits; a settle is counted once
  whichever edge retries it; seeding counts the ledger once however many edges start;
* a dead edge's places in flight (and what they reserved) come back when their leases run out;
  a living edge renews its leases;
* an admission whose caller left before its answer does not keep its place, and one whose
  caller left before it ran is not run;
* suspended (the guard knows Redis is down), the store parks its writes without trying them
  and writes them first when resumed;
* what was posted before the store closed is written;
* a settle and its release posted together are one script on the server; an admission with
  nothing queued is sent by its caller, not through the writer's tasks; one with its tenant's
  settle and release (or release) waiting carries them in its own script, run first (one
  script per request at one client), and they are written again on their own if it fails;
  a write with no admission behind it waits at most the writer's linger (flush: not at all);
* on the server's own clocks (no clock given) it limits and spends;
* nothing of the embedded default imports ``coredis``.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import trio

from dispatcher.config import Limits
from dispatcher.store.ledger import open_usage_ledger
from dispatcher.store.limits import Held, MemoryLimits
from dispatcher.store.limits_redis import (
    WRITE_LINGER,
    RedisHeld,
    RedisLimits,
    RedisLimitsStatistics,
    open_redis_limits,
)
from dispatcher.store.seam import Hold, Refusal, StoreUnreachable

from . import redis_server
from .test_contract_limits import WALL, Clocks, ledger_row

pytestmark = pytest.mark.skipif(redis_server.BINARY is None, reason="no redis-server")


@pytest.fixture
async def url() -> str:
    url = redis_server.url()
    async with open_redis_limits(url) as store:
        await store.client.call("FLUSHDB")
    return url


@asynccontextmanager
async def edge(url: str, clocks: Clocks, **options: Any) -> AsyncIterator[RedisLimits]:
    """One edge's store, on the test's clocks."""
    async with open_redis_limits(
        url, clock=lambda: clocks.now, wall=lambda: clocks.wall, **options
    ) as store:
        yield store


def hold(
    request_id: str, tokens: int = 10, usd: float = 0.0, tenant: str = "t1", **limits: Any
) -> Hold:
    return Hold(request_id, tenant, Limits(**limits), tokens, usd)


# ------------------------------------------------------------------ the reference's answers


@pytest.mark.parametrize("seed", range(12))
async def test_it_answers_what_the_reference_answers(url: str, seed: int) -> None:
    """Random operations on two tenants, applied to :class:`MemoryLimits` (the reference)
    and to the Redis store on the same clocks: every decision is the same Refusal or the
    same headers, and the spend and the places in flight agree after each step."""
    rng = random.Random(seed)
    clocks = Clocks()
    reference = MemoryLimits(clock=lambda: clocks.now, wall=lambda: clocks.wall)

    def limits() -> Limits:
        def maybe(low: float, high: float, kind: type = int) -> Any:
            if rng.random() < 0.4:
                return None
            if kind is float:
                return rng.uniform(low, high)
            return rng.randint(int(low), int(high))

        return Limits(
            rpm=maybe(1, 6),
            tpm=maybe(20, 300),
            max_concurrent=maybe(1, 4),
            budget_tokens_day=maybe(50, 600),
            budget_tokens_month=maybe(100, 900),
            budget_usd_day=maybe(0.5, 5.0, float),
            budget_usd_month=maybe(1.0, 8.0, float),
        )

    tenants = {"a": limits(), "b": limits()}
    held: list[tuple[Held, RedisHeld]] = []
    async with edge(url, clocks, hold_lease=1e9) as store:
        for step in range(80):
            action = rng.random()
            tenant = rng.choice(sorted(tenants))
            if action < 0.4:
                asked = Hold(
                    f"r{seed}-{step}",
                    tenant,
                    tenants[tenant],
                    rng.randint(0, 120),
                    round(rng.uniform(0, 1.5), 2),
                )
                expected = await reference.admit(asked)
                got = await store.admit(asked)
                if isinstance(expected, Refusal):
                    assert got == expected, (step, asked)
                else:
                    assert isinstance(got, RedisHeld), (step, asked, got)
                    assert got.headers == expected.headers, (step, asked)
                    held.append((expected, got))
            elif action < 0.6 and held:
                theirs, ours = rng.choice(held)
                attempt, tokens, usd = rng.randint(1, 2), rng.randint(0, 100), rng.random()
                reference.settle(theirs, attempt, tokens, usd)
                store.settle(ours, attempt, tokens, usd)
            elif action < 0.8 and held:
                theirs, ours = rng.choice(held)
                answered = rng.random() < 0.5
                reference.release(theirs, answered=answered)
                store.release(ours, answered=answered)
            elif action < 0.85:
                tokens, usd = rng.randint(0, 50), rng.random()
                reference.spend(tenant, tokens, usd)
                store.spend(tenant, tokens, usd)
            elif action < 0.98:
                clocks.advance(rng.choice([0.0, 0.5, 5.0, 20.0, 59.999, 60.0]))
            else:
                clocks.advance(12 * 3600.0)  # past a UTC midnight
            for name in tenants:
                assert store.in_flight(name) == reference.in_flight(name), step
                expected_spent, got_spent = reference.spent(name), store.spent(name)
                assert got_spent.tokens_day == expected_spent.tokens_day, step
                assert got_spent.tokens_month == expected_spent.tokens_month, step
                assert got_spent.usd_day == pytest.approx(expected_spent.usd_day), step
                assert got_spent.usd_month == pytest.approx(expected_spent.usd_month), step
        await store.flush()
        for name in tenants:
            assert store.in_flight(name) == reference.in_flight(name)
            assert store.spent(name).tokens_month == reference.spent(name).tokens_month


# ------------------------------------------------------------------ several edges


async def test_two_edges_share_the_limits(url: str) -> None:
    clocks = Clocks()
    async with edge(url, clocks) as one, edge(url, clocks) as other:
        first = await one.admit(hold("r1", max_concurrent=2, rpm=3))
        assert isinstance(first, RedisHeld)
        assert isinstance(await other.admit(hold("r2", max_concurrent=2, rpm=3)), RedisHeld)
        refused = await other.admit(hold("r3", max_concurrent=2, rpm=3))
        assert isinstance(refused, Refusal)
        assert refused.limit == "max_concurrent"
        one.release(first, answered=False)
        await one.flush()
        assert isinstance(await other.admit(hold("r4", max_concurrent=2, rpm=3)), RedisHeld)
        refused = await one.admit(hold("r5", max_concurrent=9, rpm=3))
        assert isinstance(refused, Refusal)
        assert refused.limit == "rpm"  # three requests in the minute, from both edges


async def test_a_settle_counts_once_whichever_edge_retries_it(url: str) -> None:
    clocks = Clocks()
    async with edge(url, clocks) as one, edge(url, clocks) as other:
        asked = hold("r1", 50, 1.0, tpm=100)
        held = await one.admit(asked)
        assert isinstance(held, RedisHeld)
        one.settle(held, 1, 20, 0.5)
        other.settle(RedisHeld(asked, ()), 1, 20, 0.5)  # the same row, from another edge
        other.settle(RedisHeld(asked, ()), 2, 5, 0.25)  # another attempt's row adds
        await one.flush()
        await other.flush()
        await one.refresh("t1")
        spent = one.spent("t1")
        assert (spent.tokens_day, spent.usd_day) == (25, 0.75)
        probe = await other.admit(hold("r2", 0, tpm=100))
        assert isinstance(probe, RedisHeld)
        assert dict(probe.headers)[b"x-ratelimit-remaining-tokens"] == b"75"


async def test_seeding_counts_the_ledger_once_for_all_edges(url: str, tmp_path: Path) -> None:
    clocks = Clocks()
    async with open_usage_ledger(tmp_path / "usage.sqlite3") as ledger:
        ledger.record(ledger_row("today", WALL - 60))
        ledger.record(ledger_row("earlier", WALL - 3 * 86400))
        async with edge(url, clocks) as one, edge(url, clocks) as other:
            await one.seed(ledger)
            await other.seed(ledger)  # a second edge starting: the counters are kept
            await other.refresh("t1")
            for store in (one, other):
                spent = store.spent("t1")
                assert (spent.tokens_day, spent.tokens_month) == (15, 30)
                assert spent.usd_month == 2.0


async def test_a_dead_edges_places_come_back_with_their_lease(url: str) -> None:
    clocks = Clocks()
    limits: dict[str, Any] = {"max_concurrent": 1, "budget_tokens_day": 100}
    async with edge(url, clocks, hold_lease=30.0) as dead:
        assert isinstance(await dead.admit(hold("r1", 90, **limits)), RedisHeld)
    # That edge is gone without releasing its request.
    async with edge(url, clocks, hold_lease=30.0) as alive:
        refused = await alive.admit(hold("r2", 5, **limits))
        assert isinstance(refused, Refusal)
        assert refused.limit == "max_concurrent"
        clocks.advance(29.0)
        assert isinstance(await alive.admit(hold("r3", 5, **limits)), Refusal)
        clocks.advance(1.0)  # the lease ran out: its place and its 90 reserved tokens
        assert isinstance(await alive.admit(hold("r4", 95, **limits)), RedisHeld)


async def test_a_living_edge_renews_its_leases(url: str) -> None:
    clocks = Clocks()
    limits: dict[str, Any] = {"max_concurrent": 1}
    async with (
        edge(url, clocks, hold_lease=30.0, renew_every=0.02) as living,
        edge(url, clocks, hold_lease=30.0) as other,
    ):
        held = await living.admit(hold("r1", **limits))
        assert isinstance(held, RedisHeld)
        for _ in range(4):  # 80 s on the store's clocks: past the first lease, and more
            clocks.advance(20.0)
            await trio.sleep(0.1)  # the renewer runs
            refused = await other.admit(hold("r2", **limits))
            assert isinstance(refused, Refusal)
            assert refused.limit == "max_concurrent"
        living.release(held, answered=False)
        await living.flush()
        assert isinstance(await other.admit(hold("r3", **limits)), RedisHeld)


async def test_an_admission_left_before_its_answer_keeps_no_place(url: str) -> None:
    clocks = Clocks()
    async with edge(url, clocks) as store:
        with trio.CancelScope() as scope:
            scope.cancel()  # the client went away while the admission was on its way
            await store.admit(hold("r1", max_concurrent=1))
        await store.flush()
        await store.refresh("t1")
        assert store.in_flight("t1") == 0
        assert isinstance(await store.admit(hold("r2", max_concurrent=1)), RedisHeld)


async def test_what_was_posted_before_closing_is_written(url: str) -> None:
    clocks = Clocks()
    async with edge(url, clocks) as store:
        held = await store.admit(hold("r1", 40, 2.0))
        assert isinstance(held, RedisHeld)
        store.settle(held, 1, 30, 1.5)
        store.release(held, answered=True)
        store.spend("t1", 5, 0.5)
    async with edge(url, clocks) as reopened:
        await reopened.refresh("t1")
        spent = reopened.spent("t1")
        assert (spent.tokens_day, spent.usd_day) == (35, 2.0)
        assert reopened.in_flight("t1") == 0
        assert reopened.statistics().lost == 0


async def test_the_servers_clocks_by_default(url: str) -> None:
    async with open_redis_limits(url) as store:
        assert isinstance(await store.admit(hold("r1", rpm=1)), RedisHeld)
        refused = await store.admit(hold("r2", rpm=1))
        assert isinstance(refused, Refusal)
        assert refused.limit == "rpm"
        assert 0.0 < refused.retry_after <= 60.0
        store.spend("t1", 7, 0.25)
        await store.flush()
        spent = store.spent("t1")
        assert (spent.tokens_day, spent.tokens_month, spent.usd_month) == (7, 7, 0.25)


def test_clocks_are_both_given_or_neither() -> None:
    async def main() -> None:
        async with open_redis_limits("redis://127.0.0.1:1/0", clock=lambda: 0.0):
            pass  # pragma: no cover

    with pytest.raises(ValueError, match="both clock and wall"):
        trio.run(main)


def test_the_embedded_default_never_imports_coredis() -> None:
    code = (
        "import sys, dispatcher.cli, dispatcher.edge, dispatcher.store.backends; "
        "assert 'coredis' not in sys.modules, sorted(m for m in sys.modules if 'redis' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


_RESTORE = "redis.call('DEL', KEYS[1]) redis.call('HSET', KEYS[1], unpack(ARGV))"


async def restore(store: RedisLimits, key: str, fields: list[bytes]) -> None:
    """Put the tenant's state hash back at once (one script: a write the store retries
    meanwhile must not land between a DEL and an HSET, and be overwritten)."""
    await store.client.call("EVAL", _RESTORE, 1, key, *fields)


async def test_a_write_is_retried_while_the_server_refuses_it(url: str) -> None:
    """Settles and spends the server refuses wait in the writer (the request's path does
    not), are written once it takes them, and are given up (counted) after their tries.
    (The tenant's state key holding a string makes every script on it fail: WRONGTYPE.)"""
    clocks = Clocks()
    async with edge(url, clocks) as store:
        held = await store.admit(hold("r1", 40))
        assert isinstance(held, RedisHeld)
        broken = "dispatcher:limits:{t1}:st"
        state = await store.client.call("HGETALL", broken)
        await store.client.call("DEL", broken)
        await store.client.call("SET", broken, "not a hash")
        store.settle(held, 1, 30, 1.5)  # never blocks, the server refusing it
        store.release(held, answered=True)
        assert store.spent("t1").tokens_day == 30  # this edge counts it already
        await trio.sleep(0.2)  # a few tries fail
        assert store.statistics().retried >= 1
        await restore(store, broken, cast(list[bytes], state))
        await store.flush()
        assert store.statistics().lost == 0
        await store.refresh("t1")
        assert store.spent("t1").tokens_day == 30
        assert store.in_flight("t1") == 0
        await store.client.call("DEL", broken)
        await store.client.call("SET", broken, "not a hash")
        store.spend("t1", 5, 0.0)
        await store.flush()  # every try fails
        assert store.statistics().lost == 1
        await store.client.call("DEL", broken)


async def test_an_admission_whose_caller_left_before_it_ran_is_not_run(url: str) -> None:
    """A write the server refuses holds the queue (WRONGTYPE: retried); an admission behind
    it whose caller leaves is skipped, not run later: it takes no request of ``rpm = 1``."""
    clocks = Clocks()
    async with edge(url, clocks) as store:
        held = await store.admit(hold("r1", 40))
        assert isinstance(held, RedisHeld)
        broken = "dispatcher:limits:{t1}:st"
        state = await store.client.call("HGETALL", broken)
        await store.client.call("DEL", broken)
        await store.client.call("SET", broken, "not a hash")
        store.settle(held, 1, 30, 0.0)  # retried at the head of the queue
        with trio.fail_after(10):  # the writer has it, alone (else one pipeline takes both)
            while store.statistics().retried == 0:
                await trio.sleep(0.001)
        with trio.move_on_after(0.05):
            await store.admit(hold("gone", tenant="t2", rpm=1))
        await restore(store, broken, cast(list[bytes], state))
        await store.flush()
        assert isinstance(await store.admit(hold("r2", tenant="t2", rpm=1)), RedisHeld)


async def test_a_suspended_store_parks_its_writes_and_writes_them_when_resumed() -> None:
    """While Redis is known down, writes are parked in order without a try each (no backlog
    of retries to wait out when it returns) and an admission fails at once; resumed, they
    are written first."""
    with redis_server.own_server() as server:
        async with open_redis_limits(server.url) as store:
            server.stop()
            store.suspend()
            for _ in range(200):
                store.spend("t1", 1, 0.0)
            with pytest.raises(StoreUnreachable):
                await store.admit(hold("r1", rpm=5))
            await trio.sleep(0.3)  # nothing is tried: six tries each would take 1.5 s
            stats = store.statistics()
            assert (stats.parked, stats.retried, stats.lost) == (200, 0, 0)
            assert store.spent("t1").tokens_day == 200  # this edge counts them already
            server.start()
            await store.ping()
            store.resume()
            with trio.fail_after(5):
                await store.flush()
            await store.refresh("t1")
            assert store.spent("t1").tokens_day == 200
            assert store.statistics() == RedisLimitsStatistics(
                pending=0, retried=0, lost=0, parked=0
            )


async def test_flush_waits_for_the_write_being_tried(url: str) -> None:
    """The one write posted is being tried (the server refuses it: WRONGTYPE) when flush is
    called: flush returns once it is written, not before."""
    clocks = Clocks()
    async with edge(url, clocks) as store:
        await store.refresh("t1")
        broken = "dispatcher:limits:{t1}:st"
        state = await store.client.call("HGETALL", broken)
        await store.client.call("DEL", broken)
        await store.client.call("SET", broken, "not a hash")
        store.spend("t1", 5, 0.0)
        await trio.sleep(0.1)  # the writer took it and is between tries
        assert store.statistics().pending == 1
        await restore(store, broken, cast(list[bytes], state) or [b"rsv_tokens", b"0"])
        await store.flush()
        assert store.statistics().pending == 0
        assert store.statistics().lost == 0


async def test_operations_queued_together_go_in_one_pipeline_a_refused_one_goes_alone(
    url: str,
) -> None:
    """What is queued when the writer takes its next operation goes in one round trip. A
    write the server refuses in it (WRONGTYPE) goes again alone, with its retries, after the
    others were answered: an admission queued behind it does not wait for those retries."""
    clocks = Clocks()
    async with edge(url, clocks) as store:
        await store.refresh("t1")
        broken = "dispatcher:limits:{t1}:st"
        state = await store.client.call("HGETALL", broken)
        await store.client.call("DEL", broken)
        await store.client.call("SET", broken, "not a hash")
        store.spend("t1", 5, 0.0)  # queued with the admission below: no checkpoint between
        with trio.fail_after(0.5):  # its six tries alone take over 3 s
            assert isinstance(await store.admit(hold("r1", tenant="t2", rpm=1)), RedisHeld)
        assert store.statistics().pending == 1  # the spend, being tried again alone
        await restore(store, broken, cast(list[bytes], state) or [b"rsv_tokens", b"0"])
        await store.flush()
        assert store.statistics().lost == 0
        await store.refresh("t1")
        assert store.spent("t1").tokens_day == 5


async def _script_calls(store: RedisLimits) -> int:
    """Scripts the server ran since it started (``INFO commandstats``)."""
    info = await store.client.call("INFO", "commandstats")
    assert isinstance(info, bytes)
    for line in info.decode().splitlines():
        if line.startswith("cmdstat_evalsha:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


async def test_a_settle_and_its_release_posted_together_are_one_script(url: str) -> None:
    """A request's settle and its release, posted with no write between them, run as one
    script (one call on the server, not two), with what each does: the place comes back,
    the reservation comes off, the spend counts; a second release of it does nothing."""
    clocks = Clocks()
    async with edge(url, clocks) as store:
        held = await store.admit(hold("r1", 50, max_concurrent=1, budget_tokens_day=100))
        assert isinstance(held, RedisHeld)
        await store.flush()
        before = await _script_calls(store)
        store.settle(held, 1, 30, 0.25)
        store.release(held, answered=True)
        await store.flush()
        assert await _script_calls(store) == before + 1
        assert store.in_flight("t1") == 0
        assert store.spent("t1").tokens_day == 30
        assert store.spent("t1").usd_day == 0.25
        # 30 spent and nothing reserved: 70 tokens of the day's 100 are left, for one place.
        again = await store.admit(hold("r2", 70, max_concurrent=1, budget_tokens_day=100))
        assert isinstance(again, RedisHeld)
        store.release(held, answered=True)  # again: nothing is posted
        store.release(again, answered=False)
        await store.flush()
        assert store.in_flight("t1") == 0
        assert store.spent("t1").tokens_day == 30


class _Steps(trio.abc.Instrument):
    """The names of the tasks that ran a step while it was installed."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.names.add(task.name)


async def test_an_admission_with_nothing_queued_is_sent_by_its_caller(url: str) -> None:
    """With no write waiting, an admission does not pass through the store's writer and
    receiver tasks (two scheduler turns instead of five): neither runs a step while it is
    answered; with its tenant's release waiting, it carries the release in its own script
    (one script on the server, the release first: the one place is free for it), still
    without the receiver."""
    clocks = Clocks()
    async with edge(url, clocks) as store:
        await store.refresh("t1")  # connected, the script loaded
        steps = _Steps()
        trio.lowlevel.add_instrument(steps)
        try:
            held = await store.admit(hold("r1", max_concurrent=1))
        finally:
            trio.lowlevel.remove_instrument(steps)
        assert isinstance(held, RedisHeld)
        assert not {name for name in steps.names if name.endswith(("_writer", "_receiver"))}
        store.release(held, answered=False)  # queued: the next admission carries it
        before = await _script_calls(store)
        steps = _Steps()
        trio.lowlevel.add_instrument(steps)
        try:
            assert isinstance(await store.admit(hold("r2", max_concurrent=1)), RedisHeld)
        finally:
            trio.lowlevel.remove_instrument(steps)
        assert not {name for name in steps.names if name.endswith("_receiver")}
        assert await _script_calls(store) == before + 1
        assert store.statistics().pending == 0
        assert store.in_flight("t1") == 1


async def test_an_admission_carries_its_tenants_settle_and_release(url: str) -> None:
    """A request's settle and release, waiting when the next admission of the tenant comes,
    run in that admission's script, first: the place is back, the reservation off and the
    spend counted before it is decided (one script on the server for all three). A write of
    another tenant goes in the same pipeline instead, in its own script."""
    clocks = Clocks()
    limits: dict[str, Any] = {"max_concurrent": 1, "budget_tokens_day": 100}
    async with edge(url, clocks) as store:
        held = await store.admit(hold("r1", 60, **limits))
        assert isinstance(held, RedisHeld)
        await store.flush()
        before = await _script_calls(store)
        store.settle(held, 1, 30, 0.25)
        store.release(held, answered=True)
        # 30 spent, 60 no longer reserved: 70 of the day's 100 left, and the one place.
        again = await store.admit(hold("r2", 70, **limits))
        assert isinstance(again, RedisHeld)
        assert await _script_calls(store) == before + 1
        assert store.statistics().pending == 0
        assert store.in_flight("t1") == 1
        assert store.spent("t1").tokens_day == 30
        assert store.spent("t1").usd_day == 0.25
        refused = await store.admit(hold("r3", 1, **limits))
        assert isinstance(refused, Refusal)
        assert refused.limit == "budget_tokens_day"  # 30 spent + 70 reserved
        store.release(again, answered=False)
        other = await store.admit(hold("r4", 1, tenant="t2", max_concurrent=1))
        assert isinstance(other, RedisHeld)
        await store.flush()
        assert await _script_calls(store) == before + 4  # r3; t1's release beside r4
        assert store.in_flight("t1") == 0
        await store.refresh("t1")
        assert store.in_flight("t1") == 0
        assert store.spent("t1").tokens_day == 30


async def test_a_carried_write_is_written_alone_when_its_admission_fails() -> None:
    """The server stops answering while an admission carries its tenant's release: the
    admission fails, and the release is written on its own once the server answers (with
    the place the admission may have taken: nothing is left held)."""
    with redis_server.own_server() as server:
        clocks = Clocks()
        async with edge(server.url, clocks, command_timeout=0.3) as store:
            held = await store.admit(hold("r1", max_concurrent=1))
            assert isinstance(held, RedisHeld)
            store.release(held, answered=False)
            server.pause()
            try:
                with pytest.raises(StoreUnreachable):
                    await store.admit(hold("r2", max_concurrent=1))
                assert store.statistics().pending >= 1  # the release, and r2's
            finally:
                server.resume()
            with trio.fail_after(10):
                await store.flush()
            assert store.statistics().lost == 0
            await store.refresh("t1")
            assert store.in_flight("t1") == 0
            assert isinstance(await store.admit(hold("r3", max_concurrent=1)), RedisHeld)


async def test_a_write_alone_waits_at_most_the_linger(url: str) -> None:
    """A release with no admission behind it is held for the next one to carry, and written
    on its own after the writer's linger: another edge then sees the place free. Flush
    writes what is held at once."""
    clocks = Clocks()
    limits: dict[str, Any] = {"max_concurrent": 1}
    async with edge(url, clocks) as one, edge(url, clocks) as other:
        held = await one.admit(hold("r1", **limits))
        assert isinstance(held, RedisHeld)
        one.release(held, answered=False)
        with trio.fail_after(5):
            while one.statistics().pending:
                await trio.sleep(WRITE_LINGER / 2)
        again = await other.admit(hold("r2", **limits))
        assert isinstance(again, RedisHeld)
        other.linger = 3600.0  # held for an admission that does not come
        other.release(again, answered=False)
        await trio.sleep(0.05)
        assert other.statistics().pending == 1
        refused = await one.admit(hold("r3", **limits))
        assert isinstance(refused, Refusal)
        assert refused.limit == "max_concurrent"
        with trio.fail_after(5):
            await other.flush()
        assert isinstance(await one.admit(hold("r4", **limits)), RedisHeld)
