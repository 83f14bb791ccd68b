"""The node's HTTP/1.1 client for its providers: a small pool over Trio streams.

Why not httpx: the node's calls are the same few requests, over and over, on connections kept
alive. httpx (over httpcore and h11) handled each piece of a streamed answer as an h11 event
through httpcore's and httpx's iterators, and built each request through its URL, header and
auth models: ~1.5-1.8 ms of the client's CPU per 64-token SSE answer against ~1.2 ms here
(``python -m bench.profile_node --clients``). Reading answers -- the status line, headers,
``Content-Length`` / until-close framing, ``1xx`` answers, keep-alive -- is h11's: one
``h11.Connection`` per connection, ``start_next_cycle()`` between requests, each read fed
whole and its events drained at once into one piece of body. A chunked body is read here
(:class:`_ChunkedBody`, h11's rules, each read's chunks in one pass: h11's ~5 us per chunk
was most of what reading a streamed answer cost), and its connection gets a fresh
``h11.Connection`` for the next request. The request's head is written here
(:func:`_request`: one formatting pass, where h11's checks and writer cost ~60 us a request)
and h11 told of it. Errors are
httpx's exception classes, so the callers' mapping (``nodes.adapters._post``,
``nodes.tunnel``) is the same table whatever the client.

::

    async with UpstreamPool(
        connect=10.0, read=600.0, write=30.0, max_connections=slots, tls_context=tls_context()
    ) as pool:
        async with pool.stream("POST", request_target(url), headers, body) as response:
            response.status_code, response.headers.get("retry-after")
            async with finished(response, response.aiter_bytes()) as pieces:  # decoded
                async for piece in pieces:
                    ...

(``nodes.upstream.pools.open_client`` opens a provider's pool so, with its settings.)

What it does: ``http`` and ``https`` (the shared TLS context, SNI and certificate checks as
the context says), keep-alive with at most ``max_connections`` connections open (a request
that finds them all busy waits, up to the connect timeout: :class:`httpx.PoolTimeout`);
timeouts for connecting (TCP and TLS: :class:`httpx.ConnectTimeout`), each read of the
answer (:class:`httpx.ReadTimeout`; None: none) and writing the request
(:class:`httpx.WriteTimeout`); proxies from the environment as httpx took them
(``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``, ``NO_PROXY``; an ``http://`` or
``https://`` proxy: absolute-form requests for ``http`` targets, ``CONNECT`` for ``https``;
a ``socks`` proxy is :class:`httpx.UnsupportedProtocol`, as httpx without ``socksio``);
bodies framed by ``Content-Length``, chunked, or the connection's end; ``1xx`` answers
skipped. No redirects, no cookies, no HTTP/2 (httpx had neither enabled).

What h11 refuses -- a malformed status line or header, a bad chunk, a head over
:data:`MAX_HEAD` -- and an answer framed both by ``Content-Length`` and chunked (RFC 9112
6.3: "ought to be handled as an error"; h11 would let chunked win) is
:class:`httpx.DecodingError`: the provider's answer cannot be read (``upstream_bad_response``
for the adapters). The provider closing the connection before the answer's end is
:class:`httpx.RemoteProtocolError`, as httpx had it. A request header whose name is no token,
or whose value holds a CR, LF or NUL, is :class:`httpx.LocalProtocolError`, before a
connection is taken.

Ownership: a request's connection belongs to its :meth:`UpstreamPool.stream` block. Left
after the body was read to its end, on a connection both sides keep alive, the connection
goes back to the pool; left any other way -- cancelled, an error, the body not read to its
end -- it is closed at once, so no later request can read what was left of another's answer.
The pool's block closes every idle connection. An idle connection the provider closed
(readable while idle), or idle for more than :data:`KEEPALIVE_EXPIRY`, is dropped instead of
reused. A caller reads a body inside :func:`finished`'s block: left normally (an adapter
that saw its last event), it first reads the rest, briefly and bounded (:data:`REUSE_WAIT`,
:data:`REUSE_MAX_BYTES`: normally only the end of the chunked body, already on the way), so
that the connection goes back to the pool.
"""

from __future__ import annotations

import base64
import functools
import logging
import re
import ssl
import urllib.parse
import urllib.request
import zlib
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Final, TypeVar, cast

