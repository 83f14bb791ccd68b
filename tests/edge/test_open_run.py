"""The ownership rule of ``open_run``, one test per way out of the block.

After each: no slot in use or draining, the subscription is gone, and where the run had
started and did not finish, the node saw ``run.cancel``. Virtual time throughout.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
from collections.abc import AsyncIterator, Iterator

import pytest
import trio
import trio.testing

from dispatcher import wire
from dispatcher.admission import QueueTimeout
from dispatcher.config import EdgeConfig, NodeSettings, QueuePolicySettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.errors import StaleGeneration
from dispatcher.link.registry import MAX_UNYIELDED_EVENTS, SUBSCRIPTION_BUFFER, Subscription
from dispatcher.paths.runs import RunSpec
from dispatcher.shared.transport import memory_connection_pair

from ..scheduling import ticks_seen
from .fakes import connect, hello, wait_until

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SPEC = RunSpec(model="m", body=BODY)


def config(**admission: float) -> EdgeConfig:
    return EdgeConfig(
        local_node=False,
        nodes=NodeSettings(heartbeat_interval=5, heartbeat_timeout=15),
        admission=QueuePolicySettings(**admission),  # type: ignore[arg-type]
    )


# pytest-trio only installs a clock the test function itself asks for, so every test here
# takes ``autojump_clock``; the fixture asks for it too so that it runs under the same clock.
@pytest.fixture
async def dispatcher(autojump_clock: trio.testing.MockClock) -> AsyncIterator[Dispatcher]:
    async with open_dispatcher(config(queue_timeout_s=10, drain_timeout_s=5)) as d:
        yield d


def assert_clean(d: Dispatcher) -> None:
    stats = d.admission.statistics()
    assert stats.in_use == 0
    assert stats.draining == 0
    assert stats.waiting == 0
    for session in d.registry.sessions.values():
        assert session.runs == {}


async def test_completed(dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock) -> None:
    node = await connect(dispatcher, hello())
    async with trio.open_nursery() as nursery:

        async def node_side() -> None:
            request = await node.receive_run()
            assert request.served_model == "m-served"
            assert request.body["model"] == "m-served"
            await node.emit(
                request.run_id,
                ("run.started", {}),
                ("run.delta", {"text": "hello"}),
                ("run.usage", {"usage": wire.Usage(prompt_tokens=1, completion_tokens=1)}),
                ("run.completed", {"finish_reason": "stop"}),
            )

        nursery.start_soon(node_side)
        async with dispatcher.open_run(SPEC) as run:
            assert dispatcher.admission.statistics().in_use == 1
            events = [event async for event in run]
        assert [type(e) for e in events] == [
            wire.RunStarted,
            wire.RunDelta,
            wire.RunUsage,
            wire.RunCompleted,
        ]
        assert run.end_reason == "completed"
    assert node.cancels() == []
    assert_clean(dispatcher)


async def test_slot_freed_by_terminal_event_before_block_exit(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    node = await connect(dispatcher, hello())
    async with dispatcher.open_run(SPEC) as run:
        request = await node.receive_run()
        await node.emit(request.run_id, ("run.completed", {}))
        await wait_until(lambda: run.finished)
        # The node is done: the slot is free even though the block is still open.
        assert dispatcher.admission.statistics().in_use == 0
    assert node.cancels() == []
    assert_clean(dispatcher)


async def test_node_run_failed(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    node = await connect(dispatcher, hello())
    async with dispatcher.open_run(SPEC) as run:
        request = await node.receive_run()
        await node.emit(
            request.run_id,
            ("run.failed", {"code": "boom", "message": "exploded", "retryable": False}),
        )
        events = [event async for event in run]
    assert isinstance(events[-1], wire.RunFailed)
    assert events[-1].code == "boom"
    assert run.end_reason == "failed"
    assert node.cancels() == []
    assert_clean(dispatcher)


async def test_client_disconnect_mid_stream(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    node = await connect(dispatcher, hello())
    run_ids: list[str] = []
    with trio.move_on_after(3) as client:  # the client leaves after 3 s
        async with dispatcher.open_run(SPEC) as run:
            request = await node.receive_run()
            run_ids.append(request.run_id)
            await node.emit(request.run_id, ("run.started", {}), ("run.delta", {"text": "a"}))
            async for _ in run:
                pass
    assert client.cancelled_caught
    assert run.end_reason == "cancelled"
    # The node is told at once; the slot drains until the node confirms.
    cancel = await node.receive()
    assert isinstance(cancel, wire.RunCancel)
    assert cancel.run_id == run_ids[0]
    stats = dispatcher.admission.statistics()
    assert (stats.in_use, stats.draining) == (0, 1)
    partial = wire.Usage(prompt_tokens=1, completion_tokens=1)
    await node.send(wire.RunCancelled(run_id=run_ids[0], seq=2, usage=partial))
    await wait_until(lambda: dispatcher.admission.statistics().draining == 0)
    # The confirmation, with the partial usage the node knew, reaches the run's handle.
    assert run.settled.is_set()
    assert isinstance(run.late_terminal, wire.RunCancelled)
    assert run.late_terminal.usage == partial
    assert_clean(dispatcher)


async def test_drain_deadline_frees_slot_when_node_ignores_cancel(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    node = await connect(dispatcher, hello())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(node.answer_pings)
        with trio.move_on_after(1):
            async with dispatcher.open_run(SPEC):
                await trio.sleep_forever()
        assert dispatcher.admission.statistics().draining == 1
        start = trio.current_time()
        await wait_until(lambda: dispatcher.admission.statistics().draining == 0, timeout=30)
        assert trio.current_time() - start == pytest.approx(5, abs=0.01)
        nursery.cancel_scope.cancel()
    assert node.cancels()
    assert_clean(dispatcher)


async def test_node_connection_dropped_mid_run(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    node = await connect(dispatcher, hello())
    async with dispatcher.open_run(SPEC) as run:
        request = await node.receive_run()
        await node.emit(request.run_id, ("run.started", {}))
        await node.conn.aclose()
        events = [event async for event in run]
    assert isinstance(events[-1], wire.RunFailed)
    assert events[-1].code == "node_lost"
    assert events[-1].retryable
    assert run.end_reason == "node_lost"
    assert dispatcher.registry.sessions == {}
    assert_clean(dispatcher)


async def test_heartbeat_timeout_drops_silent_node(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    node = await connect(dispatcher, hello())
    async with dispatcher.open_run(SPEC) as run:
        await node.receive_run()
        # The node goes silent: no pongs. The edge gives up after the timeout.
        start = trio.current_time()
        events = [event async for event in run]
        elapsed = trio.current_time() - start
    assert isinstance(events[-1], wire.RunFailed)
    assert events[-1].code == "node_lost"
    assert 15 <= elapsed <= 20
    assert_clean(dispatcher)


async def test_queue_timeout(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    node = await connect(dispatcher, hello(slots=1))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(node.answer_pings)
        async with dispatcher.open_run(SPEC):
            start = trio.current_time()
            with pytest.raises(QueueTimeout):
                async with dispatcher.open_run(SPEC):
                    pytest.fail("admitted beyond the node's slots")
            assert trio.current_time() - start == pytest.approx(10)
            assert dispatcher.admission.statistics().waiting == 0
        nursery.cancel_scope.cancel()
    # The first run was left unfinished: its slot drains, then frees.
    await wait_until(lambda: dispatcher.admission.statistics().draining == 0, timeout=30)
    assert_clean(dispatcher)


async def test_edge_shutdown_cancels_runs(autojump_clock: trio.testing.MockClock) -> None:
    """The daemon's shutdown cancels the HTTP server's nursery (where requests live) before the
    dispatcher's own: each open run tells its node, then the dispatcher closes cleanly."""
    async with open_dispatcher(config()) as d:
        node = await connect(d, hello())
        async with trio.open_nursery() as requests:  # what the HTTP server's nursery is

            async def request() -> None:
                async with d.open_run(SPEC):
                    await trio.sleep_forever()

            requests.start_soon(request)
            sent = await node.receive_run()
            requests.cancel_scope.cancel(reason="edge shutting down")
        cancel = await node.receive()
        assert isinstance(cancel, wire.RunCancel)
        assert cancel.run_id == sent.run_id
        await node.send(wire.RunCancelled(run_id=sent.run_id, seq=0))
        await wait_until(lambda: d.admission.statistics().draining == 0)
        assert_clean(d)
        assert d.runs.stats.ended == {"cancelled": 1}


