"""Tunnels: the edge's end of one raw HTTP request relayed by a node to its provider.

``open_tunnel`` is the ownership rule of the design (as :func:`dispatcher.runs.Runs.open_on_slot`
is for runs), in one ``async with``::

    async with tunnels.open_tunnel(slot, dispatch_request) as tunnel:   # route registered
        await tunnel.send_request(method="POST", path="/v1/embeddings", headers=..., body=...)
        start = await tunnel.start()             # status and headers, or TunnelFailed
        while data := await tunnel.receive_some():
            ...                                  # the body, as the provider sent it
    # however the block is left: if the tunnel was sent and is unfinished, the node is told
    # tunnel.cancel (shielded, bounded) and the slot drains until the node confirms with a
    # late tunnel.end; the route is closed; the slot is released -- once.

The route is registered on the node's session before anything is sent, so no answer can be
missed. The request itself is sent by :meth:`Tunnel.send_request` rather than on entry: the
pool opens the tunnel right after admission, before the API layer has turned the client's
HTTP request (headers, query, the body rewritten for the chosen candidate) into what the node
must send. A tunnel left before its request was sent just gives its slot back.

Flow control: the node may send at most ``window`` body bytes (:attr:`Tunnels.window`, sent
in ``tunnel.request``) beyond what the edge has consumed; the edge grants more with
``tunnel.credit`` as its consumer (the client) takes bytes, in steps of a quarter window.
A node that sends more than granted breaks the protocol and its session is closed. The node's
receive loop therefore never waits on a slow client, and one tunnel never holds more than a
window of body bytes on the edge.

The slot is freed at the first of: ``tunnel.end`` arriving, or the block exiting (draining
instead when a cancel had to be sent). A session lost mid-tunnel ends it with a synthesized,
retryable error (``node_lost`` / ``stale_generation``), like runs.
"""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import attrs
import trio

from . import wire
from .admission import Admission, Candidate, Slot
from .errors import NodeUnavailable, StaleGeneration, TunnelFailed
from .registry import NodeGone, NodeSession, Registry, SessionProtocolError

log = logging.getLogger("dispatcher.tunnel")

EndReason = Literal[
    "completed",  # tunnel.end without an error
    "failed",  # tunnel.end with an error
    "node_lost",  # the node's connection ended mid-tunnel
    "stale_generation",  # the node reconnected mid-tunnel (or before the open)
    "cancelled",  # the block was left before the end by a cancellation (client gone, ...)
    "abandoned",  # the block was left early without an error
    "error",  # the block was left early by an exception
    "send_error",  # the tunnel request could not be sent
    "unsent",  # the block was left before the request was sent
]

UsageSink = Callable[["Tunnel", int, int, bool], None]
"""``(tunnel, prompt_tokens, completion_tokens, reported)``: where tunnel usage goes (the usage
ledger); ``reported`` is False when the tokens are the edge's estimate."""


