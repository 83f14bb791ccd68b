"""Regression tests for the faults of issue #9, each deterministic (in memory, virtual time):

* a client leaving while its ``run.request`` is being written must not drop the node session;
* thousands of clients leaving at once: every cancel reaches the node, the session survives;
* usage rows come from the run, not from what the API consumed: a run that completed while
  its client was leaving, a late ``run.usage`` after the client left, usage the node
  estimated, rows of runs abandoned on a node that is then lost (settled at once).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from dispatcher import wire
from dispatcher.config import EdgeConfig, NodeSettings, QueuePolicySettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.gate.attempts import Answer, GateRequest
from dispatcher.gate.pool import DispatchRequest
from dispatcher.paths.runs import RunSpec
from dispatcher.shared.transport import MemoryConnection, RawFrame, memory_connection_pair
from dispatcher.store.usage import UsageRow

from .fakes import ScriptedNode, connect, hello, wait_until

BODY = {"model": "m", "messages": [{"role": "user", "content": "a b c"}]}


@attrs.define(eq=False)
class ServerLikeConnection:
    """The edge's end of an in-memory node connection that behaves like our server's
    websocket: a send cancelled half-way aborts the whole connection ("a write was
    interrupted"). ``hold`` makes sends wait; ``send_time`` makes each send take that long."""

    inner: MemoryConnection
    hold: trio.Event | None = None
    receive_hold: trio.Event | None = None
    send_time: float = 0.0
    in_flight: int = 0
    aborted: bool = False

    async def send(self, frame: RawFrame) -> None:
        self.in_flight += 1
        try:
            if self.hold is not None:
                await self.hold.wait()
            if self.send_time:
                await trio.sleep(self.send_time)
        except trio.Cancelled:
            self.aborted = True
            await self.inner.aclose(1011, "a write was interrupted")
            raise
        finally:
            self.in_flight -= 1
        await self.inner.send(frame)

    async def receive(self) -> RawFrame:
        if self.receive_hold is not None:
            await self.receive_hold.wait()
        return await self.inner.receive()

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        await self.inner.aclose(code, reason)


@asynccontextmanager
async def edge_with_node(
    slots: int, **policy: Any
) -> AsyncIterator[tuple[Dispatcher, ScriptedNode, ServerLikeConnection, list[UsageRow]]]:
    config = EdgeConfig(
        local_node=False,
        nodes=NodeSettings(heartbeat_interval=1000, heartbeat_timeout=3000),
        admission=QueuePolicySettings(**policy),
    )
    rows: list[UsageRow] = []
    async with open_dispatcher(config) as d:
        d.gate.record_usage = rows.append
        edge_end, node_end = memory_connection_pair()
        conn = ServerLikeConnection(edge_end)
        await d.attach_node(conn)
        node = ScriptedNode(node_end)
        await node.send(hello(slots=slots))
        welcome = await node.receive()
        assert isinstance(welcome, wire.Welcome)
        yield d, node, conn, rows


def spec() -> RunSpec:
    return RunSpec(model="m", body=BODY)


def gate_request(request_id: str = "r", *, stream: bool = True) -> GateRequest:
    return GateRequest(
        request_id=request_id, dispatch=DispatchRequest(model="m", body=BODY), stream=stream
    )


def slots_in_use(d: Dispatcher) -> tuple[int, int]:
    stats = d.admission.statistics()
    return (
        sum(c.in_use for c in stats.candidates.values()),
        sum(c.draining for c in stats.candidates.values()),
    )


async def test_client_leaving_during_its_run_request_write_keeps_the_session(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(slots=2) as (d, node, conn, _rows):
        generation = d.registry.sessions["node-a"].generation
        events_a: list[wire.RunEvent] = []
        b_scope = trio.CancelScope()

        async def run_a() -> None:
            async with d.open_run(spec()) as run:
                async for event in run:
                    events_a.append(event)

        async def run_b() -> None:
            with b_scope:
                async with d.open_run(spec()) as run:
                    async for _ in run:
                        pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_a)
            request_a = await node.receive_run()
            await node.emit(request_a.run_id, ("run.started", {}))
            await wait_until(lambda: events_a)
            # The next write (B's run.request) stays in flight until released.
            conn.hold = trio.Event()
            nursery.start_soon(run_b)
            await wait_until(lambda: conn.in_flight == 1)
            b_scope.cancel()  # B's client leaves while its request is on the wire
            await trio.testing.wait_all_tasks_blocked()
            hold, conn.hold = conn.hold, None
            hold.set()
            request_b = await node.receive_run()
            cancel_b = await node.receive()
            assert isinstance(cancel_b, wire.RunCancel)
            assert cancel_b.run_id == request_b.run_id
            await node.send(wire.RunCancelled(run_id=request_b.run_id, seq=0))
            await node.send(wire.RunDelta(run_id=request_a.run_id, seq=1, text="hi"))
            await node.send(wire.RunCompleted(run_id=request_a.run_id, seq=2))
        assert not conn.aborted
        assert [type(e) for e in events_a] == [wire.RunStarted, wire.RunDelta, wire.RunCompleted]
        assert d.registry.sessions["node-a"].generation == generation
        await wait_until(lambda: slots_in_use(d) == (0, 0))


async def test_a_client_leaving_before_its_request_was_taken_withdraws_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(slots=2) as (d, node, conn, _rows):
        conn.hold = trio.Event()
        first_scope, second_scope = trio.CancelScope(), trio.CancelScope()

        async def first() -> None:
            with first_scope:
                async with d.open_run(spec()):
                    await trio.sleep_forever()

        async def second() -> None:
            with second_scope:
                async with d.open_run(spec()):
                    pytest.fail("a withdrawn request's block was entered")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            # The first request is taken and in flight; the second waits behind it.
            await wait_until(lambda: conn.in_flight == 1)
            first_scope.cancel()
            nursery.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            second_scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            hold, conn.hold = conn.hold, None
            hold.set()
        sent = await node.receive()
        assert isinstance(sent, wire.RunRequest)
        cancel = await node.receive()
        assert isinstance(cancel, wire.RunCancel)
        assert cancel.run_id == sent.run_id
        # The second request was withdrawn: the node never hears of it.
        with trio.move_on_after(1):
            extra = await node.receive()
            pytest.fail(f"the node received {extra!r}")
        assert not conn.aborted
        await node.send(wire.RunCancelled(run_id=sent.run_id, seq=0))
        await wait_until(lambda: slots_in_use(d) == (0, 0))
        assert d.runs.stats.ended.get("withdrawn") == 1


async def test_thousands_of_clients_leaving_at_once_all_reach_the_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    clients = 1000
    async with edge_with_node(slots=clients, max_queue=clients) as (d, node, conn, _rows):
        generation = d.registry.sessions["node-a"].generation
        leave = trio.CancelScope()
        started = 0

        async def client() -> None:
            nonlocal started
            async with d.open_run(spec()) as run:
                started += 1
                async for _ in run:
                    pass

        async with trio.open_nursery() as nursery:
            with leave:
                async with trio.open_nursery() as clients_nursery:
                    for _ in range(clients):
                        clients_nursery.start_soon(client)
                    run_ids = [(await node.receive_run()).run_id for _ in range(clients)]
                    await wait_until(lambda: started == clients)
                    # Every write now takes 10 ms: 1,000 cancels take 10 s of writing, far
                    # over the 2 s a shielded send used to be given.
                    conn.send_time = 0.01
                    leave.cancel()
            cancelled: set[str] = set()
            with trio.fail_after(60):
                while len(cancelled) < clients:
                    message = await node.receive()
                    assert isinstance(message, wire.RunCancel), message
                    cancelled.add(message.run_id)
                    await node.send(wire.RunCancelled(run_id=message.run_id, seq=0))
            nursery.cancel_scope.cancel()
        assert cancelled == set(run_ids)
        assert not conn.aborted
        assert d.registry.sessions["node-a"].generation == generation
        await wait_until(lambda: slots_in_use(d) == (0, 0))


async def test_a_run_that_completed_as_its_client_left_is_billed_as_reported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(slots=1) as (d, node, _conn, rows):
        with trio.CancelScope() as client:
            async with trio.open_nursery() as nursery:

                async def node_side() -> None:
                    request = await node.receive_run()
                    await node.emit(
                        request.run_id,
                        ("run.started", {}),
                        ("run.delta", {"text": "x"}),
                        (
                            "run.usage",
                            {"usage": wire.Usage(prompt_tokens=3000, completion_tokens=3000)},
                        ),
                        ("run.completed", {}),
                    )

                nursery.start_soon(node_side)
                async with d.gate.open(gate_request()) as answer:
                    assert isinstance(answer, Answer)
                    assert answer.head  # committed at the first delta
                    run = answer.run
                    await wait_until(lambda: run.finished)
                    client.cancel()  # the client leaves with usage + completed unread
                    await trio.sleep_forever()
        await wait_until(lambda: len(rows) == 1)
    row = rows[0]
    assert (row.outcome, row.usage_source) == ("completed", "reported")
    assert (row.prompt_tokens, row.completion_tokens) == (3000, 3000)


async def test_late_usage_of_a_run_that_ignored_the_cancel_is_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(slots=1) as (d, node, _conn, rows):
        request_seen: list[wire.RunRequest] = []
        with trio.CancelScope() as client:
            async with trio.open_nursery() as nursery:

                async def node_side() -> None:
                    request = await node.receive_run()
                    request_seen.append(request)
                    await node.emit(
                        request.run_id, ("run.started", {}), ("run.delta", {"text": "x"})
                    )

                nursery.start_soon(node_side)
                async with d.gate.open(gate_request()) as answer:
                    assert answer.head
                    client.cancel()
                    await trio.sleep_forever()
        cancel = await node.receive()
        assert isinstance(cancel, wire.RunCancel)
        # The node ignores the cancel and runs to its end.
        run_id = request_seen[0].run_id
        await trio.sleep(1)
        assert rows == []  # the row waits for the node's end
        await node.send(
            wire.RunUsage(
                run_id=run_id, seq=2, usage=wire.Usage(prompt_tokens=11, completion_tokens=22)
            )
        )
        await node.send(wire.RunCompleted(run_id=run_id, seq=3))
        await wait_until(lambda: len(rows) == 1)
        await wait_until(lambda: slots_in_use(d) == (0, 0))
    row = rows[0]
    assert (row.outcome, row.usage_source) == ("cancelled", "reported")
    assert (row.prompt_tokens, row.completion_tokens) == (11, 22)


async def test_usage_the_node_estimated_is_recorded_as_estimated(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(slots=1) as (d, node, _conn, rows):
        async with trio.open_nursery() as nursery:

            async def node_side() -> None:
                request = await node.receive_run()
                await node.emit(
                    request.run_id,
                    ("run.started", {}),
                    ("run.delta", {"text": "x"}),
                    (
                        "run.usage",
                        {"usage": wire.Usage(prompt_tokens=5, completion_tokens=1, estimated=True)},
                    ),
                    ("run.completed", {}),
                )

            nursery.start_soon(node_side)
            async with d.gate.open(gate_request(stream=False)) as answer:
                assert isinstance(answer, Answer)
                assert isinstance(answer.terminal, wire.RunCompleted)
        await wait_until(lambda: len(rows) == 1)
    assert (rows[0].outcome, rows[0].usage_source) == ("completed", "estimated")
    assert (rows[0].prompt_tokens, rows[0].completion_tokens) == (5, 1)


async def test_rows_of_runs_abandoned_on_a_lost_node_settle_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(slots=1) as (d, node, _conn, rows):
        assert d.gate.settle_timeout == 10
        with trio.CancelScope() as client:
            async with trio.open_nursery() as nursery:

                async def node_side() -> None:
                    request = await node.receive_run()
                    await node.emit(
                        request.run_id, ("run.started", {}), ("run.delta", {"text": "x"})
                    )

                nursery.start_soon(node_side)
                async with d.gate.open(gate_request()) as answer:
                    assert answer.head
                    client.cancel()
                    await trio.sleep_forever()
        cancel = await node.receive()
        assert isinstance(cancel, wire.RunCancel)
        await trio.sleep(1)
        assert rows == []  # waiting for the node's cancel confirmation
        lost_at = trio.current_time()
        await node.conn.aclose(1001, "node killed")  # it never confirms: it is gone
        await wait_until(lambda: len(rows) == 1)
        assert trio.current_time() - lost_at < 1  # not the 10 s settle timeout
    assert rows[0].outcome == "cancelled"


async def test_edge_only_sends_on_the_session_writer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request's cancel scope never runs a write: cancelling every client while every
    write is held never aborts the connection."""
    async with edge_with_node(slots=4) as (d, node, conn, _rows):
        leave = trio.CancelScope()

        async def client() -> None:
            async with d.open_run(spec()) as run:
                async for _ in run:
                    pass

        async with trio.open_nursery() as nursery:
            with leave:
                async with trio.open_nursery() as clients:
                    for _ in range(4):
                        clients.start_soon(client)
                    conn.hold = trio.Event()
                    await trio.testing.wait_all_tasks_blocked()
                    leave.cancel()
            assert not conn.aborted
            hold, conn.hold = conn.hold, None
            assert hold is not None
            hold.set()
            seen = 0
            with trio.move_on_after(1):
                while True:
                    message = await node.receive()
                    seen += 1
                    if isinstance(message, wire.RunCancel):
                        await node.send(wire.RunCancelled(run_id=message.run_id, seq=0))
            nursery.cancel_scope.cancel()
        assert not conn.aborted
        assert seen >= 1
        await wait_until(lambda: slots_in_use(d) == (0, 0))


async def test_recovery_stops_choosing_a_candidate_that_always_fails(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One node fails every run before its first token, the other answers: after two failures
    the failing one is ejected, so it gets a few attempts, not half of them."""
    config = EdgeConfig(
        local_node=False, nodes=NodeSettings(heartbeat_interval=1000, heartbeat_timeout=3000)
    )
    rows: list[UsageRow] = []
    async with open_dispatcher(config) as d:
        d.gate.record_usage = rows.append
        bad = await connect(d, hello("bad", slots=4))
        good = await connect(d, hello("good", slots=4))
        attempts = {"bad": 0, "good": 0}

        async def serve(node: ScriptedNode, name: str, fail: bool) -> None:
            while True:
                request = await node.receive_run()
                attempts[name] += 1
                if fail:
                    await node.emit(
                        request.run_id,
                        ("run.started", {}),
                        (
                            "run.failed",
                            {"code": "upstream_5xx", "message": "boom", "retryable": True},
                        ),
                    )
                else:
                    await node.emit(
                        request.run_id,
                        ("run.delta", {"text": "ok"}),
                        ("run.usage", {"usage": wire.Usage(prompt_tokens=1, completion_tokens=1)}),
                        ("run.completed", {}),
                    )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, bad, "bad", True)
            nursery.start_soon(serve, good, "good", False)
            for i in range(40):
                async with d.gate.open(gate_request(f"r{i}", stream=False)) as answer:
                    assert isinstance(answer, Answer)
                    assert isinstance(answer.terminal, wire.RunCompleted)
                await trio.sleep(0.01)  # 0.4 s in all: well inside the first cool-down
            nursery.cancel_scope.cancel()
    assert attempts["good"] == 40
    assert attempts["bad"] <= 2, attempts


async def test_a_node_that_closes_right_after_its_last_event_completes_its_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A drained node sends its last ``run.completed`` and closes at once; if the edge's
    writer finds the connection closed first (a ping), the queued frames are still read."""
    async with edge_with_node(slots=1) as (d, node, conn, _rows):
        session = d.registry.sessions["node-a"]
        events: list[wire.RunEvent] = []
        async with trio.open_nursery() as nursery:

            async def client() -> None:
                async with d.open_run(spec()) as run:
                    async for event in run:
                        events.append(event)

            nursery.start_soon(client)
            request = await node.receive_run()
            conn.receive_hold = trio.Event()
            await node.send(wire.Pong(nonce=0))  # the receive loop now waits on the hold
            await trio.testing.wait_all_tasks_blocked()
            await node.emit(request.run_id, ("run.delta", {"text": "ok"}), ("run.completed", {}))
            await node.conn.aclose(1001, "node drained")
            session.post(wire.Ping(nonce=99))  # the writer meets the closed connection first
            await trio.testing.wait_all_tasks_blocked()
            hold, conn.receive_hold = conn.receive_hold, None
            hold.set()
        assert [type(e) for e in events] == [wire.RunDelta, wire.RunCompleted]
