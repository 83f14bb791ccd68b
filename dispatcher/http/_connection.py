"""One client connection: the h11 driver, its reader task, and the per-request objects.

Each connection runs as two tasks. The *connection task* parses requests, runs the handler
(in its own cancel scope) and does every HTTP write. The *reader task* is the only one that
reads the socket: it appends to a buffer the connection task feeds to h11 on demand, and
while a handler runs it is what notices the client leaving (EOF or reset), at which point
it cancels the handler's scope with the reason "client disconnected". After a websocket
upgrade the reader feeds wsproto instead. The reader stops reading while enough unparsed
bytes (or unread websocket messages) are waiting, so a pipelining client cannot grow the
buffer without bound.

Every write goes through :meth:`HTTPConnection.send_bytes`: a checkpoint, bounded by
``ServerLimits.write_timeout``; a failed or timed-out write cuts the connection off (the handler
is cancelled) and raises :class:`PeerGone`. The write that ends an answer (or starts a stream)
is :meth:`HTTPConnection.send_final`: on plain TCP, when the kernel takes it whole at once, a
cancel point only (the connection's wait for the next request is its schedule point, and a
request whose head was read already gets one before its handler runs).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import struct
import time
from collections.abc import AsyncIterator
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Final

import attrs
import h11
import trio
from wsproto.utilities import generate_accept_token

from ._sync import Waiter
from ._types import (
    Address,
    BodyTooLarge,
    Headers,
    HTTPError,
    HTTPStream,
    MalformedBody,
    PeerGone,
    RequestTimeout,
    ServerLimits,
    WebSocket,
)
from ._websocket import (
    GOING_AWAY,
    INTERNAL_ERROR,
    NORMAL_CLOSURE,
    ServerWebSocket,
)

if TYPE_CHECKING:
    from ._server import Server

logger = logging.getLogger("dispatcher.http")

STREAM_CLOSE_TIMEOUT: Final = 1.0
"""Bound on closing a stream gracefully (a TLS close_notify), and the listeners at shutdown."""

_REASONS: Final = {status.value: status.phrase.encode("ascii") for status in HTTPStatus}

# Response states of one request.
_NOT_STARTED: Final = 0
_STREAMING: Final = 1
_DONE: Final = 2
_WEBSOCKET: Final = 3

_CLOSED_STATES: Final = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)

_BLANK_LINE: Final = re.compile(rb"\n\r?\n")
"""The end of a request head (h11 accepts a bare LF as a line end too)."""
_MAX_MESSAGE: Final = 200
"""Longest message given to the error page."""


class _DateCache:
    """The ``Date`` header value, formatted once per second."""

    second = -1
    value = b""

    @classmethod
    def get(cls) -> bytes:
        now = int(time.time())
        if now != cls.second:
            cls.second = now
            cls.value = formatdate(now, usegmt=True).encode("ascii")
        return cls.value


def _reason(status: int) -> bytes:
    return _REASONS.get(status, b"")


def _head_size(event: h11.Request) -> int:
    """Size of the request line and headers as sent, give or take optional whitespace."""
    size = len(event.method) + len(event.target) + 14  # "M T HTTP/1.1\r\n" + final "\r\n"
    for name, value in event.headers:
        size += len(name) + len(value) + 4  # ": " and "\r\n"
    return size


def _raw_response(status: int, headers: Headers, body: bytes) -> bytes:
    """An error response built without h11 (for when its state machine cannot send);
    ``headers`` already carry the framing."""
    head = b"".join(b"%s: %s\r\n" % (name, value) for name, value in headers)
    return b"HTTP/1.1 %d %s\r\n%s\r\n%s" % (status, _reason(status), head, body)


def _head_lines(buffer: bytes | bytearray) -> list[bytes] | None:
    """The header lines of the request head at the start of ``buffer``, without the request
    line and the line ends; None when the head's end is not in ``buffer``."""
    end = _BLANK_LINE.search(buffer)
    if end is None:
        return None
    lines = bytes(buffer[: end.start()]).split(b"\n")
    return [line.removesuffix(b"\r") for line in lines[1:]]


