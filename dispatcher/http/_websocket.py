"""The server side of one websocket, on wsproto, after the HTTP upgrade.

The connection's reader task feeds received bytes in (:meth:`ServerWebSocket.feed`): pings
are answered there, fragments are reassembled up to the size limit, and whole messages are
queued for :meth:`ServerWebSocket.receive`. Every write (the handler's messages, pongs,
close frames) takes a lock, builds its frames under it (so nothing is sent after our close
frame) and goes through the connection's ``send_bytes``: each send is a checkpoint, has the
write timeout, and raises :class:`PeerGone` when the client is gone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import trio
from wsproto.connection import Connection as WSConnection
from wsproto.connection import ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Event, Ping, TextMessage

from ._sync import Waiter
from ._types import PeerGone, WebSocketClosed

# Close codes (RFC 6455, section 7.4.1).
NORMAL_CLOSURE = 1000
GOING_AWAY = 1001
ABNORMAL_CLOSURE = 1006
MESSAGE_TOO_BIG = 1009
INTERNAL_ERROR = 1011

_MAX_QUEUED_MESSAGES = 64
"""The reader stops reading while this many received messages wait for ``receive``."""
MAX_UNYIELDED_MESSAGES = 16
"""Messages ``receive`` may return in a row from its queue (they had arrived) before it is a
schedule point again: a bound on how long a reader with everything ready runs on; and
messages ``send`` may write in a row without one (each taken by the kernel at once)."""


def _nothing() -> bytes:
    return b""


class Transport(Protocol):
    """What the websocket needs from its HTTP connection."""

    async def send_bytes(self, data: bytes) -> None: ...
    async def send_final(self, data: bytes) -> None: ...
    def resume_reading(self) -> None: ...


class ServerWebSocket:
    """Implements the :class:`~dispatcher.http.WebSocket` protocol."""

    __slots__ = (
        "_broken",
        "_close_code",
        "_close_reason",
        "_close_wait",
        "_closed",
        "_lock",
        "_max_size",
        "_messages",
        "_parts",
        "_parts_size",
        "_pending",
        "_proto",
        "_queued",
        "_receiver",
        "_subprotocol",
        "_transport",
        "_unyielded",
        "_unyielded_sends",
    )

    def __init__(
        self,
        transport: Transport,
        subprotocol: str | None,
        *,
        max_message_size: int,
        close_wait: float,
    ) -> None:
        self._transport = transport
        self._proto = WSConnection(ConnectionType.SERVER)
        self._subprotocol = subprotocol
        self._max_size = max_message_size
        self._close_wait = close_wait
        self._messages: deque[str | bytes] = deque()
        self._queued = 0
        self._parts: list[str | bytes] = []
        self._parts_size = 0
        self._pending = b""
        """Frames the reader produced (pongs, close replies) not yet written."""
        self._close_code: int | None = None
        self._close_reason = ""
        self._broken = False
        self._closed = trio.Event()
        """Set when the closing handshake is over, the connection is gone, or its reader was
        cancelled: nothing more will be read."""
        self._receiver = Waiter()
        self._lock = trio.Lock()
        self._unyielded = 0
        self._unyielded_sends = 0
        """Messages sent since the last one sent with a schedule point."""

    # --- the handler's side -----------------------------------------------------------

    @property
    def subprotocol(self) -> str | None:
        return self._subprotocol

    @property
    def close_code(self) -> int | None:
        """The code of the close frame (ours if we closed first), or None while open."""
        return self._close_code

    async def send(self, message: str | bytes) -> None:
        event: Event
        if isinstance(message, str):
            event = TextMessage(data=message)
        else:
            event = BytesMessage(data=message)

        def build() -> bytes | None:
            if self._close_code is not None or self._proto.state is not ConnectionState.OPEN:
                return None
            return self._proto.send(event)

        await self._locked_send(build, prompt=True)

    async def receive(self) -> str | bytes:
        """The next message. Always a cancel point (a cancelled task takes no message); a
        schedule point when it waits, and at least every :data:`MAX_UNYIELDED_MESSAGES` messages
        taken from the queue in a row -- not for each: a message that already arrived is
        taken without a trip through the scheduler."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._messages:
                message = self._messages.popleft()
                self._queued -= len(message)
                self._transport.resume_reading()
                self._unyielded += 1
                if self._unyielded >= MAX_UNYIELDED_MESSAGES:
                    self._unyielded = 0
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return message
            self._unyielded = 0
            if self._close_code is not None:
                raise self._closed_error()
            await self._receiver.wait()

    async def aclose(self, code: int = NORMAL_CLOSURE, reason: str = "") -> None:
        await self.send_close(code, reason)
        with trio.move_on_after(self._close_wait):
            await self._closed.wait()

    # --- the driver's side ------------------------------------------------------------

    @property
    def backlogged(self) -> bool:
        """True while the handler has so many unread messages that the reader should pause."""
        return len(self._messages) >= _MAX_QUEUED_MESSAGES or self._queued >= self._max_size

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def ingest(self, data: bytes | bytearray) -> None:
        """Take bytes from the client; replies are kept for the next write."""
        if self._broken or self._proto.state is ConnectionState.CLOSED:
            return
        self._proto.receive_data(bytes(data))
        self._process_events()

    async def feed(self, data: bytes | bytearray) -> None:
        """Take bytes from the client and write any replies (the reader task)."""
        self.ingest(data)
        if self._pending:
            try:
                await self._locked_send(_nothing)
            except PeerGone:
                pass

    async def send_handshake(self, response: bytes) -> None:
        """Write the 101 response, then whatever the leftover bytes called for."""

        def build() -> bytes:
            data = response + self._pending
            self._pending = b""
            return data

        await self._locked_send(build, with_pending=False)

    def reader_stopped(self) -> None:
        """The reader was cancelled (the server stopping at once): the connection is still
        whole, and a close frame still goes out, but nothing more will be read -- a close
        waiting for the client's answer ends now, not at ``close_wait``."""
        self._closed.set()

    def connection_lost(self) -> None:
        """The TCP connection is gone: wake everyone; later calls raise WebSocketClosed."""
        if self._close_code is None:
            self._close_code = ABNORMAL_CLOSURE
            self._close_reason = "connection lost"
        self._closed.set()
        self._receiver.wake()

    async def send_close(self, code: int, reason: str = "") -> None:
        """Start the closing handshake (idempotent; a checkpoint; never raises PeerGone)."""

        def build() -> bytes:
            state = self._proto.state
            if state not in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
                return b""
            data = self._proto.send(CloseConnection(code=code, reason=reason))
            self._note_close(code, reason)
            if state is ConnectionState.REMOTE_CLOSING:
                self._closed.set()  # that was our reply: the handshake is over
            return data

        try:
            await self._locked_send(build)
        except PeerGone:
            pass

    async def close_for_shutdown(self) -> None:
        await self.aclose(GOING_AWAY, "server shutting down")

    # --- internals --------------------------------------------------------------------

    def _closed_error(self) -> WebSocketClosed:
        code = ABNORMAL_CLOSURE if self._close_code is None else self._close_code
        return WebSocketClosed(code, self._close_reason)

    async def _locked_send(
        self, build: Callable[[], bytes | None], *, with_pending: bool = True, prompt: bool = False
    ) -> None:
        """Build frames under the write lock and send them (always a cancel point, and a
        schedule point unless ``prompt``).

        ``build`` returns None when the websocket is closed: WebSocketClosed is raised.
        ``prompt`` (a message's send): a write the kernel takes whole at once is no schedule
        point (``send_final``), except every :data:`MAX_UNYIELDED_MESSAGES` sends in a row --
        the bound on how long a sender with everything ready runs on.
        """
        lock = self._lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            data = build()
            if data is None:
                await trio.lowlevel.checkpoint()
                raise self._closed_error()
            if with_pending and self._pending:
                data = self._pending + data
                self._pending = b""
            if not data:
                await trio.lowlevel.checkpoint()
                return
            if prompt and self._unyielded_sends < MAX_UNYIELDED_MESSAGES:
                self._unyielded_sends += 1
                send = self._transport.send_final
            else:
                self._unyielded_sends = 0
                send = self._transport.send_bytes
            try:
                await send(data)
            except PeerGone:
                self.connection_lost()
                raise
        finally:
            lock.release()

    def _note_close(self, code: int, reason: str | None) -> None:
        if self._close_code is None:
            self._close_code = code
            self._close_reason = reason or ""
        self._receiver.wake()

    def _start_close(self, code: int, reason: str) -> None:
        """Start the closing handshake from the reader (the frame goes out with pending)."""
        if self._proto.state is ConnectionState.OPEN:
            self._pending += self._proto.send(CloseConnection(code=code, reason=reason))
        self._note_close(code, reason)

    def _process_events(self) -> None:
        proto = self._proto
        for event in proto.events():
            if isinstance(event, TextMessage | BytesMessage):
                if self._close_code is not None:
                    continue  # we are closing: the rest is dropped
                data = event.data if isinstance(event.data, str) else bytes(event.data)
                self._parts.append(data)
                self._parts_size += len(data)
                if self._parts_size > self._max_size:
                    self._parts = []
                    self._parts_size = 0
                    self._start_close(MESSAGE_TOO_BIG, "message too big")
                    continue
                if event.message_finished:
                    self._finish_message(text=isinstance(data, str))
            elif isinstance(event, Ping):
                if proto.state is ConnectionState.OPEN:
                    self._pending += proto.send(event.response())
            elif isinstance(event, CloseConnection):
                if proto.state is ConnectionState.REMOTE_CLOSING:
                    self._pending += proto.send(event.response())
                    self._note_close(event.code, event.reason)
                    self._closed.set()
                elif proto.state is ConnectionState.CLOSED:
                    self._closed.set()  # the peer's reply to our close frame
                else:
                    # wsproto reports a frame that does not parse as a close event without
                    # changing state: answer with its code and read no more.
                    self._broken = True
                    self._start_close(event.code, event.reason or "")
                    self._closed.set()
                    break

    def _finish_message(self, *, text: bool) -> None:
        parts = self._parts
        message: str | bytes
        if len(parts) == 1:
            message = parts[0]
        elif text:
            message = "".join(p for p in parts if isinstance(p, str))
        else:
            message = b"".join(p for p in parts if isinstance(p, bytes))
        self._parts = []
        self._parts_size = 0
        self._messages.append(message)
        self._queued += len(message)
        self._receiver.wake()