async def test_stale_generation_between_admission_and_send(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    """A node reconnects after a waiter was admitted to its old session but before the run
    request went out: nothing is sent on the old connection and the request fails cleanly."""
    old = await connect(dispatcher, hello(slots=1))
    outcome: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(old.answer_pings)
        async with dispatcher.open_run(SPEC) as first:

            async def second() -> None:
                try:
                    async with dispatcher.open_run(SPEC):
                        pytest.fail("dispatched to a stale generation")
                except StaleGeneration as exc:
                    outcome.append(exc)

            nursery.start_soon(second)
            await wait_until(lambda: dispatcher.admission.statistics().waiting == 1)
            # In one synchronous step: the slot frees (admitting the waiter to the old
            # generation) and the node reconnects, before the waiter's task runs again.
            first.slot.release()
            new_edge_end, new_node_end = memory_connection_pair()
            new_session = dispatcher.registry.register(hello(slots=1), new_edge_end)
            assert new_session.generation > first.candidate.generation
            await wait_until(lambda: bool(outcome))
        nursery.cancel_scope.cancel()
    assert isinstance(outcome[0], StaleGeneration)
    requests = [m for m in old.seen if isinstance(m, wire.RunRequest)]
    assert [r.run_id for r in requests] == [first.run_id]
    with trio.move_on_after(1) as nothing:
        await new_node_end.receive()
    assert nothing.cancelled_caught, "the request was sent on the new connection"
    dispatcher.registry.unregister(new_session)
    assert_clean(dispatcher)


async def test_many_runs_ended_at_once_keep_the_node_session(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The regression (5,000 streams left at once in the bench): more runs ended early than
    the session's memory of finished runs, while the node was still streaming them. The edge
    forgot the oldest, the node's next delta for it was "a run this session was not given",
    and the whole node session closed -- every other run on it with it. Now a run ended early
    is remembered until its terminal arrives. (The memory is made small here: 2 instead of
    4,096, with 6 runs.)"""
    monkeypatch.setattr(wire, "EdgeProtocol", functools.partial(wire.EdgeProtocol, recent_runs=2))
    runs = 6
    async with open_dispatcher(config(drain_timeout_s=60)) as d:
        node = await connect(d, hello(slots=runs))
        generation = d.registry.sessions["node-a"].generation
        async with trio.open_nursery() as clients:
            for _ in range(runs):

                async def client() -> None:
                    async with d.open_run(SPEC):
                        await trio.sleep_forever()

                clients.start_soon(client)
            sent = [await node.receive_run() for _ in range(runs)]
            clients.cancel_scope.cancel(reason="every client left")
        cancels = [await node.receive() for _ in range(runs)]
        assert {c.run_id for c in cancels if isinstance(c, wire.RunCancel)} == {
            r.run_id for r in sent
        }
        # The node was still streaming them: a delta each, then its cancel confirmations.
        for request in sent:
            await node.send(wire.RunDelta(run_id=request.run_id, seq=0, text="late"))
        for request in sent:
            await node.send(wire.RunCancelled(run_id=request.run_id, seq=1))
        await wait_until(lambda: d.admission.statistics().draining == 0)
        session = d.registry.sessions.get("node-a")
        assert session is not None
        assert session.generation == generation
        assert session.closed_reason is None
        assert_clean(d)
        assert d.runs.stats.ended == {"cancelled": runs}


@contextlib.contextmanager
def no_cyclic_garbage() -> Iterator[None]:
    """The block's objects die by reference counting alone: with the collector off during
    it, a collection after it finds nothing unreachable (what it finds is named)."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield
        gc.collect()
        garbage = collections.Counter(type(thing).__qualname__ for thing in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not garbage, garbage.most_common(12)


async def test_a_completed_run_leaves_no_reference_cycle(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    node = await connect(dispatcher, hello())

    async def one_run() -> None:
        async with dispatcher.open_run(SPEC) as run:
            request = await node.receive_run()
            await node.emit(
                request.run_id,
                ("run.started", {}),
                ("run.delta", {"text": "hello"}),
                ("run.usage", {"usage": wire.Usage(prompt_tokens=1, completion_tokens=1)}),
                ("run.completed", {"finish_reason": "stop"}),
            )
            async for _ in run:
                pass

    await one_run()  # warm-up: what the first run creates once
    with no_cyclic_garbage():
        for _ in range(3):
            await one_run()
    assert_clean(dispatcher)


async def test_an_abandoned_run_leaves_no_reference_cycle(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    """The client leaves mid-stream (a cancellation), the node confirms the cancel late:
    the run's handle, its subscription, the late-event callback and the settle callback die
    with the request, and the Cancelled that left the block is not kept."""
    node = await connect(dispatcher, hello())

    async def one_run() -> None:
        with trio.move_on_after(1):
            async with dispatcher.open_run(SPEC) as run:
                request = await node.receive_run()
                await node.emit(request.run_id, ("run.started", {}), ("run.delta", {"text": "a"}))
                async for _ in run:
                    pass
        cancel = await node.receive()
        assert isinstance(cancel, wire.RunCancel)
        partial = wire.Usage(prompt_tokens=1, completion_tokens=1)
        await node.send(wire.RunCancelled(run_id=request.run_id, seq=2, usage=partial))
        await wait_until(lambda: dispatcher.admission.statistics().draining == 0)

    await one_run()
    with no_cyclic_garbage():
        for _ in range(3):
            await one_run()
    assert_clean(dispatcher)


def _delta(run_id: str, seq: int) -> wire.RunDelta:
    return wire.RunDelta(run_id=run_id, seq=seq, text="x")


async def test_a_subscription_that_overflows_ends_in_a_failure_after_its_buffer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    subscription = Subscription("r")
    for seq in range(SUBSCRIPTION_BUFFER + 5):
        subscription.deliver(_delta("r", seq))
    assert subscription.overflowed
    assert subscription.text_chars == SUBSCRIPTION_BUFFER + 5
    received = [await subscription.receive() for _ in range(SUBSCRIPTION_BUFFER)]
    assert [event.seq for event in received] == list(range(SUBSCRIPTION_BUFFER))
    assert subscription.receive_nowait() is None
    failure = await subscription.receive()
    assert isinstance(failure, wire.RunFailed)
    assert failure.code == "consumer_overflow"


async def test_a_waiting_consumer_gets_the_event_then_the_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    subscription = Subscription("r")
    got: list[wire.RunEvent] = []

    async def consume() -> None:
        while not got or not wire.is_terminal(got[-1]):
            got.append(await subscription.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await trio.sleep(1)
        subscription.deliver(_delta("r", 0))
        await trio.sleep(1)
        subscription.deliver(wire.RunCompleted(run_id="r", seq=1, finish_reason="stop"))
    assert [type(event) for event in got] == [wire.RunDelta, wire.RunCompleted]
    subscription.deliver(_delta("r", 2))  # after the terminal: dropped
    assert subscription.receive_nowait() is None


async def test_a_cancelled_wait_leaves_the_subscription_usable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    subscription = Subscription("r")
    with trio.move_on_after(1):
        await subscription.receive()
    subscription.deliver(_delta("r", 0))
    assert (await subscription.receive()).seq == 0
    subscription.close()
    with pytest.raises(trio.ClosedResourceError):
        await subscription.receive()


async def test_closing_wakes_a_waiting_consumer(autojump_clock: trio.testing.MockClock) -> None:
    subscription = Subscription("r")
    async with trio.open_nursery() as nursery:

        async def consume() -> None:
            with pytest.raises(trio.ClosedResourceError):
                await subscription.receive()

        nursery.start_soon(consume)
        await trio.sleep(1)
        subscription.close()


async def test_buffered_events_are_taken_with_a_schedule_point_every_max_unyielded() -> None:
    """A cancel point each time; a schedule point only every MAX_UNYIELDED_EVENTS events taken from
    the buffer in a row (another task runs then), not one per event."""
    subscription = Subscription("r")
    count = 3 * MAX_UNYIELDED_EVENTS
    for seq in range(count):
        subscription.deliver(_delta("r", seq))
    seen = await ticks_seen(count, subscription.receive)
    # one trip through the scheduler per MAX_UNYIELDED_EVENTS events (the ticker ran then), so
    # the ticker's count took at most 3 + 1 values over the 3 * MAX_UNYIELDED_EVENTS receives
    assert 2 <= len(set(seen)) <= 4, seen

    with trio.CancelScope() as scope:  # a cancelled receive takes nothing
        subscription.deliver(_delta("r", count))
        scope.cancel()
        await subscription.receive()
    assert scope.cancelled_caught
    assert (await subscription.receive()).seq == count