def _framing_problem(
    event: h11.Request, lines: list[bytes] | None, limits: ServerLimits
) -> tuple[int, str] | None:
    """Why a request h11 parsed must still be refused, and the connection closed, or None.

    What h11 lets through but a proxy in front of us might read differently (request
    smuggling): RFC 9112 section 6.1 (Transfer-Encoding in HTTP/1.0), 6.3 (Content-Length
    beside Transfer-Encoding), 5.2 (obsolete line folding, which we refuse rather than
    unfold). ``lines`` are the raw header lines (:func:`_head_lines`)."""
    if not event.http_version.startswith(b"1."):
        return 505, f"HTTP/{event.http_version.decode('ascii')} is not served; use HTTP/1.1"
    if len(event.target) > limits.max_target_length:
        return 414, f"the request target is over {limits.max_target_length} bytes"
    chunked = length = False
    for name, _ in event.headers:
        if name == b"transfer-encoding":
            chunked = True
        elif name == b"content-length":
            length = True
    if chunked and length:
        return 400, "both Content-Length and Transfer-Encoding: the body's length is ambiguous"
    if chunked and event.http_version == b"1.0":
        return 400, "Transfer-Encoding in an HTTP/1.0 request"
    if lines is None:
        return 431, "the request head is too large"
    if any(line[:1] in (b" ", b"\t") for line in lines):
        return 400, "obsolete line folding in a header"
    return None


def _transfer_coding_status(lines: list[bytes] | None) -> int:
    """The status for a head h11 refused for its Transfer-Encoding (h11 takes a lone
    ``chunked`` only): 501 when ``chunked`` is the final coding, once, after codings we do
    not implement (RFC 9112 section 6.1); else 400, as the body's length cannot be known
    (section 6.3)."""
    codings: list[bytes] = []
    for line in lines or ():
        name, _, value = line.partition(b":")
        if name.lower() == b"transfer-encoding":
            codings.extend(coding.strip().lower() for coding in value.split(b","))
    if codings and codings[-1] == b"chunked" and codings.count(b"chunked") == 1:
        return 501
    return 400


def _origin_form(target: str) -> str:
    """``target`` as a path and query: an absolute-form target (``http://host/p?q``, which a
    server must accept, RFC 9112 section 3.2.2) loses its scheme and authority."""
    if target.startswith("/"):
        return target
    scheme, sep, rest = target.partition("://")
    if not sep or not scheme.isalpha():
        return target  # "*" (asterisk-form), or something no route has
    slash = rest.find("/")
    query = rest.find("?")
    if slash == -1 or (query != -1 and query < slash):
        return "/" + rest[query:] if query != -1 else "/"
    return rest[slash:]


def _message(status: int, detail: str | None) -> str:
    phrase = _reason(status).decode("ascii")
    message = f"{phrase}: {detail}" if detail else phrase
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 3] + "..."
    return message


def _peer_address(stream: trio.SocketStream) -> Address | None:
    try:
        peer = stream.socket.getpeername()
    except OSError:
        return None
    if isinstance(peer, tuple) and len(peer) >= 2:
        return Address(str(peer[0]), int(peer[1]))
    return None


def _status_for(exc: BaseException) -> int | None:
    """The status the driver answers for a handler failure; None for a gone peer."""
    if isinstance(exc, BaseExceptionGroup):
        statuses = {_status_for(inner) for inner in exc.exceptions}
        if statuses == {None}:
            return None
        statuses.discard(None)
        return statuses.pop() if len(statuses) == 1 else 500
    if isinstance(exc, PeerGone):
        return None
    if isinstance(exc, BodyTooLarge):
        return 413
    if isinstance(exc, RequestTimeout):
        return 408
    if isinstance(exc, MalformedBody):
        return 400
    return 500


