"""TLS through trio.SSLStream, with a certificate made by trustme for the test."""

from __future__ import annotations

import ssl

import httpx
import pytest
import trio
import trio_websocket
import trustme

from dispatcher.http import (
    Request,
    Responder,
    Server,
    ServerLimits,
)

from ._helpers import BOUND, connect, read_until_eof, start_server

pytestmark = pytest.mark.usefixtures("close_clients")


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def server_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    return context


@pytest.fixture
def client_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


async def app(request: Request, responder: Responder) -> None:
    if request.path == "/ws":
        ws = await responder.accept_websocket()
        await ws.send(await ws.receive())
        await ws.aclose()
        return
    stream = await responder.start_stream(200, [(b"content-type", b"text/plain")])
    for i in range(3):
        await stream.send(b"secure %d\n" % i)


async def assert_serves_tls(server: Server, client_context: ssl.SSLContext) -> None:
    base = f"https://{server.address.host}:{server.address.port}"
    async with httpx.AsyncClient(base_url=base, verify=client_context) as client:
        response = await client.get("/ok")
    assert (response.status_code, response.text) == (200, "ok")


async def test_https_requests_and_streams(
    nursery: trio.Nursery, server_context: ssl.SSLContext, client_context: ssl.SSLContext
) -> None:
    server = await start_server(nursery, app, ssl_context=server_context)
    base = f"https://{server.address.host}:{server.address.port}"
    async with httpx.AsyncClient(base_url=base, verify=client_context) as client:
        for _ in range(3):  # keep-alive over one TLS connection
            response = await client.get("/stream")
            assert response.text == "secure 0\nsecure 1\nsecure 2\n"
        assert response.http_version == "HTTP/1.1"


async def test_wss(
    nursery: trio.Nursery, server_context: ssl.SSLContext, client_context: ssl.SSLContext
) -> None:
    server = await start_server(nursery, app, ssl_context=server_context)
    url = f"wss://{server.address.host}:{server.address.port}/ws"
    async with trio_websocket.open_websocket_url(
        url,
        ssl_context=client_context,
        max_message_size=1 << 20,
        disconnect_timeout=5,
        message_queue_size=1,
    ) as ws:
        await ws.send_message("over tls")
        assert await ws.get_message() == "over tls"


async def test_handshake_failures_are_contained(
    nursery: trio.Nursery, server_context: ssl.SSLContext, client_context: ssl.SSLContext
) -> None:
    server = await start_server(
        nursery, app, ssl_context=server_context, limits=ServerLimits(header_timeout=0.5)
    )
    # Plain HTTP to the TLS port.
    stream = await connect(server)
    await stream.send_all(b"GET /ok HTTP/1.1\r\nhost: t\r\n\r\n")
    await read_until_eof(stream)
    # A client that connects and never starts the handshake: cut off by header_timeout.
    stream = await connect(server)
    started = trio.current_time()
    assert await read_until_eof(stream) == b""
    assert trio.current_time() - started < BOUND / 2
    # A client that does not trust the certificate.
    base = f"https://{server.address.host}:{server.address.port}"
    async with httpx.AsyncClient(base_url=base, verify=ssl.create_default_context()) as c:
        with pytest.raises(httpx.ConnectError):
            await c.get("/ok")
    await assert_serves_tls(server, client_context)
