"""The node's websocket client (``nodes.websocket``, on wsproto) against a wsproto server over
an in-memory stream pair: the handshake, frames joined into one write, pongs, the size limit,
the closing handshake, backpressure, a refused upgrade, a broken stream."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)

from dispatcher.shared.transport import ConnectionClosed
from nodes.websocket import (
    UpgradeRejected,
    WebSocketClient,
    client_frames,
    handshake,
    open_websocket,
)


class Recorded(trio.abc.Stream):
    """The client's stream: its writes recorded, held while ``gate`` is set and not open."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.writes: list[bytes] = []
        self.reads = 0
        self.gate: trio.Event | None = None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))
        if self.gate is not None:
            await self.gate.wait()
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        self.reads += 1
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Edge:
    """The server's end: wsproto over the other stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.SERVER)
        self.events: deque[Event] = deque()
        self.request: Request | None = None

    async def next_event(self) -> Event:
        while not self.events:
            data = await self.stream.receive_some(65536)
            self.ws.receive_data(bytes(data) if data else None)
            self.events.extend(self.ws.events())
        return self.events.popleft()

    async def accept(self) -> None:
        event = await self.next_event()
        assert isinstance(event, Request)
        self.request = event
        await self.stream.send_all(self.ws.send(AcceptConnection()))

    async def send(self, event: Event) -> None:
        await self.stream.send_all(self.ws.send(event))

    async def message(self) -> str | bytes:
        event = await self.next_event()
        assert isinstance(event, TextMessage | BytesMessage), event
        return event.data if isinstance(event.data, str) else bytes(event.data)


@asynccontextmanager
async def connected(
    *, max_message_size: int = 1 << 20, queue_size: int = 16
) -> AsyncIterator[tuple[WebSocketClient, Edge, Recorded]]:
    client_end, server_end = trio.testing.memory_stream_pair()
    stream = Recorded(client_end)
    edge = Edge(server_end)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(edge.accept)
        proto = await handshake(stream, "edge.example:8700", "/v1/nodes/connect")
    async with open_websocket(
        stream,
        proto,
        max_message_size=max_message_size,
        queue_size=queue_size,
        close_timeout=1.0,
        cancelled_close_timeout=0.1,
    ) as ws:
        yield ws, edge, stream


async def test_the_upgrade_asks_for_the_resource_with_no_subprotocol() -> None:
    async with connected() as (ws, edge, _):
        assert edge.request is not None
        assert (edge.request.host, edge.request.target) == (
            "edge.example:8700",
            "/v1/nodes/connect",
        )
        assert edge.request.subprotocols == []
        names = {name.lower() for name, _ in edge.request.extra_headers}
        assert names == {
            b"upgrade",
            b"connection",
            b"sec-websocket-key",
            b"sec-websocket-version",
        }
        await ws.send("hello")
        assert await edge.message() == "hello"
        await edge.send(TextMessage(data="welcome"))
        assert await ws.receive() == "welcome"
        await edge.send(BytesMessage(data=b"\x00body"))
        assert await ws.receive() == b"\x00body"
        await edge.send(CloseConnection(code=1000))  # so leaving does not wait


async def test_frames_queued_behind_a_write_leave_in_one_write() -> None:
    async with connected() as (ws, edge, stream):
        writes_before = len(stream.writes)
        stream.gate = trio.Event()
        done: list[str] = []

        async def send(*frames: str) -> None:
            await ws.send_many(frames)
            done.extend(frames)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "a")
            await trio.testing.wait_all_tasks_blocked()  # "a" is being written (held)
            nursery.start_soon(send, "b", "c")
            await trio.testing.wait_all_tasks_blocked()  # handed in behind "a"
            nursery.start_soon(send, "d")
            await trio.testing.wait_all_tasks_blocked()
            assert len(stream.writes) == writes_before + 1
            assert done == []
            stream.gate.set()
        assert len(stream.writes) == writes_before + 2  # "a", then b, c and d in one write
        assert sorted(done) == ["a", "b", "c", "d"]
        assert [await edge.message() for _ in range(4)] == ["a", "b", "c", "d"]
        await edge.send(CloseConnection(code=1000))


async def test_a_cancelled_sender_s_frame_still_goes_out_in_order() -> None:
    async with connected() as (ws, edge, stream):
        stream.gate = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.send, "first")
            await trio.testing.wait_all_tasks_blocked()
            with trio.CancelScope() as scope:

                async def cancel() -> None:
                    scope.cancel()

                nursery.start_soon(cancel)
                await ws.send("second")  # queued, then cancelled while it waits
            assert scope.cancelled_caught
            stream.gate.set()
        await ws.send("third")
        assert [await edge.message() for _ in range(3)] == ["first", "second", "third"]
        await edge.send(CloseConnection(code=1000))


async def test_a_ping_is_answered_with_a_pong() -> None:
    async with connected() as (_, edge, _):
        await edge.send(Ping(payload=b"are you there"))
        event = await edge.next_event()
        assert isinstance(event, Pong)
        assert event.payload == b"are you there"
        await edge.send(CloseConnection(code=1000))


async def test_a_message_over_the_limit_closes_with_1009() -> None:
    async with connected(max_message_size=10) as (ws, edge, _):
        await edge.send(TextMessage(data="x" * 11))
        event = await edge.next_event()
        assert isinstance(event, CloseConnection)
        assert event.code == 1009
        with pytest.raises(ConnectionClosed) as closed:
            await ws.receive()
        assert closed.value.code == 1009
        await edge.send(event.response())


async def test_a_fragmented_message_is_reassembled_and_counted_whole() -> None:
    async with connected(max_message_size=10) as (ws, edge, _):
        await edge.send(TextMessage(data="hello ", message_finished=False))
        await edge.send(TextMessage(data="node", message_finished=True))
        assert await ws.receive() == "hello node"
        await edge.send(TextMessage(data="123456", message_finished=False))
        await edge.send(TextMessage(data="789012", message_finished=True))
        event = await edge.next_event()
        assert isinstance(event, CloseConnection)
        assert event.code == 1009
        await edge.send(event.response())


async def test_the_edge_s_close_is_answered_after_what_came_before_it() -> None:
    async with connected() as (ws, edge, _):
        await edge.send(TextMessage(data="last words"))
        await edge.send(CloseConnection(code=4001, reason="invalid node token"))
        reply = await edge.next_event()
        assert isinstance(reply, CloseConnection)
        assert reply.code == 4001
        assert await ws.receive() == "last words"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.receive()
        assert (closed.value.code, closed.value.reason) == (4001, "invalid node token")
        with pytest.raises(ConnectionClosed):
            await ws.send("too late")


async def test_a_close_without_reason_is_named_by_its_code() -> None:
    async with connected() as (ws, edge, _):
        await edge.send(CloseConnection(code=1001))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.receive()
        assert (closed.value.code, closed.value.reason) == (1001, "GOING_AWAY")


async def test_aclose_sends_the_code_and_waits_for_the_answer() -> None:
    async with connected() as (ws, edge, _):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.aclose, 1001, "node shutting down")
            event = await edge.next_event()
            assert isinstance(event, CloseConnection)
            assert (event.code, event.reason) == (1001, "node shutting down")
            await trio.testing.wait_all_tasks_blocked()
            await edge.send(event.response())
        with pytest.raises(ConnectionClosed) as closed:
            await ws.send("after the close")
        assert closed.value.code == 1001


async def test_leaving_the_block_closes_with_1000() -> None:
    client_end, server_end = trio.testing.memory_stream_pair()
    edge = Edge(server_end)
    seen: list[CloseConnection] = []

    async def answer_the_close() -> None:
        event = await edge.next_event()
        assert isinstance(event, CloseConnection)
        seen.append(event)
        await edge.send(event.response())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(edge.accept)
        proto = await handshake(client_end, "h", "/")
        nursery.start_soon(answer_the_close)
        async with open_websocket(
            client_end,
            proto,
            max_message_size=100,
            queue_size=4,
            close_timeout=1.0,
            cancelled_close_timeout=0.1,
        ):
            pass
    assert [(event.code, event.reason) for event in seen] == [(1000, "")]


async def test_a_close_under_way_ends_when_the_reader_is_cancelled(autojump_clock: object) -> None:
    """A node's second signal: its session, drained, was closing -- shielded, waiting for the
    edge's answer -- when everything was cancelled, the reader with it. No answer can be read
    any more, so the close ends at once, not at its bound (the node once stayed 5 s, until
    SIGKILL, after "stopping now")."""
    start = trio.current_time()
    sent: list[CloseConnection] = []
    with trio.CancelScope() as everything:
        async with connected() as (ws, edge, _):

            async def close_as_the_session_does() -> None:
                with trio.move_on_after(5.0, shield=True):
                    await ws.aclose(1000, "node drained")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(close_as_the_session_does)
                event = await edge.next_event()  # the edge has it, and does not answer yet
                assert isinstance(event, CloseConnection)
                sent.append(event)
                everything.cancel()
    assert [(event.code, event.reason) for event in sent] == [(1000, "node drained")]
    assert trio.current_time() - start < 0.1  # not the close's 1 s, nor the shield's 5 s


async def test_a_full_queue_stops_the_reader() -> None:
    async with connected(queue_size=1) as (ws, edge, stream):
        await edge.send(TextMessage(data="one"))
        await trio.testing.wait_all_tasks_blocked()
        reads = stream.reads
        await edge.send(TextMessage(data="two"))
        await trio.testing.wait_all_tasks_blocked()
        assert stream.reads == reads  # the queue is full: the socket is not read
        assert await ws.receive() == "one"
        await trio.testing.wait_all_tasks_blocked()
        assert stream.reads > reads
        assert await ws.receive() == "two"
        await edge.send(CloseConnection(code=1000))


async def test_a_refused_upgrade_says_its_status() -> None:
    client_end, server_end = trio.testing.memory_stream_pair()
    edge = Edge(server_end)

    async def refuse() -> None:
        event = await edge.next_event()
        assert isinstance(event, Request)
        await edge.send(RejectConnection(status_code=403, has_body=True))
        await edge.send(RejectData(data=b"forbidden", body_finished=True))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(refuse)
        with pytest.raises(UpgradeRejected) as refused:
            await handshake(client_end, "h", "/v1/nodes/connect")
    assert (refused.value.status_code, refused.value.body) == (403, b"forbidden")


async def test_the_edge_closing_during_the_upgrade_is_no_answer(autojump_clock: object) -> None:
    """What an edge serving TLS does with a plain hello: the upgrade times out (the dial's
    cause, a timeout in the upgrade, advises wss://)."""
    client_end, server_end = trio.testing.memory_stream_pair()

    async def hang_up() -> None:
        await server_end.receive_some(65536)
        await server_end.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hang_up)
        with pytest.raises(trio.TooSlowError), trio.fail_after(10):
            await handshake(client_end, "h", "/")


