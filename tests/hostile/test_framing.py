"""HTTP framing probes on raw sockets: malformed, ambiguous and oversized requests, slow
clients, pipelining and HTTP/1.0. A refused request gets its status with the OpenAI error body
(the HTTP layer's own answers included) and, when its framing is in doubt, a closed
connection -- never a request smuggled after it."""

from __future__ import annotations

from typing import Any

import attrs
import orjson
import pytest
import trio

from ._support import (
    BODY_TIMEOUT,
    HEADER_TIMEOUT,
    MAX_BODY,
    Edge,
    RawHTTP,
    assert_error,
    bearer,
    chat,
    json_request,
    params,
    request_bytes,
)

CHAT = "/v1/chat/completions"
AUTH = "authorization: Bearer sk-client-hostile\r\n"
BODY = orjson.dumps(chat())


def head(*lines: str, method: str = "POST", target: str = CHAT, version: str = "1.1") -> bytes:
    """A request head written line by line (CRLF ends), with the client key."""
    text = f"{method} {target} HTTP/{version}\r\nhost: edge\r\n{AUTH}" + "".join(
        f"{line}\r\n" for line in lines
    )
    return text.encode("latin-1") + b"\r\n"


SMUGGLED = b"GET /v1/models HTTP/1.1\r\nhost: edge\r\n" + AUTH.encode() + b"\r\n"
"""A request hidden in a body: if it is ever answered, it was smuggled."""


@attrs.frozen
class Refused:
    """``data`` is answered ``status`` (error ``code``), and the connection is closed."""

    data: bytes
    status: int
    code: str
    message: str | None = None


