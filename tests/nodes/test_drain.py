"""Draining a node (``Drain``; SIGTERM in ``dispatcher node``) and a node seeing the edge
drain, in virtual time over in-memory connections with a scripted edge."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import orjson
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
from nodes import load_node_config
from nodes.agent import (
    CANCEL_REPORT_TIMEOUT,
    NODE_DRAINING,
    Drain,
    serve_node,
    serve_node_session,
)
from nodes.config import (
    ModelConfig,
    NodeConfig,
    ProviderConfig,
    default_node_config,
)
from tests.nodes.fake_providers import FakeOpenAI, serve_fake_openai


def config(**changes: Any) -> NodeConfig:
    return attrs.evolve(default_node_config("node-1"), **changes)


@attrs.define(eq=False)
class Edge:
    """The edge end of a node connection, scripted by the test."""

    conn: MemoryConnection
    seen: list[wire.Message] = attrs.Factory(list)
    body_frames: int = 0

    async def welcome(self) -> None:
        assert isinstance(await self.receive(), wire.Hello)
        await self.send(
            wire.Welcome(protocol=wire.PROTOCOL_VERSION, generation=1, heartbeat_interval=5.0)
        )

    async def send(self, message: wire.Message) -> None:
        await self.conn.send(wire.encode(message))

    async def receive(self) -> wire.Message:
        """The next message; tunnel body frames (binary) are counted and skipped."""
        frame = await self.conn.receive()
        while isinstance(frame, bytes):
            self.body_frames += 1
            frame = await self.conn.receive()
        message = wire.decode(frame)
        self.seen.append(message)
        return message

    async def receive_until(self, kind: type[Any], **fields: Any) -> Any:
        while True:
            message = await self.receive()
            if isinstance(message, kind) and all(
                getattr(message, k) == v for k, v in fields.items()
            ):
                return message

    async def closed(self) -> ConnectionClosed:
        """Read until the node closes; returns how."""
        try:
            while True:
                await self.receive()
        except ConnectionClosed as exc:
            return exc


def run_request(
    run_id: str, words: int, delay: float, *, ignore_cancel: bool = False
) -> wire.RunRequest:
    text = " ".join(f"w{i}" for i in range(words))
    return wire.RunRequest(
        run_id=run_id,
        provider_id="echo",
        model="echo",
        served_model="echo",
        body={
            "model": "echo",
            "messages": [{"role": "user", "content": text}],
            "echo": {"token_delay": delay, "ignore_cancel": ignore_cancel},
        },
    )


def terminals(edge: Edge, run_id: str) -> list[Any]:
    return [
        m
        for m in edge.seen
        if isinstance(m, wire.TERMINAL_EVENTS) and getattr(m, "run_id", None) == run_id
    ]


async def test_a_draining_node_finishes_its_runs_refuses_new_work_and_leaves(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    node_end, edge_end = memory_connection_pair()
    edge = Edge(edge_end)
    drain = Drain()
    returned: list[float] = []

    async def node() -> None:
        await serve_node_session(node_end, config(drain_grace=30), drain=drain)
        returned.append(trio.current_time())

    nursery.start_soon(node)
    await edge.welcome()
    await edge.send(run_request("r1", 4, 0.5))  # about 2 s
    await edge.receive_until(wire.RunStarted, run_id="r1")
    start = trio.current_time()
    drain.request()
    assert await edge.receive_until(wire.NodeDraining) == wire.NodeDraining(grace=30)

    # Work the edge sent before it learned: refused, retryable, so it goes elsewhere.
    await edge.send(run_request("r2", 1, 0))
    refused = await edge.receive_until(wire.RunFailed, run_id="r2")
    assert (refused.seq, refused.code, refused.retryable) == (0, NODE_DRAINING, True)
    await edge.send(
        wire.TunnelRequest(
            tunnel_id="t1", provider_id="echo", method="POST", path="/v1/x", window=1024
        )
    )
    end = await edge.receive_until(wire.TunnelEnd, tunnel_id="t1")
    assert end.retryable
    assert end.error is not None
    assert end.error.startswith(NODE_DRAINING)

    closed = await edge.closed()
    closed_at = trio.current_time()
    with trio.fail_after(10):
        while not returned:
            await trio.sleep(0.01)
    [done] = terminals(edge, "r1")
    assert isinstance(done, wire.RunCompleted)  # the run in flight finished normally
    assert closed.code == 1000  # a clean leave
    assert [t.TYPE for t in terminals(edge, "r2")] == ["run.failed"]
    assert 1.5 <= closed_at - start <= 2.5  # when the run ended, not after the grace
    assert returned[0] - closed_at < 0.1


async def drain_mid_run(
    nursery: trio.Nursery, grace: float, request: wire.RunRequest
) -> tuple[Edge, ConnectionClosed, float]:
    """A session with ``request`` running, drained: the scripted edge, how the node closed,
    and how long after the drain request."""
    node_end, edge_end = memory_connection_pair()
    edge = Edge(edge_end)
    drain = Drain()
    nursery.start_soon(partial_session, node_end, config(drain_grace=grace), drain)
    await edge.welcome()
    await edge.send(request)
    await edge.receive_until(wire.RunStarted, run_id=request.run_id)
    start = trio.current_time()
    drain.request()
    closed = await edge.closed()
    return edge, closed, trio.current_time() - start


async def test_the_drain_grace_bounds_the_wait(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    edge, closed, took = await drain_mid_run(nursery, 3.5, run_request("r1", 100, 1.0))  # 100 s
    assert took == pytest.approx(3.5)
    assert closed.code == 1000
    # Cancelled at the end of the grace, and reported so (with its partial usage) before
    # the node left: the edge settles it at once instead of as a lost node's run.
    [cancelled] = terminals(edge, "r1")
    assert isinstance(cancelled, wire.RunCancelled)
    assert cancelled.usage is not None
    assert cancelled.usage.completion_tokens == 3
    assert "grace of 3.5 s is over: cancelling 1 run(s) and 0 tunnel(s)" in caplog.text


async def test_a_run_that_ignores_the_cancel_does_not_hold_the_node(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    request = run_request("r1", 100, 1.0, ignore_cancel=True)  # 100 s
    edge, closed, took = await drain_mid_run(nursery, 3, request)
    assert took == pytest.approx(3 + CANCEL_REPORT_TIMEOUT)
    assert closed.code == 1000
    assert terminals(edge, "r1") == []  # cut off: the edge fails it as a lost node's run
    assert "leaving with 1 run(s) and 0 tunnel(s) that did not report their end" in caplog.text


async def partial_session(conn: Connection, cfg: NodeConfig, drain: Drain) -> None:
    await serve_node_session(conn, cfg, drain=drain)


class Dialer:
    """Each dial connects to a fresh scripted edge run by ``behaviour``, or fails."""

    def __init__(self, nursery: trio.Nursery, behaviour: Any = None) -> None:
        self.nursery = nursery
        self.behaviour = behaviour
        self.attempts: list[float] = []

    @asynccontextmanager
    async def __call__(self) -> AsyncIterator[Connection]:
        self.attempts.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        if self.behaviour is None:
            raise ConnectionClosed("connection refused")
        node_end, edge_end = memory_connection_pair()
        self.nursery.start_soon(self.behaviour, Edge(edge_end))
        yield node_end


async def test_edge_draining_then_its_close_is_a_normal_end(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nodes")

    async def draining_edge(edge: Edge) -> None:
        await edge.welcome()
        await edge.send(run_request("r1", 4, 0.5))
        await edge.send(wire.EdgeDraining(grace=10))
        await edge.receive_until(wire.RunCompleted, run_id="r1")  # the node kept serving
        await edge.conn.aclose(1001, "server shutting down")

    dialer = Dialer(nursery, draining_edge)
    with trio.move_on_after(5):
        await serve_node(config(), dial=dialer)
    assert len(dialer.attempts) >= 2  # it reconnected, with backoff
    assert 0.5 <= dialer.attempts[1] - dialer.attempts[0] - 2 <= 1.5
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert noisy == []
    assert "the edge is draining" in caplog.text


async def test_a_drain_while_disconnected_returns_at_once(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    dialer = Dialer(nursery)  # never connects
    drain = Drain()

    async def drain_soon() -> None:
        await trio.sleep(10)
        drain.request()

    nursery.start_soon(drain_soon)
    await serve_node(config(), dial=dialer, drain=drain)
    assert trio.current_time() == 10  # not at the end of a backoff delay


async def test_a_drain_before_welcome_abandons_the_attempt(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    async def silent_edge(edge: Edge) -> None:
        await edge.receive()  # hello, and never a welcome
        await trio.sleep_forever()

    dialer = Dialer(nursery, silent_edge)
    drain = Drain()

    async def drain_soon() -> None:
        await trio.sleep(1)
        drain.request()

    nursery.start_soon(drain_soon)
    await serve_node(config(handshake_timeout=60), dial=dialer, drain=drain)
    assert trio.current_time() == pytest.approx(1, abs=0.2)
    assert len(dialer.attempts) == 1


def test_drain_grace_is_configurable(tmp_path: Any) -> None:
    path = tmp_path / "node.toml"
    path.write_text(
        '[node]\nid = "n"\ndrain_grace = 5\n\n[[providers]]\nid = "echo"\ntype = "echo"\n'
        '[[providers.models]]\nname = "echo"\n'
    )
    assert load_node_config(path).drain_grace == 5.0
    assert default_node_config("n").drain_grace == 30.0


async def test_a_tunnel_still_open_at_the_end_of_the_grace_is_cancelled_and_reported(
    nursery: trio.Nursery,
) -> None:
    """Real time, a real upstream on 127.0.0.1 (a fake OpenAI server that stalls after its
    first token), a scripted edge: the tunnel's end is on the wire before the close."""
    fake: FakeOpenAI = await nursery.start(
        serve_fake_openai, FakeOpenAI(reply="one two three", stall_after_chunks=1)
    )
    assert fake.server is not None
    provider = ProviderConfig(
        id="up",
        type="openai",
        path="tunnel",
        base_url=f"http://127.0.0.1:{fake.server.address.port}",
        models=(ModelConfig(name="m", served_name="fake-model"),),
    )
    node_end, edge_end = memory_connection_pair()
    edge = Edge(edge_end)
    drain = Drain()
    cfg = attrs.evolve(config(drain_grace=0.5), providers=(provider,))
    nursery.start_soon(partial_session, node_end, cfg, drain)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with trio.fail_after(30):
        await edge.welcome()
        await edge.send(
            wire.TunnelRequest(
                tunnel_id="t1",
                provider_id="up",
                method="POST",
                path="/v1/chat/completions",
                body=orjson.dumps(body).decode(),
                window=1 << 20,
            )
        )
        await edge.receive_until(wire.TunnelStart, tunnel_id="t1")
        drain.request()
        closed = await edge.closed()
    [end] = [m for m in edge.seen if isinstance(m, wire.TunnelEnd)]
    assert end.tunnel_id == "t1"
    assert end.error == "cancelled"
    assert edge.body_frames >= 1  # it had started streaming
    assert closed.code == 1000


async def test_a_zero_grace_still_tells_the_edge_and_reports_the_cancel(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    edge, closed, took = await drain_mid_run(nursery, 0, run_request("r1", 100, 1.0))
    assert took == 0
    assert closed.code == 1000
    assert wire.NodeDraining(grace=0) in edge.seen
    assert [type(t) for t in terminals(edge, "r1")] == [wire.RunCancelled]