import attrs
import h11
import httpx  # noqa: ASYNC127  (its exception classes; see the module docstring)
import trio

MAX_HEAD: Final = 100 * 1024
"""Bytes an answer's status line and headers (or a chunk's size line) may take: h11's
``max_incomplete_event_size``, httpcore's bound."""
READ_SIZE: Final = 64 * 1024
KEEPALIVE_EXPIRY: Final = 5.0
"""Seconds an idle connection is reused within (httpcore's default): older, it is closed
rather than raced against a provider closing it (uvicorn's default keep-alive is 5 s)."""
USER_AGENT: Final = b"trio-dispatcher-node"
REUSE_WAIT: Final = 0.05
"""How long a response left normally (its last event seen) may take to end its body before
its connection is closed instead of reused (a provider lingering after its last event)."""
REUSE_MAX_BYTES: Final = 64 * 1024
"""How much of a body left normally is read, at most, to reach its end and reuse the
connection."""

log = logging.getLogger("nodes.upstream")

_T = TypeVar("_T")

_REQUEST_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})


@attrs.frozen
class Target:
    """Where a request goes, parsed once (a provider's URLs are the same on every request):
    from an ``httpx.URL``, so a URL is valid here exactly when httpx took it."""

    scheme: str
    host: str
    port: int
    path: bytes
    """The request target in origin form: the path and query."""
    host_header: bytes
    absolute: bytes
    """The request target in absolute form (through an ``http`` proxy)."""

    @classmethod
    def from_url(cls, url: httpx.URL) -> Target:
        if url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(
                f"Request URL has an unsupported protocol '{url.scheme}://'."
            )
        if not url.host:
            raise httpx.UnsupportedProtocol("Request URL is missing a host.")
        host = url.raw_host.decode("ascii")
        default = 443 if url.scheme == "https" else 80
        port = url.port or default
        bracketed = f"[{host}]" if ":" in host else host
        authority = bracketed if port == default else f"{bracketed}:{port}"
        path = url.raw_path or b"/"
        origin = f"{url.scheme}://{authority}".encode("ascii")
        return cls(url.scheme, host, port, path, authority.encode("ascii"), origin + path)

    @property
    def origin(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)


@functools.lru_cache(maxsize=256)
def request_target(url: str) -> Target:
    """``url`` parsed (by httpx's rules) for the client: the same for every request to a
    provider's path, so worked out once (httpx's URL parsing was a tenth of a pooled run's
    CPU)."""
    return Target.from_url(httpx.URL(url))


@attrs.frozen
class _Proxy:
    scheme: str
    host: str
    port: int
    authorization: bytes | None


def environment_proxies() -> dict[str, str]:
    """The proxies the environment names, as httpx read them (``trust_env``): scheme ->
    proxy URL, and ``no`` -> the ``NO_PROXY`` list."""
    return urllib.request.getproxies_environment()


def _proxy_for(target: Target, proxies: dict[str, str]) -> _Proxy | None:
    if not proxies:
        return None
    url = proxies.get(target.scheme) or proxies.get("all")
    if not url:
        return None
    # A public function of urllib.request that typeshed does not declare (the library's stubs
    # are at fault, not the call).
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    if "no" in proxies and bypass(target.host, proxies):
        return None
    if "://" not in url:
        url = "http://" + url
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise httpx.UnsupportedProtocol(f"unsupported proxy {parsed.scheme}://")
    authorization = None
    if parsed.username is not None:
        userinfo = (
            f"{urllib.parse.unquote(parsed.username)}:{urllib.parse.unquote(parsed.password or '')}"
        )
        authorization = b"Basic " + base64.b64encode(userinfo.encode("utf-8"))
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return _Proxy(parsed.scheme, parsed.hostname, port, authorization)


class ResponseHeaders:
    """An answer's headers: ``raw`` (lower-case names, in order), :meth:`get` by name."""

    __slots__ = ("_index", "raw")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        self._index: dict[str, str] | None = None

    def get(self, name: str, default: str | None = None) -> str | None:
        """The header's value (several joined by ``", "``), or ``default``."""
        if self._index is None:
            index: dict[str, str] = {}
            for key, value in self.raw:
                text_key, text = key.decode("latin-1"), value.decode("latin-1")
                index[text_key] = f"{index[text_key]}, {text}" if text_key in index else text
            self._index = index
        return self._index.get(name.lower(), default)

    def tokens(self, name: bytes) -> list[bytes]:
        """The comma-separated tokens of every ``name`` header, lower-case."""
        return [
            token.strip().lower()
            for key, value in self.raw
            if key == name
            for token in value.split(b",")
            if token.strip()
        ]


