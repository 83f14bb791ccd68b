"""A node connection: one ordered, message-based, closable channel between edge and node.

The edge serves nodes over our own server's websocket (:class:`ServerWebSocketConnection`);
a node dials with trio-websocket (``nodes.agent`` wraps it the same way); embedded apps and
tests join the two ends in memory with :func:`memory_connection_pair`, no sockets.

Messages are ``str`` (a JSON frame) or ``bytes`` (a binary tunnel frame). ``receive`` raises
:class:`ConnectionClosed` once the peer is gone or the connection was closed; so does ``send``.
"""

from __future__ import annotations

import math
from typing import Protocol

import attrs
import trio

RawFrame = str | bytes
"""One frame as a connection carries it: ``str`` (a JSON text frame) or ``bytes`` (a binary
tunnel frame); :mod:`dispatcher.wire` decodes it into a ``wire.Frame``."""


class ConnectionClosed(Exception):
    """The connection is closed (by us, by the peer, or by the network)."""

    def __init__(self, reason: str = "connection closed", code: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


class Connection(Protocol):
    async def send(self, frame: RawFrame) -> None: ...
    async def receive(self) -> RawFrame: ...
    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        """Close (idempotent). ``code``/``reason`` reach the peer where the transport can
        carry them (a websocket close frame)."""


@attrs.define(eq=False)
class MemoryConnection:
    """One end of an in-memory connection pair."""

    _send: trio.MemorySendChannel[RawFrame]
    _receive: trio.MemoryReceiveChannel[RawFrame]
    _state: _PairState
    _closed: bool = False

    async def send(self, frame: RawFrame) -> None:
        if self._closed or self._state.close_reason is not None:
            await trio.lowlevel.checkpoint()
            raise ConnectionClosed(
                self._state.close_reason or "connection closed", self._state.close_code
            )
        try:
            await self._send.send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ConnectionClosed(
                self._state.close_reason or "connection closed", self._state.close_code
            ) from None

    async def receive(self) -> RawFrame:
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError, trio.BrokenResourceError):
            raise ConnectionClosed(
                self._state.close_reason or "connection closed", self._state.close_code
            ) from None

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        if not self._closed:
            self._closed = True
            if self._state.close_reason is None:
                self._state.close_reason = reason or "connection closed"
                self._state.close_code = code
            self._send.close()
            self._receive.close()
        await trio.lowlevel.checkpoint()


@attrs.define
class _PairState:
    close_reason: str | None = None
    close_code: int | None = None


def memory_connection_pair(buffer: float = math.inf) -> tuple[MemoryConnection, MemoryConnection]:
    """Two connected ends. ``buffer`` is each direction's channel size (unbounded by default,
    as a socket's buffers are effectively large relative to our frames)."""
    a_send, b_receive = trio.open_memory_channel[RawFrame](buffer)
    b_send, a_receive = trio.open_memory_channel[RawFrame](buffer)
    state = _PairState()
    return MemoryConnection(a_send, a_receive, state), MemoryConnection(b_send, b_receive, state)
