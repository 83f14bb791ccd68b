"""Websockets against a live server, with a raw wsproto client (and trio-websocket)."""

from __future__ import annotations

import pytest
import trio
import trio_websocket
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    RejectConnection,
    TextMessage,
)
from wsproto.frame_protocol import FrameProtocol, Opcode

from dispatcher.http import (
    Request,
    Responder,
    ServerLimits,
    WebSocketClosed,
)
from dispatcher.http._websocket import MAX_UNYIELDED_MESSAGES

from ..scheduling import ticks_seen
from ._helpers import WSClient, assert_serves, start_server

pytestmark = pytest.mark.usefixtures("close_clients")


class EchoApp:
    """``/ws`` echoes until the client says "bye" (then returns without closing)."""

    def __init__(self) -> None:
        self.closed_with: list[int] = []
        self.errors: list[BaseException] = []
        self.received: list[str | bytes] = []
        self.finished = trio.Event()

    async def __call__(self, request: Request, responder: Responder) -> None:
        subprotocol = None
        if request.path == "/ws-proto":
            subprotocol = request.query or None
        try:
            ws = await responder.accept_websocket(subprotocol=subprotocol)
        except ValueError as exc:
            self.errors.append(exc)
            raise
        try:
            while True:
                message = await ws.receive()
                self.received.append(message)
                if message == "bye":
                    return
                await ws.send(message)
        except WebSocketClosed as exc:
            self.closed_with.append(exc.code)
        finally:
            self.finished.set()


async def test_echo_ping_and_normal_close(nursery: trio.Nursery) -> None:
    app = EchoApp()
    server = await start_server(nursery, app)
    client, event = await WSClient.connect(server)
    assert isinstance(event, AcceptConnection)
    await client.send(TextMessage(data="hello"))
    assert await client.next_event() == TextMessage(data="hello")
    await client.send(BytesMessage(data=b"\x00\x01"))
    assert await client.next_event() == BytesMessage(data=b"\x00\x01")
    await client.send(Ping(payload=b"p"))
    assert await client.next_event() == Pong(payload=b"p")
    await client.send(TextMessage(data="bye"))  # the handler returns without closing
    event = await client.next_event()
    assert isinstance(event, CloseConnection)
    assert event.code == 1000
    await client.send(event.response())
    await client.aclose()
    await assert_serves(server)


async def test_fragmented_message_is_reassembled(nursery: trio.Nursery) -> None:
    app = EchoApp()
    server = await start_server(nursery, app)
    client, _ = await WSClient.connect(server)
    for i, last in ((0, False), (1, False), (2, True)):
        await client.send(TextMessage(data=f"part{i}-", message_finished=last))
    assert await client.next_event() == TextMessage(data="part0-part1-part2-")
    await client.aclose()


async def test_message_over_the_limit_closes_with_1009(nursery: trio.Nursery) -> None:
    app = EchoApp()
    server = await start_server(nursery, app, limits=ServerLimits(max_websocket_message_size=1000))
    client, _ = await WSClient.connect(server)
    await client.send(BytesMessage(data=b"x" * 600, message_finished=False))
    await client.send(BytesMessage(data=b"x" * 600, message_finished=True))
    event = await client.next_event()
    assert isinstance(event, CloseConnection)
    assert event.code == 1009
    await client.send(event.response())
    await client.aclose()
    await assert_serves(server)


async def test_upgrade_followed_by_a_stray_byte(nursery: trio.Nursery) -> None:
    app = EchoApp()
    server = await start_server(nursery, app)
    client, event = await WSClient.connect(server, extra=b"x")
    assert isinstance(event, AcceptConnection)
    # One byte is half a frame header: wsproto waits for the rest, nothing breaks.
    await assert_serves(server)
    await client.stream.send_all(b"y")  # now the header is complete, and invalid
    event = await client.next_event()
    assert isinstance(event, CloseConnection)
    assert event.code == 1002  # protocol error
    await client.aclose()
    await assert_serves(server)


async def test_upgrade_followed_by_stray_crlf(nursery: trio.Nursery) -> None:
    app = EchoApp()
    server = await start_server(nursery, app)
    client, event = await WSClient.connect(server, extra=b"\r\n")
    assert isinstance(event, AcceptConnection)
    event = await client.next_event()
    assert isinstance(event, CloseConnection)
    assert event.code == 1002
    await client.aclose()
    await assert_serves(server)


async def test_frame_in_the_same_write_as_the_upgrade(nursery: trio.Nursery) -> None:
    app = EchoApp()
    server = await start_server(nursery, app)
    frame = FrameProtocol(client=True, extensions=[])._serialize_frame(Opcode.TEXT, b"early")
    client, event = await WSClient.connect(server, extra=bytes(frame))
    assert isinstance(event, AcceptConnection)
    assert await client.next_event() == TextMessage(data="early")
    await client.aclose()