REFUSED: dict[str, Refused] = {
    "garbage-request-line": Refused(b"\x00\x01\x02 garbage\r\n\r\n", 400, "invalid_request"),
    "bad-method-token": Refused(
        b"G@T /healthz HTTP/1.1\r\nhost: edge\r\n\r\n", 400, "invalid_request"
    ),
    "request-line-without-version": Refused(b"GET /healthz\r\n\r\n", 400, "invalid_request"),
    "lowercase-protocol-name": Refused(
        b"GET /healthz http/1.1\r\nhost: edge\r\n\r\n", 400, "invalid_request"
    ),
    "missing-host": Refused(b"GET /healthz HTTP/1.1\r\n\r\n", 400, "invalid_request", "Host"),
    "two-hosts": Refused(
        b"GET /healthz HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n", 400, "invalid_request", "Host"
    ),
    "content-length-and-transfer-encoding": Refused(
        head("content-length: 4", "transfer-encoding: chunked") + b"0\r\n\r\n" + SMUGGLED,
        400,
        "invalid_request",
        "both Content-Length and Transfer-Encoding",
    ),
    "transfer-encoding-and-content-length": Refused(
        head("transfer-encoding: chunked", "content-length: 60") + b"0\r\n\r\n" + SMUGGLED,
        400,
        "invalid_request",
        "both Content-Length and Transfer-Encoding",
    ),
    "differing-content-lengths": Refused(
        head("content-length: 5", "content-length: 6") + b"hello!", 400, "invalid_request"
    ),
    "differing-content-length-list": Refused(
        head("content-length: 5, 6") + b"hello!", 400, "invalid_request"
    ),
    "non-numeric-content-length": Refused(
        head("content-length: abc") + b"abc", 400, "invalid_request", "Content-Length"
    ),
    "negative-content-length": Refused(head("content-length: -1"), 400, "invalid_request"),
    "content-length-with-plus": Refused(
        head("content-length: +5") + b"hello", 400, "invalid_request"
    ),
    "hex-content-length": Refused(head("content-length: 0x10"), 400, "invalid_request"),
    "content-length-overflow": Refused(
        head("content-length: 99999999999999999999999999"), 400, "invalid_request"
    ),
    "transfer-encoding-gzip": Refused(
        head("transfer-encoding: gzip") + b"\x1f\x8b" + SMUGGLED, 400, "invalid_request"
    ),
    "transfer-encoding-identity": Refused(
        head("transfer-encoding: identity") + BODY, 400, "invalid_request"
    ),
    "transfer-encoding-chunked-twice": Refused(
        head("transfer-encoding: chunked, chunked") + b"0\r\n\r\n", 400, "invalid_request"
    ),
    "two-transfer-encoding-headers": Refused(
        head("transfer-encoding: chunked", "transfer-encoding: chunked") + b"0\r\n\r\n",
        400,
        "invalid_request",
    ),
    "transfer-encoding-chunked-then-gzip": Refused(
        head("transfer-encoding: chunked, gzip") + b"0\r\n\r\n", 400, "invalid_request"
    ),
    "transfer-encoding-gzip-then-chunked": Refused(
        head("transfer-encoding: gzip, chunked") + b"0\r\n\r\n", 501, "not_implemented"
    ),
    "transfer-encoding-in-http-1.0": Refused(
        head("transfer-encoding: chunked", version="1.0") + b"0\r\n\r\n",
        400,
        "invalid_request",
        "HTTP/1.0",
    ),
    "obsolete-line-folding": Refused(
        head("x-note: first", " transfer-encoding: chunked", "content-length: 2") + b"{}",
        400,
        "invalid_request",
        "folding",
    ),
    "obsolete-line-folding-with-a-tab": Refused(
        head("x-note: first", "\tsecond", "content-length: 2") + b"{}",
        400,
        "invalid_request",
        "folding",
    ),
    "nul-in-a-header-value": Refused(head("x-note: a\x00b"), 400, "invalid_request"),
    "bare-cr-in-a-header-value": Refused(head("x-note: a\rb"), 400, "invalid_request"),
    "space-before-the-colon": Refused(head("content-length : 2") + b"{}", 400, "invalid_request"),
    "header-line-without-colon": Refused(head("this is no header"), 400, "invalid_request"),
    "header-name-with-a-slash": Refused(head("x/y: 1"), 400, "invalid_request"),
    "header-too-large": Refused(head("x-big: " + "a" * 20_000), 431, "headers_too_large"),
    "too-many-headers": Refused(
        head(*(f"x-h{i}: {'v' * 10}" for i in range(1500))), 431, "headers_too_large"
    ),
    "target-too-long": Refused(
        b"GET /healthz?" + b"q" * 10_000 + b" HTTP/1.1\r\nhost: edge\r\n\r\n",
        414,
        "uri_too_long",
    ),
    "http-2-request-line": Refused(
        b"GET /healthz HTTP/2.0\r\nhost: edge\r\n\r\n", 505, "http_version_not_supported"
    ),
    "http-2-connection-preface": Refused(
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, "http_version_not_supported"
    ),
    "bad-chunk-size": Refused(
        head("transfer-encoding: chunked") + b"zz\r\nhello\r\n0\r\n\r\n", 400, "invalid_request"
    ),
    "chunk-size-with-trailing-garbage": Refused(
        head("transfer-encoding: chunked") + b"5 x y\r\nhello\r\n0\r\n\r\n", 400, "invalid_request"
    ),
    "chunk-without-its-crlf": Refused(
        head("transfer-encoding: chunked") + b"2\r\n{}XX0\r\n\r\n", 400, "invalid_request"
    ),
    "expect-100-continue-over-the-limit": Refused(
        head("expect: 100-continue", f"content-length: {MAX_BODY + 1}"),
        413,
        "payload_too_large",
    ),
    "content-length-over-the-limit": Refused(
        head(f"content-length: {MAX_BODY + 1}") + b"x" * 1000, 413, "payload_too_large"
    ),
}


@params(REFUSED)
async def test_refused_and_closed(edge: Edge, case: Refused) -> None:
    async with edge.case():
        response = await edge.exchange(case.data)
        assert response.header("connection") == "close"
        assert_error(response, case.status, code=case.code, message=case.message)


async def test_chunked_body_over_the_limit_is_413(edge: Edge) -> None:
    async with edge.case():
        client = await edge.raw()
        async with client.stream:
            await client.send(head("transfer-encoding: chunked") + b"20000\r\n")
            with trio.move_on_after(5):
                try:
                    await client.send(b"x" * (MAX_BODY + 4096))
                except trio.BrokenResourceError:
                    pass  # the edge may stop reading once it has answered
            assert_error(await client.read_response(), 413, code="payload_too_large")
            await client.assert_closed()


async def test_huge_chunk_size_is_refused(edge: Edge) -> None:
    async with edge.case():
        response = await edge.exchange(
            head("transfer-encoding: chunked") + b"ffffffffffffffffffffffff\r\nhello"
        )
        assert response.status in (400, 413)
        assert_error(response, response.status)


# --------------------------------------------------------------------------- slow clients


