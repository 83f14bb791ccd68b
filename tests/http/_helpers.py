"""Raw clients for probing the server over real loopback sockets."""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import h11
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import Event as WSEvent
from wsproto.events import Request as WSRequest

from dispatcher.http import (
    Handler,
    Request,
    Responder,
    Server,
    serve_http,
)

BOUND = 10.0
"""Generous bound on anything that should happen at once (a hang fails instead)."""


def with_ok(handler: Handler) -> Handler:
    """``handler``, plus ``GET /ok`` answered 200 (what :func:`assert_serves` asks for)."""

    async def wrapped(request: Request, responder: Responder) -> None:
        if request.path == "/ok":
            await responder.respond(200, [(b"content-type", b"text/plain")], b"ok")
        else:
            await handler(request, responder)

    return wrapped


async def start_server(nursery: trio.Nursery, handler: Handler, **kwargs: Any) -> Server:
    server: Server = await nursery.start(_serve, with_ok(handler), kwargs)
    return server


async def _serve(
    handler: Handler,
    kwargs: dict[str, Any],
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
) -> None:
    await serve_http(handler, task_status=task_status, **kwargs)


class Stopped:
    """Runs serve_http and records when it returns."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.at: float | None = None

    async def serve(
        self,
        handler: Handler,
        kwargs: dict[str, Any],
        task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await serve_http(with_ok(handler), task_status=task_status, **kwargs)
        self.at = trio.current_time()
        self.event.set()


OPEN_STREAMS: list[trio.SocketStream] = []
"""Client streams of the running test, closed by the ``close_clients`` fixture."""


async def connect(server: Server) -> trio.SocketStream:
    stream = await trio.open_tcp_stream(server.address.host, server.address.port)
    OPEN_STREAMS.append(stream)
    return stream


async def read_until_eof(stream: trio.abc.ReceiveStream, *, bound: float = BOUND) -> bytes:
    chunks = []
    with trio.fail_after(bound):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks)


def status_of(raw: bytes) -> int:
    """The status code of the first response in ``raw``."""
    return int(raw.split(b" ", 2)[1])


class HTTPClient:
    """One raw HTTP/1.1 client connection, driven by h11."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, server: Server) -> HTTPClient:
        return cls(await connect(server))

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def send_request(
        self,
        method: str,
        target: str,
        headers: Sequence[tuple[str, str]] = (),
        body: bytes | None = None,
    ) -> None:
        all_headers = [("host", "test"), *headers]
        if body is not None and not any(k.lower() == "transfer-encoding" for k, _ in headers):
            all_headers.append(("content-length", str(len(body))))
        data = self.h11.send(h11.Request(method=method, target=target, headers=all_headers))
        if body:
            data += self.h11.send(h11.Data(data=body))
        data += self.h11.send(h11.EndOfMessage())
        await self.stream.send_all(data)

    async def next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                self.h11.receive_data(data)
                continue
            return event

    async def read_response(self) -> tuple[h11.Response, bytes]:
        with trio.fail_after(BOUND):
            event = await self.next_event()
            while isinstance(event, h11.InformationalResponse):
                event = await self.next_event()
            assert isinstance(event, h11.Response), event
            body = bytearray()
            while True:
                part = await self.next_event()
                if isinstance(part, h11.Data):
                    body += part.data
                    continue
                assert isinstance(part, h11.EndOfMessage), part
                return event, bytes(body)

    def next_cycle(self) -> None:
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()

    async def request(
        self,
        method: str,
        target: str,
        headers: Sequence[tuple[str, str]] = (),
        body: bytes | None = None,
    ) -> tuple[h11.Response, bytes]:
        await self.send_request(method, target, headers, body)
        result = await self.read_response()
        self.next_cycle()
        return result


class PipelineReader:
    """Reads responses to requests that were written raw (pipelined) onto one stream."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def read_response(self, method: str = "GET") -> tuple[h11.Response, bytes]:
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method=method, target="/", headers=[("host", "test")]))
        conn.send(h11.EndOfMessage())
        if self.buffer:  # (an empty receive_data means EOF to h11)
            conn.receive_data(self.buffer)
        client = HTTPClient(self.stream)
        client.h11 = conn
        result = await client.read_response()
        self.buffer = conn.trailing_data[0]
        return result


def header(response: h11.Response, name: bytes) -> bytes | None:
    for key, value in response.headers:
        if key == name:
            return bytes(value)
    return None


async def assert_serves(server: Server) -> None:
    """A fresh connection gets ``200 ok`` for ``GET /ok``."""
    client = await HTTPClient.open(server)
    try:
        response, body = await client.request("GET", "/ok")
    finally:
        await client.aclose()
    assert (response.status_code, body) == (200, b"ok")


class WSClient:
    """A raw websocket client on wsproto, so tests control every byte."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self._events: deque[WSEvent] = deque()

    @classmethod
    async def connect(
        cls,
        server: Server,
        target: str = "/ws",
        *,
        subprotocols: Sequence[str] = (),
        extra: bytes = b"",
    ) -> tuple[WSClient, WSEvent]:
        """Open and send the handshake (plus ``extra`` bytes in the same write)."""
        client = cls(await connect(server))
        request = WSRequest(host="test", target=target, subprotocols=list(subprotocols))
        await client.stream.send_all(client.ws.send(request) + extra)
        return client, await client.next_event()

    async def next_event(self, *, bound: float = BOUND) -> WSEvent:
        with trio.fail_after(bound):
            while not self._events:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                self.ws.receive_data(data or None)
                self._events.extend(self.ws.events())
            return self._events.popleft()

    async def send(self, event: WSEvent) -> None:
        await self.stream.send_all(self.ws.send(event))

    async def aclose(self) -> None:
        await self.stream.aclose()


async def wait_for(predicate: Callable[[], bool], *, bound: float = BOUND) -> None:
    """Wait (polling each scheduler pass) until ``predicate()`` holds."""
    with trio.fail_after(bound):
        while not predicate():
            await trio.sleep(0.001)


async def until(awaitable: Awaitable[Any], *, bound: float = BOUND) -> Any:
    with trio.fail_after(bound):
        return await awaitable
