"""Bad input from nodes: each case closes only the offending session, with a clear reason,
and the edge keeps serving the other node's runs."""

from __future__ import annotations

from collections.abc import AsyncIterator

import attrs
import orjson
import pytest
import trio
import trio.testing

from dispatcher import wire
from dispatcher.config import EdgeConfig, NodeSettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.paths.runs import RunSpec
from dispatcher.shared.transport import ConnectionClosed, memory_connection_pair

from .fakes import ScriptedNode, connect, hello

TOKEN = "node-secret-token"
BODY = {"model": "good", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def dispatcher(autojump_clock: trio.testing.MockClock) -> AsyncIterator[Dispatcher]:
    config = EdgeConfig(local_node=False, nodes=NodeSettings(tokens=(TOKEN,), hello_timeout=3))
    async with open_dispatcher(config) as d:
        yield d


async def closed_with(node: ScriptedNode) -> ConnectionClosed:
    """Read until the edge closes the connection; return how it closed."""
    with trio.fail_after(60):
        while True:
            try:
                await node.receive()
            except ConnectionClosed as exc:
                return exc


async def assert_other_node_serves(d: Dispatcher, good: ScriptedNode) -> None:
    async with trio.open_nursery() as nursery:

        async def node_side() -> None:
            request = await good.receive_run()
            await good.emit(request.run_id, ("run.delta", {"text": "ok"}), ("run.completed", {}))

        nursery.start_soon(node_side)
        async with d.open_run(RunSpec(model="good", body=BODY)) as run:
            events = [event async for event in run]
    assert isinstance(events[-1], wire.RunCompleted)
    assert "good" in d.registry.sessions


async def raw_node(d: Dispatcher) -> ScriptedNode:
    edge_end, node_end = memory_connection_pair()
    await d.attach_node(edge_end)
    return ScriptedNode(node_end)


@pytest.mark.parametrize(
    ("token", "reason"),
    [(None, "missing node token"), ("wrong", "invalid node token"), ("", "invalid node token")],
)
async def test_bad_token_refused(
    dispatcher: Dispatcher,
    autojump_clock: trio.testing.MockClock,
    token: str | None,
    reason: str,
) -> None:
    good = await connect(dispatcher, hello("good", model="good", token=TOKEN))
    bad = await raw_node(dispatcher)
    await bad.send(hello("bad", model="bad", token=token))
    closed = await closed_with(bad)
    assert closed.code == 4001
    assert closed.reason == reason
    assert "bad" not in dispatcher.registry.sessions
    await assert_other_node_serves(dispatcher, good)


async def test_token_not_logged(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    await connect(dispatcher, hello("good", model="good", token=TOKEN))
    bad = await raw_node(dispatcher)
    await bad.send(hello("bad", token="guess-" + TOKEN))
    await closed_with(bad)
    assert TOKEN not in caplog.text


@pytest.mark.parametrize(
    ("first_frame", "code", "reason"),
    [
        ("{not json", 1002, "bad hello: frame is not JSON"),
        (b"\x00binary", 1002, "expected a hello text frame"),
        ('{"type": "pong", "nonce": 1}', 1002, "expected hello, got 'pong'"),
        ('{"type": "hello", "protocol": 99, "node_id": "x"}', 1002, "protocol version 99"),
        ('{"type": "hello", "protocol": 1}', 1002, "required field missing @ $.node_id"),
    ],
)
async def test_bad_hello(
    dispatcher: Dispatcher,
    autojump_clock: trio.testing.MockClock,
    first_frame: str | bytes,
    code: int,
    reason: str,
) -> None:
    good = await connect(dispatcher, hello("good", model="good", token=TOKEN))
    bad = await raw_node(dispatcher)
    await bad.conn.send(first_frame)
    closed = await closed_with(bad)
    assert closed.code == code
    assert reason in closed.reason
    await assert_other_node_serves(dispatcher, good)


async def test_no_hello_in_time(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    bad = await raw_node(dispatcher)
    start = trio.current_time()
    closed = await closed_with(bad)
    assert closed.code == 1008
    assert trio.current_time() - start == pytest.approx(3)


def _frame(**fields: object) -> str:
    return orjson.dumps(fields).decode()


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        ("][", "frame is not JSON"),
        (_frame(type="run.launch", run_id="x"), "unknown message type 'run.launch'"),
        (_frame(type="run.delta", run_id="r", seq="0"), "$.seq"),
        (_frame(type="run.delta", run_id="never-given", seq=0, text="x"), "was not given"),
        (_frame(type="welcome", protocol=1, generation=1, heartbeat_interval=1.0), "'welcome'"),
        (b"\x03abcpayload", "binary frame for no open tunnel"),
    ],
)
async def test_bad_frame_closes_only_that_session(
    dispatcher: Dispatcher,
    autojump_clock: trio.testing.MockClock,
    frame: str | bytes,
    reason: str,
) -> None:
    good = await connect(dispatcher, hello("good", model="good", token=TOKEN))
    bad = await connect(dispatcher, hello("bad", model="bad", token=TOKEN))
    await bad.conn.send(frame)
    closed = await closed_with(bad)
    assert closed.code == 1002
    assert reason in closed.reason
    assert "bad" not in dispatcher.registry.sessions
    await assert_other_node_serves(dispatcher, good)


async def test_event_for_another_nodes_run(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    good = await connect(dispatcher, hello("good", model="good", token=TOKEN))
    bad = await connect(dispatcher, hello("bad", model="bad", token=TOKEN))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bad.answer_pings)
        async with dispatcher.open_run(RunSpec(model="good", body=BODY)) as run:
            request = await good.receive_run()
            # The other node tries to finish (hijack) the good node's run.
            await bad.send(wire.RunDelta(run_id=request.run_id, seq=0, text="injected"))
            await bad.send(wire.RunCompleted(run_id=request.run_id, seq=1))
            await good.emit(request.run_id, ("run.delta", {"text": "real"}), ("run.completed", {}))
            events = [event async for event in run]
        nursery.cancel_scope.cancel()
    assert [e.text for e in events if isinstance(e, wire.RunDelta)] == ["real"]
    assert "bad" not in dispatcher.registry.sessions
    assert "good" in dispatcher.registry.sessions


async def test_second_hello_is_a_protocol_error(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    bad = await connect(dispatcher, hello("bad", token=TOKEN))
    await bad.send(attrs.evolve(hello("bad", token=TOKEN), label="again"))
    closed = await closed_with(bad)
    assert closed.code == 1002
    assert "unexpected 'hello'" in closed.reason


async def test_reconnect_supersedes_old_session(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    old = await connect(dispatcher, hello("n", model="good", token=TOKEN))
    async with dispatcher.open_run(RunSpec(model="good", body=BODY)) as run:
        await old.receive_run()
        new = await connect(dispatcher, hello("n", model="good", token=TOKEN))
        assert new.welcome is not None
        assert old.welcome is not None
        assert new.welcome.generation > old.welcome.generation
        events = [event async for event in run]
    assert isinstance(events[-1], wire.RunFailed)
    assert events[-1].code == "stale_generation"
    assert events[-1].retryable
    closed = await closed_with(old)
    assert closed.code == 4002
    assert dispatcher.registry.sessions["n"].generation == new.welcome.generation
    await assert_other_node_serves_on(dispatcher, new)


async def assert_other_node_serves_on(d: Dispatcher, node: ScriptedNode) -> None:
    async with trio.open_nursery() as nursery:

        async def node_side() -> None:
            request = await node.receive_run()
            await node.emit(request.run_id, ("run.completed", {}))

        nursery.start_soon(node_side)
        async with d.open_run(RunSpec(model="good", body=BODY)) as run:
            events = [event async for event in run]
    assert isinstance(events[-1], wire.RunCompleted)


async def test_capacity_change_applies(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    node = await connect(dispatcher, hello("n", model="good", token=TOKEN, slots=1))
    await node.send(wire.Capacity(provider_id="p1", model="good", slots=3))
    with trio.fail_after(5):
        while True:
            stats = dispatcher.admission.statistics()
            if [c.total for c in stats.candidates.values()] == [3]:
                break
            await trio.sleep(0.01)


def _hello_with(**model: object) -> wire.Hello:
    base = hello("bad", model="bad", token=TOKEN)
    provider = base.providers[0]
    changed = attrs.evolve(provider.models[0], **model)  # type: ignore[arg-type]
    return attrs.evolve(base, providers=(attrs.evolve(provider, models=(changed,)),))


@pytest.mark.parametrize(
    ("greeting", "reason"),
    [
        (_hello_with(slots=-1), "slots -1 is outside 0..4096"),
        (_hello_with(slots=10**9), "is outside 0..4096"),
        (_hello_with(slots=2, long_context_slots=3), "long_context_slots 3 is outside"),
        (attrs.evolve(hello("bad", token=TOKEN), node_id="evil\r\nx-forged: 1"), "node_id"),
        (attrs.evolve(hello("bad", token=TOKEN), node_id=""), "node_id must be 1 to 128"),
        (attrs.evolve(hello("bad", token=TOKEN), label="ok\nforged log line"), "label"),
        (_hello_with(name="has space"), "model name 'has space' has characters"),
        (_hello_with(capabilities=("Tools!",)), "capability"),
        (_hello_with(context_window=0), "context_window must be positive"),
    ],
)
async def test_hostile_hello_is_refused_and_the_edge_serves_on(
    dispatcher: Dispatcher,
    autojump_clock: trio.testing.MockClock,
    greeting: wire.Hello,
    reason: str,
) -> None:
    good = await connect(dispatcher, hello("good", model="good", token=TOKEN))
    bad = await raw_node(dispatcher)
    await bad.send(greeting)
    closed = await closed_with(bad)
    assert closed.code == 1002
    assert closed.reason.startswith("bad hello: ")
    assert reason in closed.reason
    assert set(dispatcher.registry.sessions) == {"good"}
    await assert_other_node_serves(dispatcher, good)


async def test_ten_thousand_models_are_refused(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    base = hello("bad", token=TOKEN)
    provider = base.providers[0]
    models = tuple(attrs.evolve(provider.models[0], name=f"m{i}") for i in range(10_000))
    greeting = attrs.evolve(base, providers=(attrs.evolve(provider, models=models),))
    good = await connect(dispatcher, hello("good", model="good", token=TOKEN))
    bad = await raw_node(dispatcher)
    await bad.send(greeting)
    closed = await closed_with(bad)
    assert (closed.code, closed.reason) == (1002, "bad hello: 10000 models announced; at most 512")
    assert len(dispatcher.admission.statistics().groups) <= 1
    await assert_other_node_serves(dispatcher, good)


async def test_capacity_out_of_range_closes_the_session(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    good = await connect(dispatcher, hello("good", model="good", token=TOKEN))
    bad = await connect(dispatcher, hello("bad", model="bad", token=TOKEN))
    await bad.send(wire.Capacity(provider_id="p1", model="bad", slots=-5))
    closed = await closed_with(bad)
    assert (closed.code, closed.reason) == (1002, "bad capacity: slots -5 is outside 0..4096")
    await assert_other_node_serves(dispatcher, good)


@pytest.mark.parametrize(
    ("events", "reason"),
    [
        (
            [wire.RunStarted(run_id="{r}", seq=0), wire.RunDelta(run_id="{r}", seq=2, text="x")],
            "event 'run.delta' for run '{r}' has seq 2, expected 1",
        ),
        (
            [wire.RunStarted(run_id="{r}", seq=0), wire.RunDelta(run_id="{r}", seq=0, text="x")],
            "event 'run.delta' for run '{r}' has seq 0, expected 1",
        ),
        (
            [wire.RunDelta(run_id="{r}", seq=1, text="x")],
            "event 'run.delta' for run '{r}' has seq 1, expected 0",
        ),
        (
            [wire.RunCompleted(run_id="{r}", seq=0), wire.RunDelta(run_id="{r}", seq=1, text="x")],
            "event 'run.delta' for run '{r}' after its terminal event",
        ),
        (
            [wire.RunCompleted(run_id="{r}", seq=0), wire.RunCompleted(run_id="{r}", seq=1)],
            "event 'run.completed' for run '{r}' after its terminal event",
        ),
    ],
    ids=["seq-gap", "seq-repeat", "seq-not-from-0", "event-after-terminal", "second-terminal"],
)
async def test_run_event_out_of_order_closes_the_session(
    dispatcher: Dispatcher,
    autojump_clock: trio.testing.MockClock,
    events: list[wire.RunEvent],
    reason: str,
) -> None:
    good = await connect(dispatcher, hello("good", model="good", token=TOKEN))
    bad = await connect(dispatcher, hello("bad", model="bad", token=TOKEN))
    seen: list[wire.RunEvent] = []
    async with trio.open_nursery() as nursery:

        async def client() -> None:
            async with dispatcher.open_run(RunSpec(model="bad", body=BODY)) as run:
                seen.extend([event async for event in run])

        nursery.start_soon(client)
        request = await bad.receive_run()
        for event in events:
            await bad.send(attrs.evolve(event, run_id=request.run_id))
        closed = await closed_with(bad)
    assert closed.code == 1002
    assert closed.reason == reason.format(r=request.run_id)
    assert "bad" not in dispatcher.registry.sessions
    if not isinstance(events[0], wire.RunCompleted):
        # The run did not end before the violation: it fails as the node's session ends.
        assert isinstance(seen[-1], wire.RunFailed)
        assert seen[-1].code == "node_lost"
    await assert_other_node_serves(dispatcher, good)
