"""The node's HTTP/1.1 client (nodes.upstream.client) against scripted raw TCP servers, and
the byte-level line and SSE splitters (nodes.upstream.lines) fed at every split point."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from nodes.upstream import client as _client
from nodes.upstream.client import Response, Target, UpstreamPool
from nodes.upstream.lines import LineSplitter, SSEDecoder
from nodes.upstream.tls import tls_context

Script = Callable[[trio.SocketStream, "Server"], Awaitable[None]]


class Server:
    """A TCP server on 127.0.0.1 port 0 running ``script`` per connection; what it read."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.accepted = 0
        self.heads: list[bytes] = []
        self.port = 0

    async def read_head(self, stream: trio.SocketStream, buffer: bytearray) -> bytes | None:
        """One request's head and its Content-Length body; None at EOF."""
        while b"\r\n\r\n" not in buffer:
            data = await stream.receive_some(65536)
            if not data:
                return None
            buffer += data
        end = buffer.index(b"\r\n\r\n") + 4
        head = bytes(buffer[:end])
        del buffer[:end]
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        while len(buffer) < length:
            buffer += await stream.receive_some(65536)
        del buffer[:length]
        self.heads.append(head)
        return head


@asynccontextmanager
async def serve(script: Script) -> AsyncIterator[Server]:
    server = Server(script)

    async def handler(stream: trio.SocketStream) -> None:
        server.accepted += 1
        try:
            await script(stream, server)
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        server.port = listeners[0].socket.getsockname()[1]
        yield server
        nursery.cancel_scope.cancel()


def answering(*answers: bytes, close: bool = False) -> Script:
    """Answer each request the server reads with the next of ``answers`` (cycling), in
    pieces of one byte."""

    async def script(stream: trio.SocketStream, server: Server) -> None:
        buffer = bytearray()
        while await server.read_head(stream, buffer) is not None:
            answer = answers[(len(server.heads) - 1) % len(answers)]
            for position in range(len(answer)):
                await stream.send_all(answer[position : position + 1])
            if close:
                return

    return script


def pool(**kwargs: object) -> UpstreamPool:
    options: dict[str, object] = {
        "connect": 5.0,
        "read": 5.0,
        "write": 5.0,
        "max_connections": 2,
        "tls_context": tls_context(),
        "proxies": {},
    }
    options.update(kwargs)
    return UpstreamPool(**options)  # type: ignore[arg-type]


def target(server: Server, path: str = "/v1/x") -> Target:
    return Target.from_url(httpx.URL(f"http://127.0.0.1:{server.port}{path}"))


async def body(response: Response, *, raw: bool = False) -> bytes:
    pieces = [piece async for piece in (response.aiter_raw() if raw else response.aiter_bytes())]
    return b"".join(pieces)


CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"7\r\ndata: a\r\n5;ext=1\r\n\n\ndat\r\n0A\r\na: bcdefgh\r\n0\r\nx-trailer: 1\r\n\r\n"
)


async def test_a_chunked_body_byte_by_byte_and_the_connection_reused() -> None:
    async with serve(answering(CHUNKED)) as server, pool() as client:
        for _ in range(3):
            async with client.stream("POST", target(server), [("a", "b")], b"{}") as response:
                assert response.status_code == 200
                assert response.headers.get("Content-Type") == "text/event-stream"
                assert await body(response) == b"data: a\n\ndata: bcdefgh"
        assert server.accepted == 1
        assert client.connections == 1
    head = server.heads[0]
    assert head.startswith(b"POST /v1/x HTTP/1.1\r\nhost: 127.0.0.1:")
    assert b"\r\na: b\r\n" in head
    assert b"\r\ncontent-length: 2\r\n" in head


async def test_content_length_bodies_close_and_bodies_to_the_end_of_the_connection() -> None:
    sized = b"HTTP/1.1 201 Created\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello"
    unsized = b"HTTP/1.0 200 OK\r\n\r\nto the end"
    async with serve(answering(sized, unsized, close=True)) as server, pool() as client:
        async with client.stream("GET", target(server), []) as response:
            assert (response.status_code, response.reason_phrase) == (201, "Created")
            assert await body(response) == b"hello"
        async with client.stream("GET", target(server), []) as response:
            assert await body(response) == b"to the end"
        assert server.accepted == 2  # neither connection could be kept
        assert client.connections == 0
    assert b"content-length" not in server.heads[0]  # a GET without a body says none


async def test_interim_answers_are_skipped_and_gzip_is_decoded() -> None:
    packed = gzip.compress(b'{"ok": true}')
    answer = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(packed)
    ) + packed
    async with serve(answering(answer)) as server, pool() as client:
        async with client.stream("POST", target(server), [], b"x") as response:
            assert response.status_code == 200
            assert await body(response) == b'{"ok": true}'
        async with client.stream("POST", target(server), [], b"x") as response:
            assert await body(response, raw=True) == packed


