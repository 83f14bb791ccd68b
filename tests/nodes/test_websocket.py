"""The default dial path end to end: serve_node over a real trio-websocket connection on
127.0.0.1 to a fake edge served by trio_websocket.serve_websocket (real time, no MockClock)."""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import attrs
import pytest
import trio
import trio_websocket

from dispatcher import wire
from dispatcher.shared.transport import ConnectionClosed
from nodes.agent import serve_node
from nodes.config import NodeConfig, default_node_config
from nodes.dial import NodeRejected, dial_edge

Handler = Callable[[trio_websocket.WebSocketRequest], Awaitable[None]]


async def start_edge(nursery: trio.Nursery, handler: Handler) -> int:
    server = await nursery.start(
        partial(
            trio_websocket.serve_websocket,
            handler,
            "127.0.0.1",
            0,
            None,
            max_message_size=wire.MAX_FRAME_SIZE,
            disconnect_timeout=2,
        )
    )
    port: int = server.port
    return port


def node_config(port: int) -> NodeConfig:
    return attrs.evolve(
        default_node_config("ws-node"),
        edge_url=f"ws://127.0.0.1:{port}/v1/nodes/connect",
        token="tok",
    )


async def receive(ws: trio_websocket.WebSocketConnection) -> wire.Message:
    return wire.decode(await ws.get_message())


async def test_serve_node_over_a_real_websocket(nursery: trio.Nursery) -> None:
    seen: dict[str, Any] = {}

    async def edge(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        seen["path"] = request.path
        hello = await receive(ws)
        assert isinstance(hello, wire.Hello)
        seen["hello"] = hello
        await ws.send_message(
            wire.encode(
                wire.Welcome(protocol=wire.PROTOCOL_VERSION, generation=1, heartbeat_interval=5)
            )
        )
        await ws.send_message(wire.encode(wire.Ping(nonce=3)))
        seen["pong"] = await receive(ws)
        body = {"model": "echo", "messages": [{"role": "user", "content": "over the wire"}]}
        await ws.send_message(
            wire.encode(
                wire.RunRequest(
                    run_id="r1", provider_id="echo", model="echo", served_model="echo", body=body
                )
            )
        )
        events: list[Any] = []
        while not events or not isinstance(events[-1], wire.TERMINAL_EVENTS):
            event = await receive(ws)
            assert getattr(event, "run_id", None) == "r1"
            events.append(event)
        seen["events"] = events
        done.set()
        with pytest.raises(trio_websocket.ConnectionClosed):
            await ws.get_message()
        seen["close"] = ws.closed
        closed.set()

    done, closed = trio.Event(), trio.Event()
    port = await start_edge(nursery, edge)
    with trio.fail_after(10):
        with trio.CancelScope() as node_scope:
            async with trio.open_nursery() as node_nursery:
                await node_nursery.start(serve_node, node_config(port))
                await done.wait()
                node_scope.cancel()  # shut the node down: prompt, and it says goodbye
        await closed.wait()
    assert seen["close"].code == 1001
    assert seen["close"].reason == "node shutting down"
    hello = seen["hello"]
    assert seen["path"] == "/v1/nodes/connect"
    assert (hello.node_id, hello.token) == ("ws-node", "tok")
    assert seen["pong"] == wire.Pong(nonce=3)
    events = seen["events"]
    assert [e.seq for e in events] == list(range(len(events)))
    assert "".join(e.text for e in events if isinstance(e, wire.RunDelta)) == "over the wire"
    assert isinstance(events[-1], wire.RunCompleted)


async def test_close_with_4001_over_websocket_is_a_rejection(nursery: trio.Nursery) -> None:
    async def edge(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.get_message()
        await ws.aclose(4001, "invalid node token")

    port = await start_edge(nursery, edge)
    with trio.fail_after(10), pytest.raises(NodeRejected, match="invalid node token"):
        await serve_node(node_config(port))
    gc.collect()  # a leaked socket would warn here (trio-websocket's open_websocket leaks it)


async def test_refused_upgrade_403_is_a_rejection(nursery: trio.Nursery) -> None:
    async def edge(request: trio_websocket.WebSocketRequest) -> None:
        await request.reject(403, body=b"forbidden")

    port = await start_edge(nursery, edge)
    with trio.fail_after(10), pytest.raises(NodeRejected, match="HTTP 403"):
        await serve_node(node_config(port))
    gc.collect()


async def test_edge_going_away_reconnects(nursery: trio.Nursery) -> None:
    connections = 0
    second = trio.Event()

    async def edge(request: trio_websocket.WebSocketRequest) -> None:
        nonlocal connections
        ws = await request.accept()
        connections += 1
        await ws.get_message()
        await ws.send_message(
            wire.encode(
                wire.Welcome(protocol=wire.PROTOCOL_VERSION, generation=1, heartbeat_interval=5)
            )
        )
        if connections == 1:
            await ws.aclose(1001, "edge restarting")
        else:
            second.set()
            await trio.sleep_forever()

    port = await start_edge(nursery, edge)
    with trio.fail_after(10):
        await nursery.start(serve_node, node_config(port))
        await second.wait()  # after a backoff of 0.5 to 1 s
    assert connections == 2


async def test_upgrade_refused_with_503_is_transient(nursery: trio.Nursery) -> None:
    async def edge(request: trio_websocket.WebSocketRequest) -> None:
        await request.reject(503)

    port = await start_edge(nursery, edge)
    with trio.fail_after(10), pytest.raises(ConnectionClosed, match="HTTP 503"):
        async with dial_edge(node_config(port)):
            pass  # pragma: no cover
    gc.collect()  # a leaked socket would warn here (trio-websocket's open_websocket leaks it)


async def test_nothing_listening_is_transient() -> None:
    with trio.socket.socket() as sock:  # a port nobody listens on
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with trio.fail_after(10), pytest.raises(ConnectionClosed, match="cannot connect"):
        async with dial_edge(node_config(port)):
            pass  # pragma: no cover
