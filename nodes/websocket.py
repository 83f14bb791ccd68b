"""The node's websocket client, on wsproto directly (as the edge's server is, ``dispatcher.http``).

::

    proto = await handshake(stream, host, resource)  # the HTTP upgrade
    async with open_websocket(stream, proto, max_message_size=..., ...) as ws:
        await ws.send_many([frame, frame])  # one socket write
        frame = await ws.receive()

:func:`handshake` runs the opening handshake over a stream the caller owns (TCP, or TLS as a
``trio.SSLStream``): an HTTP/1.1 upgrade of ``resource`` with no subprotocol and no extra
header (the node's token travels in its ``hello``), answered by ``101`` -- else
:class:`UpgradeRejected` with the status; no answer (the edge closed, or answered what is not
HTTP) waits for the caller's deadline, as trio-websocket did. In :func:`open_websocket`, a
reader task, in a nursery around the block, reads the socket: pings are answered with pongs,
fragments reassembled up to ``max_message_size`` (beyond: close 1009, "message too big"),
whole messages queued for :meth:`WebSocketClient.receive`; while ``queue_size`` messages wait
there the reader stops reading the socket, so TCP pushes back on the edge. The peer's close
frame is answered and ends the reader; the connection lost without one is an abnormal close
(1006).

Writes: every data frame is built (framed and masked here, :func:`client_frames`; wsproto
builds the control frames) when it is handed in, in the order handed in, and one task at a
time writes the socket: a send made while a write is in
flight queues its bytes behind it and waits, and the writer, when its write is done, writes
everything queued meanwhile in **one** socket write. :meth:`WebSocketClient.send_many`
hands several frames in at once (one write). A send cancelled while it waits still has its
frame written (it was queued in order: taking it back could split the stream). On a TCP
stream (``trio.SocketStream``) the writer sends through the socket itself, whose every send
either sends some bytes or is cancelled having sent none: a writer cancelled mid-write puts
what it has not sent back at the head of the queue, and the next send (or a sender waiting
behind it, woken to take over) writes it -- the framing stays whole and the connection open,
as a cancelled write was harmless with trio-websocket. On any other stream (TLS, memory) a
write cancelled part-way, and on every stream a write that fails, leaves the framing broken,
so the connection is closed at once and every send after raises ``ConnectionClosed``.

:meth:`WebSocketClient.aclose` starts the closing handshake (our close frame goes after every
frame queued before it; sends after it raise ``ConnectionClosed``) and waits for the edge's
answer, bounded by the caller. Leaving :func:`open_websocket` closes (code 1000 unless closed
before, bounded by ``close_timeout``) and stops the reader; the stream stays the caller's to
close. Every error of the connection -- the peer's close, the stream broken -- is
``transport.ConnectionClosed``, with the close code and reason when there is one.
"""

from __future__ import annotations

import math
import os
import struct
from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Final, NoReturn

import trio
from wsproto.connection import Connection as WSConnection
from wsproto.connection import ConnectionState, ConnectionType
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Message,
    Ping,
    RejectConnection,
    RejectData,
    Request,
)
from wsproto.frame_protocol import CloseReason
from wsproto.handshake import H11Handshake
from wsproto.utilities import RemoteProtocolError

from dispatcher.shared.transport import ConnectionClosed, RawFrame

_NORMAL_CLOSURE: Final = 1000
_ABNORMAL_CLOSURE: Final = 1006
_MESSAGE_TOO_BIG: Final = 1009
_READ_SIZE: Final = 65536
_MAX_REJECT_BODY: Final = 64 * 1024
"""Of a refused upgrade's body, what is kept (for the error)."""

Stream = trio.abc.Stream


class UpgradeRejected(Exception):
    """The edge answered the upgrade with an HTTP status other than 101."""

    def __init__(self, status_code: int, body: bytes = b"") -> None:
        super().__init__(f"the websocket upgrade was refused with HTTP {status_code}")
        self.status_code = status_code
        self.body = body


def close_name(code: int) -> str:
    """A close code's name, for a close frame without a reason (as trio-websocket named them:
    RFC 6455's names, else the range's)."""
    try:
        return CloseReason(code).name
    except ValueError:
        if 1000 <= code <= 2999:
            return "RFC_RESERVED"
        if 3000 <= code <= 3999:
            return "IANA_RESERVED"
        if 4000 <= code <= 4999:
            return "PRIVATE_RESERVED"
        return "INVALID_CODE"