class _Connection:
    __slots__ = ("eof", "h11", "idle_since", "stream")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.h11 = _h11_client()
        self.eof = False
        """The provider closed its side (h11 was told)."""
        self.idle_since = 0.0

    def is_readable(self) -> bool:
        """Readable while idle: the provider closed it (or sent what it should not)."""
        stream = self.stream
        while isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        if isinstance(stream, trio.SocketStream):
            return stream.socket.is_readable()
        return False

    async def receive(self, timeouts: _Timeouts) -> None:
        """One read, fed to h11 whole (its end too)."""
        data = await _receive(self, timeouts)
        if not data:
            self.eof = True
        self.h11.receive_data(data)

    def refused(self, exc: h11.RemoteProtocolError) -> httpx.HTTPError:
        """What h11 raised as the httpx error the callers map."""
        if self.eof:  # the answer broke off: the provider closed the connection early
            return httpx.RemoteProtocolError(str(exc))
        return httpx.DecodingError(f"the provider's answer is not valid HTTP/1.1: {exc}")


_DATA: Final = h11.Data
_NEED_DATA: Final = h11.NEED_DATA


def _h11_client() -> h11.Connection:
    return h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)


class _Timeouts:
    __slots__ = ("connect", "read", "write")

    def __init__(self, connect: float, read: float | None, write: float) -> None:
        self.connect, self.read, self.write = connect, read, write