class HTTPConnection:
    """The driver of one client connection (see the module docstring)."""

    __slots__ = (
        "_aborted",
        "_discard",
        "_eof",
        "_expect_pending",
        "_h11",
        "_handler_scope",
        "_head_waited",
        "_inbuf",
        "_main",
        "_method",
        "_opened_at",
        "_raw",
        "_reader_wake",
        "_served",
        "_stream",
        "_timed_out",
        "_ws",
        "client",
        "server",
        "write_started",
    )

    def __init__(self, server: Server, stream: trio.SocketStream) -> None:
        self.server = server
        self._raw = stream
        self._stream: trio.abc.Stream = stream
        self.client = _peer_address(stream)
        self._h11 = h11.Connection(
            h11.SERVER, max_incomplete_event_size=server.limits.max_header_size
        )
        self._inbuf = bytearray()
        self._eof = False
        """The reader is done: the client closed or reset the connection (or we did)."""
        self._aborted = False
        """We cut the connection off (failed or timed-out write): nothing more is sent."""
        self._timed_out = False
        self.write_started = 0.0
        """When the write in progress began (the watchdog reads it)."""
        self._discard = False
        self._main = Waiter()
        self._reader_wake = Waiter()
        self._handler_scope: trio.CancelScope | None = None
        self._ws: ServerWebSocket | None = None
        self._method = b""
        self._expect_pending = False
        self._head_waited = False
        """The connection waited for the head of the request being served."""
        self._served = 0
        self._opened_at = trio.current_time()

    # --- lifecycle --------------------------------------------------------------------

    async def run(self) -> None:
        closed = False
        try:
            ssl_context = self.server.ssl_context
            if ssl_context is not None:
                self._stream = trio.SSLStream(
                    self._raw, ssl_context, server_side=True, https_compatible=True
                )
                if not await self._tls_handshake():
                    return
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_loop)
                try:
                    await self._serve()
                finally:
                    nursery.cancel_scope.cancel(reason="connection closing")
            if not self._aborted:
                if self._stream is self._raw:
                    # A plain socket's close never blocks: no scope needed, and once it
                    # returned there is nothing left to close forcefully (a cancel scope
                    # entered and cancelled, a Cancelled raised and caught: per connection,
                    # 10,000 clients leaving at once, issue #12).
                    await self._raw.aclose()
                    closed = True
                else:
                    with trio.move_on_after(
                        min(STREAM_CLOSE_TIMEOUT, self.server.limits.write_timeout)
                    ):
                        await self._stream.aclose()
        finally:
            if not closed:
                if self._aborted:
                    self._reset_on_close()
                with trio.move_on_after(STREAM_CLOSE_TIMEOUT, shield=True):
                    await trio.aclose_forcefully(self._stream)

    async def _tls_handshake(self) -> bool:
        stream = self._stream
        assert isinstance(stream, trio.SSLStream)
        with trio.move_on_after(self.server.limits.header_timeout):
            try:
                await stream.do_handshake()
            except trio.BrokenResourceError as exc:
                logger.debug("TLS handshake with %s failed: %r", self.client, exc.__cause__)
                return False
            return True
        logger.debug("TLS handshake with %s timed out", self.client)
        return False

    def _reset_on_close(self) -> None:
        """Make the close a reset: the kernel drops what the dead client did not read."""
        try:
            self._raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass

    def notify_shutdown(self) -> ServerWebSocket | None:
        """Graceful shutdown began: an idle connection closes now; returns the websocket."""
        self._main.wake()
        return self._ws

    # --- the reader task --------------------------------------------------------------

    async def _read_loop(self) -> None:
        stream = self._stream
        read_size = self.server.limits.read_size
        pause_at = 2 * read_size
        try:
            while True:
                ws = self._ws
                if ws is not None:
                    paused = ws.backlogged
                else:
                    paused = len(self._inbuf) >= pause_at and not self._discard
                if paused:
                    await self._reader_wake.wait()
                    continue
                data = await stream.receive_some(read_size)
                if not data:
                    break
                ws = self._ws
                if ws is not None:
                    await ws.feed(data)
                elif not self._discard:
                    self._inbuf += data
                    self._main.wake()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except trio.Cancelled:
            # The connection is being cancelled (the server stopping at once): a handler's
            # close frame may still go out, but its answer can no longer be read.
            if self._ws is not None:
                self._ws.reader_stopped()
            raise
        self._eof = True
        self._main.wake()
        if self._ws is not None:
            self._ws.connection_lost()
        if self._handler_scope is not None:
            self._handler_scope.cancel(reason="client disconnected")

    def resume_reading(self) -> None:
        self._reader_wake.wake()

    # --- writing ----------------------------------------------------------------------

    async def send_bytes(self, data: bytes) -> None:
        """Write ``data``: a checkpoint; PeerGone if the client is gone or too slow.

        The write timeout is kept by the server's write watchdog (see
        :meth:`cut_off_slow_writer`), not by a cancel scope per write: entering and leaving
        one costs about as much as the rest of sending a small SSE event.
        """
        if self._aborted:
            await trio.lowlevel.checkpoint()
            raise self._gone_error()
        writing = self.server._writing
        self.write_started = trio.current_time()
        writing.add(self)
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._abort("client connection broken")
            raise self._gone_error() from exc
        except BaseException:
            # Interrupted part-way (cancelled): the framing may be broken, so the
            # connection cannot carry anything more.
            self._abort("a write was interrupted")
            raise
        finally:
            writing.discard(self)

    async def send_final(self, data: bytes) -> None:
        """Write the bytes that end a request's answer (or its head): like :meth:`send_bytes`,
        but on a plain TCP connection whose kernel buffer takes ``data`` whole at once, a
        cancel point and no schedule point -- the connection's wait for the next request is
        one (a request whose head was here already gets one: :meth:`_serve`). Anything
        else (TLS, a full buffer, an error) goes through :meth:`send_bytes`."""
        if self._stream is self._raw and not self._aborted:
            try:
                await trio.lowlevel.checkpoint_if_cancelled()
            except BaseException:
                # as send_bytes: h11 has these bytes as sent, the client never gets them
                self._abort("a write was interrupted")
                raise
            try:
                written = os.write(self._raw.socket.fileno(), data)
            except BlockingIOError:
                written = 0
            except OSError:
                # a reset, or the socket closed: send_bytes's own write fails the same way
                # and says so
                written = 0
            if written == len(data):
                return
            data = data[written:]
        await self.send_bytes(data)

    def cut_off_slow_writer(self) -> None:
        """The write watchdog found a write older than the write timeout: close the socket
        (the blocked write raises PeerGone), then cancel the handler."""
        self._timed_out = True
        self._reset_on_close()
        try:
            self._raw.socket.close()
        except OSError:
            pass
        self._abort("write timed out: the client stopped reading")

    def _gone_error(self) -> PeerGone:
        if self._timed_out:
            timeout = self.server.limits.write_timeout
            return PeerGone(f"the client did not read for {timeout} s")
        return PeerGone("the client is gone")

    def _abort(self, reason: str) -> None:
        if self._aborted:
            return
        self._aborted = True
        if self._handler_scope is not None:
            self._handler_scope.cancel(reason=reason)
        self._main.wake()
        if self._ws is not None:
            self._ws.connection_lost()

    def _error_page(self, status: int, message: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """Headers and body of an error response the driver writes itself."""
        error_page = self.server.error_page
        if error_page is not None:
            try:
                headers, body = error_page(status, message)
                return list(headers), body
            except Exception:
                logger.exception("the error_page hook failed for status %d", status)
        body = b"%d %s\n" % (status, message.encode("ascii", "backslashreplace"))
        return [(b"content-type", b"text/plain; charset=utf-8")], body

    async def _reject(self, status: int, detail: str | None = None, *, linger: bool = True) -> None:
        """Answer an error status with ``Connection: close`` (the caller then closes);
        ``detail`` says what was wrong."""
        h = self._h11
        reason = _reason(status)
        headers, body = self._error_page(status, _message(status, detail))
        headers.extend(
            [
                (b"content-length", b"%d" % len(body)),
                (b"connection", b"close"),
                (b"date", _DateCache.get()),
            ]
        )
        data = None
        if h.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            try:
                data = h.send(h11.Response(status_code=status, headers=headers, reason=reason))
                if self._method != b"HEAD":
                    data += h.send(h11.Data(data=body))
                data += h.send(h11.EndOfMessage())
            except h11.LocalProtocolError:
                data = None
        if data is None:
            data = _raw_response(status, headers, b"" if self._method == b"HEAD" else body)
        try:
            await self.send_bytes(data)
        except PeerGone:
            return
        if linger and self._may_have_unread_input():
            await self._linger()

    def _may_have_unread_input(self) -> bool:
        if self._eof or self._aborted:
            return False
        h = self._h11
        return h.their_state not in _CLOSED_STATES or bool(self._inbuf or h.trailing_data[0])

    async def _linger(self) -> None:
        """Lingering close: stop sending, then drain the client's bytes for a while, so the
        kernel does not answer them with a reset that could destroy our last response."""
        limits = self.server.limits
        self._discard = True
        self._inbuf.clear()
        self._reader_wake.wake()
        stream = self._stream
        if isinstance(stream, trio.abc.HalfCloseableStream):
            with trio.move_on_after(limits.write_timeout):
                try:
                    await stream.send_eof()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
        with trio.move_on_after(limits.linger_timeout):
            while not self._eof:
                await self._main.wait()

    # --- reading ----------------------------------------------------------------------

    def _feed(self) -> None:
        self._h11.receive_data(bytes(self._inbuf))
        self._inbuf.clear()
        self._reader_wake.wake()

    async def _receive_request_head(self) -> tuple[h11.Request, list[bytes] | None] | None:
        """The next request's head and its raw header lines (see :func:`_head_lines`), or
        None when the connection should close."""
        h = self._h11
        server = self.server
        limits = server.limits
        first = self._served == 0
        got_bytes = False
        deadline = self._opened_at + limits.header_timeout if first else None
        # The raw bytes of the head, for what h11 does not tell (obsolete line folding):
        # what h11 holds of the next request already, then what we feed it.
        head = bytearray(h.trailing_data[0])
        head_cap = 2 * limits.max_header_size + 1024
        while True:
            if self._aborted:
                return None
            try:
                event = h.next_event()
            except h11.RemoteProtocolError as exc:
                if not self._eof:
                    status = exc.error_status_hint
                    if status == 501:  # h11's "only Transfer-Encoding: chunked"
                        status = _transfer_coding_status(_head_lines(head))
                    await self._reject(status, str(exc))
                return None
            if event is h11.NEED_DATA:
                if self._inbuf:
                    if not got_bytes:
                        got_bytes = True
                        if not first:
                            deadline = trio.current_time() + limits.header_timeout
                    if len(head) < head_cap:
                        head += self._inbuf
                    self._feed()
                    continue
                if self._eof:
                    h.receive_data(b"")
                    continue
                if deadline is None:
                    if h.trailing_data[0]:  # part of a pipelined request was read already
                        got_bytes = True
                        deadline = trio.current_time() + limits.header_timeout
                    else:
                        deadline = trio.current_time() + limits.keepalive_timeout
                if not got_bytes and server.closing:
                    return None
                if trio.current_time() >= deadline:
                    if got_bytes:
                        detail = f"no complete request head within {limits.header_timeout} s"
                        await self._reject(408, detail, linger=False)
                    return None
                self._head_waited = True
                with trio.move_on_at(deadline):
                    await self._main.wait()
                continue
            if type(event) is h11.Request:
                return event, _head_lines(head)
            return None  # ConnectionClosed

    async def receive_body_chunk(self, *, checkpoint: bool = True) -> bytes | None:
        """The next piece of the request body, or None at its end.

        ``checkpoint=False`` skips the checkpoint when the data is already here (for
        :meth:`_Request.body`, which checkpoints once for the whole body).
        """
        if checkpoint:
            await trio.lowlevel.checkpoint()
        h = self._h11
        if self._expect_pending:
            self._expect_pending = False
            if h.they_are_waiting_for_100_continue:
                await self.send_bytes(
                    h.send(h11.InformationalResponse(status_code=100, headers=[]))
                )
        deadline = None
        while True:
            if self._aborted:
                raise self._gone_error()
            try:
                event = h.next_event()
            except h11.RemoteProtocolError as exc:
                if self._eof:
                    raise PeerGone("the client left in the middle of the body") from exc
                raise MalformedBody(f"malformed request body: {exc}") from exc
            if type(event) is h11.Data:
                return bytes(event.data)
            if event is h11.NEED_DATA:
                if self._inbuf:
                    self._feed()
                    continue
                if self._eof:
                    h.receive_data(b"")
                    continue
                timeout = self.server.limits.body_timeout
                if deadline is None:
                    deadline = trio.current_time() + timeout
                elif trio.current_time() >= deadline:
                    raise RequestTimeout(f"no request body data for {timeout} s")
                with trio.move_on_at(deadline):
                    await self._main.wait()
                continue
            return None  # EndOfMessage (or PAUSED after it)

    async def _skip_unread_body(self, request: _Request) -> None:
        """The handler answered without reading the whole body (a 401 before it, say): read
        the rest and drop it, so that the connection serves the client's next request, as
        its answer (with no ``Connection: close``) promised -- within the body size limit and
        the body timeout, as the handler's own reading would have been. A body over the limit,
        a client that stops sending it, or a malformed one: the connection closes (what
        arrived already is drained by the lingering close)."""
        left = self.server.limits.max_body_size - request._received
        if request.declared_too_large or left < 0:
            return
        try:
            while (chunk := await self.receive_body_chunk(checkpoint=False)) is not None:
                left -= len(chunk)
                if left < 0:
                    return
        except HTTPError:
            return

    # --- requests ---------------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            self._method = b""
            self._head_waited = False
            received = await self._receive_request_head()
            if received is None:
                return
            if not self._head_waited:
                # The head was here already (pipelined): a schedule point per request even
                # if its handler has none (send_final, a body that came with the head).
                await trio.lowlevel.checkpoint()
            if not await self._handle_request(*received):
                return
            if self.server.shutting_down:
                return
            self._h11.start_next_cycle()

    async def _handle_request(self, event: h11.Request, lines: list[bytes] | None) -> bool:
        """Run the handler for one request; True if the connection can be reused."""
        server = self.server
        limits = server.limits
        self._served += 1
        self._method = event.method
        if _head_size(event) > limits.max_header_size:
            await self._reject(431, f"the request head is over {limits.max_header_size} bytes")
            return False
        problem = _framing_problem(event, lines, limits)
        if problem is not None:
            await self._reject(*problem)
            return False
        request = _Request(self, event)
        self._expect_pending = self._h11.they_are_waiting_for_100_continue
        if request.declared_too_large and self._expect_pending:
            # At once, in the driver: the client holds the body back until we answer.
            await self._reject(413, f"the request body is over {limits.max_body_size} bytes")
            return False
        responder = _Responder(self, request)
        scope = trio.CancelScope()
        if self._eof or self._aborted:
            scope.cancel(reason="client disconnected")
        self._handler_scope = scope
        failure: Exception | None = None
        try:
            with scope:
                await server.handler(request, responder)
        except Exception as exc:
            failure = exc
        finally:
            self._handler_scope = None
        return await self._finish_request(request, responder, failure)

    async def _finish_request(
        self, request: _Request, responder: _Responder, failure: Exception | None
    ) -> bool:
        ws = self._ws
        if ws is not None:
            await self._finish_websocket(ws, failure)
            return False
        gone = self._eof or self._aborted
        if failure is not None:
            status = _status_for(failure)
            if status == 500:
                logger.error(
                    "handler failed on %s %s", request.method, request.target, exc_info=failure
                )
            if status is None or gone:
                return False
            if responder.state == _NOT_STARTED:
                # Our own errors say what was wrong; a handler's bug stays in the log.
                detail = str(failure) if isinstance(failure, HTTPError) else None
                await self._reject(status, detail)
            else:
                self._abort("handler failed after answering")
            return False
        if gone:
            return False
        if responder.state == _NOT_STARTED:
            logger.error("handler returned without answering %s %s", request.method, request.target)
            await self._reject(500)
            return False
        if responder.stream is not None:
            try:
                await responder.stream.end()
            except PeerGone:
                return False
        h = self._h11
        if h.their_state is h11.SEND_BODY and not self._expect_pending:
            await self._skip_unread_body(request)
        if h.our_state is h11.DONE and h.their_state is h11.DONE:
            return True
        if self._may_have_unread_input():
            await self._linger()
        return False

    async def _finish_websocket(self, ws: ServerWebSocket, failure: Exception | None) -> None:
        code = NORMAL_CLOSURE
        if failure is not None and _status_for(failure) is not None:
            logger.error("websocket handler failed", exc_info=failure)
            code = INTERNAL_ERROR
        if not (self._eof or self._aborted or ws.closed):
            await ws.aclose(code)

    async def accept_websocket(
        self, request: _Request, subprotocol: str | None, headers: Headers
    ) -> ServerWebSocket:
        while await request._next_chunk() is not None:
            pass  # reach the end of the upgrade request, so that h11 can switch protocols
        h = self._h11
        key = request.header(b"sec-websocket-key") or b""
        response_headers = [
            (b"upgrade", b"websocket"),
            (b"connection", b"Upgrade"),
            (b"sec-websocket-accept", generate_accept_token(key)),
        ]
        if subprotocol is not None:
            response_headers.append((b"sec-websocket-protocol", subprotocol.encode("ascii")))
        response_headers.extend(headers)
        response = h.send(
            h11.InformationalResponse(
                status_code=101, headers=response_headers, reason=b"Switching Protocols"
            )
        )
        limits = self.server.limits
        ws = ServerWebSocket(
            self,
            subprotocol,
            max_message_size=limits.max_websocket_message_size,
            close_wait=limits.linger_timeout,
        )
        # Bytes that came after the request (even in the same read) belong to the
        # websocket: hand them over before anything else can be read.
        leftover = h.trailing_data[0] + bytes(self._inbuf)
        self._inbuf.clear()
        self._ws = ws
        ws.ingest(leftover)
        self._reader_wake.wake()
        await ws.send_handshake(response)
        if self.server.closing:
            await ws.send_close(GOING_AWAY, "server shutting down")
        return ws


@attrs.define(init=False, eq=False, repr=False)
class _Request:
    """Implements the :class:`~dispatcher.http.Request` protocol. (A slotted class whose
    fields are declared with their types; built from the h11 event by ``__init__``.)"""

    method: str
    target: str
    http_version: str
    headers: Headers
    client: Address | None
    declared_too_large: bool
    _conn: HTTPConnection
    _body: bytes | None
    _started: bool
    _done: bool
    _received: int

    def __init__(self, conn: HTTPConnection, event: h11.Request) -> None:
        self._conn = conn
        self.method = event.method.decode("ascii")
        self.target = event.target.decode("latin-1")
        self.http_version = event.http_version.decode("ascii")
        self.headers = event.headers
        self.client = conn.client
        self._body = None
        self._started = False
        self._done = False
        self._received = 0
        length = self.header(b"content-length")  # (h11 checked that it is digits)
        self.declared_too_large = (
            length is not None and int(length) > conn.server.limits.max_body_size
        )
        """The Content-Length is over the limit: reading the body raises BodyTooLarge at
        once, before a byte of it is read."""

    @property
    def path(self) -> str:
        return _origin_form(self.target).partition("?")[0]

    @property
    def query(self) -> str:
        return _origin_form(self.target).partition("?")[2]

    @property
    def is_websocket_upgrade(self) -> bool:
        """A valid websocket handshake: GET, Upgrade: websocket, Connection: upgrade,
        a key and version 13."""
        if self.method != "GET":
            return False
        upgrade = self.header(b"upgrade")
        if upgrade is None or upgrade.strip().lower() != b"websocket":
            return False
        connection = self.header(b"connection") or b""
        if b"upgrade" not in (token.strip().lower() for token in connection.split(b",")):
            return False
        return (
            self.header(b"sec-websocket-key") is not None
            and self.header(b"sec-websocket-version") == b"13"
        )

    @property
    def websocket_subprotocols(self) -> list[str]:
        """The subprotocols the client offered, in its order of preference."""
        offered: list[str] = []
        for name, value in self.headers:
            if name == b"sec-websocket-protocol":
                offered.extend(
                    token.strip() for token in value.decode("latin-1").split(",") if token.strip()
                )
        return offered

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def iter_body(self) -> AsyncIterator[bytes]:
        return _BodyIterator(self, self._body)

    async def body(self) -> bytes:
        if self._body is not None:
            await trio.lowlevel.checkpoint()
            return self._body
        if self._started:
            await trio.lowlevel.checkpoint()
            raise RuntimeError("the body was already (partly) read with iter_body()")
        # A cancel point; a schedule point only when the body is still to come (the
        # handler's answer is written with one: a request whose body came with its head
        # does not pay for a second).
        await trio.lowlevel.checkpoint_if_cancelled()
        chunks = []
        while (chunk := await self._next_chunk(checkpoint=False)) is not None:
            chunks.append(chunk)
        self._body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return self._body

    async def _next_chunk(self, *, checkpoint: bool = True) -> bytes | None:
        if self._done:
            if checkpoint:
                await trio.lowlevel.checkpoint()
            return None
        if self.declared_too_large:
            await trio.lowlevel.checkpoint()
            limit = self._conn.server.limits.max_body_size
            raise BodyTooLarge(f"the request body is over {limit} bytes")
        self._started = True
        chunk = await self._conn.receive_body_chunk(checkpoint=checkpoint)
        if chunk is None:
            self._done = True
            return None
        self._received += len(chunk)
        limit = self._conn.server.limits.max_body_size
        if self._received > limit:
            raise BodyTooLarge(f"the request body is over {limit} bytes")
        return chunk


class _BodyIterator:
    __slots__ = ("_cached", "_request")

    def __init__(self, request: _Request, cached: bytes | None) -> None:
        self._request = request
        self._cached = cached

    def __aiter__(self) -> _BodyIterator:
        return self

    async def __anext__(self) -> bytes:
        cached = self._cached
        if cached is not None:
            self._cached = None
            await trio.lowlevel.checkpoint()
            if cached:
                return cached
            raise StopAsyncIteration
        chunk = await self._request._next_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk


class _Responder:
    """Implements the :class:`~dispatcher.http.Responder` protocol."""

    __slots__ = ("_conn", "_request", "state", "stream")

    def __init__(self, conn: HTTPConnection, request: _Request) -> None:
        self._conn = conn
        self._request = request
        self.state = _NOT_STARTED
        self.stream: _HTTPStream | None = None

    @property
    def shutting_down(self) -> bool:
        return self._conn.server.shutting_down

    async def _check(self) -> None:
        if self._conn._eof:
            await trio.lowlevel.checkpoint()
            raise PeerGone("the client disconnected")
        if self.state != _NOT_STARTED:
            await trio.lowlevel.checkpoint()
            raise RuntimeError("this request was already answered")

    def _headers(self, headers: Headers) -> list[tuple[bytes, bytes]]:
        conn = self._conn
        out = list(headers)
        out.append((b"date", _DateCache.get()))
        if (
            conn.server.shutting_down
            or self._request.declared_too_large
            or (conn._expect_pending and conn._h11.they_are_waiting_for_100_continue)
        ):
            # We close after this response (an over-limit body is never read; under
            # Expect, the client still holds the body back, waiting for 100): say so.
            out.append((b"connection", b"close"))
        return out

    async def respond(self, status: int, headers: Headers = (), body: bytes = b"") -> None:
        await self._check()
        conn = self._conn
        h = conn._h11
        all_headers = self._headers(headers)
        if status not in (204, 304) and not any(
            name.lower() == b"content-length" for name, _ in headers
        ):
            all_headers.append((b"content-length", b"%d" % len(body)))
        data = h.send(h11.Response(status_code=status, headers=all_headers, reason=_reason(status)))
        if body and self._request.method != "HEAD":
            data += h.send(h11.Data(data=body))
        data += h.send(h11.EndOfMessage())
        self.state = _DONE
        await conn.send_final(data)

    async def start_stream(self, status: int, headers: Headers = ()) -> HTTPStream:
        await self._check()
        conn = self._conn
        data = conn._h11.send(
            h11.Response(status_code=status, headers=self._headers(headers), reason=_reason(status))
        )
        if self._request.method == "HEAD" or status in (204, 304):
            framing = _NO_BODY
        elif any(name.lower() in _FRAMING_HEADERS for name, _ in headers):
            framing = _H11_FRAMING
        elif (conn._h11.their_http_version or b"1.0") >= b"1.1":
            framing = _CHUNKED  # what h11 chose for these headers
        else:
            framing = _CLOSE_DELIMITED  # HTTP/1.0: the body ends when we close
        stream = _HTTPStream(conn, framing)
        self.state = _STREAMING
        self.stream = stream
        await conn.send_final(data)
        return stream

    async def accept_websocket(
        self, subprotocol: str | None = None, headers: Headers = ()
    ) -> WebSocket:
        await self._check()
        request = self._request
        if not request.is_websocket_upgrade:
            raise ValueError("accept_websocket() on a request that is not a websocket upgrade")
        if subprotocol is not None and subprotocol not in request.websocket_subprotocols:
            raise ValueError(
                f"subprotocol {subprotocol!r} was not offered by the client "
                f"(offered: {request.websocket_subprotocols})"
            )
        self.state = _WEBSOCKET
        return await self._conn.accept_websocket(request, subprotocol, headers)


# How a streamed response body is framed.
_NO_BODY: Final = 0
_H11_FRAMING: Final = 1
_CHUNKED: Final = 2
_CLOSE_DELIMITED: Final = 3

_FRAMING_HEADERS: Final = (b"content-length", b"transfer-encoding")


class _HTTPStream:
    """Implements the :class:`~dispatcher.http.HTTPStream` protocol.

    Chunks are framed here rather than through ``h11.Data`` when h11 chose chunked or
    close-delimited framing: neither writer keeps state between chunks, and skipping the
    event objects takes a tenth off the cost of a small SSE event. h11 still writes the
    head and the end of the body, so its state machine stays exact.
    """

    __slots__ = ("_conn", "_ended", "_framing")

    def __init__(self, conn: HTTPConnection, framing: int) -> None:
        self._conn = conn
        self._framing = framing
        self._ended = False

    async def send(self, data: bytes) -> None:
        conn = self._conn
        if self._ended:
            await trio.lowlevel.checkpoint()
            raise RuntimeError("the response stream has ended")
        if conn._eof:
            await trio.lowlevel.checkpoint()
            raise PeerGone("the client disconnected")
        framing = self._framing
        if framing == _NO_BODY or not data:
            await trio.lowlevel.checkpoint()
            return
        if framing == _CHUNKED:
            await conn.send_bytes(b"%x\r\n%b\r\n" % (len(data), data))
        elif framing == _CLOSE_DELIMITED:
            await conn.send_bytes(bytes(data))
        else:
            await conn.send_bytes(conn._h11.send(h11.Data(data=data)))

    async def end(self) -> None:
        conn = self._conn
        if self._ended:
            await trio.lowlevel.checkpoint()
            return
        if conn._eof:
            await trio.lowlevel.checkpoint()
            raise PeerGone("the client disconnected")
        self._ended = True
        await conn.send_final(conn._h11.send(h11.EndOfMessage()))