@attrs.define(eq=False)
class _Route:
    """One tunnel's messages from the session's receive loop (a
    :class:`~dispatcher.registry.TunnelRoute`). Never blocks; buffers at most ``window``
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
    lost_code: str | None = None
    """``node_lost`` / ``stale_generation`` when the end was synthesized."""
    on_late_end: Callable[[], None] | None = None
    _lot: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)

    def __attrs_post_init__(self) -> None:
        self.outstanding = self.window

    async def wait(self) -> None:
        await self._lot.park()

    def _violation(self, what: str) -> SessionProtocolError:
        return SessionProtocolError(f"tunnel {self.tunnel_id!r}: {what}")

    def deliver_start(self, message: wire.TunnelStart) -> None:
        if self.end is not None or self.start is not None:
            raise self._violation("tunnel.start after the response started or ended")
        self.start = message
        self._lot.unpark_all()

    def deliver_data(self, data: bytes) -> None:
        if self.start is None:
            raise self._violation("body frame before tunnel.start")
        if self.end is not None:
            raise self._violation("body frame after tunnel.end")
        if len(data) > self.outstanding:
            raise self._violation(
                f"{len(data)} body bytes with only {self.outstanding} granted "
                f"(window {self.window})"
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
        if self.end is not None:
            raise self._violation("a second tunnel.end")
        self._finish(message)

    def lost(self, code: str, message: str) -> None:
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


@attrs.define(eq=False)
class Tunnel:
    """The handle ``open_tunnel`` yields: send the request once, then read the response."""

    tunnel_id: str
    candidate: Candidate
    session: NodeSession
    slot: Slot
    _route: _Route
    _owner: Tunnels
    started_at: float
    requested: bool = False
    sent: bool = False
    """The request reached the node's connection (:meth:`send_request` returned)."""
    end_reason: EndReason | None = None
    """How the tunnel ended, set once when its block is left."""
    _unreported: int = 0
    """Body bytes consumed and not yet granted back to the node."""
    usage_recorded: bool = False
    usage: tuple[int, int, bool] | None = None
    """The last usage reported with :meth:`on_usage`: ``(prompt, completion, reported)``."""

    @property
    def finished(self) -> bool:
        """The end arrived (from the node, or synthesized when the node was lost)."""
        return self._route.end is not None

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

    @property
    def buffered(self) -> int:
        """Body bytes received from the node and not yet consumed."""
        return self._route.buffered

    @property
    def peak_buffered(self) -> int:
        return self._route.peak_buffered

    async def send_request(
        self,
        *,
        method: str,
        path: str,
        query: str = "",
        headers: Sequence[tuple[str, str]] = (),
        body: str = "",
    ) -> None:
        """Send ``tunnel.request`` (once). ``headers`` go to the provider as given: leave out
        hop-by-hop headers and the client's ``Authorization`` (the node adds its own)."""
        if self.requested:
            raise RuntimeError(f"tunnel {self.tunnel_id}: the request was already sent")
        request = wire.TunnelRequest(
            tunnel_id=self.tunnel_id,
            provider_id=self.candidate.provider_id,
            method=method,
            path=path,
            query=query,
            headers=tuple(headers),
            body=body,
            window=self._route.window,
        )
        # The session's writer sends it; this only waits until it is taken. Cancelled before
        # that, the request is withdrawn and the node never hears of this tunnel.
        try:
            outgoing = self.session.enqueue(request)
        except NodeGone as exc:
            raise NodeUnavailable(str(exc)) from exc
        self.requested = True
        try:
            await outgoing.wait_taken()
        except NodeGone as exc:
            self.requested = False
            raise NodeUnavailable(str(exc)) from exc
        except trio.Cancelled:
            self.requested = False  # withdrawn: nothing to cancel at the node
            raise
        self.sent = True

    async def start(self) -> wire.TunnelStart:
        """The response's status and headers. Raises :class:`TunnelFailed` if the tunnel
        ended before its response started."""
        route = self._route
        while route.start is None and route.end is None:
            await route.wait()
        if route.start is None:
            assert route.end is not None
            raise self._failure(route.end, "before the response started")
        await trio.lowlevel.checkpoint()
        return route.start

    async def receive_some(self) -> bytes:
        """Every body byte buffered now, as one piece (waiting for some when there are
        none); ``b""`` at the clean end. At an abnormal end, what arrived before it is
        delivered first, then :class:`TunnelFailed` is raised."""
        route = self._route
        while not route.chunks and route.end is None:
            await route.wait()
        if route.chunks:
            data = route.take()
            await self._consumed(len(data))
            return data
        await trio.lowlevel.checkpoint()
        end = route.end
        assert end is not None
        if end.error is not None:
            raise self._failure(end, "mid-body")
        return b""

    def on_usage(self, prompt_tokens: int, completion_tokens: int, reported: bool) -> None:
        """Report this tunnel's usage: ``reported`` when the provider said so, else the
        edge's estimate. The last report is kept in :attr:`usage` (the gate's usage row
        reads it); only the first counts in the statistics and goes to the usage sink."""
        self.usage = (prompt_tokens, completion_tokens, reported)
        if not self.usage_recorded:
            self.usage_recorded = True
            self._owner._record_usage(self, prompt_tokens, completion_tokens, reported)

    async def _consumed(self, size: int) -> None:
        self._unreported += size
        if self._unreported < self._owner.credit_step or self.finished:
            await trio.lowlevel.checkpoint()
            return
        grant, self._unreported = self._unreported, 0
        # Granted before the send: the node may answer with data before the send returns.
        self._route.outstanding += grant
        # Posted: dropped if the session is over (the route is failed by the registry).
        self.session.post(wire.TunnelCredit(tunnel_id=self.tunnel_id, bytes=grant))
        await trio.lowlevel.checkpoint()

    def _failure(self, end: wire.TunnelEnd, when: str) -> TunnelFailed:
        where = f"{self.candidate.label}"
        code = self._route.lost_code or "tunnel_failed"
        return TunnelFailed(
            f"the tunnel through {where} failed {when}: {end.error}",
            code=code,
            retryable=end.retryable,
        )


@attrs.frozen
class TunnelStatistics:
    opened: int
    ended: dict[str, int]
    cancels_sent: int
    open_tunnels: int
    buffered_bytes: int
    """Body bytes buffered on the edge now, over every open tunnel."""
    peak_buffered_bytes: int
    """The most body bytes any one tunnel has held on the edge at once."""
    usage_reported: int
    usage_estimated: int
    prompt_tokens: int
    completion_tokens: int