class WebSocketClient:
    """One open websocket: a :class:`~dispatcher.shared.transport.Connection` with
    :meth:`send_many`. Create with :func:`open_websocket`."""

    def __init__(
        self,
        stream: Stream,
        proto: WSConnection,
        *,
        max_message_size: int,
        queue_size: int,
        close_timeout: float,
    ) -> None:
        self._stream = stream
        self._close_timeout = close_timeout
        self._proto = proto
        self._max_size = max_message_size
        self._queue_size = queue_size
        self._messages: deque[RawFrame] = deque()
        self._parts: list[str | bytes] = []
        self._parts_size = 0
        self._close_code: int | None = None
        """The close: ours if we closed first, else the peer's (or 1006); None while open."""
        self._close_reason = ""
        self._peer_closed = trio.Event()
        """The closing handshake is over, the connection is gone, or the reader was
        cancelled: nothing more will be read."""
        self._receiver = trio.lowlevel.ParkingLot()
        self._reader_wake = trio.lowlevel.ParkingLot()
        # writing
        self._outgoing = bytearray()
        """Frames handed in, not yet taken by the writer."""
        self._queued = 0
        """Bytes handed in so far (a running total: where each send's bytes end)."""
        self._written = 0
        """Bytes the writer has written so far."""
        self._writing = False
        self._flushed = trio.lowlevel.ParkingLot()
        self._broken: str | None = None
        """Why the stream can carry nothing more (a write failed or was cut part-way)."""
        self._socket: trio.socket.SocketType | None = (
            stream.socket if isinstance(stream, trio.SocketStream) else None
        )
        """A TCP stream's socket: written directly, so a cancelled write is taken back."""

    # --- the Connection ---------------------------------------------------------------

    async def send(self, frame: RawFrame) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        await self.send_many((frame,))

    async def send_many(self, frames: Iterable[RawFrame]) -> None:
        """Send ``frames`` in order, in one socket write with whatever else is queued. They
        are handed in before the first schedule point (so in call order), and written even
        if the caller is cancelled after that. Raises ``ConnectionClosed`` once the
        connection is closing or gone."""
        if self._close_code is not None or self._proto.state is not ConnectionState.OPEN:
            raise self._closed_error()
        await self._write(client_frames(frames))

    async def receive(self) -> RawFrame:
        """The next message; ``ConnectionClosed`` once the connection is closing or gone
        (messages that came before the peer's close frame are still taken first)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._messages:
                message = self._messages.popleft()
                self._reader_wake.unpark_all()
                return message
            if self._close_code is not None:
                raise self._closed_error()
            await self._receiver.park()

    async def aclose(self, code: int = _NORMAL_CLOSURE, reason: str = "") -> None:
        """Send our close frame (once; after everything queued) and wait for the edge's
        answer, at most ``close_timeout``. Never raises for a connection already gone."""
        with trio.move_on_after(self._close_timeout):
            await self._close(code, reason)

    async def _close(self, code: int = _NORMAL_CLOSURE, reason: str = "") -> None:
        if self._close_code is None and self._proto.state is ConnectionState.OPEN:
            data = self._proto.send(CloseConnection(code=code, reason=reason))
            self._note_close(code, reason)
            try:
                await self._write(data)
            except ConnectionClosed:
                return
        await self._peer_closed.wait()

    # --- internals --------------------------------------------------------------------

    def _closed_error(self) -> ConnectionClosed:
        if self._broken is not None and self._close_code in (None, _ABNORMAL_CLOSURE):
            return ConnectionClosed(self._broken, _ABNORMAL_CLOSURE)
        code = _ABNORMAL_CLOSURE if self._close_code is None else self._close_code
        return ConnectionClosed(self._close_reason or close_name(code), code)

    def _note_close(self, code: int, reason: str) -> None:
        if self._close_code is None:
            self._close_code = code
            self._close_reason = reason
        self._receiver.unpark_all()

    def _lost(self, why: str) -> None:
        """The stream is gone (or unusable): wake everyone; every later call raises."""
        if self._broken is None:
            self._broken = why
        self._note_close(_ABNORMAL_CLOSURE, "")
        self._peer_closed.set()
        self._flushed.unpark_all()
        self._reader_wake.unpark_all()

    async def _write(self, data: bytes) -> None:
        """Queue ``data``; the first sender with nothing in flight writes all that is queued,
        the others wait for their bytes to be written."""
        if self._broken is not None:
            raise self._closed_error()
        self._outgoing += data
        self._queued += len(data)
        end = self._queued
        while self._writing:
            await self._flushed.park()
            if self._written >= end:
                return
            if self._broken is not None:
                raise self._closed_error()
        await self._flush()

    async def _flush(self) -> None:
        """Write what is queued, as one write, until nothing is; every waiter whose bytes
        went out is woken. Cancelled on a TCP stream: what was not sent goes back to the
        head of the queue (a waiter takes over). Else, cancelled or failing part-way: the
        connection is broken."""
        self._writing = True
        try:
            while self._outgoing and self._broken is None:
                data = bytes(self._outgoing)
                self._outgoing.clear()
                if self._socket is not None:
                    await self._send_on_socket(self._socket, data)
                    continue
                try:
                    await self._stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self._lost(f"a write failed: {type(exc).__name__}")
                    raise self._closed_error() from exc
                except BaseException as exc:
                    # Part of it may have been written: nothing can follow it on this stream.
                    self._lost(f"a write failed: {type(exc).__name__}")
                    raise
                self._written += len(data)
                self._flushed.unpark_all()
        finally:
            self._writing = False
            if self._outgoing:
                # A writer leaving with bytes queued (cancelled): a sender waiting behind it
                # takes over the writing.
                self._flushed.unpark_all()
        if self._broken is not None:
            raise self._closed_error()

    async def _send_on_socket(self, sock: trio.socket.SocketType, data: bytes) -> None:
        """Write ``data`` on the TCP socket. Each ``sock.send`` sends some bytes or, cancelled,
        none: cancelled, the unsent rest goes back to the head of the queue (in order, before
        what was handed in meanwhile) and the cancellation goes on; a failure breaks the
        connection."""
        view = memoryview(data)
        sent = 0
        try:
            while sent < len(data):
                n = await sock.send(view[sent:])
                sent += n
                self._written += n
        except trio.Cancelled:
            self._outgoing[0:0] = data[sent:]
            raise
        except (OSError, trio.ClosedResourceError) as exc:
            self._lost(f"a write failed: {type(exc).__name__}")
            raise self._closed_error() from exc
        self._flushed.unpark_all()

    async def _read_loop(self) -> None:
        """The reader task: until the close handshake is over or the stream is gone."""
        proto = self._proto
        try:
            await self._process_events()
            while proto.state is not ConnectionState.CLOSED and self._broken is None:
                while len(self._messages) >= self._queue_size and self._broken is None:
                    await self._reader_wake.park()
                data = await self._stream.receive_some(_READ_SIZE)
                if not data:
                    break
                proto.receive_data(bytes(data))  # the same object for bytes: no copy
                await self._process_events()
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionClosed):
            pass
        except trio.Cancelled:
            # The node is stopping: the connection is still whole, and the session's close
            # frame still goes out, but no answer can be read any more, so a close waiting
            # for one (shielded, with seconds of budget) ends now rather than at its bound.
            self._peer_closed.set()
            raise
        self._lost("the connection to the edge was lost")

    async def _process_events(self) -> None:
        proto = self._proto
        replies = b""
        for event in proto.events():
            if isinstance(event, Message):
                if self._close_code is not None:
                    continue  # we are closing: the rest is dropped
                data: str | bytes = event.data if isinstance(event.data, str) else bytes(event.data)
                self._parts.append(data)
                self._parts_size += len(data)
                if self._parts_size > self._max_size:
                    self._parts, self._parts_size = [], 0
                    if proto.state is ConnectionState.OPEN:
                        reason = f"message too big (over {self._max_size} bytes)"
                        replies += proto.send(CloseConnection(code=_MESSAGE_TOO_BIG, reason=reason))
                        self._note_close(_MESSAGE_TOO_BIG, reason)
                    continue
                if event.message_finished:
                    self._finish_message(text=isinstance(data, str))
            elif isinstance(event, Ping):
                if proto.state is ConnectionState.OPEN:
                    replies += proto.send(event.response())
            elif isinstance(event, CloseConnection):
                if proto.state is ConnectionState.REMOTE_CLOSING:
                    replies += proto.send(event.response())
                self._note_close(event.code, event.reason or "")
                self._peer_closed.set()
        if replies:
            await self._write(replies)

    def _finish_message(self, *, text: bool) -> None:
        parts = self._parts
        message: RawFrame
        if len(parts) == 1:
            message = parts[0]
        elif text:
            message = "".join(p for p in parts if isinstance(p, str))
        else:
            message = b"".join(p for p in parts if isinstance(p, bytes))
        self._parts, self._parts_size = [], 0
        self._messages.append(message)
        self._receiver.unpark_all()


def client_frames(frames: Iterable[RawFrame]) -> bytes:
    """``frames`` as a client's websocket frames, each a whole message (text for ``str``, as
    UTF-8; binary for ``bytes``), masked with a fresh key from ``os.urandom`` for every frame
    (RFC 6455 5.3): what wsproto makes of a ``TextMessage`` or ``BytesMessage`` on a
    connection without extensions (the handshake offers none), built here in one pass, the
    masking one XOR of two integers -- wsproto's way, through its connection and frame
    objects and four ``translate`` calls, cost more than the rest of sending a frame."""
    out: list[bytes] = []
    for frame in frames:
        if isinstance(frame, str):
            payload, opcode = frame.encode(), 0x81  # FIN, text
        else:
            payload, opcode = frame, 0x82  # FIN, binary
        size = len(payload)
        if size < 126:
            out.append(_HEADER_BYTES(opcode, 0x80 | size))
        elif size < 65536:
            out.append(_HEADER_16(opcode, 0xFE, size))
        else:
            out.append(_HEADER_64(opcode, 0xFF, size))
        key = os.urandom(4)
        out.append(key)
        if size:
            mask = (key * ((size >> 2) + 1))[:size]
            masked = int.from_bytes(payload, "little") ^ int.from_bytes(mask, "little")
            out.append(masked.to_bytes(size, "little"))
    return b"".join(out)


_HEADER_BYTES: Final = struct.Struct("!BB").pack
_HEADER_16: Final = struct.Struct("!BBH").pack
_HEADER_64: Final = struct.Struct("!BBQ").pack


async def handshake(stream: Stream, host: str, resource: str) -> WSConnection:
    """The opening handshake over ``stream`` (bound it from outside): the open connection
    (bytes that came after the ``101`` already fed to it). Raises :class:`UpgradeRejected`,
    or the stream's errors; the edge closing without an answer, or answering what is not
    HTTP, is no answer: it waits for the caller's deadline."""
    handshake = H11Handshake(ConnectionType.CLIENT)
    await stream.send_all(handshake.send(Request(host=host, target=resource)))
    rejected: RejectConnection | None = None
    body = b""
    while True:
        data = await stream.receive_some(_READ_SIZE)
        if not data:
            if rejected is not None:
                raise UpgradeRejected(rejected.status_code, body)
            await _no_answer()
        try:
            handshake.receive_data(bytes(data))
        except RemoteProtocolError:
            await _no_answer()
        for event in handshake.events():
            if isinstance(event, AcceptConnection):
                connection = handshake.connection
                assert connection is not None
                return connection
            if isinstance(event, RejectConnection):
                rejected = event
                if not event.has_body:
                    raise UpgradeRejected(event.status_code)
            elif isinstance(event, RejectData) and rejected is not None:
                body = (body + bytes(event.data))[:_MAX_REJECT_BODY]
                if event.body_finished:
                    raise UpgradeRejected(rejected.status_code, body)


