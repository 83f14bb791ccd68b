"""The node's HTTP/1.1 client for its providers: a small pool over Trio streams.

Why not httpx: the node's calls are the same few requests, over and over, on connections kept
alive. httpx (over httpcore and h11) handled each piece of a streamed answer as an h11 event
through httpcore's and httpx's iterators, and built each request through its URL, header and
auth models: measured against the same fake provider, a 64-token SSE answer cost ~1.7-2.2 ms
of the client's CPU through httpx, ~1.1-1.2 ms through h11 over a Trio stream, and ~0.9 ms
with the body's chunks decoded a whole read at a time (this module's way). Errors are httpx's
exception classes, so the callers' mapping (``nodes.adapters._http``, ``nodes.tunnel``) is
the same table whatever the client.

::

    async with Pool(timeouts, max_connections=slots, tls=tls_context()) as pool:
        async with pool.stream("POST", target, headers, body) as response:
            response.status_code, response.headers.get("retry-after")
            async for piece in response.aiter_bytes():   # decoded (gzip, deflate)
                ...

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

Ownership: a request's connection belongs to its :meth:`Pool.stream` block. Left after the
body was read to its end, on a connection both sides keep alive, the connection goes back
to the pool; left any other way -- cancelled, an error, the body not read to its end -- it is
closed at once, so no later request can read what was left of another's answer. The pool's
block closes every idle connection. An idle connection the provider closed (readable while
idle), or idle for more than :data:`KEEPALIVE_EXPIRY`, is dropped instead of reused.
"""

from __future__ import annotations

import base64
import ssl
import urllib.parse
import urllib.request
import zlib
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Final

import attrs
import httpx  # noqa: ASYNC127  (its exception classes; see the module docstring)
import trio

MAX_HEAD: Final = 100 * 1024
"""Bytes an answer's status line and headers may take (httpcore's bound)."""
READ_SIZE: Final = 64 * 1024
KEEPALIVE_EXPIRY: Final = 5.0
"""Seconds an idle connection is reused within (httpcore's default): older, it is closed
rather than raced against a provider closing it (uvicorn's default keep-alive is 5 s)."""
USER_AGENT: Final = b"trio-dispatcher-node"

_NO_BODY_STATUSES: Final = frozenset({204, 304})
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


class Headers:
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
    __slots__ = ("buffer", "idle_since", "stream")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        self.idle_since = 0.0

    def is_readable(self) -> bool:
        """Readable while idle: the provider closed it (or sent what it should not)."""
        stream = self.stream
        while isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        if isinstance(stream, trio.SocketStream):
            return stream.socket.is_readable()
        return False


class _Timeouts:
    __slots__ = ("connect", "read", "write")

    def __init__(self, connect: float, read: float | None, write: float) -> None:
        self.connect, self.read, self.write = connect, read, write


class Response:
    """One answer, its body read from the connection as the caller asks for it."""

    __slots__ = (
        "_chunk_left",
        "_chunked",
        "_conn",
        "_left",
        "_state",
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
        status: int,
        reason: str,
        headers: Headers,
        *,
        method: str,
        http11: bool,
    ) -> None:
        self._conn = conn
        self._timeouts = timeouts
        self.status_code = status
        self.reason_phrase = reason
        self.headers = headers
        self.closed = False
        self.reusable = http11 and b"close" not in headers.tokens(b"connection")
        self._chunked = False
        self._left = -1
        """Content-Length bytes still to read; -1: read to the connection's end."""
        self._chunk_left = 0
        self._state = 0
        """Chunked: 0 a size line next, 1 in a chunk's data, 2 its CRLF, 3 trailers."""
        self.complete = False
        if method == "HEAD" or status in _NO_BODY_STATUSES or status < 200:
            self.complete = True
        elif headers.tokens(b"transfer-encoding")[-1:] == [b"chunked"]:
            self._chunked = True
        else:
            lengths = {value.strip() for key, value in headers.raw if key == b"content-length"}
            if len(lengths) > 1:
                raise httpx.RemoteProtocolError("conflicting Content-Length headers")
            if lengths:
                raw = lengths.pop()
                if not raw.isdigit():
                    raise httpx.RemoteProtocolError(f"bad Content-Length {raw!r}")
                self._left = int(raw)
                self.complete = self._left == 0
            else:
                self.reusable = False  # the body ends with the connection

    async def read(self) -> bytes:
        """The next piece of the body as it is on the wire (chunked framing removed); b""
        at its end, or once the response is closed."""
        buffer = self._conn.buffer
        while True:
            if self.complete or self.closed:
                return b""
            if buffer:
                piece = self._take_chunked() if self._chunked else self._take_plain()
                if piece or self.complete:
                    return piece
            data = await _receive(self._conn, self._timeouts)
            if not data:
                if self._left < 0 and not self._chunked:
                    self.complete = True
                    return b""
                raise httpx.RemoteProtocolError(
                    "peer closed connection without sending complete message body"
                )
            buffer.extend(data)

    def _take_plain(self) -> bytes:
        buffer = self._conn.buffer
        if self._left < 0:
            piece = bytes(buffer)
            buffer.clear()
            return piece
        size = min(self._left, len(buffer))
        piece = bytes(buffer[:size])
        del buffer[:size]
        self._left -= size
        if self._left == 0:
            self.complete = True
            if buffer:
                self.reusable = False  # more than the answer: nothing to trust after it
        return piece

    def _take_chunked(self) -> bytes:
        """Every chunk's data the buffer holds, at once."""
        buffer = self._conn.buffer
        pieces: list[bytes] = []
        position, end = 0, len(buffer)
        while position < end:
            state = self._state
            if state == 1:
                size = min(self._chunk_left, end - position)
                pieces.append(bytes(buffer[position : position + size]))
                position += size
                self._chunk_left -= size
                if self._chunk_left == 0:
                    self._state = 2
                continue
            newline = buffer.find(b"\n", position)
            if newline < 0:
                if end - position > MAX_HEAD:
                    raise httpx.RemoteProtocolError("a chunk's size line is too long")
                break
            line = bytes(buffer[position:newline]).strip()
            position = newline + 1
            if state == 2:
                if line:
                    raise httpx.RemoteProtocolError("a chunk did not end with CRLF")
                self._state = 0
            elif state == 0:
                size_text = line.split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise httpx.RemoteProtocolError(f"bad chunk size {size_text!r}") from None
                if size < 0:
                    raise httpx.RemoteProtocolError(f"bad chunk size {size_text!r}")
                if size:
                    self._chunk_left, self._state = size, 1
                else:
                    self._state = 3
            elif not line:  # state 3: the blank line after the trailers ends the body
                self.complete = True
                break
        del buffer[:position]
        if self.complete and buffer:
            self.reusable = False
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

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