@attrs.define(eq=False)
class Tunnels:
    """Opens tunnels on the node that admission selected (``pool.open_tunnel``)."""

    registry: Registry
    admission: Admission
    window: int = wire.DEFAULT_TUNNEL_WINDOW
    usage_sink: UsageSink | None = None
    """Where each tunnel's usage goes besides the counters (the usage ledger)."""
    _prefix: str = attrs.field(factory=lambda: secrets.token_hex(4))
    _counter: Iterator[int] = attrs.field(factory=itertools.count)
    _open: dict[str, Tunnel] = attrs.field(factory=dict)
    _opened: int = 0
    _ended: dict[str, int] = attrs.field(factory=dict)
    _cancels_sent: int = 0
    _peak_buffered: int = 0
    _usage_reported: int = 0
    _usage_estimated: int = 0
    _prompt_tokens: int = 0
    _completion_tokens: int = 0

    @property
    def credit_step(self) -> int:
        """Consumed bytes granted back to the node at once (a quarter window)."""
        return max(1, self.window // 4)

    def new_tunnel_id(self) -> str:
        return f"tun-{self._prefix}-{next(self._counter)}"

    def statistics(self) -> TunnelStatistics:
        buffered = [t.buffered for t in self._open.values()]
        peaks = [t.peak_buffered for t in self._open.values()]
        return TunnelStatistics(
            opened=self._opened,
            ended=dict(self._ended),
            cancels_sent=self._cancels_sent,
            open_tunnels=len(self._open),
            buffered_bytes=sum(buffered),
            peak_buffered_bytes=max([self._peak_buffered, *peaks]),
            usage_reported=self._usage_reported,
            usage_estimated=self._usage_estimated,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._completion_tokens,
        )

    @asynccontextmanager
    async def open_tunnel(self, slot: Slot, request: Any = None) -> AsyncIterator[Tunnel]:
        """Route a new tunnel on the candidate ``slot`` holds and yield its handle (the
        ``pool.open_tunnel`` hook; ``request``, the pool's ``DispatchRequest``, is not
        needed: :meth:`Tunnel.send_request` carries what goes to the node)."""
        candidate = slot.candidate
        try:
            session = self.registry.require_current(candidate.node_id, candidate.generation)
        except StaleGeneration:
            self._count("stale_generation")
            raise
        tunnel_id = self.new_tunnel_id()
        route = _Route(tunnel_id, self.window, on_end=slot.release)
        with session.route_tunnel_to(tunnel_id, route):
            tunnel = Tunnel(tunnel_id, candidate, session, slot, route, self, time.monotonic())
            self._open[tunnel_id] = tunnel
            self._opened += 1
            try:
                yield tunnel
            except BaseException as exc:
                tunnel.end_reason = self._reason(tunnel, exc)
                raise
            else:
                tunnel.end_reason = self._reason(tunnel, None)
            finally:
                del self._open[tunnel_id]
                self._peak_buffered = max(self._peak_buffered, route.peak_buffered)
                self._count(tunnel.end_reason or "error")
                if tunnel.requested and not tunnel.finished:
                    self._abandon(tunnel, route)

    def _abandon(self, tunnel: Tunnel, route: _Route) -> None:
        """The block was left before the end: drain the slot and tell the node (posted to
        the session's writer: never waits, so no deadline can lose it)."""
        tunnel.slot.drain()
        slot_id = tunnel.slot.slot_id
        route.on_late_end = lambda: self.admission.confirm_drain(slot_id)
        if tunnel.session.is_open:
            tunnel.session.post(wire.TunnelCancel(tunnel_id=tunnel.tunnel_id))
            self._cancels_sent += 1

    @staticmethod
    def _reason(tunnel: Tunnel, exc: BaseException | None) -> EndReason:
        route = tunnel._route
        if route.end is not None:
            if route.lost_code in ("node_lost", "stale_generation"):
                return route.lost_code  # type: ignore[return-value]
            return "failed" if route.end.error is not None else "completed"
        if not tunnel.requested:
            return "unsent"
        if isinstance(exc, NodeUnavailable):
            return "send_error"
        if isinstance(exc, trio.Cancelled):
            return "cancelled"
        return "abandoned" if exc is None else "error"

    def _record_usage(
        self, tunnel: Tunnel, prompt_tokens: int, completion_tokens: int, reported: bool
    ) -> None:
        if reported:
            self._usage_reported += 1
        else:
            self._usage_estimated += 1
        self._prompt_tokens += prompt_tokens
        self._completion_tokens += completion_tokens
        if self.usage_sink is not None:
            try:
                self.usage_sink(tunnel, prompt_tokens, completion_tokens, reported)
            except Exception:  # the ledger must never break a request's exit path
                log.exception("could not record usage of tunnel %s", tunnel.tunnel_id)

    def _count(self, reason: str) -> None:
        self._ended[reason] = self._ended.get(reason, 0) + 1
