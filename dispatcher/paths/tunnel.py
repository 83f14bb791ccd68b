"""Tunnels: the edge's end of one raw HTTP request relayed by a node to its provider -- the
tunnel path's handle on the ownership rule of :mod:`dispatcher.paths.lease` (the rule itself is
written there, once, for runs and tunnels; :mod:`dispatcher.paths.runs` is the other path)::

    async with tunnels.open_tunnel(slot) as tunnel:   # route registered
        await tunnel.send_request(method="POST", path="/v1/embeddings", headers=..., body=...)
        start = await tunnel.start()             # status and headers, or TunnelFailed
        while data := await tunnel.receive_some():
            ...                                  # the body, as the provider sent it
    # however the block is left: if the tunnel was sent and is unfinished, the node is told
    # tunnel.cancel (posted, never waits) and the slot drains until the node confirms with a
    # late tunnel.end; the route is closed; the slot is released -- once.

What is the tunnel path's: the route is a :class:`_Route` (the response's start, its body
bytes, its end), the node's end is ``tunnel.end``, the cancel is ``tunnel.cancel``. The
request is sent by :meth:`Tunnel.send_request` rather than on entry: the pool opens the
tunnel right after admission, before the API layer has turned the client's HTTP request
(headers, query, the body rewritten for the chosen candidate) into what the node must send.
A tunnel left before its request was sent just gives its slot back (``unsent``).

Which frames the node may send in which order (``tunnel.start`` once and before any body
frame, one ``tunnel.end``, nothing after it) is the session's protocol machine's call
(:class:`dispatcher.wire.EdgeProtocol`); the route only sees what it accepted.

Flow control is the route's: the node may send at most ``window`` body bytes
(:attr:`Tunnels.window`, sent in ``tunnel.request``) beyond what the edge has consumed; the
edge grants more with ``tunnel.credit`` as its consumer (the client) takes bytes, in steps of
a quarter window. A node that sends more than granted breaks the protocol and its session is
closed. The node's receive loop therefore never waits on a slow client, and one tunnel never
holds more than a window of body bytes on the edge.

A session that ends mid-tunnel ends it with a synthesized, retryable error whose code says
why (``node_lost``, ``node_draining``, ``shutting_down``, ``stale_generation``: a
:data:`~dispatcher.link.registry.LostCode`), like runs.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Final

import attrs
import trio

from .. import wire
from ..admission import Slot
from ..errors import NodeUnavailable, TunnelFailed
from ..link.registry import LostCode, NodeGone, NodeSession, SessionProtocolError
from .lease import (
    EndReason,
    Lease,
    Leases,
    LeaseStatistics,
    NodeEnd,
)

__all__ = ["INLINE_BODY_LIMIT", "EndReason", "Tunnel", "TunnelStatistics", "Tunnels"]

INLINE_BODY_LIMIT: Final = 1024 * 1024
"""The longest text body sent inside ``tunnel.request``, in UTF-8 bytes: escaped in the
message's JSON (at most twice as long) it stays under ``wire.MAX_FRAME_SIZE``; a longer one
goes as binary frames."""


@attrs.define(eq=False)
class _Route:
    """One tunnel's messages from the session's receive loop (a
    :class:`~dispatcher.link.registry.TunnelRoute`). Never blocks; buffers at most ``window``
    body bytes because the node may not send more than it was granted."""

    tunnel_id: str
    window: int
    on_end: Callable[[], None]
    """Called once when the end arrives (or is synthesized) while the route is open."""
    outstanding: int = attrs.field(init=False)
    """Body bytes the node may still send (granted minus received)."""
    chunks: collections.deque[bytes] = attrs.Factory(collections.deque)
    buffered: int = 0
    peak_buffered: int = 0
    start: wire.TunnelStart | None = None
    end: wire.TunnelEnd | None = None
    lost_code: LostCode | None = None
    """Why the session ended, when the end was synthesized."""
    on_late_end: Callable[[], None] | None = None
    _lot: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)

    def __attrs_post_init__(self) -> None:
        self.outstanding = self.window

    async def wait(self) -> None:
        await self._lot.park()

    def deliver_start(self, message: wire.TunnelStart) -> None:
        self.start = message
        self._lot.unpark_all()

    def deliver_data(self, data: bytes) -> None:
        if len(data) > self.outstanding:
            raise SessionProtocolError(
                f"tunnel {self.tunnel_id!r}: {len(data)} body bytes with only "
                f"{self.outstanding} granted (window {self.window})"
            )
        if not data:
            return
        self.outstanding -= len(data)
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > self.peak_buffered:
            self.peak_buffered = self.buffered
        self._lot.unpark_all()

    def deliver_end(self, message: wire.TunnelEnd) -> None:
        self._finish(message)

    def lost(self, code: LostCode, message: str) -> None:
        if self.end is None:
            self.lost_code = code
            self._finish(wire.TunnelEnd(tunnel_id=self.tunnel_id, error=message, retryable=True))

    def late_end(self, message: wire.TunnelEnd) -> None:
        callback, self.on_late_end = self.on_late_end, None
        if callback is not None:
            callback()

    def _finish(self, end: wire.TunnelEnd) -> None:
        self.end = end
        self._lot.unpark_all()
        self.on_end()

    def take(self) -> bytes:
        """Everything buffered, as one piece."""
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        return data


@attrs.define(eq=False, kw_only=True)
class Tunnel(Lease):
    """The handle ``open_tunnel`` yields: send the request once, then read the response."""

    _route: _Route
    _owner: Tunnels
    _unreported: int = 0
    """Body bytes consumed and not yet granted back to the node."""
    _end_told: bool = False
    """The last piece :meth:`receive_some` returned came after the end had arrived (its
    checkpoint counts for telling the end)."""
    usage_recorded: bool = False
    usage: wire.Usage | None = None
    """The last usage reported with :meth:`on_usage` (``estimated`` when the edge estimated
    it)."""

    @property
    def tunnel_id(self) -> str:
        return self.lease_id

    @property
    def completed(self) -> bool:
        """The end arrived without an error: the provider's response was relayed whole."""
        end = self._route.end
        return end is not None and end.error is None

    @property
    def status(self) -> int | None:
        """The response's status, once ``tunnel.start`` arrived."""
        start = self._route.start
        return None if start is None else start.status

    async def send_request(
        self,
        *,
        method: str,
        path: str,
        query: str = "",
        headers: Sequence[tuple[str, str]] = (),
        body: str | bytes = "",
    ) -> None:
        """Send ``tunnel.request`` (once). ``headers`` go to the provider as given: leave out
        hop-by-hop headers and the client's ``Authorization`` (the node adds its own).
        Cancelled before the session's writer took it, the request is withdrawn and the
        node never hears of this tunnel.

        A ``str`` body (JSON) of at most :data:`INLINE_BODY_LIMIT` bytes (UTF-8) travels inside
        the message; a ``bytes`` body (a multipart upload), or a longer ``str`` one (UTF-8),
        follows it as binary frames of at most ``wire.MAX_TUNNEL_CHUNK`` bytes
        (``tunnel.request.body_size``: no frame is ever over the wire's frame limit), each
        handed to the session's writer once the one before was taken, so the outbox holds
        one of them at a time. Left before the last is taken (cancelled, or the session
        ended: :class:`NodeUnavailable`), the block that owns the tunnel tells the node to
        cancel it."""
        if isinstance(body, str) and len(body) > INLINE_BODY_LIMIT // 4:
            encoded = body.encode("utf-8")
            if len(encoded) > INLINE_BODY_LIMIT:
                body = encoded
        upload = body if isinstance(body, bytes) else b""
        await self.send(
            wire.TunnelRequest(
                tunnel_id=self.tunnel_id,
                provider_id=self.candidate.provider_id,
                model=self.candidate.model,
                method=method,
                path=path,
                query=query,
                headers=tuple(headers),
                body=body if isinstance(body, str) else "",
                body_size=len(upload),
                window=self._route.window,
            )
        )
        if upload:
            await self._send_body(upload)

    async def _send_body(self, body: bytes) -> None:
        view = memoryview(body)
        chunk = wire.MAX_TUNNEL_CHUNK
        for at in range(0, len(body), chunk):
            if self._route.end is not None:
                return  # the node ended the tunnel (it refused it): it drops the rest
            frame = wire.TunnelData(self.tunnel_id, bytes(view[at : at + chunk]))
            try:
                await self.session.enqueue(frame).wait_taken()
            except NodeGone as exc:
                raise NodeUnavailable(str(exc)) from exc

    async def start(self) -> wire.TunnelStart:
        """The response's status and headers. Raises :class:`TunnelFailed` if the tunnel
        ended before its response started."""
        route = self._route
        if route.start is None and route.end is None:
            # parked until it came: that wait is the checkpoint
            while route.start is None and route.end is None:
                await route.wait()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()  # once per tunnel: no schedule point
        if route.start is None:
            assert route.end is not None
            raise self._failure(route.end, "before the response started")
        return route.start

    async def receive_some(self) -> bytes:
        """Every body byte buffered now, as one piece (waiting for some when there are
        none); ``b""`` at the clean end. At an abnormal end, what arrived before it is
        delivered first, then :class:`TunnelFailed` is raised.

        A schedule point only when it waits for a piece; a piece already here is returned
        at a cancel point (the caller's write of it to the client is the schedule point;
        and a loop of calls waits at least every other call, as each takes all there is);
        the end that had arrived with the last piece is told without another."""
        route = self._route
        waited = not route.chunks and route.end is None
        while not route.chunks and route.end is None:
            await route.wait()
        if route.chunks:
            data = route.take()
            await self._consumed(len(data), checkpoint=not waited)
            self._end_told = route.end is not None  # (nothing can come after the end)
            return data
        if not (waited or self._end_told):
            await trio.lowlevel.checkpoint_if_cancelled()
        end = route.end
        assert end is not None
        if end.error is not None:
            raise self._failure(end, "mid-body")
        return b""

    def on_usage(self, usage: wire.Usage) -> None:
        """Report this tunnel's usage: as the provider said, or the edge's estimate
        (``usage.estimated``). The last report is kept in :attr:`usage` (the gate's usage row
        reads it); only the first counts in the statistics."""
        self.usage = usage
        if not self.usage_recorded:
            self.usage_recorded = True
            self._owner._record_usage(
                self, usage.prompt_tokens, usage.completion_tokens, not usage.estimated
            )

    async def _consumed(self, size: int, *, checkpoint: bool = True) -> None:
        """``size`` bytes were taken: the node gets its credit back a step at a time. A
        cancel point unless ``checkpoint`` is False (the caller parked already)."""
        self._unreported += size
        if self._unreported < self._owner.credit_step or self.finished:
            if checkpoint:
                await trio.lowlevel.checkpoint_if_cancelled()
            return
        grant, self._unreported = self._unreported, 0
        # Granted before the send: the node may answer with data before the send returns.
        self._route.outstanding += grant
        # Posted: dropped if the session is over (the route is failed by the registry).
        self.session.post(wire.TunnelCredit(tunnel_id=self.tunnel_id, bytes=grant))
        if checkpoint:
            await trio.lowlevel.checkpoint_if_cancelled()

    def _failure(self, end: wire.TunnelEnd, when: str) -> TunnelFailed:
        where = f"{self.candidate.label}"
        code = self._route.lost_code or "tunnel_failed"
        return TunnelFailed(
            f"the tunnel through {where} failed {when}: {end.error}",
            code=code,
            retryable=end.retryable,
        )

    def _node_end(self) -> NodeEnd | None:
        route = self._route
        if route.end is None:
            return None
        if route.lost_code is not None:
            return route.lost_code
        return "failed" if route.end.error is not None else "completed"

    def _cancel_message(self) -> wire.TunnelCancel:
        return wire.TunnelCancel(tunnel_id=self.tunnel_id)

    def _on_late_end(self, settle: Callable[[], None]) -> None:
        self._route.on_late_end = settle


