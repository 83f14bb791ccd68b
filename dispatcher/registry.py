"""Connected node sessions, their generations, and the routing of run events to subscribers.

Each accepted node connection becomes a :class:`NodeSession` with a fresh generation number. A
reconnect of the same node id supersedes the old session: the old one is marked stale, its
subscribers get a ``stale_generation`` failure, and nothing more is sent on it.

A session routes the run events its node sends to the subscription of that run (opened by
:mod:`dispatcher.runs` before the run request is sent, so no event can be missed). Events for
a run the edge never gave this session are a protocol error; late events for a run that
recently ended here (a cancel confirmation after the client left) are expected and dropped.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import attrs
import trio

from . import wire
from .errors import StaleGeneration
from .transport import Connection, ConnectionClosed

log = logging.getLogger("dispatcher.registry")

SUBSCRIPTION_BUFFER = 4096
"""Events buffered per run before the run is failed as too slow to consume. Bounded so a
stuck consumer can neither grow memory nor stall the node's whole connection."""
RECENT_RUNS = 4096
"""How many ended run ids a session remembers, to tolerate their late events."""
RECENT_TUNNELS = 4096
"""How many ended tunnel ids a session remembers, to tolerate their late frames."""


class NodeGone(Exception):
    """The node session is closed or superseded; nothing can be sent on it."""


class SessionProtocolError(Exception):
    """The node broke the protocol; its session must be closed."""


@attrs.define(eq=False)
class Subscription:
    """The edge's end of one run's event stream. Iterate with :meth:`receive`."""

    run_id: str
    _send: trio.MemorySendChannel[wire.RunEvent]
    _receive: trio.MemoryReceiveChannel[wire.RunEvent]
    terminal: wire.RunEvent | None = None
    """The terminal event once delivered (by the node, or synthesized when it was lost)."""
    overflowed: bool = False
    on_terminal: Callable[[wire.RunEvent], None] | None = None
    """Called when the terminal event arrives while the subscription is open."""
    on_late_terminal: Callable[[wire.RunEvent], None] | None = None
    """Called if the terminal event arrives after the subscription closed (the node's
    confirmation of a cancel)."""

    @property
    def finished(self) -> bool:
        return self.terminal is not None

    def deliver(self, event: wire.RunEvent) -> None:
        if self.terminal is not None or self.overflowed:
            return
        if wire.is_terminal(event):
            self.terminal = event
            if self.on_terminal is not None:
                self.on_terminal(event)
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            # The consumer is stuck; end its stream rather than buffer without bound or
            # stall the node's connection. It reads what is buffered, then a failure.
            self.overflowed = True
            self._send.close()
            log.warning(
                "run %s: consumer too slow, %d events buffered", self.run_id, SUBSCRIPTION_BUFFER
            )
        except trio.ClosedResourceError:
            pass
        if self.terminal is not None:
            self._send.close()

    async def receive(self) -> wire.RunEvent:
        """The next event. If the stream overflowed, a synthesized ``run.failed``."""
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            return wire.RunFailed(
                run_id=self.run_id,
                seq=-1,
                code="consumer_overflow",
                message="the client read events too slowly",
                retryable=False,
            )

    def receive_nowait(self) -> wire.RunEvent | None:
        """The next event if one is already buffered, else None."""
        try:
            return self._receive.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return None

    def close(self) -> None:
        self._send.close()
        self._receive.close()


class TunnelRoute(Protocol):
    """Where a session delivers one tunnel's messages (implemented by ``dispatcher.tunnel``).
    Called from the session's receive loop: never blocks; raises
    :class:`SessionProtocolError` for a message that breaks the protocol."""

    def deliver_start(self, message: wire.TunnelStart) -> None: ...
    def deliver_data(self, data: bytes) -> None: ...
    def deliver_end(self, message: wire.TunnelEnd) -> None: ...
    def lost(self, code: str, message: str) -> None:
        """The session is over: end the tunnel with a synthesized, retryable error."""

    def late_end(self, message: wire.TunnelEnd) -> None:
        """``tunnel.end`` arrived after the route closed (the node confirms a cancel)."""