async def test_unoffered_subprotocol_is_a_handler_error(nursery: trio.Nursery) -> None:
    app = EchoApp()
    server = await start_server(nursery, app)
    client, event = await WSClient.connect(server, "/ws-proto?nope", subprotocols=["chat"])
    assert isinstance(event, RejectConnection)
    assert event.status_code == 500
    assert len(app.errors) == 1
    assert isinstance(app.errors[0], ValueError)
    await client.aclose()
    await assert_serves(server)
    # An offered one is accepted.
    client, event = await WSClient.connect(server, "/ws-proto?chat", subprotocols=["x", "chat"])
    assert isinstance(event, AcceptConnection)
    assert event.subprotocol == "chat"
    await client.aclose()


async def test_plain_request_to_accept_websocket_is_a_handler_error(
    nursery: trio.Nursery,
) -> None:
    app = EchoApp()
    server = await start_server(nursery, app)
    stream = await trio.open_tcp_stream(server.address.host, server.address.port)
    async with stream:
        await stream.send_all(b"GET /ws HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        with trio.fail_after(10):
            raw = await stream.receive_some(65536)
    assert raw.startswith(b"HTTP/1.1 500 ")
    assert isinstance(app.errors[0], ValueError)


async def test_trio_websocket_client(nursery: trio.Nursery) -> None:
    app = EchoApp()
    server = await start_server(nursery, app)
    url = f"ws://{server.address.host}:{server.address.port}/ws"
    async with trio_websocket.open_websocket_url(
        url, max_message_size=1 << 20, disconnect_timeout=5, message_queue_size=1
    ) as ws:
        for i in range(20):
            await ws.send_message(f"m{i}")
            assert await ws.get_message() == f"m{i}"
        await ws.send_message(b"\xff" * 100_000)
        assert await ws.get_message() == b"\xff" * 100_000
    with trio.fail_after(10):
        await app.finished.wait()
    assert app.closed_with == [1000]


async def test_messages_that_arrived_are_taken_with_a_schedule_point_every_max_unyielded(
    nursery: trio.Nursery,
) -> None:
    """``receive`` is a cancel point each time, but a schedule point only every
    MAX_UNYIELDED_MESSAGES messages taken in a row from those that already arrived (another task
    runs then), not one per message; a cancelled receive takes no message."""
    count = 3 * MAX_UNYIELDED_MESSAGES
    seen: list[int] = []
    cancelled: list[bool] = []
    after: list[str | bytes] = []

    async def app(request: Request, responder: Responder) -> None:
        ws = await responder.accept_websocket()
        assert await ws.receive() == "first"
        await trio.sleep(0.5)  # the rest arrives and waits (generous: one write of 50)
        seen.extend(await ticks_seen(count, ws.receive))
        with trio.CancelScope() as scope:
            scope.cancel()
            await ws.receive()
        cancelled.append(scope.cancelled_caught)
        after.append(await ws.receive())
        await ws.send("done")

    server = await start_server(nursery, app)
    client, _ = await WSClient.connect(server)
    for text in ["first", *(f"m{i}" for i in range(count)), "after"]:
        await client.send(TextMessage(data=text))
    assert await client.next_event() == TextMessage(data="done")
    # one trip through the scheduler per MAX_UNYIELDED_MESSAGES messages (the ticker ran then)
    assert 2 <= len(set(seen)) <= 4, seen
    assert cancelled == [True]
    assert after == ["after"]
    await client.aclose()


async def test_a_close_under_way_ends_when_the_server_is_cancelled() -> None:
    """The edge's second signal: a handler closing its websocket (shielded, as a node's
    session does) waits for the client's answer; the server cancelled, its reader with it, no
    answer can be read any more, so the close ends then, not at ``close_wait`` (here an hour;
    the edge once sat out its 2 s with every node connected)."""
    waited_out: list[bool] = []
    closing = trio.Event()

    async def app(request: Request, responder: Responder) -> None:
        ws = await responder.accept_websocket()
        await ws.receive()  # the client's cue
        with trio.move_on_after(20, shield=True) as bound:
            closing.set()
            await ws.aclose(1001, "edge shutting down")
        waited_out.append(bound.cancelled_caught)

    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, app, limits=ServerLimits(linger_timeout=3600))
        client, _ = await WSClient.connect(server)
        await client.send(TextMessage(data="close now"))
        await closing.wait()
        event = await client.next_event()  # the close frame, left unanswered
        assert isinstance(event, CloseConnection)
        assert (event.code, event.reason) == (1001, "edge shutting down")
        nursery.cancel_scope.cancel()
    await client.aclose()
    assert waited_out == [False]