@pytest.mark.short_timeouts
async def test_slowloris_headers_get_408(edge: Edge) -> None:
    async with edge.case(stream_seconds=HEADER_TIMEOUT + 0.5):
        client = await edge.raw()
        async with client.stream, trio.open_nursery() as nursery:

            async def trickle() -> None:
                # A byte every 50 ms, each one in time, the whole head never: until the
                # answer comes.
                for byte in b"GET /healthz HTTP/1.1\r\nhost: edge\r\nx-slow: " + b"a" * 100:
                    await client.send(bytes([byte]))
                    await trio.sleep(0.05)

            nursery.start_soon(trickle)
            with trio.fail_after(HEADER_TIMEOUT * 4):
                client.buffer = await client.stream.receive_some(65536)
            nursery.cancel_scope.cancel()
            response = await client.read_response()
            assert_error(response, 408, code="request_timeout")
            await client.assert_closed()


@pytest.mark.short_timeouts
async def test_partial_request_line_then_silence_gets_408(edge: Edge) -> None:
    async with edge.case(stream_seconds=HEADER_TIMEOUT + 0.3):
        response = await edge.exchange(b"GET /heal")
        assert_error(response, 408, code="request_timeout", message="request head")


@pytest.mark.short_timeouts
async def test_a_connection_that_sends_nothing_is_closed_without_an_answer(edge: Edge) -> None:
    async with edge.case(stream_seconds=HEADER_TIMEOUT + 0.3):
        client = await edge.raw()
        async with client.stream:
            assert await client.read_to_eof(bound=HEADER_TIMEOUT + 2) == b""


@pytest.mark.short_timeouts
async def test_a_body_that_stalls_gets_408(edge: Edge) -> None:
    async with edge.case(stream_seconds=BODY_TIMEOUT + 0.3):
        response = await edge.exchange(head("content-length: 100") + b'{"model": "ec')
        assert_error(response, 408, code="request_timeout", message="no request body data")


async def test_a_body_shorter_than_its_content_length_then_eof(edge: Edge) -> None:
    # The client left mid-body: nobody is there to read an answer, the edge just closes.
    async with edge.case():
        client = await edge.raw()
        async with client.stream:
            await client.send(head("content-length: 100") + b'{"model": "ec')
            await client.stream.send_eof()
            assert await client.read_to_eof() == b""


async def test_reset_mid_body(edge: Edge) -> None:
    async with edge.case():
        client = await edge.raw()
        await client.send(head("content-length: 100") + b'{"model": "ec')
        await trio.aclose_forcefully(client.stream)


# --------------------------------------------------------------------------- pipelining


async def test_pipelined_garbage_after_a_good_request(edge: Edge) -> None:
    async with edge.case():
        client = await edge.raw()
        async with client.stream:
            await client.send(b"GET /healthz HTTP/1.1\r\nhost: edge\r\n\r\nGARBAGE\r\n\r\n")
            first = await client.read_response()
            assert first.status == 200
            assert first.json()["status"] == "ok"
            assert_error(await client.read_response(), 400, code="invalid_request")
            await client.assert_closed()


async def test_a_body_longer_than_its_content_length(edge: Edge) -> None:
    # What follows the declared body is the next request: here, garbage.
    async with edge.case():
        client = await edge.raw()
        async with client.stream:
            await client.send(head("content-length: 2") + b"{}" + b"trailing garbage\r\n\r\n")
            assert_error(await client.read_response(), 400, param="model")
            assert_error(await client.read_response(), 400, code="invalid_request")
            await client.assert_closed()


async def test_pipelined_requests_are_answered_in_order(edge: Edge) -> None:
    async with edge.case():
        client = await edge.raw()
        async with client.stream:
            await client.send(
                json_request(CHAT, chat("first"))
                + request_bytes("GET", "/healthz")
                + json_request(CHAT, chat("third"))
            )
            first, second, third = [await client.read_response() for _ in range(3)]
            assert first.json()["choices"][0]["message"]["content"] == "first"
            assert second.json()["status"] == "ok"
            assert third.json()["choices"][0]["message"]["content"] == "third"
            assert first.header("connection") is None  # still open: keep-alive


async def test_keep_alive_survives_a_refused_method(edge: Edge) -> None:
    async with edge.case():
        client = await edge.raw()
        async with client.stream:
            await client.send(request_bytes("BREW", "/v1/models", [bearer()]))
            refused = await client.read_response()
            assert_error(refused, 405, code="method_not_allowed")
            assert refused.header("allow") == "GET, HEAD, OPTIONS"
            await client.send(request_bytes("GET", "/v1/models", [bearer()]))
            models = await client.read_response()
            assert [m["id"] for m in models.json()["data"]] == ["echo"]


# --------------------------------------------------------------------------- quirks


@attrs.frozen
class Quirk:
    data: bytes
    status: int
    closes: bool
    check: Any = None
    method: str = "GET"