@attrs.define(eq=False)
class NodeSession:
    """One connected node: its announcement, its connection, and its runs' routes."""

    node_id: str
    generation: int
    hello: wire.Hello
    _conn: Connection
    _send_lock: trio.StrictFIFOLock = attrs.field(factory=trio.StrictFIFOLock)
    runs: dict[str, Subscription] = attrs.field(factory=dict)
    """Open subscriptions, by run id."""
    _ended_runs: collections.OrderedDict[str, Callable[[wire.RunEvent], None] | None] = attrs.field(
        factory=collections.OrderedDict
    )
    """The last RECENT_RUNS runs whose subscription closed, with what to do with a late
    terminal event (a cancel confirmation), if anything."""
    tunnels: dict[str, TunnelRoute] = attrs.field(factory=dict)
    """Open tunnel routes, by tunnel id."""
    _ended_tunnels: collections.OrderedDict[str, TunnelRoute | None] = attrs.field(
        factory=collections.OrderedDict
    )
    """The last RECENT_TUNNELS tunnels whose route closed (None once their end arrived)."""
    closed_reason: str | None = None
    ended: trio.Event = attrs.field(factory=trio.Event)
    """Set when the session is over (disconnected or superseded)."""

    @property
    def label(self) -> str:
        return self.hello.label or self.node_id

    @property
    def is_open(self) -> bool:
        return self.closed_reason is None

    async def send(self, message: wire.EdgeMessage) -> None:
        """Send one message; raises :class:`NodeGone` if the session is over."""
        await self.send_frame(wire.encode(message))

    async def send_frame(self, frame: str | bytes) -> None:
        if self.closed_reason is not None:
            await trio.lowlevel.checkpoint()
            raise NodeGone(f"node {self.node_id} session {self.generation}: {self.closed_reason}")
        async with self._send_lock:
            try:
                await self._conn.send(frame)
            except ConnectionClosed as exc:
                raise NodeGone(f"node {self.node_id} connection lost: {exc.reason}") from None

    @contextmanager
    def subscribe(self, run_id: str) -> Iterator[Subscription]:
        """Route this run's events to a new subscription while the block is open."""
        if self.closed_reason is not None:
            raise NodeGone(f"node {self.node_id} session {self.generation}: {self.closed_reason}")
        send, receive = trio.open_memory_channel[wire.RunEvent](SUBSCRIPTION_BUFFER)
        subscription = Subscription(run_id, send, receive)
        self.runs[run_id] = subscription
        try:
            yield subscription
        finally:
            del self.runs[run_id]
            self._ended_runs[run_id] = subscription.on_late_terminal
            if len(self._ended_runs) > RECENT_RUNS:
                self._ended_runs.popitem(last=False)
            subscription.close()

    def route(self, event: wire.RunEvent) -> None:
        """Deliver a node's run event. Raises :class:`SessionProtocolError` for a run this
        session was never given."""
        subscription = self.runs.get(event.run_id)
        if subscription is not None:
            subscription.deliver(event)
            return
        if event.run_id in self._ended_runs:
            if wire.is_terminal(event):
                callback = self._ended_runs[event.run_id]
                self._ended_runs[event.run_id] = None
                if callback is not None:
                    callback(event)
            return
        raise SessionProtocolError(
            f"event {event.TYPE!r} for run {event.run_id!r}, which this session was not given"
        )

    @contextmanager
    def route_tunnel_to(self, tunnel_id: str, route: TunnelRoute) -> Iterator[None]:
        """Deliver this tunnel's messages to ``route`` while the block is open."""
        if self.closed_reason is not None:
            raise NodeGone(f"node {self.node_id} session {self.generation}: {self.closed_reason}")
        if tunnel_id in self.tunnels:
            raise ValueError(f"tunnel {tunnel_id!r} is already routed")
        self.tunnels[tunnel_id] = route
        try:
            yield
        finally:
            del self.tunnels[tunnel_id]
            self._ended_tunnels[tunnel_id] = route
            if len(self._ended_tunnels) > RECENT_TUNNELS:
                self._ended_tunnels.popitem(last=False)

    def route_tunnel(self, message: wire.TunnelStart | wire.TunnelEnd | wire.TunnelData) -> None:
        """Deliver a node's tunnel message or body frame. Raises
        :class:`SessionProtocolError` for a tunnel this session was never given."""
        tunnel_id = message.tunnel_id
        route = self.tunnels.get(tunnel_id)
        if route is not None:
            if isinstance(message, wire.TunnelData):
                route.deliver_data(message.data)
            elif isinstance(message, wire.TunnelStart):
                route.deliver_start(message)
            else:
                route.deliver_end(message)
            return
        if tunnel_id in self._ended_tunnels:
            if isinstance(message, wire.TunnelEnd):
                late = self._ended_tunnels[tunnel_id]
                self._ended_tunnels[tunnel_id] = None
                if late is not None:
                    late.late_end(message)
            return
        what = "binary frame" if isinstance(message, wire.TunnelData) else repr(message.TYPE)
        raise SessionProtocolError(
            f"{what} for no open tunnel: {tunnel_id!r} was not given to this session"
        )

    def fail_all(self, code: str, message: str) -> None:
        """End every open run and tunnel with a synthesized retryable failure (the node is
        gone)."""
        for run_id, subscription in list(self.runs.items()):
            subscription.deliver(
                wire.RunFailed(run_id=run_id, seq=-1, code=code, message=message, retryable=True)
            )
        self._ended_runs.clear()
        for route in list(self.tunnels.values()):
            route.lost(code, message)
        self._ended_tunnels.clear()

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        with trio.move_on_after(2, shield=True):
            await self._conn.aclose(code, reason)


