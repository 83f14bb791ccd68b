"""Hypothesis: arbitrary and mutated request bytes against ONE live server.

The server runs for the whole module in a helper thread (its own ``trio.run``); each example
runs a client in a fresh ``trio.run``: it writes the bytes (in one or more pieces), reads
whatever comes back for a moment, and then a well-formed request on a new connection must
be answered 200. No connection may crash inside the driver.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from functools import partial

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from dispatcher.http import (
    Address,
    Request,
    Responder,
    Server,
    ServerLimits,
    WebSocketClosed,
    serve_http,
)

VALID_REQUESTS = [
    b"GET /ok HTTP/1.1\r\nhost: t\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n\r\nhello",
    b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n3\r\nabc\r\n0\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\ncontent-length: 3\r\n\r\nabc",
    b"GET /stream HTTP/1.0\r\n\r\n",
    b"HEAD /stream HTTP/1.1\r\nhost: t\r\n\r\n",
    b"GET /ws HTTP/1.1\r\nhost: t\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
    b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n"
    b"sec-websocket-protocol: chat\r\n\r\n",
]


@st.composite
def mutated_requests(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(VALID_REQUESTS)))
    if draw(st.booleans()):
        data += draw(st.sampled_from(VALID_REQUESTS))  # pipelined
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["insert", "delete", "replace", "duplicate", "truncate"]))
        at = draw(st.integers(0, len(data)))
        if op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "replace" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "duplicate":
            data[at:at] = data[at : at + draw(st.integers(1, 32))]
        elif op == "truncate":
            del data[at:]
    return bytes(data)


request_bytes = st.one_of(
    st.binary(max_size=300),
    mutated_requests(),
    st.builds(bytes.__add__, st.just(VALID_REQUESTS[-1]), st.binary(min_size=1, max_size=64)),
)


async def app(request: Request, responder: Responder) -> None:
    if request.is_websocket_upgrade:
        ws = await responder.accept_websocket(subprotocol=request.query or None)
        try:
            while True:
                await ws.send(await ws.receive())
        except WebSocketClosed:
            return
    if request.path == "/ok":
        await responder.respond(200, body=b"ok")
    elif request.path == "/echo":
        await responder.respond(200, body=await request.body())
    else:
        stream = await responder.start_stream(200)
        await stream.send(b"one")
        await stream.send(b"two")


class _Crashes(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "crashed" in record.getMessage():
            self.records.append(record)


class LiveServer:
    def __init__(self, server: Server, token: trio.lowlevel.TrioToken) -> None:
        self.server = server
        self.token = token
        self.crashes = _Crashes()


def _run_server(ready: queue.Queue[tuple[Server, trio.lowlevel.TrioToken]]) -> None:
    limits = ServerLimits(
        header_timeout=1.0,
        keepalive_timeout=1.0,
        body_timeout=1.0,
        write_timeout=2.0,
        linger_timeout=0.5,
        shutdown_grace=2.0,
    )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            server: Server = await nursery.start(partial(serve_http, app, limits=limits))
            ready.put((server, trio.lowlevel.current_trio_token()))

    trio.run(main)


@pytest.fixture(scope="module")
def live_server() -> Iterator[LiveServer]:
    ready: queue.Queue[tuple[Server, trio.lowlevel.TrioToken]] = queue.Queue()
    thread = threading.Thread(target=_run_server, args=(ready,), daemon=True)
    thread.start()
    live = LiveServer(*ready.get(timeout=10))
    logger = logging.getLogger("dispatcher.http")
    logger.addHandler(live.crashes)
    try:
        yield live
    finally:
        logger.removeHandler(live.crashes)
        trio.from_thread.run_sync(live.server.shutdown, trio_token=live.token)
        thread.join(timeout=10)
    assert not thread.is_alive()


async def _probe(address: Address, data: bytes, pieces: list[int]) -> bytes:
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream(address.host, address.port)
        async with stream:
            try:
                start = 0
                for cut in [*sorted(pieces), len(data)]:
                    if cut > start:
                        await stream.send_all(data[start:cut])
                        start = cut
                with trio.move_on_after(0.1):
                    while await stream.receive_some(65536):
                        pass
            except trio.BrokenResourceError:
                pass
        stream = await trio.open_tcp_stream(address.host, address.port)
        async with stream:
            await stream.send_all(b"GET /ok HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
            response = b""
            while chunk := await stream.receive_some(65536):
                response += chunk
    return response


@given(data=request_bytes, pieces=st.lists(st.integers(0, 600), max_size=3))
def test_arbitrary_bytes_never_break_the_server(
    live_server: LiveServer, data: bytes, pieces: list[int]
) -> None:
    response = trio.run(_probe, live_server.server.address, data, pieces)
    assert response.startswith(b"HTTP/1.1 200 "), response
    assert response.endswith(b"\r\n\r\nok")
    assert not live_server.crashes.records