class Response:
    """One answer, its body read from the connection as the caller asks for it."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_failed",
        "_pieces",
        "_timeouts",
        "closed",
        "complete",
        "headers",
        "reason_phrase",
        "reusable",
        "status_code",
    )

    def __init__(
        self,
        conn: _Connection,
        timeouts: _Timeouts,
        event: h11.Response,
        request: h11.Request | None = None,
    ) -> None:
        self._conn = conn
        self._timeouts = timeouts
        self.status_code = event.status_code
        self.reason_phrase = event.reason.decode("latin-1")
        self.headers = ResponseHeaders(list(event.headers))
        self.closed = False
        self.complete = False
        """h11 gave the body's end."""
        self.reusable = False
        """Complete, both sides keep the connection alive and nothing followed the answer:
        h11 is ready for the next request."""
        self._pieces: list[bytes | bytearray] = []
        """The body h11 gave from what was received and the caller has not read."""
        self._failed: httpx.HTTPError | None = None
        """What h11 refused in :meth:`take_whole`: the next read raises it."""
        framing = 0
        for name, _ in self.headers.raw:
            if name == b"transfer-encoding":
                framing |= 1
            elif name == b"content-length":
                framing |= 2
        if framing == 3:
            raise httpx.DecodingError(
                "the provider's answer is framed by both Content-Length and chunked"
            )
        self._chunks: _ChunkedBody | None = None
        """A chunked body, read here rather than by h11 (see :class:`_ChunkedBody`)."""
        if (
            framing == 1  # h11 accepted the head: its Transfer-Encoding is exactly chunked
            and request is not None
            and request.method not in (b"HEAD", b"CONNECT")
            and event.status_code not in (204, 304)
        ):
            keep_alive = (
                event.http_version == b"1.1"
                and b"close" not in self.headers.tokens(b"connection")
                and not any(
                    name == b"connection" and b"close" in value.lower()
                    for name, value in request.headers
                )
            )
            self._chunks = _ChunkedBody(keep_alive)
            self._feed(conn.h11.trailing_data[0], eof=conn.eof)

    async def read(self) -> bytes:
        """The next piece of the body as it is on the wire (chunked framing removed): what
        one read of the connection brought; b"" at its end, or once the response is
        closed."""
        if self._failed is not None:
            raise self._failed
        pieces = self._pieces
        while not self.closed:
            if pieces:
                piece = bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)
                pieces.clear()
                return piece
            if self.complete:
                break
            if self._chunks is None:
                await self._conn.receive(self._timeouts)
                self._drain()
            else:
                data = await _receive(self._conn, self._timeouts)
                if not data:
                    self._conn.eof = True
                self._feed(data, eof=not data)
        return b""

    def _feed(self, data: bytes, *, eof: bool) -> None:
        """Bytes of a chunked body (``eof``: the provider closed the connection after them)."""
        chunks = self._chunks
        assert chunks is not None
        conn = self._conn
        try:
            done = chunks.feed(data, self._pieces) if data else False
            if not done and eof:
                raise h11.RemoteProtocolError(
                    "peer closed connection without sending complete message body: "
                    "incomplete chunked read"
                )
        except h11.RemoteProtocolError as exc:
            raise conn.refused(exc) from None
        if done:
            self.complete = True
            if chunks.keep_alive and not chunks.leftover and not conn.eof:
                conn.h11 = _h11_client()  # the next request's (h11 did not read this body)
                self.reusable = True

    def take_whole(self) -> bytes | None:
        """The whole body, if it already arrived (with the head: no read needed); else None,
        and nothing is taken (the reads give it all). A body h11 refuses is None too: the
        next read raises."""
        if self.closed or self._failed is not None:
            return None
        if not self.complete:
            try:
                self._drain()
            except httpx.HTTPError as exc:
                self._failed = exc
                return None
            if not self.complete:
                return None
        pieces = self._pieces
        body = bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        return body

    def _drain(self) -> None:
        """Every event h11 makes of what was received: body pieces kept, the end noted. (A
        chunked body was fed as it came.)"""
        if self._chunks is not None:
            return
        conn = self._conn
        connection = conn.h11
        next_event, append = connection.next_event, self._pieces.append
        while True:
            try:
                event = next_event()
            except h11.RemoteProtocolError as exc:
                raise conn.refused(exc) from None
            kind = type(event)
            if kind is _DATA:
                append(cast(h11.Data, event).data)  # `kind is` is the fast test; no narrowing
            elif event is _NEED_DATA:
                return
            elif kind is h11.EndOfMessage:
                self.complete = True
                if (
                    connection.our_state is h11.DONE
                    and connection.their_state is h11.DONE
                    and not conn.eof
                    and not connection.trailing_data[0]  # more than the answer: untrusted
                ):
                    connection.start_next_cycle()
                    self.reusable = True
                return
            else:  # PAUSED: a CONNECT's 2xx, the rest of the stream is no more HTTP
                self.complete = True
                return

    def aiter_raw(self) -> _Body:
        """The body's pieces as the provider encoded them."""
        return _Body(self, None)

    def aiter_bytes(self) -> _Body:
        """The body's pieces, decoded when the provider compressed them (``gzip``,
        ``deflate``; other codings pass as they are, as httpx did)."""
        decoder = None
        codings = self.headers.tokens(b"content-encoding")
        for coding in reversed(codings):  # one coding supported (no stacked ones)
            if coding in (b"gzip", b"x-gzip"):
                decoder = _Decoder(zlib.MAX_WBITS | 16)
            elif coding == b"deflate":
                decoder = _Decoder(zlib.MAX_WBITS)
            if decoder is not None:
                break
        return _Body(self, decoder)

    async def aclose(self) -> None:
        """No more of the body is read: the connection is closed when the request's block
        is left, unless the body was read to its end."""
        self.closed = True


_CHUNK_HEADER: Final = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;[^\r\n]*)?[ \t]*")
"""A chunk's size line without its CRLF (h11's rule: 1 to 20 hex digits, extensions)."""
_WHOLE_SIZE_LINE: Final = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;[^\r\n]*)?[ \t]*\r\n")
""":data:`_CHUNK_HEADER` with its CRLF."""
_TRAILER: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\r\n\0]*")

_IN_SIZE, _IN_DATA, _IN_DATA_END, _IN_TRAILERS, _IN_DONE = range(5)