QUIRKS: dict[str, Quirk] = {
    "http-1.0-without-host": Quirk(b"GET /healthz HTTP/1.0\r\n\r\n", 200, closes=True),
    "http-1.0-asking-for-keep-alive": Quirk(
        b"GET /healthz HTTP/1.0\r\nconnection: keep-alive\r\n\r\n", 200, closes=True
    ),
    "http-1.1-connection-close": Quirk(
        b"GET /healthz HTTP/1.1\r\nhost: edge\r\nconnection: close\r\n\r\n", 200, closes=True
    ),
    "http-1.2-is-served-as-1.1": Quirk(
        b"GET /healthz HTTP/1.2\r\nhost: edge\r\n\r\n", 200, closes=False
    ),
    "bare-lf-line-ends": Quirk(b"GET /healthz HTTP/1.1\nhost: edge\n\n", 200, closes=False),
    "absolute-form-target": Quirk(
        b"GET http://edge/healthz HTTP/1.1\r\nhost: edge\r\n\r\n", 200, closes=False
    ),
    "asterisk-form-get": Quirk(b"GET * HTTP/1.1\r\nhost: edge\r\n\r\n", 404, closes=False),
    "lowercase-method": Quirk(b"get /healthz HTTP/1.1\r\nhost: edge\r\n\r\n", 405, closes=False),
    "head-has-no-body": Quirk(
        b"HEAD /healthz HTTP/1.1\r\nhost: edge\r\n\r\n", 200, closes=False, method="HEAD"
    ),
    "head-of-an-error-has-no-body": Quirk(
        b"HEAD /v1/chat/completions HTTP/1.1\r\nhost: edge\r\n\r\n",
        405,
        closes=False,
        method="HEAD",
    ),
    "chunked-request-body": Quirk(
        head("transfer-encoding: chunked") + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
        200,
        closes=False,
        method="POST",
    ),
    "chunk-extensions-are-ignored": Quirk(
        head("transfer-encoding: chunked")
        + b"%x;name=value\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
        200,
        closes=False,
        method="POST",
    ),
    "identical-duplicate-content-lengths": Quirk(
        head(f"content-length: {len(BODY)}", f"content-length: {len(BODY)}") + BODY,
        200,
        closes=False,
        method="POST",
    ),
}


@params(QUIRKS)
async def test_quirks(edge: Edge, case: Quirk) -> None:
    async with edge.case():
        response = await edge.exchange(case.data, method=case.method, closes=case.closes)
        assert response.status == case.status, response.body[:300]
        if case.method == "HEAD":
            assert response.body == b""
        elif response.status >= 400:
            assert_error(response, response.status)
        elif response.status == 200 and case.method == "GET":
            assert response.json()["status"] == "ok"
        elif response.status == 200:
            assert response.json()["choices"][0]["message"]["content"] == "still here"


async def test_expect_100_continue_is_answered_then_served(edge: Edge) -> None:
    async with edge.case():
        client = await edge.raw()
        async with client.stream:
            await client.send(head("expect: 100-continue", f"content-length: {len(BODY)}"))
            with trio.fail_after(5):
                while not client.buffer.startswith(b"HTTP/1.1 100 "):
                    client.buffer += await client.stream.receive_some(1024)
            await client.send(BODY)
            response = await client.read_response()
            assert client.informational == [100]
            assert response.json()["choices"][0]["message"]["content"] == "still here"


async def test_http_1_0_streams_are_close_delimited(edge: Edge) -> None:
    async with edge.case():
        client = await edge.raw()
        async with client.stream:
            await client.send(json_request(CHAT, chat("one two three", stream=True), version="1.0"))
            response = await client.read_response("POST")
            assert response.status == 200
            assert response.http_version == "1.1"
            assert response.header("transfer-encoding") is None
            assert response.body.endswith(b"data: [DONE]\n\n")
            assert client.eof


async def test_many_connections_opened_and_dropped(edge: Edge) -> None:
    async with edge.case(stream_seconds=0.3):
        for _ in range(50):
            client = await RawHTTP.open(edge.port)
            await trio.aclose_forcefully(client.stream)


@pytest.mark.parametrize("split_at", [1, 7, 30])
async def test_a_request_split_across_writes(edge: Edge, split_at: int) -> None:
    # a few hundred writes (one byte each at split_at 1) take longer than the default guard
    # stream on a loaded machine: a guard of a second outlasts them with room to spare
    async with edge.case(stream_seconds=1.0):
        data = json_request(CHAT, chat())
        client = await edge.raw()
        async with client.stream:
            for start in range(0, len(data), split_at):
                await client.send(data[start : start + split_at])
            response = await client.read_response()
            assert response.json()["choices"][0]["message"]["content"] == "still here"
