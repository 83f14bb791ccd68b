"""The node's provider pools outlive its sessions with the edge (issue #12): ``serve_node``
opens the normalized adapters' and the tunnels' pooled clients once, so after the edge drops
the node and it reconnects, the next session's runs and tunnels reuse the connections the
first session's opened.

Each session is served by a tiny edge over an in-memory connection (welcome, a few requests one
after the other, then a close: the node reconnects); the provider is a fake on 127.0.0.1 port
0 behind the counting relay of ``test_connection_reuse``. Not a timing test: it counts TCP
connections.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import attrs
import orjson
import pytest
import trio

from dispatcher import wire
from dispatcher.shared.transport import Connection, MemoryConnection, memory_connection_pair
from nodes.agent import serve_node
from nodes.config import NodeConfig
from tests.nodes.test_connection_reuse import (
    KINDS,
    TIMEOUT,
    Kind,
    Upstream,
    provider,
    run_request,
    start_upstream,
)

SESSIONS = 2
PER_SESSION = 4

EdgeSession = Callable[[MemoryConnection], Awaitable[None]]


class Dialer:
    """Connects each dial to the next of ``sessions``; once they are used up, the dial waits
    (the test ends the node)."""

    def __init__(self, nursery: trio.Nursery, sessions: list[EdgeSession]) -> None:
        self._nursery = nursery
        self._sessions = sessions
        self.dials = 0
        self.all_served = trio.Event()

    def __call__(self) -> AbstractAsyncContextManager[Connection]:
        return self._dial()

    @asynccontextmanager
    async def _dial(self) -> AsyncIterator[Connection]:
        self.dials += 1
        if not self._sessions:
            self.all_served.set()
            await trio.sleep_forever()
        node, edge = memory_connection_pair()
        self._nursery.start_soon(self._sessions.pop(0), edge)
        yield node


async def welcome(conn: MemoryConnection) -> None:
    frame = await conn.receive()
    assert isinstance(frame, str)
    assert isinstance(wire.decode(frame), wire.Hello)
    welcome = wire.Welcome(protocol=wire.PROTOCOL_VERSION, generation=1, heartbeat_interval=0)
    await conn.send(wire.encode(welcome))


@attrs.define
class Answers:
    """What the node answered, by run or tunnel id."""

    events: dict[str, list[wire.Message]] = attrs.Factory(dict)
    bodies: dict[str, bytes] = attrs.Factory(dict)

    async def until_end(self, conn: MemoryConnection, work_id: str) -> None:
        """Read the node's frames until ``work_id`` ended (the node sends nothing else)."""
        while True:
            frame = await conn.receive()
            if isinstance(frame, bytes):
                data = wire.decode_binary(frame)
                self.bodies[data.tunnel_id] = self.bodies.get(data.tunnel_id, b"") + data.data
                continue
            message = wire.decode(frame)
            self.events.setdefault(work_id, []).append(message)
            if isinstance(message, (*wire.TERMINAL_EVENTS, wire.TunnelEnd)):
                return

    def text(self, run_id: str) -> str:
        return "".join(e.text for e in self.events[run_id] if isinstance(e, wire.RunDelta))


def node_config(up: Upstream, *, path: wire.ExecutionPath) -> NodeConfig:
    base = provider(up, slots=2)
    return NodeConfig(
        node_id="pooled",
        providers=(attrs.evolve(base, path=path),),
        reconnect_min_backoff=0.001,
        reconnect_max_backoff=0.001,
    )


async def serve_sessions(
    nursery: trio.Nursery, config: NodeConfig, sessions: list[EdgeSession]
) -> None:
    """``serve_node`` until every session was served and the node dialled again."""
    count = len(sessions)
    dialer = Dialer(nursery, sessions)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as node:
            node.start_soon(lambda: serve_node(config, dial=dialer))
            await dialer.all_served.wait()
            node.cancel_scope.cancel(reason="every session served")
    assert dialer.dials == count + 1  # one reconnect after each session


@pytest.fixture(params=KINDS)
async def upstream(request: pytest.FixtureRequest, nursery: trio.Nursery) -> Upstream:
    kind: Kind = request.param
    return await start_upstream(nursery, kind)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_runs_in_a_later_session_reuse_the_first_sessions_connection(
    upstream: Upstream, nursery: trio.Nursery, stream: bool
) -> None:
    answers = Answers()
    open_between: list[int] = []

    def session(index: int) -> EdgeSession:
        async def serve(conn: MemoryConnection) -> None:
            await welcome(conn)
            for n in range(PER_SESSION):
                run_id = f"s{index}r{n}"
                await conn.send(wire.encode(run_request(run_id, stream=stream)))
                await answers.until_end(conn, run_id)
            open_between.append(upstream.relay.open)
            await conn.aclose(1001, "edge restarting")

        return serve

    config = node_config(upstream, path="normalized")
    await serve_sessions(nursery, config, [session(index) for index in range(SESSIONS)])
    for index in range(SESSIONS):
        for n in range(PER_SESSION):
            run_id = f"s{index}r{n}"
            assert isinstance(answers.events[run_id][-1], wire.RunCompleted)
            assert answers.text(run_id) == upstream.fake.expected_text
    assert len(upstream.fake.requests) == SESSIONS * PER_SESSION
    assert open_between == [1] * SESSIONS  # kept alive across the reconnect
    assert upstream.relay.accepted == 1  # one connection for every run of both sessions
    await upstream.relay.wait_for(lambda: upstream.relay.open == 0)  # closed with the node


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_tunnels_in_a_later_session_reuse_the_first_sessions_connection(
    nursery: trio.Nursery, stream: bool
) -> None:
    up = await start_upstream(nursery, "openai")
    answers = Answers()
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
    }

    def session(index: int) -> EdgeSession:
        async def serve(conn: MemoryConnection) -> None:
            await welcome(conn)
            for n in range(PER_SESSION):
                tunnel_id = f"s{index}t{n}"
                request = wire.TunnelRequest(
                    tunnel_id=tunnel_id,
                    provider_id="up",
                    method="POST",
                    path="/v1/chat/completions",
                    headers=(("content-type", "application/json"),),
                    body=orjson.dumps(body).decode(),
                )
                await conn.send(wire.encode(request))
                await answers.until_end(conn, tunnel_id)
            await conn.aclose(1001, "edge restarting")

        return serve

    await serve_sessions(
        nursery, node_config(up, path="tunnel"), [session(index) for index in range(SESSIONS)]
    )
    for index in range(SESSIONS):
        for n in range(PER_SESSION):
            tunnel_id = f"s{index}t{n}"
            start, end = answers.events[tunnel_id][0], answers.events[tunnel_id][-1]
            assert isinstance(start, wire.TunnelStart)
            assert start.status == 200
            assert isinstance(end, wire.TunnelEnd)
            assert end.error is None
            assert up.fake.tokens[0].strip().encode() in answers.bodies[tunnel_id]
    assert len(up.fake.requests) == SESSIONS * PER_SESSION
    assert up.relay.accepted == 1  # one connection for every tunnel of both sessions
    await up.relay.wait_for(lambda: up.relay.open == 0)  # closed with the node