class _ChunkedBody:
    """A chunked body's framing removed, sans-IO: what one read brings, in one pass.

    h11 makes an event of every chunk (an SSE stream is a chunk per token: ~5 us each, the
    most of what reading a streamed answer cost); this takes a read's chunks in one loop and
    gives their data as pieces. The rules are h11's: a size line of 1 to 20 hex digits (and
    extensions), each chunk's data followed by CRLF, trailers as header lines up to the
    empty line, at most :data:`MAX_HEAD` bytes of a size line or of the trailers. A broken
    framing is ``h11.RemoteProtocolError`` (the caller maps it as it maps h11's). Once done,
    ``leftover`` is what followed the body (the connection is then not reused)."""

    __slots__ = (
        "_bad_trailer",
        "_buffer",
        "_left",
        "_state",
        "_trailers",
        "keep_alive",
        "leftover",
    )

    def __init__(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive
        """Both sides keep the connection alive (HTTP/1.1, no ``Connection: close``)."""
        self.leftover = b""
        self._buffer = b""
        self._state = _IN_SIZE
        self._left = 0
        self._trailers = 0
        self._bad_trailer: bytes | None = None

    def feed(self, data: bytes, out: list[bytes | bytearray]) -> bool:
        """Take ``data``; append its body pieces to ``out``. True once the body ended."""
        buf = self._buffer + data if self._buffer else data
        pos, size = 0, len(buf)
        state, left = self._state, self._left
        if state == _IN_SIZE:
            # Whole chunks, one after the other (an SSE stream's events): each by one match
            # of its size line. What is not one -- the last chunk, a chunk cut by the read,
            # anything malformed -- is left to the loop below, from its start.
            match = _WHOLE_SIZE_LINE.match
            while (found := match(buf, pos)) is not None:
                start = found.end()
                end = start + int(found.group(1), 16)
                if end == start or end + 2 > size or buf[end : end + 2] != b"\r\n":
                    break
                out.append(buf[start:end])
                pos = end + 2
        while True:
            if state == _IN_DATA:
                if pos >= size:
                    break
                end = pos + left
                if end <= size:
                    out.append(buf[pos:end])
                    pos, left, state = end, 0, _IN_DATA_END
                else:
                    out.append(buf[pos:])
                    left -= size - pos
                    pos = size
                    break
            elif state == _IN_DATA_END:
                if size - pos < 2:
                    if pos < size and buf[pos] != 13:
                        raise h11.RemoteProtocolError("missing \\r\\n after chunk data")
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise h11.RemoteProtocolError("missing \\r\\n after chunk data")
                pos += 2
                state = _IN_SIZE
            elif state == _IN_SIZE:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > MAX_HEAD:
                        raise h11.RemoteProtocolError("chunk header too long")
                    break
                found = _CHUNK_HEADER.fullmatch(buf, pos, end)
                if found is None:
                    raise h11.RemoteProtocolError(f"illegal chunk header: {buf[pos:end]!r}")
                left = int(found.group(1), 16)
                pos = end + 2
                state = _IN_DATA if left else _IN_TRAILERS
            else:  # _IN_TRAILERS: header lines (CRLF or LF, as h11) up to an empty one
                end = buf.find(b"\n", pos)
                if end < 0:
                    if self._trailers + size - pos > MAX_HEAD:
                        raise h11.RemoteProtocolError("trailers too long")
                    break
                line_end = end - 1 if end > pos and buf[end - 1] == 13 else end
                if line_end == pos:
                    if self._bad_trailer is not None:  # judged, as h11 does, once whole
                        raise h11.RemoteProtocolError(f"illegal trailer: {self._bad_trailer!r}")
                    self.leftover = buf[end + 1 :]
                    self._buffer, self._state = b"", _IN_DONE
                    return True
                if self._bad_trailer is None:
                    first = buf[pos]
                    if first in (32, 9):  # an obsolete folded line: part of the one before
                        if not self._trailers:
                            self._bad_trailer = buf[pos:line_end]
                    elif _TRAILER.fullmatch(buf, pos, line_end) is None:
                        self._bad_trailer = buf[pos:line_end]
                self._trailers += end + 1 - pos
                if self._trailers > MAX_HEAD:
                    raise h11.RemoteProtocolError("trailers too long")
                pos = end + 1
        self._buffer = buf[pos:] if pos < size else b""
        self._state, self._left = state, left
        return False


class _Decoder:
    __slots__ = ("_first", "_wbits", "_zlib")

    def __init__(self, wbits: int) -> None:
        self._wbits = wbits
        self._zlib = zlib.decompressobj(wbits)
        self._first = True

    def decode(self, data: bytes) -> bytes:
        try:
            return self._zlib.decompress(data)
        except zlib.error as exc:
            if self._first and self._wbits == zlib.MAX_WBITS:  # raw deflate, as httpx
                self._wbits = -zlib.MAX_WBITS
                self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)
                return self.decode(data)
            raise httpx.DecodingError(str(exc)) from None
        finally:
            self._first = False

    def flush(self) -> bytes:
        try:
            return self._zlib.flush()
        except zlib.error as exc:
            raise httpx.DecodingError(str(exc)) from None