async def _no_answer() -> NoReturn:
    """The edge closed without answering the upgrade (what an edge serving TLS does with a
    plain hello), or answered what is not HTTP: no answer, the upgrade times out, as it did
    with trio-websocket (the dial's cause, "timeout" in the "websocket upgrade", advises
    wss://)."""
    await trio.sleep_forever()


@asynccontextmanager
async def open_websocket(
    stream: Stream,
    proto: WSConnection,
    *,
    max_message_size: int,
    queue_size: int,
    close_timeout: float,
    cancelled_close_timeout: float,
) -> AsyncIterator[WebSocketClient]:
    """The websocket over ``stream``, whose :func:`handshake` gave ``proto`` (see the
    module's docstring). Leaving closes it: ``close_timeout`` for the edge's answer, or
    ``cancelled_close_timeout`` when the block is being cancelled (the answer could never be
    read: the close frame is written, then the block is left)."""
    ws = WebSocketClient(
        stream,
        proto,
        max_message_size=max_message_size,
        queue_size=queue_size,
        close_timeout=close_timeout,
    )
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws._read_loop, name="websocket reader")
            try:
                yield ws
            except BaseException as exc:
                body_error = exc
                raise
            finally:
                cancelled = trio.current_effective_deadline() == -math.inf
                budget = cancelled_close_timeout if cancelled else close_timeout
                with trio.move_on_after(budget, shield=True):
                    await ws._close()
                nursery.cancel_scope.cancel(reason="websocket closed")
    except BaseExceptionGroup:
        if body_error is not None:
            # The reader never fails (it ends with the connection): the block's error is it.
            raise body_error from None
        raise
