"""The agent's session against a fake edge written here, over an in-memory connection."""

from __future__ import annotations

import logging
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from dispatcher import wire
from dispatcher.shared.transport import ConnectionClosed, MemoryConnection, memory_connection_pair
from nodes.agent import NodeRejected, serve_node_session
from nodes.config import NodeConfig, default_node_config

TOKEN = "node-token-s3cret"


def config(**changes: Any) -> NodeConfig:
    return attrs.evolve(default_node_config("node-1"), token=TOKEN, label="test node", **changes)


class FakeEdge:
    """The edge's end of one node connection, driven by the test."""

    def __init__(self, conn: MemoryConnection) -> None:
        self.conn = conn

    async def send(self, message: wire.Message) -> None:
        await self.conn.send(wire.encode(message))

    async def receive(self) -> wire.Message:
        frame = await self.conn.receive()
        assert isinstance(frame, str)
        return wire.decode(frame)

    async def handshake(self, heartbeat_interval: float = 5.0) -> wire.Hello:
        hello = await self.receive()
        assert isinstance(hello, wire.Hello)
        await self.send(
            wire.Welcome(
                protocol=wire.PROTOCOL_VERSION,
                generation=7,
                heartbeat_interval=heartbeat_interval,
            )
        )
        return hello

    async def run_events(self, run_id: str) -> list[Any]:
        """Receive until the run's terminal event; everything must belong to the run."""
        events: list[Any] = []
        while True:
            message = await self.receive()
            assert getattr(message, "run_id", None) == run_id, message
            events.append(message)
            if isinstance(message, wire.TERMINAL_EVENTS):
                return events

    async def wait_closed(self) -> ConnectionClosed:
        """Receive (and drop) frames until the connection closes; how it closed."""
        while True:
            try:
                await self.conn.receive()
            except ConnectionClosed as exc:
                return exc


def run_request(run_id: str, text: str, **body: Any) -> wire.RunRequest:
    return wire.RunRequest(
        run_id=run_id,
        provider_id="echo",
        model="echo",
        served_model="echo",
        body={"model": "echo", "messages": [{"role": "user", "content": text}], **body},
    )


async def start_session(
    nursery: trio.Nursery, cfg: NodeConfig | None = None
) -> tuple[FakeEdge, trio.Event]:
    node_conn, edge_conn = memory_connection_pair()
    done = trio.Event()

    async def session() -> None:
        await serve_node_session(node_conn, cfg or config())
        done.set()

    nursery.start_soon(session)
    return FakeEdge(edge_conn), done


