"""The responder every request's handler answers through: it tells the request's record
(:mod:`dispatcher.observe.traffic`) the status its answer started with."""

from __future__ import annotations

from ..http import (
    Headers,
    HTTPStream,
    Responder,
    WebSocket,
)
from ..observe.traffic import RequestRecord

__all__ = ["RecordingResponder"]


class RecordingResponder:
    """``inner``, with the status of the answer written into ``record`` as it starts (101
    for an accepted websocket)."""

    __slots__ = ("_answered", "_inner")

    def __init__(self, inner: Responder, record: RequestRecord) -> None:
        self._inner, self._answered = inner, record.answered

    async def respond(self, status: int, headers: Headers = (), body: bytes = b"") -> None:
        self._answered(status)
        await self._inner.respond(status, headers, body)

    async def start_stream(self, status: int, headers: Headers = ()) -> HTTPStream:
        self._answered(status)
        return await self._inner.start_stream(status, headers)

    async def accept_websocket(
        self, subprotocol: str | None = None, headers: Headers = ()
    ) -> WebSocket:
        self._answered(101)
        return await self._inner.accept_websocket(subprotocol, headers)

    @property
    def shutting_down(self) -> bool:
        return self._inner.shutting_down