@pytest.mark.parametrize(
    "answer",
    [b"", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab"],
    ids=["no answer", "cut mid-body"],
)
async def test_a_connection_that_ends_early_is_a_remote_protocol_error(answer: bytes) -> None:
    async with serve(answering(answer, close=True)) as server, pool() as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", target(server), [], b"x") as response:
                await body(response)
        assert client.connections == 0


async def test_an_idle_connection_the_server_closed_is_not_reused() -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

    async def once_then_close(stream: trio.SocketStream, server: Server) -> None:
        buffer = bytearray()
        await server.read_head(stream, buffer)
        await stream.send_all(answer)  # keep-alive said, then the server closes it idle

    async with serve(once_then_close) as server, pool() as client:
        for _ in range(2):
            async with client.stream("POST", target(server), [], b"x") as response:
                assert await body(response) == b"ok"
            with trio.fail_after(5):
                while not client._idle[target(server).origin][0].is_readable():
                    await trio.sleep(0.01)
        assert server.accepted == 2


async def test_an_idle_connection_past_its_keepalive_expiry_is_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_client, "KEEPALIVE_EXPIRY", 0.0)
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    async with serve(answering(answer)) as server, pool() as client:
        for _ in range(2):
            async with client.stream("POST", target(server), [], b"x") as response:
                assert await body(response) == b"ok"
            await trio.sleep(0.01)
        assert server.accepted == 2
        assert client.connections == 1


async def test_leaving_before_the_end_closes_the_connection_at_once() -> None:
    async def endless(stream: trio.SocketStream, server: Server) -> None:
        buffer = bytearray()
        await server.read_head(stream, buffer)
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while True:
            await stream.send_all(b"1\r\nx\r\n")
            await trio.sleep(0.01)

    async with serve(endless) as server, pool() as client:
        with trio.move_on_after(0.1):
            async with client.stream("POST", target(server), [], b"x") as response:
                async for _ in response.aiter_bytes():
                    pass
        assert client.connections == 0
        assert client._idle.get(target(server).origin, []) == []


async def test_a_read_timeout_is_httpx_read_timeout() -> None:
    async def silent(stream: trio.SocketStream, server: Server) -> None:
        await server.read_head(stream, bytearray())
        await trio.sleep_forever()

    async with serve(silent) as server, pool(read=0.05) as client:
        with pytest.raises(httpx.ReadTimeout):
            async with client.stream("POST", target(server), [], b"x"):
                pass


async def test_every_connection_busy_waits_then_pool_timeout() -> None:
    async def slow(stream: trio.SocketStream, server: Server) -> None:
        await server.read_head(stream, bytearray())
        await trio.sleep_forever()

    async with serve(slow) as server, pool(max_connections=1, connect=0.05) as client:
        async with trio.open_nursery() as nursery:

            async def hold() -> None:
                async with client.stream("POST", target(server), [], b"x"):
                    pass

            nursery.start_soon(hold)
            await trio.sleep(0.01)
            with pytest.raises(httpx.PoolTimeout):
                async with client.stream("POST", target(server), [], b"x"):
                    pass
            nursery.cancel_scope.cancel()
        assert server.accepted == 1


async def test_an_http_proxy_from_the_environment_gets_the_absolute_form() -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    async with serve(answering(answer)) as proxy:
        proxies = {"http": f"http://user:p%40ss@127.0.0.1:{proxy.port}", "no": "example.org"}
        async with pool(proxies=proxies) as client:
            url = Target.from_url(httpx.URL("http://provider.invalid:8000/v1/x?q=1"))
            async with client.stream("POST", url, [], b"x") as response:
                assert await body(response) == b"ok"
    head = proxy.heads[0]
    assert head.startswith(b"POST http://provider.invalid:8000/v1/x?q=1 HTTP/1.1\r\n")
    assert b"\r\nhost: provider.invalid:8000\r\n" in head
    assert b"\r\nproxy-authorization: Basic dXNlcjpwQHNz\r\n" in head  # user:p@ss


async def test_a_proxy_refusing_connect_is_a_proxy_error() -> None:
    refusal = b"HTTP/1.1 407 Proxy Authentication Required\r\ncontent-length: 0\r\n\r\n"
    url = Target.from_url(httpx.URL("https://provider.invalid/v1/x"))
    async with serve(answering(refusal)) as proxy:
        client = pool(proxies={"https": f"http://127.0.0.1:{proxy.port}"})
        async with client:
            with pytest.raises(httpx.ProxyError):
                async with client.stream("POST", url, [], b"x"):
                    pass
    assert proxy.heads[0].startswith(b"CONNECT provider.invalid:443 HTTP/1.1\r\n")