async def test_a_lost_connection_fails_receive_and_send() -> None:
    async with connected() as (ws, edge, _):
        await edge.stream.aclose()
        with pytest.raises(ConnectionClosed) as closed:
            await ws.receive()
        assert closed.value.code == 1006
        with pytest.raises(ConnectionClosed):
            await ws.send("into the void")


@asynccontextmanager
async def connected_over_tcp() -> AsyncIterator[tuple[WebSocketClient, Edge]]:
    """The client over a real TCP connection on 127.0.0.1 (the node's case)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with listeners[0], trio.open_nursery() as nursery:
        client_end = await trio.testing.open_stream_to_socket_listener(listeners[0])
        server_end = await listeners[0].accept()
        async with client_end, server_end:
            edge = Edge(server_end)
            nursery.start_soon(edge.accept)
            proto = await handshake(client_end, "127.0.0.1", "/v1/nodes/connect")
            async with open_websocket(
                client_end,
                proto,
                max_message_size=1 << 20,
                queue_size=16,
                close_timeout=1.0,
                cancelled_close_timeout=0.1,
            ) as ws:
                yield ws, edge


async def whole_message(edge: Edge) -> str:
    """The next text message, its pieces joined (wsproto hands a large one over in pieces)."""
    parts: list[str] = []
    while True:
        event = await edge.next_event()
        assert isinstance(event, TextMessage), event
        parts.append(event.data)
        if event.message_finished:
            return "".join(parts)


async def test_a_write_cancelled_part_way_on_tcp_keeps_the_connection_and_the_framing() -> None:
    """The cluster soak's failure: a run's task cancelled (its client left) while it was the
    writer closed the node's whole session ("a write failed: Cancelled"). On TCP the unsent
    rest goes back to the head of the queue: the frame arrives whole, and later ones after it."""
    big = "x" * (16 << 20)  # far more than the socket buffers: the write blocks part-way
    async with connected_over_tcp() as (ws, edge):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_when_blocked() -> None:
                    await trio.testing.wait_all_tasks_blocked()
                    scope.cancel()

                nursery.start_soon(cancel_when_blocked)
                await ws.send(big)
        assert scope.cancelled_caught
        # not broken: the next send writes the rest, then itself
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.send, "after")
            assert await whole_message(edge) == big
            assert await whole_message(edge) == "after"
        # and a write cancelled before it started sends nothing of it, and breaks nothing
        with trio.CancelScope() as scope:
            scope.cancel()
            await ws.send("never started")
        await ws.send("next")
        assert await whole_message(edge) == "next"
        await edge.send(CloseConnection(code=1000))


_SIZES = st.sampled_from([0, 1, 3, 4, 5, 125, 126, 127, 65535, 65536, 70000])
_FRAME = st.one_of(
    _SIZES.flatmap(lambda n: st.just("\u00e9x" * (n // 3) + "y" * (n % 3))),  # 2-byte chars
    st.text(max_size=40),
    _SIZES.flatmap(lambda n: st.binary(min_size=n, max_size=n)),
)


@given(st.lists(_FRAME, max_size=5))
def test_the_client_s_frames_are_read_by_a_server_as_the_messages_sent(
    frames: list[str | bytes],
) -> None:
    """The frames the client builds itself (masked, one pass): a wsproto server reads each
    as one whole message, text or binary as sent."""
    server = WSConnection(ConnectionType.SERVER)
    client = WSConnection(ConnectionType.CLIENT)
    server.receive_data(client.send(Request(host="edge", target="/v1/nodes/connect")))
    assert [type(e) for e in server.events()] == [Request]
    client.receive_data(server.send(AcceptConnection()))
    data = client_frames(frames)
    masked = [data[i] & 0x80 for i in _frame_starts(data)]
    assert masked == [0x80] * len(frames)
    server.receive_data(data)
    received = list(server.events())
    assert all(isinstance(e, TextMessage | BytesMessage) and e.message_finished for e in received)
    assert [e.data for e in received if isinstance(e, TextMessage | BytesMessage)] == frames


def _frame_starts(data: bytes) -> list[int]:
    """Where each frame's second byte (MASK and length) is."""
    starts, at = [], 0
    while at < len(data):
        starts.append(at + 1)
        size = data[at + 1] & 0x7F
        header = 2 + {126: 2, 127: 8}.get(size, 0)
        if size >= 126:
            size = int.from_bytes(data[at + 2 : at + header], "big")
        at += header + 4 + size
    return starts