@attrs.define(eq=False)
class Registry:
    """The current node sessions. Listeners hear of joins and leaves synchronously."""

    sessions: dict[str, NodeSession] = attrs.field(factory=dict)
    _generations: Iterator[int] = attrs.field(factory=lambda: itertools.count(1))
    _joined: list[Callable[[NodeSession], None]] = attrs.field(factory=list)
    _left: list[Callable[[NodeSession], None]] = attrs.field(factory=list)
    _changed: trio.Event = attrs.field(factory=trio.Event)

    def on_join(self, callback: Callable[[NodeSession], None]) -> None:
        self._joined.append(callback)

    def on_leave(self, callback: Callable[[NodeSession], None]) -> None:
        self._left.append(callback)

    def register(self, hello: wire.Hello, conn: Connection) -> NodeSession:
        """A new session for ``hello.node_id``, superseding any current one."""
        old = self.sessions.get(hello.node_id)
        if old is not None:
            self._end(old, "stale_generation", "superseded by a reconnect of the same node")
        session = NodeSession(hello.node_id, next(self._generations), hello, conn)
        self.sessions[hello.node_id] = session
        for callback in self._joined:
            callback(session)
        self._notify()
        return session

    def unregister(self, session: NodeSession, reason: str = "node disconnected") -> None:
        """End ``session`` (idempotent); its runs fail as ``node_lost``."""
        if session.closed_reason is None:
            self._end(session, "node_lost", reason)

    def _end(self, session: NodeSession, code: str, reason: str) -> None:
        session.closed_reason = reason
        session.ended.set()
        if self.sessions.get(session.node_id) is session:
            del self.sessions[session.node_id]
        # Admission hears of the leave first, so the slots that the failing runs release
        # below are void and cannot admit a waiter onto the session that just ended.
        for callback in self._left:
            callback(session)
        session.fail_all(code, f"node {session.node_id}: {reason}")
        self._notify()

    def current(self, node_id: str, generation: int) -> NodeSession | None:
        """The session of ``node_id`` if its generation is ``generation``, else None."""
        session = self.sessions.get(node_id)
        if session is None or session.generation != generation:
            return None
        return session

    def require_current(self, node_id: str, generation: int) -> NodeSession:
        """The session of ``node_id`` at ``generation``; :class:`StaleGeneration` if the node
        reconnected (or left) since that generation was chosen."""
        session = self.current(node_id, generation)
        if session is None:
            raise StaleGeneration(
                f"node {node_id} reconnected while the request was being dispatched",
                retry_after=0,
            )
        return session

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def models(self) -> dict[str, list[tuple[NodeSession, wire.ProviderInfo, wire.ModelInfo]]]:
        """Every public model name served now, with who serves it."""
        served: dict[str, list[tuple[NodeSession, wire.ProviderInfo, wire.ModelInfo]]] = {}
        for session in self.sessions.values():
            for provider in session.hello.providers:
                for model in provider.models:
                    served.setdefault(model.name, []).append((session, provider, model))
        return served