def test_no_proxy_bypasses_the_proxy() -> None:
    from nodes.upstream.client import _proxy_for

    proxies = {"http": "http://proxy:3128", "no": "127.0.0.1,.internal"}
    assert _proxy_for(Target.from_url(httpx.URL("http://127.0.0.1:1/")), proxies) is None
    assert _proxy_for(Target.from_url(httpx.URL("http://a.internal/")), proxies) is None
    assert _proxy_for(Target.from_url(httpx.URL("http://a.example/")), proxies) is not None
    with pytest.raises(httpx.UnsupportedProtocol):
        _proxy_for(Target.from_url(httpx.URL("http://a/")), {"all": "socks5://proxy:1080"})


# --------------------------------------------------------------------------- what h11 refuses


def sending(answer: bytes) -> Script:
    """Answer one request with ``answer`` in one write, then wait for the client to close."""

    async def script(stream: trio.SocketStream, server: Server) -> None:
        buffer = bytearray()
        if await server.read_head(stream, buffer) is not None:
            await stream.send_all(answer)
            await stream.receive_some(1)

    return script


OK_HEAD = b"HTTP/1.1 200 OK\r\n"

REFUSED = {
    "content-length and chunked": (
        OK_HEAD + b"content-length: 6\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n"
    ),
    "bad chunk size": OK_HEAD + b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\nz1\r\nx\r\n",
    "chunk without its CRLF": OK_HEAD + b"transfer-encoding: chunked\r\n\r\n1\r\nxy\r\n0\r\n\r\n",
    "conflicting content-lengths": OK_HEAD + b"content-length: 2\r\ncontent-length: 3\r\n\r\nok",
    "two transfer-encodings": (
        OK_HEAD + b"transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "a coding other than chunked": OK_HEAD + b"transfer-encoding: gzip\r\n\r\nxx",
    "head over MAX_HEAD": OK_HEAD + b"x-big: " + b"a" * 2 * _client.MAX_HEAD + b"\r\n\r\n",
    "header line without a colon": OK_HEAD + b"content-length 2\r\n\r\nok",
    "space before the colon": OK_HEAD + b"content-length : 2\r\n\r\nok",
    "not a status line": b"HTTP/1.1 OK 200\r\ncontent-length: 2\r\n\r\nok",
    "not HTTP": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
}


@pytest.mark.parametrize("answer", REFUSED.values(), ids=REFUSED.keys())
async def test_what_h11_refuses_is_a_decoding_error_and_the_connection_is_closed(
    answer: bytes,
) -> None:
    async with serve(sending(answer)) as server, pool() as client:
        with pytest.raises(httpx.DecodingError, match=r"HTTP/1\.1|Content-Length and chunked"):
            async with client.stream("POST", target(server), [], b"x") as response:
                await body(response)
        assert client.connections == 0


async def test_a_refused_answer_is_upstream_bad_response_for_the_adapters() -> None:
    from nodes.adapters._post import post_chunks
    from nodes.adapters.base import AdapterError

    answer = REFUSED["bad chunk size"]
    async with serve(sending(answer)) as server, pool() as client:
        url = f"http://127.0.0.1:{server.port}/v1/chat/completions"

        async def post() -> None:
            async with post_chunks(client, url, {"model": "m"}, headers={}) as chunks:
                async for _ in chunks:
                    pass

        with pytest.raises(AdapterError) as caught:
            await post()
    assert caught.value.code == "upstream_bad_response"
    assert caught.value.retryable


async def test_bytes_after_the_answer_or_connection_close_mean_no_reuse() -> None:
    extra = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n"
    closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"
    for answer in (extra, closing):
        async with serve(sending(answer)) as server, pool() as client:
            async with client.stream("POST", target(server), [], b"x") as response:
                assert await body(response) == b"ok"
            assert client.connections == 0


async def test_an_answer_without_a_body_is_complete_at_once_and_the_connection_reused() -> None:
    answers = (
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",  # a HEAD's: no body follows
    )
    async with serve(answering(*answers)) as server, pool() as client:
        for method in ("POST", "GET", "HEAD"):
            async with client.stream(method, target(server), []) as response:
                assert response.complete  # nothing read
        assert server.accepted == 1


async def test_a_caller_saying_connection_close_gets_no_reuse() -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    async with serve(answering(answer)) as server, pool() as client:
        for _ in range(2):
            async with client.stream("GET", target(server), [("Connection", "close")]) as r:
                assert await body(r) == b"ok"
        assert server.accepted == 2
    assert b"\r\nConnection: close\r\n" in server.heads[0]
    assert b"keep-alive" not in server.heads[0]


@pytest.mark.parametrize(
    "header",
    [("x-a", "1\r\nx-b: 2"), ("x-a\r\nx-b", "2"), ("x a", "1"), ("", "1"), ("x-a", "1\x00")],
    ids=["CRLF in a value", "CRLF in a name", "space in a name", "empty name", "NUL"],
)
async def test_an_illegal_request_header_is_refused_before_connecting(
    header: tuple[str, str],
) -> None:
    async with serve(answering(b"HTTP/1.1 200 OK\r\n\r\n")) as server, pool() as client:
        with pytest.raises(httpx.LocalProtocolError):
            async with client.stream("POST", target(server), [header], b"x"):
                pass
        assert client.connections == 0
    assert server.accepted == 0


# --------------------------------------------------------------------------- splitters

BODY = b'data: {"a": "x\xe2\x80\xa8y\x0cz"}\r\n\r\n: comment\ndata: 1\ndata: 2\n\ndata: [DONE]\n\n'
"""SSE with a raw U+2028 and a form feed inside a JSON string: not line ends in SSE."""


@pytest.mark.parametrize("split", range(len(BODY) + 1))
def test_sse_events_whatever_the_pieces(split: int) -> None:
    decoder = SSEDecoder()
    events = decoder.feed(BODY[:split]) + decoder.feed(BODY[split:])
    assert events == [b'{"a": "x\xe2\x80\xa8y\x0cz"}', b"1\n2", b"[DONE]"]
    assert decoder.flush() is None


def test_sse_flush_gives_an_unterminated_last_event() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n\ndata: b") == [b"a"]
    assert decoder.flush() == b"b"


_SSE_TEXT = [b"data: ", b"data:", b"data", b"event: x", b": c", b"id: 1", b"{}", b"[DONE]", b"x"]
_SSE_ENDS = [b" ", b"\n", b"\n\n", b"\r", b"\r\n", b"\n\ndata: ", b"data: a\n\n"]
_SSE_PARTS = st.sampled_from([*_SSE_TEXT, *_SSE_ENDS])


@given(st.lists(st.lists(_SSE_PARTS, max_size=12).map(b"".join), max_size=4))
def test_sse_whole_reads_decode_as_byte_by_byte(pieces: list[bytes]) -> None:
    """Reads of whole ``data:`` events take a shortcut (a few scans of the read); whatever
    the reads, the events are those of the same bytes fed one at a time (the line-by-line
    path)."""
    whole, one_by_one = SSEDecoder(), SSEDecoder()
    body = b"".join(pieces)
    expected = [e for i in range(len(body)) for e in one_by_one.feed(body[i : i + 1])]
    assert [e for piece in pieces for e in whole.feed(piece)] == expected
    assert whole.flush() == one_by_one.flush()


def test_sse_whole_events_in_one_read() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: {}\n\ndata:  b\n\ndata: [DONE]\n\n") == [b"{}", b" b", b"[DONE]"]
    assert decoder.feed(b"data: a\n\n\ndata: b\n\n") == [b"a", b"b"]
    assert decoder.feed(b"data: a\ndata: b\n\n") == [b"a\nb"]
    assert decoder.flush() is None


@pytest.mark.parametrize("split", range(12))
def test_lines_end_with_lf_crlf_or_cr(split: int) -> None:
    data = b"a\r\nb\rc\nd\r\n\re"
    lines = LineSplitter()
    assert lines.feed(data[:split]) + lines.feed(data[split:]) == [b"a", b"b", b"c", b"d", b""]
    assert lines.flush() == b"e"


# --------------------------------------------------------------------------- TLS


async def test_https_with_the_context_given_and_an_untrusted_certificate_refused() -> None:
    import ssl

    import trustme

    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    served = Server(answering(answer))

    async def handler(stream: trio.SSLStream[trio.SocketStream]) -> None:
        served.accepted += 1
        try:
            await served.script(stream, served)  # type: ignore[arg-type]
        except trio.BrokenResourceError:
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_ssl_over_tcp, handler, 0, server_context, host="127.0.0.1")
        )
        port = listeners[0].transport_listener.socket.getsockname()[1]
        url = Target.from_url(httpx.URL(f"https://localhost:{port}/v1/x"))
        async with pool(tls_context=trusting) as client:
            for _ in range(2):
                async with client.stream("POST", url, [], b"x") as response:
                    assert await body(response) == b"ok"
            assert served.accepted == 1
        async with pool() as client:  # the default trust: not our test CA
            with pytest.raises(httpx.ConnectError):
                async with client.stream("POST", url, [], b"x"):
                    pass
        nursery.cancel_scope.cancel()