class _Body:
    """An async iterator over a body (a class, not an async generator: nothing to finalize
    when the caller leaves early)."""

    __slots__ = ("_decoder", "_response")

    def __init__(self, response: Response, decoder: _Decoder | None) -> None:
        self._response = response
        self._decoder = decoder

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        while True:
            piece = await self._response.read()
            decoder = self._decoder
            if not piece:
                if decoder is not None and self._response.complete:
                    self._decoder = None
                    rest = decoder.flush()
                    if rest:
                        return rest
                raise StopAsyncIteration
            if decoder is None:
                return piece
            piece = decoder.decode(piece)
            if piece:
                return piece


@asynccontextmanager
async def finished(
    response: Response, iterator: AsyncIterator[_T]
) -> AsyncIterator[AsyncIterator[_T]]:
    """``iterator`` (one of the response's body iterators), finished when the block is left.

    Left normally (the caller has what it wanted), the rest of the body is read first, for
    at most :data:`REUSE_WAIT` and :data:`REUSE_MAX_BYTES`: a response read to its end gives
    its connection back to the pool. Left by an error or cancelled, nothing more is read.
    Either way the response is closed: unless its body was read to the end, its connection
    is closed when the request's block is left (the iterators are plain objects, not async
    generators: nothing is left suspended to finalize).
    """
    try:
        yield iterator
        if not (response.complete and not response._pieces):  # else nothing is left to read
            with trio.move_on_after(REUSE_WAIT):
                await _read_to_end(iterator)
    finally:
        await response.aclose()  # no checkpoint: runs when cancelled too


async def _read_to_end(iterator: AsyncIterator[Any]) -> None:
    """Read what is left, up to :data:`REUSE_MAX_BYTES` (characters for text iterators). A
    failure is no failure of the request, whose answer is complete: the connection is just
    not reused."""
    size = 0
    try:
        async for piece in iterator:
            size += len(piece)
            if size > REUSE_MAX_BYTES:
                return
    except Exception as exc:  # the body's end broke: closing the response drops the connection
        log.debug(
            "reading the rest of a finished response failed: %s", str(exc) or type(exc).__name__
        )


