"""The failure modes that sank hypercorn's Trio worker (docs/http-server.md): slow readers,
sends after the peer left, disconnects, graceful shutdown and hard stops."""

from __future__ import annotations

import signal
import statistics
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing
from wsproto.events import AcceptConnection, CloseConnection, TextMessage

from dispatcher.http import (
    HTTPStream,
    PeerGone,
    Request,
    Responder,
    Server,
    ServerLimits,
    WebSocket,
    WebSocketClosed,
    serve_http_until_signal,
)

from ._helpers import (
    BOUND,
    HTTPClient,
    Stopped,
    WSClient,
    assert_serves,
    connect,
    header,
    read_until_eof,
    start_server,
    with_ok,
)

pytestmark = pytest.mark.usefixtures("close_clients")

BIG = b"x" * (1 << 20)


async def EMPTY(request: Request, responder: Responder) -> None:
    await responder.respond(204)


async def open_channel(kind: str, responder: Responder) -> HTTPStream | WebSocket:
    if kind == "ws":
        return await responder.accept_websocket()
    return await responder.start_stream(200, [(b"content-type", b"text/event-stream")])


async def start_stalled_client(server: Server, kind: str) -> trio.SocketStream:
    """A client that asks for a stream (or a websocket) and then never reads again."""
    if kind == "ws":
        client, event = await WSClient.connect(server, "/flood")
        assert isinstance(event, AcceptConnection)
        return client.stream
    stream = await connect(server)
    await stream.send_all(b"GET /flood HTTP/1.1\r\nhost: t\r\n\r\n")
    return stream


