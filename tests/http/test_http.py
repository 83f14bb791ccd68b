"""HTTP/1.1 semantics against a live server: keep-alive, pipelining, chunked bodies, HEAD,
HTTP/1.0, Expect: 100-continue, the limits, and containment of handler failures."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio

from dispatcher.http import (
    BodyTooLarge,
    PeerGone,
    Request,
    Responder,
    ServerLimits,
)
from dispatcher.http._connection import HTTPConnection

from ._helpers import (
    BOUND,
    HTTPClient,
    PipelineReader,
    assert_serves,
    connect,
    header,
    read_until_eof,
    start_server,
    status_of,
)

pytestmark = pytest.mark.usefixtures("close_clients")


async def app(request: Request, responder: Responder) -> None:
    """Routes used across these tests."""
    path = request.path
    if path == "/echo":
        body = await request.body()
        await responder.respond(200, [(b"x-method", request.method.encode())], body)
    elif path == "/chunks":
        total = 0
        async for chunk in request.iter_body():
            total += len(chunk)
        await responder.respond(200, body=b"%d" % total)
    elif path == "/stream":
        count = int(request.query.partition("=")[2] or 3)
        stream = await responder.start_stream(200, [(b"content-type", b"text/plain")])
        for i in range(count):
            await stream.send(b"part %d\n" % i)
    elif path == "/peer":
        assert request.client is not None
        await responder.respond(200, body=b"%d" % request.client.port)
    elif path == "/where":
        await responder.respond(200, body=f"{request.path}|{request.query}".encode())
    else:
        await responder.respond(404, body=b"no such route")


async def test_keep_alive_reuses_the_connection(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app)
    client = await HTTPClient.open(server)
    ports = set()
    for i in range(3):
        response, body = await client.request("POST", "/echo", body=b"hello %d" % i)
        assert (response.status_code, body) == (200, b"hello %d" % i)
        assert header(response, b"x-method") == b"POST"
        assert header(response, b"date") is not None
        response, body = await client.request("GET", "/peer")
        ports.add(body)
    assert len(ports) == 1
    await client.aclose()
    await assert_serves(server)


async def test_httpx_client_roundtrip(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app)
    base = f"http://{server.address.host}:{server.address.port}"
    async with httpx.AsyncClient(base_url=base) as client:
        response = await client.post("/echo", content=b"x" * 100_000)
        assert response.content == b"x" * 100_000
        response = await client.get("/where?a=1&b=2")
        assert response.text == "/where|a=1&b=2"
        response = await client.get("/stream?n=5")
        assert response.text == "".join(f"part {i}\n" for i in range(5))
        assert response.headers["transfer-encoding"] == "chunked"


async def test_pipelined_requests_are_answered_in_order(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app)
    stream = await connect(server)
    requests = (
        b"".join(b"GET /where?n=%d HTTP/1.1\r\nhost: t\r\n\r\n" % i for i in range(10))
        + b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\n\r\nlast"
    )
    await stream.send_all(requests)
    reader = PipelineReader(stream)
    for i in range(10):
        response, body = await reader.read_response()
        assert (response.status_code, body) == (200, b"/where|n=%d" % i)
    response, body = await reader.read_response("POST")
    assert body == b"last"
    await stream.aclose()
    await assert_serves(server)


async def test_pipelined_requests_each_pass_a_schedule_point(nursery: trio.Nursery) -> None:
    """A pipelining client whose handlers never wait (the body came with the head, the
    answer's write is taken at once) does not keep its connection's task running: each
    request passes a schedule point, so the other tasks run as it is served."""
    ticks = 0
    seen: list[int] = []

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.lowlevel.checkpoint()
            ticks += 1

    async def handler(request: Request, responder: Responder) -> None:
        await request.body()
        seen.append(ticks)
        await responder.respond(200, [], b"ok")

    server = await start_server(nursery, handler)
    stream = await connect(server)
    count = 20
    nursery.start_soon(ticker)
    await stream.send_all(
        b"".join(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 1\r\n\r\nx" for _ in range(count))
    )
    reader = PipelineReader(stream)
    for _ in range(count):
        response, body = await reader.read_response("POST")
        assert (response.status_code, body) == (200, b"ok")
    assert len(seen) == count
    # The ticker runs once per scheduler batch; each request takes one at least (without a
    # schedule point per request, the connection serves them all in one step: no tick).
    assert seen[-1] - seen[0] >= count // 2
    await stream.aclose()


async def test_chunked_request_and_response_bodies(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app)
    stream = await connect(server)
    await stream.send_all(
        b"POST /chunks HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n3\r\nabc\r\n0\r\n\r\n"
        b"GET /stream?n=2 HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"
    )
    raw = await read_until_eof(stream)
    assert raw.startswith(b"HTTP/1.1 200 ")
    first, _, second = raw.partition(b"\r\n\r\n8")
    assert first.endswith(b"content-length: 1")
    assert b"transfer-encoding: chunked" in second.lower()
    assert second.endswith(b"7\r\npart 0\n\r\n7\r\npart 1\n\r\n0\r\n\r\n")
    await assert_serves(server)


async def test_chunked_upload_over_the_limit_is_413(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app, limits=ServerLimits(max_body_size=10))
    stream = await connect(server)
    await stream.send_all(
        b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        b"8\r\n12345678\r\n8\r\n12345678\r\n0\r\n\r\n"
    )
    assert status_of(await read_until_eof(stream)) == 413
    await assert_serves(server)


async def test_head_sends_no_body(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app)
    client = await HTTPClient.open(server)
    await client.send_request("HEAD", "/echo")
    raw = b""
    with trio.fail_after(BOUND):
        while b"\r\n\r\n" not in raw:
            raw += await client.stream.receive_some(65536)
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"content-length: 0" in head
    assert rest == b""
    # The connection is still usable: the next response starts right after the head.
    await client.stream.send_all(b"HEAD /stream HTTP/1.1\r\nhost: t\r\n\r\n")
    with trio.fail_after(BOUND):
        raw = await client.stream.receive_some(65536)
    assert raw.startswith(b"HTTP/1.1 200 ")
    assert raw.endswith(b"\r\n\r\n")
    await client.aclose()
    await assert_serves(server)


async def test_http_1_0_gets_close_delimited_stream(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app)
    stream = await connect(server)
    await stream.send_all(b"GET /stream?n=3 HTTP/1.0\r\n\r\n")
    raw = await read_until_eof(stream)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"transfer-encoding" not in head.lower()
    assert b"connection: close" in head.lower()
    assert body == b"part 0\npart 1\npart 2\n"
    # A complete HTTP/1.0 response and then close, too.
    stream = await connect(server)
    await stream.send_all(b"POST /echo HTTP/1.0\r\ncontent-length: 2\r\n\r\nhi")
    raw = await read_until_eof(stream)
    assert raw.endswith(b"\r\n\r\nhi")
    await assert_serves(server)


async def test_expect_100_continue_is_sent_when_the_body_is_read(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app)
    stream = await connect(server)
    await stream.send_all(
        b"POST /echo HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\ncontent-length: 5\r\n\r\n"
    )
    with trio.fail_after(BOUND):
        interim = await stream.receive_some(65536)
    assert interim.startswith(b"HTTP/1.1 100 ")
    await stream.send_all(b"hello")
    reader = PipelineReader(stream)
    response, body = await reader.read_response("POST")
    assert (response.status_code, body) == (200, b"hello")
    await stream.aclose()


async def test_expect_100_continue_left_unread_closes(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app)
    stream = await connect(server)
    await stream.send_all(
        b"POST /ok HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\ncontent-length: 5\r\n\r\n"
    )
    raw = await read_until_eof(stream)  # /ok never reads the body: no 100, and close
    assert raw.startswith(b"HTTP/1.1 200 ")
    assert b"100 Continue" not in raw
    assert b"connection: close" in raw.lower()
    await assert_serves(server)


async def test_a_body_arriving_after_an_answer_that_did_not_read_it_keeps_the_connection(
    nursery: trio.Nursery,
) -> None:
    """A handler answers before reading the body (an edge's 401, say) and the body is still
    on its way: the answer promised keep-alive (no ``Connection: close``), so the server reads
    the rest and drops it, and the client's next request on the connection is served. (The
    server used to close unless the body had already arrived: a client reusing the
    connection then saw it drop -- 'Server disconnected' -- a few times in a hundred.)"""
    server = await start_server(nursery, app)
    stream = await connect(server)
    await stream.send_all(b"POST /ok HTTP/1.1\r\nhost: t\r\ncontent-length: 11\r\n\r\n")
    reader = PipelineReader(stream)
    response, _ = await reader.read_response("POST")  # answered before any byte of the body
    assert response.status_code == 200
    assert header(response, b"connection") is None
    await stream.send_all(b"hello")  # the body, in two pieces, after the answer
    await trio.sleep(0.05)
    await stream.send_all(b" world")
    await stream.send_all(b"GET /where?next HTTP/1.1\r\nhost: t\r\n\r\n")
    response, body = await reader.read_response()
    assert (response.status_code, body) == (200, b"/where|next")


async def test_an_unread_body_over_the_limit_still_closes(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app, limits=ServerLimits(max_body_size=1024))
    stream = await connect(server)
    await stream.send_all(b"POST /ok HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n")
    reader = PipelineReader(stream)
    response, _ = await reader.read_response("POST")
    assert response.status_code == 200
    await stream.send_all(b"800\r\n" + b"x" * 2048 + b"\r\n")  # 2 KiB: over the limit
    assert await read_until_eof(stream) == b""  # dropped, and the connection closed
    await assert_serves(server)


async def test_expect_100_continue_over_the_limit_is_413_at_once(nursery: trio.Nursery) -> None:
    called = False

    async def handler(request: Request, responder: Responder) -> None:
        nonlocal called
        called = True
        await responder.respond(200)

    server = await start_server(nursery, handler, limits=ServerLimits(max_body_size=1024 * 1024))
    stream = await connect(server)
    started = trio.current_time()
    await stream.send_all(
        b"POST /upload HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\n"
        b"content-length: 100000000\r\n\r\n"
    )
    raw = await read_until_eof(stream)  # the server closes without waiting for the body
    elapsed = trio.current_time() - started
    assert status_of(raw) == 413
    assert b"100 Continue" not in raw
    assert b"connection: close" in raw.lower()
    assert not called
    assert elapsed < 2.0
    await assert_serves(server)


async def test_content_length_over_the_limit_is_the_handlers_to_answer(
    nursery: trio.Nursery,
) -> None:
    seen: list[BodyTooLarge] = []

    async def handler(request: Request, responder: Responder) -> None:
        try:
            await request.body()
        except BodyTooLarge as exc:  # at once: nothing of the body was read
            seen.append(exc)
            await responder.respond(413, [(b"content-type", b"application/json")], b"{}")

    server = await start_server(nursery, handler, limits=ServerLimits(max_body_size=1000))
    stream = await connect(server)
    await stream.send_all(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 5000\r\n\r\n")
    raw = await read_until_eof(stream)  # answered and closed before the body was sent
    assert status_of(raw) == 413
    assert raw.endswith(b"\r\n\r\n{}")
    assert b"connection: close" in raw.lower()
    assert len(seen) == 1
    await assert_serves(server)


async def test_error_page_hook_formats_driver_errors(nursery: trio.Nursery) -> None:
    def error_page(status: int, reason: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
        body = f'{{"error": {{"code": {status}, "message": "{reason}"}}}}'.encode()
        return [(b"content-type", b"application/json")], body

    server = await start_server(nursery, app, error_page=error_page)
    stream = await connect(server)
    await stream.send_all(b"\x00garbage\r\n\r\n")
    raw = await read_until_eof(stream)
    assert status_of(raw) == 400
    assert b"content-type: application/json" in raw.lower()
    # The hook gets the reason phrase and what was wrong (h11's words, client bytes quoted).
    message = b"Bad Request: illegal request line: bytearray(b'\\x00garbage')"
    assert raw.endswith(b'\r\n\r\n{"error": {"code": 400, "message": "' + message + b'"}}')
    await assert_serves(server)


async def test_content_length_over_the_limit_is_413_without_reading(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, app, limits=ServerLimits(max_body_size=1000))
    stream = await connect(server)
    await stream.send_all(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 5000\r\n\r\n")
    await stream.send_all(b"x" * 5000)
    assert status_of(await read_until_eof(stream)) == 413
    await assert_serves(server)


async def test_garbage_request_line_is_400(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app)
    for garbage in (b"\x00\x01\x02 garbage\r\n\r\n", b"GET\r\n\r\n", b"GET / FOO/1.1\r\n\r\n"):
        stream = await connect(server)
        await stream.send_all(garbage)
        raw = await read_until_eof(stream)
        assert 400 <= status_of(raw) < 600, raw
        assert b"connection: close" in raw.lower()
    await assert_serves(server)


@pytest.mark.parametrize("size", [100 * 1024, 20 * 1024])
async def test_oversized_headers_are_431(nursery: trio.Nursery, size: int) -> None:
    server = await start_server(nursery, app, limits=ServerLimits(max_header_size=16 * 1024))
    stream = await connect(server)
    request = b"GET /ok HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * size + b"\r\n\r\n"
    async with trio.open_nursery() as inner:
        inner.start_soon(stream.send_all, request)
        raw = await read_until_eof(stream)
    assert status_of(raw) == 431
    await assert_serves(server)


async def test_headers_just_under_the_limit_pass(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app, limits=ServerLimits(max_header_size=16 * 1024))
    client = await HTTPClient.open(server)
    response, _ = await client.request("GET", "/ok", [("x-big", "a" * 15_000)])
    assert response.status_code == 200
    await client.aclose()


async def test_slowloris_headers_get_408(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app, limits=ServerLimits(header_timeout=0.5))
    stream = await connect(server)
    await stream.send_all(b"GET /ok HTTP/1.1\r\nhost: t\r\n")
    started = trio.current_time()

    async def drip() -> None:
        # A header line every 0.1 s, never the end of the headers: the clock is the point.
        for i in range(50):
            await trio.sleep(0.1)
            try:
                await stream.send_all(b"x-drip-%d: y\r\n" % i)
            except trio.BrokenResourceError:
                return

    async with trio.open_nursery() as inner:
        inner.start_soon(drip)
        raw = await read_until_eof(stream)
        inner.cancel_scope.cancel()
    assert status_of(raw) == 408
    assert 0.4 < trio.current_time() - started < 3.0
    await assert_serves(server)


async def test_idle_keep_alive_connection_is_closed(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app, limits=ServerLimits(keepalive_timeout=0.3))
    client = await HTTPClient.open(server)
    await client.request("GET", "/ok")
    started = trio.current_time()
    assert await read_until_eof(client.stream) == b""  # closed without a response
    assert 0.2 < trio.current_time() - started < 3.0


async def test_stalled_body_is_408(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app, limits=ServerLimits(body_timeout=0.3))
    stream = await connect(server)
    await stream.send_all(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 10\r\n\r\n12345")
    assert status_of(await read_until_eof(stream)) == 408
    await assert_serves(server)


async def test_max_connections_holds_back_the_next_one(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, app, limits=ServerLimits(max_connections=2))
    first = await HTTPClient.open(server)
    second = await HTTPClient.open(server)
    for client in (first, second):
        response, _ = await client.request("GET", "/ok")
        assert response.status_code == 200
    third = await HTTPClient.open(server)  # the kernel accepts it; the server does not yet
    await third.send_request("GET", "/ok")
    with trio.move_on_after(0.3) as waited:
        await third.read_response()
    assert waited.cancelled_caught
    await first.aclose()
    response, _ = await third.read_response()
    assert response.status_code == 200
    await second.aclose()
    await third.aclose()


async def test_handler_failures_are_contained(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    async def handler(request: Request, responder: Responder) -> None:
        if request.path == "/raise":
            raise RuntimeError("boom")
        if request.path == "/raise-late":
            stream = await responder.start_stream(200)
            await stream.send(b"partial")
            raise RuntimeError("late boom")
        if request.path == "/silent":
            return
        if request.path == "/too-large":
            raise BodyTooLarge("nope")
        if request.path == "/gone":
            raise PeerGone("pretend")

    server = await start_server(nursery, handler)
    with caplog.at_level(logging.ERROR, logger="dispatcher.http"):
        client = await HTTPClient.open(server)
        response, _ = await client.request("GET", "/raise")
        assert response.status_code == 500
        await client.aclose()

        client = await HTTPClient.open(server)
        response, _ = await client.request("GET", "/silent")
        assert response.status_code == 500
        await client.aclose()

        client = await HTTPClient.open(server)
        response, _ = await client.request("GET", "/too-large")
        assert response.status_code == 413
        await client.aclose()

        stream = await connect(server)
        await stream.send_all(b"GET /raise-late HTTP/1.1\r\nhost: t\r\n\r\n")
        raw = await read_until_eof(stream)  # aborted: the chunked body never ends
        assert raw.startswith(b"HTTP/1.1 200 ")
        assert b"partial" in raw
        assert not raw.endswith(b"0\r\n\r\n")

        stream = await connect(server)
        await stream.send_all(b"GET /gone HTTP/1.1\r\nhost: t\r\n\r\n")
        assert await read_until_eof(stream) == b""
    messages = [record.getMessage() for record in caplog.records]
    assert any("handler failed on GET /raise" in m for m in messages)
    assert any("without answering" in m for m in messages)
    assert not any("crashed" in m for m in messages)
    await assert_serves(server)


@pytest.mark.parametrize("part", ["_serve", "_read_loop"])
async def test_a_crash_inside_the_driver_stays_with_its_connection(
    nursery: trio.Nursery,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    part: str,
) -> None:
    original = getattr(HTTPConnection, part)
    crashes: list[HTTPConnection] = []

    async def crash_once(self: HTTPConnection) -> None:
        if not crashes:
            crashes.append(self)
            raise RuntimeError("a bug in the driver")
        await original(self)

    monkeypatch.setattr(HTTPConnection, part, crash_once)
    server = await start_server(nursery, app)
    with caplog.at_level(logging.ERROR, logger="dispatcher.http"):
        stream = await connect(server)
        await stream.send_all(b"GET /ok HTTP/1.1\r\nhost: t\r\n\r\n")
        assert await read_until_eof(stream) == b""
        await assert_serves(server)  # (the crash is logged right after the close)
        await assert_serves(server)
    assert len(crashes) == 1
    assert any("crashed" in record.getMessage() for record in caplog.records)
