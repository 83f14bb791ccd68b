"""The handler interface of our HTTP/1.1 + websocket server.

A handler is ``async def handler(request: Request, responder: Responder) -> None``.
For each request the handler does exactly one of:

* ``await responder.respond(status, headers, body)``: a complete response;
* ``stream = await responder.start_stream(status, headers)`` then ``await stream.send(data)``
  any number of times (each send is a checkpoint, cancellable, bounded by the write timeout);
  the response ends when the handler returns (or at ``await stream.end()``);
* ``ws = await responder.accept_websocket(subprotocol=...)`` on an upgrade request, then
  ``send`` / ``receive`` / ``aclose``.

If the handler returns without answering, the driver sends 500. If it raises before
answering, the driver logs the error and sends 500; after answering it aborts the
connection. Either way only that connection is affected.

When the client goes away, the handler's cancel scope is cancelled (reason "client
disconnected"); a send to a peer that is gone raises :class:`PeerGone` (a
``trio.BrokenResourceError``), it never returns silently.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

import attrs
import trio

Headers = Sequence[tuple[bytes, bytes]]
"""Header list as h11 has it: names lower-cased bytes, values bytes, order kept."""


class HTTPError(Exception):
    """Root of the server's own errors."""


class PeerGone(trio.BrokenResourceError, HTTPError):
    """The client is gone (closed, reset, or cut off by the write timeout)."""


class BodyTooLarge(HTTPError):
    """The request body is over ``ServerLimits.max_body_size``; the driver answers 413."""


class RequestTimeout(HTTPError):
    """The request body stalled for longer than ``ServerLimits.body_timeout``; the driver answers
    408."""


class MalformedBody(HTTPError):
    """The request body is malformed (e.g. broken chunked framing); the driver answers 400."""


class WebSocketClosed(HTTPError):
    """The websocket is closed; ``code`` and ``reason`` are the close frame's."""

    def __init__(self, code: int, reason: str = "") -> None:
        super().__init__(f"websocket closed with code {code}: {reason}")
        self.code = code
        self.reason = reason


@attrs.frozen(kw_only=True)
class ServerLimits:
    """Every limit and timeout of the driver. Times are in seconds."""

    max_header_size: int = 16 * 1024
    """Request line plus headers, in bytes; over it: 431 and close."""
    max_target_length: int = 8 * 1024
    """The request target (path and query), in bytes; over it: 414 and close."""
    max_body_size: int = 8 * 1024 * 1024
    """Request body, in bytes; over it: 413."""
    header_timeout: float = 10.0
    """From the first byte of a request (or connection open) to the end of its headers: 408."""
    keepalive_timeout: float = 30.0
    """Idle time between requests on a keep-alive connection before it is closed."""
    write_timeout: float = 30.0
    """A single send that cannot complete within this is a dead client: cut off, handler
    cancelled."""
    body_timeout: float = 60.0
    """Time allowed between two chunks of a request body."""
    max_connections: int = 10_000
    """Concurrent connections; the accept loop waits while at the limit."""
    max_websocket_message_size: int = 4 * 1024 * 1024
    """Largest websocket message accepted; over it: close with 1009."""
    shutdown_grace: float = 10.0
    """Time in-flight requests get during graceful shutdown before being cancelled."""
    linger_timeout: float = 2.0
    """Time spent draining the client's bytes after we decided to close (lingering close)."""
    read_size: int = 64 * 1024


@attrs.frozen
class Address:
    host: str
    port: int


class Request(Protocol):
    """One parsed request. Header names are lower-case bytes."""

    @property
    def method(self) -> str: ...
    @property
    def target(self) -> str:
        """The raw request target, e.g. ``/v1/models?x=1``."""

    @property
    def path(self) -> str: ...
    @property
    def query(self) -> str: ...
    @property
    def http_version(self) -> str: ...
    @property
    def headers(self) -> Headers: ...
    @property
    def client(self) -> Address | None: ...
    @property
    def is_websocket_upgrade(self) -> bool: ...
    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower-case), or None."""

    def iter_body(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises BodyTooLarge past the limit."""

    async def body(self) -> bytes:
        """The whole body; raises BodyTooLarge past the limit. Reads once, then cached. A
        cancel point; a schedule point when it waits for the body."""


class HTTPStream(Protocol):
    """A streamed (chunked, or close-delimited for HTTP/1.0) response body."""

    async def send(self, data: bytes) -> None:
        """Send one chunk; raises PeerGone if the client is gone or too slow."""

    async def end(self) -> None:
        """End the body (idempotent; also done when the handler returns)."""


class WebSocket(Protocol):
    @property
    def subprotocol(self) -> str | None: ...
    async def send(self, message: str | bytes) -> None:
        """Send a text (str) or binary (bytes) message; raises WebSocketClosed/PeerGone."""

    async def receive(self) -> str | bytes:
        """Next whole message; raises WebSocketClosed when the peer closed."""

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        """Send a close frame (idempotent) and wait briefly for the peer's."""


class Responder(Protocol):
    @property
    def shutting_down(self) -> bool:
        """True once graceful shutdown has begun (a hint to end streams)."""

    async def respond(self, status: int, headers: Headers = (), body: bytes = b"") -> None: ...
    async def start_stream(self, status: int, headers: Headers = ()) -> HTTPStream: ...
    async def accept_websocket(
        self, subprotocol: str | None = None, headers: Headers = ()
    ) -> WebSocket:
        """Accept the upgrade. ``subprotocol`` must be one the client offered, else
        ValueError is raised in the handler (the connection is answered 500, the server
        carries on)."""


Handler = Callable[[Request, Responder], Awaitable[None]]
ShutdownHook = Callable[[], Awaitable[None]]
ErrorPage = Callable[[int, str], tuple[Headers, bytes]]
"""``(status, message) -> (headers, body)`` of the error responses the driver writes itself
(400, 408, 413, 414, 431, 500, 501, 505), e.g. to give them the application's JSON error
format. ``message`` is the reason phrase, followed by what was wrong when the driver knows
(``"Bad Request: both Content-Length and Transfer-Encoding"``); at most 200 characters, any
bytes of the client's quoted. The driver adds ``content-length``, ``connection: close`` and
``date``; the response always closes the connection."""