class FloodApp:
    """Sends 1 MiB chunks or messages as fast as the client takes them."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.started = trio.Event()
        self.ended = trio.Event()
        self.error: BaseException | None = None
        self.stalled_for = -1.0

    async def __call__(self, request: Request, responder: Responder) -> None:
        channel = await open_channel(self.kind, responder)
        self.started.set()
        last_ok = trio.current_time()
        try:
            while True:
                await channel.send(BIG)
                last_ok = trio.current_time()
        except BaseException as exc:
            self.error = exc
            self.stalled_for = trio.current_time() - last_ok
            raise
        finally:
            self.ended.set()


@pytest.mark.parametrize("kind", ["sse", "ws"])
async def test_client_that_stops_reading_is_cut_off(nursery: trio.Nursery, kind: str) -> None:
    write_timeout = 0.5
    limits = ServerLimits(write_timeout=write_timeout, shutdown_grace=30)
    app = FloodApp(kind)
    stopped = Stopped()
    server: Server = await nursery.start(stopped.serve, app, {"limits": limits})

    await start_stalled_client(server, kind)
    with trio.fail_after(BOUND):
        await app.ended.wait()
    assert isinstance(app.error, PeerGone | trio.Cancelled), app.error
    assert write_timeout * 0.8 <= app.stalled_for < write_timeout + 1.0
    await assert_serves(server)

    # A stalled client does not hold up graceful shutdown either (the grace is 30 s).
    app.started, app.ended = trio.Event(), trio.Event()
    await start_stalled_client(server, kind)
    with trio.fail_after(BOUND):
        await app.started.wait()
    shutdown_at = trio.current_time()
    server.shutdown()
    with trio.fail_after(BOUND):
        await stopped.event.wait()
    assert stopped.at is not None
    assert stopped.at - shutdown_at < write_timeout + 1.5


@pytest.mark.parametrize("kind", ["sse", "ws"])
async def test_sending_after_the_peer_left_raises_and_checkpoints(
    nursery: trio.Nursery, kind: str
) -> None:
    ready = trio.Event()
    done = trio.Event()
    outcome: dict[str, Any] = {}
    ticks = 0

    async def handler(request: Request, responder: Responder) -> None:
        channel = await open_channel(kind, responder)
        outcome["ticks_at_start"] = ticks
        ready.set()
        sends = 0
        # Shielded (with a deadline) from the disconnect cancellation: only the send
        # itself can tell this loop that the peer left. Bounded so a bug fails, not hangs.
        with trio.move_on_after(BOUND, shield=True):
            try:
                while sends < 2_000_000:
                    await channel.send(b"tick\n")
                    sends += 1
            except (PeerGone, WebSocketClosed) as exc:
                outcome["error"] = exc
                outcome["ticks_at_error"] = ticks
                # Every later send raises too, and each one is a checkpoint.
                for _ in range(3):
                    with trio.testing.assert_checkpoints():
                        try:
                            await channel.send(b"again\n")
                        except (PeerGone, WebSocketClosed):
                            outcome["raised_again"] = outcome.get("raised_again", 0) + 1
        outcome["sends"] = sends
        done.set()

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.lowlevel.checkpoint()
            ticks += 1

    server = await start_server(nursery, handler)
    nursery.start_soon(ticker)
    if kind == "ws":
        client, _ = await WSClient.connect(server, "/tick")
        stream = client.stream
    else:
        stream = await connect(server)
        await stream.send_all(b"GET /tick HTTP/1.1\r\nhost: t\r\n\r\n")
    with trio.fail_after(BOUND):
        await ready.wait()
        await stream.receive_some(1000)
    await stream.aclose()
    with trio.fail_after(BOUND):
        await done.wait()
    assert "error" in outcome, outcome
    assert outcome["raised_again"] == 3
    # The loop never froze the event loop: the ticker kept running while it sent.
    assert outcome["ticks_at_error"] > outcome["ticks_at_start"]
    await assert_serves(server)


async def test_client_disconnect_cancels_the_handler_quickly(nursery: trio.Nursery) -> None:
    events: list[tuple[trio.Event, trio.Event, list[Any]]] = []

    async def handler(request: Request, responder: Responder) -> None:
        started, cancelled, record = events[-1]
        stream = await responder.start_stream(200, [(b"content-type", b"text/event-stream")])
        await stream.send(b"data: first\n\n")
        started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled as exc:
            record.extend([trio.current_time(), str(exc)])
            cancelled.set()
            raise

    server = await start_server(nursery, handler)
    figures = []
    for _ in range(20):
        started, cancelled = trio.Event(), trio.Event()
        record: list[Any] = []
        events.append((started, cancelled, record))
        stream = await connect(server)
        await stream.send_all(b"GET /sse HTTP/1.1\r\nhost: t\r\n\r\n")
        with trio.fail_after(BOUND):
            await started.wait()
            received = b""
            while b"data: first" not in received:
                received += await stream.receive_some(65536)
        closed_at = trio.current_time()
        await stream.aclose()
        with trio.fail_after(BOUND):
            await cancelled.wait()
        figures.append(record[0] - closed_at)
        assert "client disconnected" in record[1]
    worst = max(figures)
    print(
        f"\ndisconnect-to-cancel over {len(figures)} runs: "
        f"median {statistics.median(figures) * 1000:.3f} ms, max {worst * 1000:.3f} ms"
    )
    assert worst < 1.0
    await assert_serves(server)


async def test_graceful_shutdown(nursery: trio.Nursery) -> None:
    app_stopping = trio.Event()
    sse_started = trio.Event()
    slow_started = trio.Event()
    ws_closed: list[int] = []
    saw_shutting_down: list[bool] = []

    async def on_shutdown() -> None:
        app_stopping.set()

    async def handler(request: Request, responder: Responder) -> None:
        if request.path == "/sse":
            stream = await responder.start_stream(200, [(b"content-type", b"text/event-stream")])
            await stream.send(b"data: hello\n\n")
            sse_started.set()
            await app_stopping.wait()
            saw_shutting_down.append(responder.shutting_down)
            await stream.send(b"event: shutdown\ndata: bye\n\n")
        elif request.path == "/ws":
            ws = await responder.accept_websocket()
            try:
                while True:
                    await ws.send(await ws.receive())
            except WebSocketClosed as exc:
                ws_closed.append(exc.code)
        elif request.path == "/slow":
            slow_started.set()
            await app_stopping.wait()
            await responder.respond(200, body=b"late")

    grace = 5.0
    stopped = Stopped()
    kwargs = {"limits": ServerLimits(shutdown_grace=grace), "on_shutdown": on_shutdown}
    server: Server = await nursery.start(stopped.serve, handler, kwargs)

    idle = await HTTPClient.open(server)
    response, _ = await idle.request("GET", "/ok")
    assert response.status_code == 200
    sse = await connect(server)
    await sse.send_all(b"GET /sse HTTP/1.1\r\nhost: t\r\n\r\n")
    with trio.fail_after(BOUND):
        await sse_started.wait()
    ws, event = await WSClient.connect(server)
    assert isinstance(event, AcceptConnection)
    await ws.send(TextMessage(data="ping"))
    assert await ws.next_event() == TextMessage(data="ping")
    slow = await HTTPClient.open(server)
    await slow.send_request("GET", "/slow")
    with trio.fail_after(BOUND):
        await slow_started.wait()

    shutdown_at = trio.current_time()
    server.shutdown()
    assert server.shutting_down

    assert await read_until_eof(idle.stream) == b""
    idle_closed_after = trio.current_time() - shutdown_at
    assert idle_closed_after < 1.0

    rest = await read_until_eof(sse)
    assert b"event: shutdown\ndata: bye\n\n" in rest
    assert rest.endswith(b"\r\n0\r\n\r\n")  # the stream was ended cleanly

    event = await ws.next_event()
    assert isinstance(event, CloseConnection)
    assert event.code == 1001
    await ws.send(event.response())

    response, body = await slow.read_response()
    assert (response.status_code, body) == (200, b"late")
    assert header(response, b"connection") == b"close"

    with trio.fail_after(grace + 1):
        await stopped.event.wait()
    assert stopped.at is not None
    assert stopped.at - shutdown_at < grace
    assert ws_closed == [1001]
    assert saw_shutting_down == [True]
    with pytest.raises(OSError, match="onnect"):
        await trio.open_tcp_stream(server.address.host, server.address.port)


async def test_shutdown_grace_cancels_what_is_left(nursery: trio.Nursery) -> None:
    cancelled = trio.Event()
    started = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        stream = await responder.start_stream(200)
        await stream.send(b"data: 1\n\n")
        started.set()
        try:
            await trio.sleep_forever()  # ignores the shutdown hint
        finally:
            cancelled.set()

    stopped = Stopped()
    server: Server = await nursery.start(
        stopped.serve, handler, {"limits": ServerLimits(shutdown_grace=0.3)}
    )
    stream = await connect(server)
    await stream.send_all(b"GET /sse HTTP/1.1\r\nhost: t\r\n\r\n")
    with trio.fail_after(BOUND):
        await started.wait()
    shutdown_at = trio.current_time()
    server.shutdown()
    with trio.fail_after(BOUND):
        await stopped.event.wait()
    assert cancelled.is_set()
    assert stopped.at is not None
    assert 0.25 < stopped.at - shutdown_at < 2.0


async def test_cancelling_serve_http_is_a_hard_stop() -> None:
    started = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        if request.path == "/ws":
            ws = await responder.accept_websocket()
            started.set()
            while True:
                await ws.send(BIG)  # the client never reads
        stream = await responder.start_stream(200)
        with trio.CancelScope(shield=True, deadline=trio.current_time() + 0.5):
            await stream.send(b"x")  # a shield with a deadline is fine
        await trio.sleep_forever()

    async with trio.open_nursery() as inner:
        server = await start_server(inner, handler)
        stream = await connect(server)
        await stream.send_all(b"GET /sse HTTP/1.1\r\nhost: t\r\n\r\n")
        await WSClient.connect(server)
        await connect(server)  # idle
        with trio.fail_after(BOUND):
            await started.wait()
        cancelled_at = trio.current_time()
        inner.cancel_scope.cancel()
    assert trio.current_time() - cancelled_at < 1.0


async def test_signals_shut_down_gracefully_then_hard() -> None:
    started = trio.Event()
    cancelled = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        stream = await responder.start_stream(200)
        await stream.send(b"data: 1\n\n")
        started.set()
        try:
            await trio.sleep_forever()  # ignores the graceful hint: only the 2nd signal ends it
        finally:
            cancelled.set()

    returned_at: list[float] = []

    async def run(task_status: trio.TaskStatus[Server]) -> None:
        await serve_http_until_signal(
            with_ok(handler), limits=ServerLimits(shutdown_grace=30), task_status=task_status
        )
        returned_at.append(trio.current_time())

    async with trio.open_nursery() as inner:
        server: Server = await inner.start(run)
        await assert_serves(server)
        stream = await connect(server)
        await stream.send_all(b"GET /sse HTTP/1.1\r\nhost: t\r\n\r\n")
        with trio.fail_after(BOUND):
            await started.wait()
        signal.raise_signal(signal.SIGTERM)
        with trio.fail_after(BOUND):
            while not server.shutting_down:
                await trio.lowlevel.checkpoint()
        assert not cancelled.is_set()
        second_at = trio.current_time()
        signal.raise_signal(signal.SIGTERM)
        with trio.fail_after(BOUND):
            await cancelled.wait()
    assert len(returned_at) == 1  # the hard stop is complete: it returned
    assert returned_at[0] - second_at < 2.0


async def test_one_signal_is_a_graceful_shutdown() -> None:
    async with trio.open_nursery() as inner:
        server: Server = await inner.start(
            partial(serve_http_until_signal, with_ok(EMPTY), signals=(signal.SIGUSR1,))
        )
        await assert_serves(server)
        idle = await connect(server)
        signal.raise_signal(signal.SIGUSR1)
        assert await read_until_eof(idle) == b""
    assert server.shutting_down