@attrs.frozen
class TunnelStatistics(LeaseStatistics):
    buffered_bytes: int
    """Body bytes buffered on the edge now, over every open tunnel."""
    peak_buffered_bytes: int
    """The most body bytes any one tunnel has held on the edge at once."""
    usage_reported: int
    usage_estimated: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def open_tunnels(self) -> int:
        """Tunnels whose block is open now: :attr:`open`."""
        return self.open


@attrs.define(eq=False)
class Tunnels(Leases[Tunnel]):
    """Opens tunnels on the node that admission selected (``pool.open_tunnel``)."""

    kind = "tun"

    window: int = wire.DEFAULT_TUNNEL_WINDOW
    _peak_buffered: int = 0
    """The most body bytes a tunnel that ended held at once."""
    _usage_reported: int = 0
    _usage_estimated: int = 0
    _prompt_tokens: int = 0
    _completion_tokens: int = 0

    @property
    def credit_step(self) -> int:
        """Consumed bytes granted back to the node at once (a quarter window)."""
        return max(1, self.window // 4)

    def statistics(self) -> TunnelStatistics:
        routes = [tunnel._route for tunnel in self._open.values()]
        return TunnelStatistics(
            *self._counts(),
            buffered_bytes=sum(route.buffered for route in routes),
            peak_buffered_bytes=max([self._peak_buffered, *(r.peak_buffered for r in routes)]),
            usage_reported=self._usage_reported,
            usage_estimated=self._usage_estimated,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._completion_tokens,
        )

    def open_tunnel(self, slot: Slot) -> AbstractAsyncContextManager[Tunnel]:
        """Route a new tunnel on the candidate ``slot`` holds and yield its handle (the
        ``pool.open_tunnel`` hook); :meth:`Tunnel.send_request` sends it."""
        return self.open_lease(slot)

    @contextmanager
    def _route(self, session: NodeSession, lease_id: str, slot: Slot) -> Iterator[Tunnel]:
        route = _Route(lease_id, self.window, on_end=slot.release)
        with session.route_tunnel_to(lease_id, route):
            try:
                yield Tunnel(lease_id=lease_id, slot=slot, session=session, route=route, owner=self)
            finally:
                self._peak_buffered = max(self._peak_buffered, route.peak_buffered)

    def _record_usage(
        self, tunnel: Tunnel, prompt_tokens: int, completion_tokens: int, reported: bool
    ) -> None:
        if reported:
            self._usage_reported += 1
        else:
            self._usage_estimated += 1
        self._prompt_tokens += prompt_tokens
        self._completion_tokens += completion_tokens
