"""The ceiling: a bare h11 + Trio loop serving the benchmark's routes.

No limits, timeouts, error pages or websockets: only what the benchmark needs, as fast as h11
on a Trio stream goes. Not a server to use; a yardstick for ``bench.http_bench``.
Routes: ``POST /echo`` (JSON in, small JSON out), ``GET /sse?n=N`` (N events, chunked),
``GET /idle`` (one event, then the response stays open forever).
"""

from __future__ import annotations

import json

import h11
import trio

JSON_REPLY = b'{"id":"bench","object":"chat.completion","choices":[{"text":"ok"}]}'
SSE_EVENT = b'data: {"choices":[{"delta":"token"}]}\n\n'
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def sse_count(query: str) -> int:
    """``n=200`` -> 200 (the only parameter the benchmark sends)."""
    for part in query.split("&"):
        if part.startswith("n="):
            return int(part[2:])
    return 1


async def _next(conn: h11.Connection, stream: trio.SocketStream) -> h11.Event | type:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await stream.receive_some(65536))


async def _send(conn: h11.Connection, stream: trio.SocketStream, event: h11.Event) -> None:
    data = conn.send(event)
    if data:
        await stream.send_all(data)


async def handle_connection(stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            request = await _next(conn, stream)
            if not isinstance(request, h11.Request):
                return  # ConnectionClosed (or PAUSED after a close)
            body = b""
            while not isinstance(event := await _next(conn, stream), h11.EndOfMessage):
                if isinstance(event, h11.Data):
                    body += event.data
            path, _, query = request.target.decode().partition("?")
            if path == "/echo":
                json.loads(body)
                headers = [(b"content-type", b"application/json")]
                headers.append((b"content-length", str(len(JSON_REPLY)).encode()))
                await _send(conn, stream, h11.Response(status_code=200, headers=headers))
                await _send(conn, stream, h11.Data(data=JSON_REPLY))
            elif path in ("/sse", "/idle"):
                await _send(conn, stream, h11.Response(status_code=200, headers=SSE_HEADERS))
                for _ in range(sse_count(query) if path == "/sse" else 1):
                    await _send(conn, stream, h11.Data(data=SSE_EVENT))
                if path == "/idle":
                    await trio.sleep_forever()
            else:
                await _send(conn, stream, h11.Response(status_code=404, headers=[]))
            await _send(conn, stream, h11.EndOfMessage())
            if conn.our_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()
    except (trio.BrokenResourceError, h11.ProtocolError):
        return
    finally:
        await stream.aclose()