async def test_handshake_announces_the_node_without_leaking_the_token(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    node_conn, edge_conn = memory_connection_pair()
    edge = FakeEdge(edge_conn)

    async def welcome_it() -> wire.Hello:
        return await edge.handshake()

    hello_box: list[wire.Hello] = []

    async def edge_side() -> None:
        hello_box.append(await welcome_it())

    nursery.start_soon(edge_side)
    welcome = await nursery.start(serve_node_session, node_conn, config())
    assert welcome == wire.Welcome(
        protocol=wire.PROTOCOL_VERSION, generation=7, heartbeat_interval=5.0
    )
    (hello,) = hello_box
    assert hello.protocol == wire.PROTOCOL_VERSION
    assert (hello.node_id, hello.label, hello.token) == ("node-1", "test node", TOKEN)
    (provider,) = hello.providers
    assert (provider.id, provider.type, provider.adapter, provider.path) == (
        "echo",
        "echo",
        "echo",
        "normalized",
    )
    assert provider.models == (
        wire.ModelInfo(name="echo", served_name="echo", slots=8, capabilities=("tools", "json")),
    )
    assert TOKEN not in repr(hello)
    assert TOKEN not in repr(config())
    # run something so the logs cover a whole session too
    await edge.send(run_request("r1", "hi there"))
    await edge.run_events("r1")
    await edge.conn.aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert "registered with the edge" in caplog.text
    assert TOKEN not in caplog.text


async def test_ping_pong_and_run_events_in_order(nursery: trio.Nursery) -> None:
    edge, _ = await start_session(nursery)
    await edge.handshake()
    await edge.send(wire.Ping(nonce=41))
    assert await edge.receive() == wire.Pong(nonce=41)
    text = "the quick brown fox jumps over the lazy dog"
    await edge.send(run_request("r1", text))
    events = await edge.run_events("r1")
    assert [e.seq for e in events] == list(range(len(events)))
    assert isinstance(events[0], wire.RunStarted)
    assert "".join(e.text for e in events if isinstance(e, wire.RunDelta)) == text
    assert events[-2] == wire.RunUsage(
        run_id="r1", seq=len(events) - 2, usage=wire.Usage(prompt_tokens=9, completion_tokens=9)
    )
    assert events[-1] == wire.RunCompleted(run_id="r1", seq=len(events) - 1, finish_reason="stop")


async def test_run_cancel_answers_run_cancelled_with_partial_usage(
    nursery: trio.Nursery,
) -> None:
    edge, _ = await start_session(nursery)
    await edge.handshake()
    await edge.send(run_request("r1", "a b c d e f", echo={"stall_after_tokens": 2}))
    received = ""
    events: list[Any] = []
    while received != "a b ":
        event = await edge.receive()
        events.append(event)
        if isinstance(event, wire.RunDelta):
            received += event.text
    await edge.send(wire.RunCancel(run_id="r1", reason="client disconnected"))
    events += await edge.run_events("r1")
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[-1] == wire.RunCancelled(
        run_id="r1", seq=len(events) - 1, usage=wire.Usage(prompt_tokens=6, completion_tokens=2)
    )


async def test_concurrent_runs_and_pings_share_the_connection(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    edge, _ = await start_session(nursery)
    await edge.handshake()
    texts = {f"r{i}": " ".join(f"w{i}.{j}" for j in range(30)) for i in range(20)}
    for run_id, text in texts.items():
        await edge.send(run_request(run_id, text, echo={"token_delay": 0.01}))
    for nonce in range(5):
        await edge.send(wire.Ping(nonce=nonce))
    by_run: dict[str, list[Any]] = {run_id: [] for run_id in texts}
    pongs = []
    while sum(1 for evs in by_run.values() if evs and wire.is_terminal(evs[-1])) < len(texts):
        message = await edge.receive()
        if isinstance(message, wire.Pong):
            pongs.append(message.nonce)
        else:
            by_run[message.run_id].append(message)  # type: ignore[union-attr]
    assert pongs == [0, 1, 2, 3, 4]
    for run_id, events in by_run.items():
        assert [e.seq for e in events] == list(range(len(events)))
        assert "".join(e.text for e in events if isinstance(e, wire.RunDelta)) == texts[run_id]
        assert isinstance(events[-1], wire.RunCompleted)


async def test_tunnel_request_for_a_normalized_provider_is_refused(nursery: trio.Nursery) -> None:
    edge, _ = await start_session(nursery)
    await edge.handshake()
    await edge.send(
        wire.TunnelRequest(
            tunnel_id="t1", provider_id="echo", method="POST", path="/v1/chat/completions"
        )
    )
    assert await edge.receive() == wire.TunnelEnd(
        tunnel_id="t1",
        error="unknown_provider: this node serves no provider 'echo' through a tunnel",
        retryable=True,
    )
    await edge.send(wire.TunnelCancel(tunnel_id="t1"))  # harmless
    await edge.send(wire.TunnelCredit(tunnel_id="t1", bytes=10))  # harmless
    await edge.send(wire.Ping(nonce=1))
    assert await edge.receive() == wire.Pong(nonce=1)


@pytest.mark.parametrize(
    "frame",
    [
        "not json",
        '{"type": "run.request", "run_id": 3}',
        '{"type": "party"}',
        wire.encode(wire.Pong(nonce=1)),  # a node -> edge message
        wire.encode(wire.Welcome(protocol=1, generation=8, heartbeat_interval=5)),  # again
        b"",  # an empty binary frame
    ],
)
async def test_malformed_frame_closes_with_1002(nursery: trio.Nursery, frame: str | bytes) -> None:
    edge, done = await start_session(nursery)
    await edge.handshake()
    await edge.conn.send(frame)
    closed = await edge.wait_closed()
    assert closed.code == 1002
    await done.wait()


async def test_a_second_request_for_a_running_run_closes_with_1002(
    nursery: trio.Nursery,
) -> None:
    """The session's protocol machine judges it: the edge gives a run id once."""
    edge, done = await start_session(nursery)
    await edge.handshake()
    await edge.send(run_request("r1", "x y z", echo={"stall_after_tokens": 1}))
    assert isinstance(await edge.receive(), wire.RunStarted)
    await edge.send(run_request("r1", "again"))
    with trio.fail_after(5):  # before the machine judged it, the runner answered and went on
        closed = await edge.wait_closed()
    assert (closed.code, closed.reason) == (1002, "run.request for run 'r1', which is running")
    await done.wait()


async def test_a_late_cancel_is_dropped_and_the_session_goes_on(nursery: trio.Nursery) -> None:
    edge, done = await start_session(nursery)
    await edge.handshake()
    await edge.send(run_request("r1", "x y"))
    events = await edge.run_events("r1")
    assert isinstance(events[-1], wire.RunCompleted)
    await edge.send(wire.RunCancel(run_id="r1", reason="crossed its end"))
    await edge.send(run_request("r1", "a new run may reuse the id"))
    assert isinstance((await edge.run_events("r1"))[-1], wire.RunCompleted)
    assert not done.is_set()


async def test_heartbeat_watchdog_ends_a_silent_session(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    edge, done = await start_session(nursery)
    await edge.handshake(heartbeat_interval=5.0)
    welcomed_at = trio.current_time()
    # pings keep it alive well past 3 intervals
    for nonce in range(12):
        await trio.sleep(5.0)
        await edge.send(wire.Ping(nonce=nonce))
        assert await edge.receive() == wire.Pong(nonce=nonce)
    assert not done.is_set()
    last = trio.current_time()
    assert last - welcomed_at == pytest.approx(60.0)
    # then the edge goes silent
    closed = await edge.wait_closed()
    assert closed.code == 1001
    assert "silent" in closed.reason
    await done.wait()
    assert trio.current_time() - last == pytest.approx(15.0)


async def test_any_message_counts_as_a_sign_of_life(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    edge, done = await start_session(nursery, config(heartbeat_timeout_factor=2.0))
    await edge.handshake(heartbeat_interval=1.0)
    for i in range(10):
        await trio.sleep(1.5)
        await edge.send(wire.RunCancel(run_id=f"nothing-{i}"))
    assert not done.is_set()
    await done.wait()
    assert trio.current_time() == pytest.approx(15.0 + 2.0)


async def test_bad_token_close_before_welcome_is_a_rejection(nursery: trio.Nursery) -> None:
    node_conn, edge_conn = memory_connection_pair()
    edge = FakeEdge(edge_conn)

    async def refuse() -> None:
        await edge.receive()
        await edge.conn.aclose(4001, "invalid node token")

    nursery.start_soon(refuse)
    with pytest.raises(NodeRejected, match=r"invalid node token \(close code 4001\)"):
        await serve_node_session(node_conn, config())


async def test_protocol_version_mismatch_is_a_rejection(nursery: trio.Nursery) -> None:
    node_conn, edge_conn = memory_connection_pair()
    edge = FakeEdge(edge_conn)
    closed: list[ConnectionClosed] = []

    async def newer_edge() -> None:
        await edge.receive()
        await edge.send(wire.Welcome(protocol=99, generation=1, heartbeat_interval=5))
        closed.append(await edge.wait_closed())

    nursery.start_soon(newer_edge)
    with pytest.raises(NodeRejected, match="protocol version 99"):
        await serve_node_session(node_conn, config())
    await trio.testing.wait_all_tasks_blocked()
    assert closed[0].code == 1002


@pytest.mark.parametrize("code", [1000, 1001, 1008, 1011, 1013, 4002, 4003])
async def test_transient_close_before_welcome_is_not_a_rejection(code: int) -> None:
    node_conn, edge_conn = memory_connection_pair()
    edge = FakeEdge(edge_conn)
    async with trio.open_nursery() as nursery:

        async def going_away() -> None:
            await edge.receive()
            await edge.conn.aclose(code, "restarting")

        nursery.start_soon(going_away)
        await serve_node_session(node_conn, config())  # returns: retry later


async def test_no_welcome_within_the_handshake_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    node_conn, edge_conn = memory_connection_pair()
    edge = FakeEdge(edge_conn)
    await serve_node_session(node_conn, config(handshake_timeout=7.0))
    assert trio.current_time() == pytest.approx(7.0)
    assert isinstance(await edge.receive(), wire.Hello)
    closed = await edge.wait_closed()
    assert closed.code == 1001


async def test_a_non_welcome_first_message_closes_with_1002() -> None:
    node_conn, edge_conn = memory_connection_pair()
    edge = FakeEdge(edge_conn)
    await edge.send(wire.Ping(nonce=1))
    await serve_node_session(node_conn, config())
    await edge.receive()  # the hello
    assert (await edge.wait_closed()).code == 1002


async def test_drop_connection_aborts_with_1011_and_no_terminal(nursery: trio.Nursery) -> None:
    edge, done = await start_session(nursery)
    await edge.handshake()
    await edge.send(run_request("r1", "x y z", echo={"stall_after_tokens": 1}))
    await edge.send(run_request("r2", "a b c d", echo={"drop_connection_after_tokens": 2}))
    events: list[Any] = []
    while True:
        try:
            events.append(await edge.receive())
        except ConnectionClosed as exc:
            closed = exc
            break
    assert closed.code == 1011
    assert not any(isinstance(e, wire.TERMINAL_EVENTS) for e in events)
    await done.wait()


async def test_edge_closing_after_welcome_ends_the_session_quietly(nursery: trio.Nursery) -> None:
    edge, done = await start_session(nursery)
    await edge.handshake()
    await edge.send(run_request("r1", "x y z", echo={"stall_after_tokens": 1}))
    await edge.receive()  # run.started
    await edge.conn.aclose(1001, "edge shutting down")
    await done.wait()


async def test_cancelling_the_session_closes_with_going_away(nursery: trio.Nursery) -> None:
    node_conn, edge_conn = memory_connection_pair()
    edge = FakeEdge(edge_conn)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as inner:
            inner.start_soon(edge.handshake)
            await inner.start(serve_node_session, node_conn, config())
            scope.cancel()
    closed = await edge.wait_closed()
    assert (closed.code, closed.reason) == (1001, "node shutting down")


async def test_edge_closing_mid_run_is_a_connection_loss_not_a_crash(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """The runner's nursery wraps the tunnels' nursery, so the ConnectionClosed arrives in a
    nested group: the session must still see a connection loss (an INFO line), never an
    AssertionError traceback and a 1011 close."""
    caplog.set_level(logging.INFO, logger="nodes")
    edge, done = await start_session(nursery)
    await edge.handshake()
    await edge.send(run_request("r1", "x y z", echo={"stall_after_tokens": 1}))
    await edge.receive()  # run.started
    await edge.conn.aclose(1001, "edge restarting")
    await done.wait()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "connection to the edge lost: edge restarting" in caplog.text