class UpstreamPool:
    """Connections to a provider, kept alive: see the module docstring. Use as
    ``async with``; :meth:`stream` inside it."""

    def __init__(
        self,
        *,
        connect: float,
        read: float | None,
        write: float,
        max_connections: int,
        tls_context: ssl.SSLContext,
        proxies: dict[str, str] | None = None,
    ) -> None:
        self._tls = tls_context
        self._timeouts = _Timeouts(connect, read, write)
        self._slots = trio.Semaphore(max_connections)
        self._max = max_connections
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open = 0
        self._proxies = environment_proxies() if proxies is None else proxies
        self._closed = False

    async def __aenter__(self) -> UpstreamPool:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._closed = True
        idle = [conn for conns in self._idle.values() for conn in conns]
        self._idle.clear()
        for conn in idle:  # no await at all: a cancelled exit still closes every one
            self._discard(conn)

    @property
    def connections(self) -> int:
        """Connections open now (in use and idle)."""
        return self._open

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        target: Target,
        headers: Iterable[tuple[str, str]],
        content: bytes = b"",
    ) -> AsyncIterator[Response]:
        """Send one request and give its answer once its headers arrived; the body is read
        inside the block. Raises httpx's transport errors (see the module docstring)."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        proxy = _proxy_for(target, self._proxies)
        request, event = _request(method, target, headers, content, proxy)
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._slots.acquire_nowait()  # a free slot: no deadline to set up
        except trio.WouldBlock:
            try:
                with trio.fail_after(self._timeouts.connect):
                    await self._slots.acquire()
            except trio.TooSlowError:
                raise httpx.PoolTimeout("every connection to the provider stayed busy") from None
        try:
            conn = self._take_idle(target.origin)
            if conn is None:
                conn = await self._connect(target, proxy)
            response: Response | None = None
            try:
                _tell(conn.h11, event)
                await self._send(conn, request)
                response = await self._read_head(conn, event)
                yield response
            finally:
                if (
                    response is not None
                    and response.complete
                    and response.reusable
                    and not self._closed
                ):
                    conn.idle_since = trio.current_time()
                    self._idle.setdefault(target.origin, []).append(conn)
                else:
                    self._discard(conn)
        finally:
            self._slots.release()

    def _take_idle(self, origin: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(origin)
        if idle:
            now = trio.current_time()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since <= KEEPALIVE_EXPIRY and not conn.is_readable():
                return conn
            self._discard(conn)
        return None

    async def _connect(self, target: Target, proxy: _Proxy | None) -> _Connection:
        # Room for a new connection: drop an idle one to another origin if all are open.
        if self._open >= self._max:
            for conns in self._idle.values():
                if conns:
                    self._discard(conns.pop())
                    break
        self._open += 1
        try:
            with trio.fail_after(self._timeouts.connect):
                return await self._open_stream(target, proxy)
        except trio.TooSlowError:
            self._open -= 1
            raise httpx.ConnectTimeout("connecting to the provider timed out") from None
        except BaseException:
            self._open -= 1
            raise

    async def _open_stream(self, target: Target, proxy: _Proxy | None) -> _Connection:
        host, port = (target.host, target.port) if proxy is None else (proxy.host, proxy.port)
        try:
            stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from None
        try:
            if proxy is not None and proxy.scheme == "https":
                stream = await self._tls_handshake(stream, proxy.host)
            conn = _Connection(stream)
            if proxy is not None and target.scheme == "https":
                await self._tunnel_through(conn, target, proxy)
            if target.scheme == "https":
                conn.stream = await self._tls_handshake(conn.stream, target.host)
            return conn
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise

    async def _tls_handshake(
        self, stream: trio.abc.Stream, host: str
    ) -> trio.SSLStream[trio.abc.Stream]:
        wrapped = trio.SSLStream(stream, self._tls, server_hostname=host, https_compatible=True)
        try:
            await wrapped.do_handshake()
        except (trio.BrokenResourceError, ssl.SSLError, OSError) as exc:
            cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else exc
            raise httpx.ConnectError(str(cause or exc) or type(exc).__name__) from None
        return wrapped

    async def _tunnel_through(self, conn: _Connection, target: Target, proxy: _Proxy) -> None:
        """``CONNECT`` through an ``http`` proxy to an ``https`` target."""
        authority = f"{target.host}:{target.port}".encode("ascii")
        headers = [(b"host", authority)]
        if proxy.authorization is not None:
            headers.append((b"proxy-authorization", proxy.authorization))
        request = h11.Request(method=b"CONNECT", target=authority, headers=headers)
        await self._send(conn, conn.h11.send(request) + conn.h11.send(_END))
        response = await self._read_head(conn)
        if not 200 <= response.status_code < 300:
            raise httpx.ProxyError(f"the proxy answered CONNECT with {response.status_code}")
        conn.h11 = _h11_client()  # what follows is the target's TLS, then its HTTP

    async def _send(self, conn: _Connection, data: bytes) -> None:
        try:
            with trio.fail_after(self._timeouts.write):
                await conn.stream.send_all(data)
        except trio.TooSlowError:
            raise httpx.WriteTimeout("writing the request to the provider timed out") from None
        except (trio.BrokenResourceError, OSError) as exc:
            raise httpx.WriteError(str(exc) or type(exc).__name__) from None

    async def _read_head(self, conn: _Connection, request: h11.Request | None = None) -> Response:
        """The answer's status line and headers (``1xx`` answers skipped), and what h11
        made of the body's bytes that came with them."""
        next_event = conn.h11.next_event
        while True:
            try:
                event = next_event()
            except h11.RemoteProtocolError as exc:
                if conn.eof:
                    raise httpx.RemoteProtocolError(
                        "Server disconnected without sending a response."
                    ) from None
                raise conn.refused(exc) from None
            if event is h11.NEED_DATA:
                await conn.receive(self._timeouts)
            elif type(event) is h11.Response:
                response = Response(conn, self._timeouts, event, request)
                response._drain()
                return response
            # else an interim answer (100 Continue, 103 Early Hints): skipped

    def _discard(self, conn: _Connection) -> None:
        """Close ``conn`` at once (nothing more is sent on it: no TLS close_notify)."""
        self._open -= 1
        _close_now(conn)


