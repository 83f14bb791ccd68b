"""serve_node's reconnect loop, in virtual time, with a dial the test controls."""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from dispatcher import wire
from dispatcher.shared.transport import (
    Connection,
    ConnectionClosed,
    MemoryConnection,
    memory_connection_pair,
)
from nodes.agent import (
    EXIT_GAVE_UP,
    Backoff,
    EdgeUnreachable,
    NodeRejected,
    run_node,
    serve_node,
)
from nodes.config import NodeConfig, default_node_config
from nodes.dial import DialFailed
from nodes.reconnect import DialCause

EdgeBehaviour = Callable[[MemoryConnection], Awaitable[None]]


def config(**changes: Any) -> NodeConfig:
    return attrs.evolve(default_node_config("node-1"), **changes)


async def welcome(conn: MemoryConnection) -> None:
    frame = await conn.receive()
    assert isinstance(frame, str)
    assert isinstance(wire.decode(frame), wire.Hello)
    await conn.send(
        wire.encode(
            wire.Welcome(protocol=wire.PROTOCOL_VERSION, generation=1, heartbeat_interval=5.0)
        )
    )


async def welcome_then_ping_for(seconds: float, conn: MemoryConnection) -> None:
    await welcome(conn)
    with trio.move_on_after(seconds):
        nonce = 0
        while True:
            await trio.sleep(5.0)
            nonce += 1
            await conn.send(wire.encode(wire.Ping(nonce=nonce)))
            await conn.receive()  # the pong
    await conn.aclose(1001, "edge restarting")


class Dialer:
    """A dial that fails ``failures`` times, then connects to an edge behaving as told."""

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        failures: int | None = None,
        edges: list[EdgeBehaviour] | None = None,
        error: Exception | None = None,
    ) -> None:
        self.nursery = nursery
        self.failures = failures
        self.edges = edges or []
        self.error = error or ConnectionClosed("connection refused")
        self.attempts: list[float] = []

    def __call__(self) -> AbstractAsyncContextManager[Connection]:
        return self._dial()

    @asynccontextmanager
    async def _dial(self) -> AsyncIterator[Connection]:
        self.attempts.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        if self.failures is None or len(self.attempts) <= self.failures or not self.edges:
            raise self.error
        node, edge = memory_connection_pair()
        self.nursery.start_soon(self.edges.pop(0), edge)
        yield node

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.attempts, self.attempts[1:], strict=False)]


def test_backoff_bounds_and_jitter() -> None:
    backoff = Backoff(0.5, 30.0, rng=random.Random(1))
    delays = [backoff.next_delay() for _ in range(200)]
    for n, delay in enumerate(delays, start=1):
        assert 0.5 <= delay <= min(30.0, 0.5 * 2**n)
    assert len({round(d, 6) for d in delays}) == len(delays)  # jittered, not fixed steps
    assert max(delays[10:]) > 20  # the ceiling reaches the maximum
    backoff.reset()
    assert 0.5 <= backoff.next_delay() <= 1.0