class Pool:
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

    async def __aenter__(self) -> Pool:
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
        request = _request_head(method, target, headers, content, proxy)
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
                await self._send(conn, request)
                response = await self._read_head(conn, method)
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
        head = b"CONNECT %s HTTP/1.1\r\nhost: %s\r\n" % (authority, authority)
        if proxy.authorization is not None:
            head += b"proxy-authorization: " + proxy.authorization + b"\r\n"
        await self._send(conn, head + b"\r\n")
        response = await self._read_head(conn, "CONNECT")
        if not 200 <= response.status_code < 300:
            raise httpx.ProxyError(f"the proxy answered CONNECT with {response.status_code}")
        conn.buffer.clear()

    async def _send(self, conn: _Connection, data: bytes) -> None:
        try:
            with trio.fail_after(self._timeouts.write):
                await conn.stream.send_all(data)
        except trio.TooSlowError:
            raise httpx.WriteTimeout("writing the request to the provider timed out") from None
        except (trio.BrokenResourceError, OSError) as exc:
            raise httpx.WriteError(str(exc) or type(exc).__name__) from None

    async def _read_head(self, conn: _Connection, method: str) -> Response:
        """The answer's status line and headers (``1xx`` answers skipped)."""
        buffer = conn.buffer
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD:
                    raise httpx.RemoteProtocolError("the answer's headers are too long")
                data = await _receive(conn, self._timeouts)
                if not data:
                    raise httpx.RemoteProtocolError(
                        "Server disconnected without sending a response."
                    )
                buffer.extend(data)
                continue
            head = bytes(buffer[:end])
            del buffer[: end + 4]
            lines = head.split(b"\r\n")
            status_line = lines[0].split(b" ", 2)
            version = status_line[0]
            if len(status_line) < 2 or not version.startswith(b"HTTP/1."):
                raise httpx.RemoteProtocolError(f"not an HTTP/1 status line: {lines[0]!r}")
            try:
                status = int(status_line[1])
            except ValueError:
                raise httpx.RemoteProtocolError(f"bad status {status_line[1]!r}") from None
            if 100 <= status < 200 and status != 101 and method != "CONNECT":
                continue  # an interim answer (100 Continue, 103 Early Hints)
            raw: list[tuple[bytes, bytes]] = []
            for line in lines[1:]:
                name, colon, value = line.partition(b":")
                if not colon or not name or name != name.strip() or line[:1] in b" \t":
                    raise httpx.RemoteProtocolError(f"malformed header line {line!r}")
                raw.append((name.lower(), value.strip()))
            reason = status_line[2].decode("latin-1") if len(status_line) > 2 else ""
            return Response(
                conn,
                self._timeouts,
                status,
                reason,
                Headers(raw),
                method=method,
                http11=version == b"HTTP/1.1",
            )

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


def _request_head(
    method: str,
    target: Target,
    headers: Iterable[tuple[str, str]],
    content: bytes,
    proxy: _Proxy | None,
) -> bytes:
    """The request's bytes, head and body, for one write."""
    path = target.absolute if proxy is not None and target.scheme == "http" else target.path
    lines = [b"%s %s HTTP/1.1" % (method.encode("ascii"), path), b"host: " + target.host_header]
    seen: set[str] = set()
    for name, value in headers:
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise httpx.LocalProtocolError(f"illegal header {name!r}")
        lowered = name.lower()
        if lowered in ("host", "content-length", "transfer-encoding"):
            continue  # the client frames the request itself
        seen.add(lowered)
        lines.append(b"%s: %s" % (name.encode("ascii"), _header_value(value)))
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
    return b"\r\n".join(lines)


def _header_value(value: str) -> bytes:
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")