async def _receive(conn: _Connection, timeouts: _Timeouts) -> bytes:
    try:
        if timeouts.read is None:
            return bytes(await conn.stream.receive_some(READ_SIZE))
        with trio.fail_after(timeouts.read):
            return bytes(await conn.stream.receive_some(READ_SIZE))
    except trio.TooSlowError:
        raise httpx.ReadTimeout("the provider sent nothing in time") from None
    except (trio.BrokenResourceError, OSError) as exc:
        raise httpx.ReadError(str(exc) or type(exc).__name__) from None


def _close_now(conn: _Connection) -> None:
    """Close a connection's socket without waiting."""
    stream = conn.stream
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    if isinstance(stream, trio.SocketStream):
        stream.socket.close()


def _request(
    method: str,
    target: Target,
    headers: Iterable[tuple[str, str]],
    content: bytes,
    proxy: _Proxy | None,
) -> tuple[bytes, h11.Request]:
    """The request's bytes, head and body, for one write; and the event h11 is told.

    The head is written here, not by h11: h11's ``Request`` checks each header with regular
    expressions and its ``send`` runs the state machine three times, ~60 us a request
    against ~5 us for one formatting pass (a name must be a token, a value has no CR, LF or
    NUL: nothing can be smuggled into the head). h11 is told of the request by a ``Request``
    holding what its state machine reads of one -- the method (a ``HEAD``'s answer has no
    body), the target, ``Host``, and the caller's ``Connection``, ``Upgrade`` and
    ``Expect`` -- without a body (it reads answers, it does not frame our body): the same
    few events over and over, built once (:func:`_h11_request`).
    """
    path = target.absolute if proxy is not None and target.scheme == "http" else target.path
    lines = [b"%s %s HTTP/1.1" % (method.encode("ascii"), path), b"host: " + target.host_header]
    seen: set[str] = set()
    told: list[tuple[bytes, bytes]] | None = None
    for name, value in headers:
        if not _TOKEN.fullmatch(name) or _NOT_IN_VALUE.search(value):
            raise httpx.LocalProtocolError(f"illegal header {name!r}")
        lowered = name.lower()
        if lowered in ("host", "content-length", "transfer-encoding"):
            continue  # the client frames the request itself
        seen.add(lowered)
        raw = _header_value(value)
        lines.append(b"%s: %s" % (name.encode("ascii"), raw))
        if lowered in _TOLD:
            told = [] if told is None else told
            told.append((lowered.encode("ascii"), raw))
    if "accept" not in seen:
        lines.append(b"accept: */*")
    if "accept-encoding" not in seen:
        lines.append(b"accept-encoding: gzip, deflate")
    if "connection" not in seen:
        lines.append(b"connection: keep-alive")
    if "user-agent" not in seen:
        lines.append(b"user-agent: " + USER_AGENT)
    if proxy is not None and target.scheme == "http" and proxy.authorization is not None:
        lines.append(b"proxy-authorization: " + proxy.authorization)
    if content or method in _REQUEST_BODY_METHODS:
        lines.append(b"content-length: %d" % len(content))
    lines.append(b"")
    lines.append(content)
    event = _h11_request(method, path, target.host_header, None if told is None else tuple(told))
    return b"\r\n".join(lines), event


_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NOT_IN_VALUE: Final = re.compile(r"[\r\n\0]")
_TOLD: Final = frozenset({"connection", "upgrade", "expect"})
_END: Final = h11.EndOfMessage()


@functools.lru_cache(maxsize=256)
def _h11_request(
    method: str, path: bytes, host: bytes, told: tuple[tuple[bytes, bytes], ...] | None
) -> h11.Request:
    try:
        return h11.Request(
            method=method.encode("ascii"), target=path, headers=[(b"host", host), *(told or ())]
        )
    except (h11.LocalProtocolError, UnicodeEncodeError) as exc:
        raise httpx.LocalProtocolError(f"illegal request: {exc}") from None


def _tell(connection: h11.Connection, request: h11.Request) -> None:
    """Put h11 where it is once ``request`` was sent: waiting for the answer."""
    connection.send(request)
    connection.send(_END)


def _header_value(value: str) -> bytes:
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")