async def test_failing_dial_backs_off_exponentially_without_busy_looping(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    dialer = Dialer(nursery)  # never connects
    with trio.move_on_after(60):
        await serve_node(config(keep_trying=True), dial=dialer, rng=random.Random(7))
    assert dialer.attempts[0] == 0
    gaps = dialer.gaps()
    for n, gap in enumerate(gaps, start=1):
        assert 0.5 <= gap <= min(30.0, 0.5 * 2**n) + 1e-9
    # a floor of 0.5 s and a doubling ceiling: a handful of attempts per minute, not thousands
    assert 4 <= len(dialer.attempts) <= 20


async def test_reconnects_after_failures_and_reports_started_after_welcome(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="nodes.agent")
    dialer = Dialer(nursery, failures=5, edges=[welcome])
    await nursery.start(partial(serve_node, config(), dial=dialer))
    assert len(dialer.attempts) == 6
    for n, gap in enumerate(dialer.gaps(), start=1):
        assert 0.5 <= gap <= 0.5 * 2**n
    # Each failure is reported once: the first two at INFO, the third a WARNING naming the
    # cause, the ones after it (within a minute of that warning) at DEBUG.
    ends = [
        r
        for r in caplog.records
        if r.getMessage().startswith(("reconnecting", "cannot reach the edge"))
    ]
    levels = [r.levelno for r in ends]
    assert levels == [logging.INFO, logging.INFO, logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert all("connection refused" in r.getMessage() for r in ends)
    nursery.cancel_scope.cancel()


async def test_unexpected_dial_errors_are_retried_too(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    dialer = Dialer(nursery, failures=2, edges=[welcome], error=RuntimeError("a bug"))
    await nursery.start(partial(serve_node, config(), dial=dialer))
    assert len(dialer.attempts) == 3
    assert "unexpected error" in caplog.text
    nursery.cancel_scope.cancel()


async def test_long_session_resets_the_backoff(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    async def long_session(conn: MemoryConnection) -> None:
        await welcome_then_ping_for(60.0, conn)

    async def short_session(conn: MemoryConnection) -> None:
        await welcome_then_ping_for(1.0, conn)

    dialer = Dialer(nursery, failures=6, edges=[long_session, short_session, long_session])
    with trio.move_on_after(300):
        await serve_node(config(), dial=dialer)
    # attempts: 6 failures (growing delays), long session, short session, long session...
    gaps = dialer.gaps()
    after_long = gaps[6] - 60.0  # the session lasted ~60 s, then a fresh, small delay
    assert 0.5 <= after_long <= 1.0 + 1e-9
    # after the short session the backoff was not reset: it keeps growing from 1
    after_short = gaps[7] - 1.0
    assert 0.5 <= after_short <= 2.0 + 1e-9


async def test_rejection_stops_the_loop(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async def refuse(conn: MemoryConnection) -> None:
        await conn.receive()
        await conn.aclose(4001, "invalid node token")

    dialer = Dialer(nursery, failures=2, edges=[refuse, welcome])
    with pytest.raises(NodeRejected, match="invalid node token"):
        await serve_node(config(), dial=dialer)
    assert len(dialer.attempts) == 3
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "rejected" in error.getMessage()
    assert "not reconnecting" in error.getMessage()


async def test_rejection_before_the_first_welcome_fails_nursery_start(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    async def refuse(conn: MemoryConnection) -> None:
        await conn.receive()
        await conn.aclose(1002, "protocol version 1 is not supported")

    dialer = Dialer(nursery, failures=0, edges=[refuse])
    with pytest.raises(NodeRejected, match="not supported"):
        await nursery.start(partial(serve_node, config(), dial=dialer))


def test_run_node_exits_2_when_rejected() -> None:
    @asynccontextmanager
    async def rejecting_dial() -> AsyncIterator[Connection]:
        node, edge = memory_connection_pair()
        await edge.aclose(4001, "invalid node token")
        yield node

    assert run_node(config(), dial=rejecting_dial) == 2


# -- a node that cannot reach its edge (issue #21) ---------------------------------------

REFUSED = DialFailed(
    "cannot connect to ws://127.0.0.1:9/v1/nodes/connect: all attempts to connect failed",
    DialCause(kind="refused", host="127.0.0.1", port=9),
)


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


@pytest.mark.parametrize("seed", range(8))
async def test_a_node_that_never_gets_in_warns_then_gives_up(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    seed: int,
) -> None:
    caplog.set_level(logging.DEBUG, logger="nodes.agent")
    dialer = Dialer(nursery, error=REFUSED)
    with pytest.raises(EdgeUnreachable) as gave_up:
        await serve_node(config(give_up_after=60.0), dial=dialer, rng=random.Random(seed))
    # At the bound (the last delay is cut to end there, or after the 0.5 s floor when less
    # was left), not a whole backoff later.
    assert 60.0 <= dialer.attempts[-1] <= 60.5
    assert trio.current_time() == dialer.attempts[-1]
    message = str(gave_up.value)
    assert message.startswith("node node-1 gave up: it never got in to the edge at ")
    assert "connection refused at 127.0.0.1:9: is the edge running, and is the port right?" in (
        message
    )
    assert records(caplog, logging.ERROR) == [message]
    # One warning in the minute (at the third attempt), naming the cause and the give-up.
    (warning,) = records(caplog, logging.WARNING)
    assert "3 attempts in a row" in warning
    assert "connection refused at 127.0.0.1:9" in warning
    assert "it gives up in" in warning
    assert len(dialer.attempts) > 4  # the rest at DEBUG
    assert len(records(caplog, logging.INFO)) == 2


async def test_keep_trying_never_gives_up_and_warns_at_a_bounded_rate(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="nodes.agent")
    dialer = Dialer(nursery, error=REFUSED)
    with trio.move_on_after(3600) as waited:
        await serve_node(config(keep_trying=True), dial=dialer)
    assert waited.cancelled_caught  # still trying after an hour
    warnings = records(caplog, logging.WARNING)
    assert 30 <= len(warnings) <= 61  # about one a minute
    assert len(dialer.attempts) > len(warnings) + 40  # not one per attempt
    assert all("next attempt in" in w and "gives up" not in w for w in warnings)
    assert records(caplog, logging.ERROR) == []


async def test_a_node_that_got_in_once_reconnects_for_ever(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async def welcome_then_leave(conn: MemoryConnection) -> None:
        await welcome_then_ping_for(10.0, conn)

    # The edge lets it in once, goes away after 10 s and never comes back.
    dialer = Dialer(nursery, failures=0, edges=[welcome_then_leave], error=REFUSED)
    with trio.move_on_after(3600) as waited:
        await serve_node(config(give_up_after=60.0), dial=dialer)
    assert waited.cancelled_caught  # not EdgeUnreachable: that is a reconnect
    assert len(dialer.attempts) > 50
    assert records(caplog, logging.ERROR) == []
    assert any("cannot reach the edge" in w for w in records(caplog, logging.WARNING))


def test_run_node_exits_3_when_it_never_got_in(caplog: pytest.LogCaptureFixture) -> None:
    @asynccontextmanager
    async def refused_dial() -> AsyncIterator[Connection]:
        await trio.lowlevel.checkpoint()
        raise DialFailed(str(REFUSED), REFUSED.cause)
        yield  # type: ignore[unreachable]  # (an async generator)

    quick = config(give_up_after=0.0, reconnect_min_backoff=0.01, reconnect_max_backoff=0.01)
    assert run_node(quick, dial=refused_dial) == EXIT_GAVE_UP == 3
    (error,) = records(caplog, logging.ERROR)
    assert "gave up" in error
