"""Connected node sessions, their generations, and the routing of run events to subscribers.

Each accepted node connection becomes a :class:`NodeSession` with a fresh generation number. A
reconnect of the same node id *with the same credential* supersedes the old session: the old
one is marked stale, its subscribers get a ``stale_generation`` failure, and nothing more is
sent on it. A connection claiming a live session's node id with another credential is refused
(:class:`NodeIdInUse`) and the live session is untouched: holding some node token does not
make you every node.

A session routes what its node sends (:meth:`NodeSession.receive`) to the subscription of that
run or the route of that tunnel (each registered by its lease, :mod:`dispatcher.paths.lease`, before
the request is sent, so no event can be missed). Whether the node may send it is the
session's protocol state machine's call (:class:`dispatcher.wire.EdgeProtocol`, fed every
message both ways): an event for a run the edge never gave this session, a ``seq`` out of
order, an event after the run's terminal, a tunnel's frames out of order are protocol errors;
late events for a run that recently ended here (a cancel confirmation after the client left)
are kept for the run's usage row, then dropped.

**One owner of the writes.** Nothing a request does runs a write on the node's connection:
a cancelled ``send_all`` half-way through a frame aborts the whole websocket, and with it every
other run on the node. Each session has an *outbox* that its writer task
(:meth:`NodeSession.serve_writer`, in the node connection's nursery) empties in order.
Requests hand frames over with :meth:`NodeSession.enqueue` and wait until the writer *took*
the frame (:meth:`Outgoing.wait_taken`); a request cancelled before that withdraws its frame
(:meth:`Outgoing.withdraw`) and the node never hears of it. Cancels, credits and pings are
posted (:meth:`NodeSession.post`): they never wait, so a cancel is never lost to a deadline,
however many clients leave at once. Requests waiting to be taken are bounded by the slots
admission gave out; the outbox as a whole by :data:`MAX_OUTBOX`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, Protocol

import attrs
import trio

from .. import wire
from ..errors import StaleGeneration
from ..shared.transport import Connection

log = logging.getLogger("dispatcher.registry")

SUBSCRIPTION_BUFFER = 4096
"""Events buffered per run before the run is failed as too slow to consume. Bounded so a
stuck consumer can neither grow memory nor stall the node's whole connection."""
MAX_UNYIELDED_EVENTS = 16
"""Buffered events a subscription's ``receive`` may return in a row before it is a schedule
point again (a bound on how long a consumer with everything ready runs on)."""
MAX_OUTBOX = 65536
"""Frames a session's outbox may hold before the node is deemed not to be reading: its
session then ends (the node is dropped) rather than the edge buffering without bound."""


LostCode = Literal["node_lost", "node_draining", "shutting_down", "stale_generation"]
"""Why a session's runs and tunnels were ended for it, as their (synthesized, retryable)
failure's code: the node was lost (its connection closed or broke, or the edge dropped it),
it left while draining (its operator stopped it), the edge itself is shutting down, or the
node reconnected (a new session replaced this one)."""


class NodeGone(Exception):
    """The node session is closed or superseded; nothing can be sent on it."""


class SessionProtocolError(Exception):
    """The node broke the protocol (raised by a tunnel route: more body bytes than granted);
    its session must be closed."""


class NodeIdInUse(Exception):
    """A live session holds this node id under another credential."""


@attrs.define(eq=False)
class Outgoing:
    """One frame handed to a session's writer (see :meth:`NodeSession.enqueue`)."""

    frame: str | bytes
    taken: bool = False
    """The writer took the frame: it is being, or has been, written; it cannot be withdrawn."""
    withdrawn: bool = False
    lost: str | None = None
    """Why the frame will never be written (the session ended before the writer took it)."""
    _waiter: trio.lowlevel.Task | None = None

    def withdraw(self) -> bool:
        """Take the frame back if the writer has not taken it yet; True if it was withdrawn
        (the node will never see it)."""
        if self.taken:
            return False
        self.withdrawn = True
        return True

    async def wait_taken(self) -> None:
        """Wait until the writer took the frame. Raises :class:`NodeGone` if the session
        ended first. If this wait is cancelled, the frame is withdrawn in the same step (the
        cancellation and the writer cannot both win), so ``Cancelled`` out of here always
        means the node never sees the frame."""
        if self.taken or self.lost is not None:
            await trio.lowlevel.checkpoint()
        else:
            self._waiter = trio.lowlevel.current_task()

            def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
                self._waiter = None
                self.withdrawn = True
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        if not self.taken:
            raise NodeGone(self.lost or "session ended")

    def _settle(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            trio.lowlevel.reschedule(waiter)


class LateEvents(Protocol):
    """What a run's subscription leaves behind when it closes before the run's end: the
    node's events that still arrive for it (its ``run.usage`` and its terminal, the
    confirmation of a cancel), for the run's usage row."""

    def __call__(self, event: wire.RunEvent) -> None: ...


@attrs.define(eq=False)
class Subscription:
    """The edge's end of one run's event stream. Iterate with :meth:`receive`.

    Its own one-consumer channel rather than a Trio memory channel pair: an event for a
    waiting consumer is handed over at once, the buffer (a deque, made when first needed)
    holds at most :data:`SUBSCRIPTION_BUFFER` events. Measured with 10,000 streams held
    (issue #12): the pair's state (two channel objects, their state, a deque, two ordered
    dicts) was per run, and each wait built a closure; here a wait is the task parked on
    this object."""

    run_id: str
    terminal: wire.RunEvent | None = None
    """The terminal event once delivered (by the node, or synthesized when it was lost)."""
    usage: wire.Usage | None = None
    """The last usage the node reported for the run (``run.usage``, or a ``run.cancelled``'s
    partial usage), as delivered -- whether or not the consumer read that event."""
    text_chars: int = 0
    """Characters of text delivered (for an estimate when the node reported no usage)."""
    overflowed: bool = False
    on_terminal: Callable[[wire.RunEvent], None] | None = None
    """Called when the terminal event arrives while the subscription is open."""
    on_late_event: LateEvents | None = None
    """Called for the run's ``run.usage`` and terminal events that arrive after the
    subscription closed (the node's confirmation of a cancel, its last usage)."""
    _buffer: collections.deque[wire.RunEvent] | None = attrs.field(default=None, repr=False)
    _ended: bool = attrs.field(default=False, repr=False)
    """Nothing more will be buffered: the terminal arrived, the buffer overflowed, or the
    subscription was closed."""
    _closed: bool = attrs.field(default=False, repr=False)
    _waiter: trio.lowlevel.Task | None = attrs.field(default=None, repr=False)
    _handed: wire.RunEvent | None = attrs.field(default=None, repr=False)
    """The event handed to the waiter as it is woken."""
    _unyielded: int = attrs.field(default=0, repr=False)
    """Buffered events returned since the last schedule point."""

    @property
    def finished(self) -> bool:
        return self.terminal is not None

    def deliver(self, event: wire.RunEvent) -> None:
        if self.terminal is not None:
            return
        if isinstance(event, wire.RunDelta):
            self.text_chars += len(event.text)
            if event.usage is not None:  # counted before the first content
                self.usage = event.usage
        elif isinstance(event, wire.RunUsage | wire.RunCancelled) and event.usage is not None:
            self.usage = event.usage
        if self.overflowed:
            return  # the consumer was failed; the usage above still counts for its row
        if wire.is_terminal(event):
            self.terminal = event
            if self.on_terminal is not None:
                self.on_terminal(event)
        self._put(event)
        if self.terminal is not None:
            self._end()

    def deliver_as(self, event: wire.RunCancelled, shown: wire.RunFailed) -> None:
        """The node ended the run with ``event``; its consumer is shown ``shown`` instead
        (why it ended, as the edge knows it). The usage ``event`` carries still counts."""
        if self.terminal is None and event.usage is not None:
            self.usage = event.usage
        self.deliver(shown)

    def _put(self, event: wire.RunEvent) -> None:
        if self._ended:
            return
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            self._handed = event
            trio.lowlevel.reschedule(waiter)
            return
        buffer = self._buffer
        if buffer is None:
            buffer = self._buffer = collections.deque()
        elif len(buffer) >= SUBSCRIPTION_BUFFER:
            # The consumer is stuck; end its stream rather than buffer without bound or
            # stall the node's connection. It reads what is buffered, then a failure.
            self.overflowed = True
            self._end()
            log.warning(
                "run %s: consumer too slow, %d events buffered", self.run_id, SUBSCRIPTION_BUFFER
            )
            return
        buffer.append(event)

    def _end(self) -> None:
        self._ended = True
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            trio.lowlevel.reschedule(waiter)  # nothing handed: the stream ended

    def _overflow_failure(self) -> wire.RunFailed:
        return wire.RunFailed(
            run_id=self.run_id,
            seq=-1,
            code="consumer_overflow",
            message="the client read events too slowly",
            retryable=False,
        )

    async def receive(self) -> wire.RunEvent:
        """The next event. If the stream overflowed, a synthesized ``run.failed``. Always a
        cancel point (a cancelled task takes no event); a schedule point when it waits, and
        at least every :data:`MAX_UNYIELDED_EVENTS` buffered events in a row -- not for each: an
        event that already arrived is taken without a trip through the scheduler."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise trio.ClosedResourceError("the subscription is closed")
        buffer = self._buffer
        if buffer:
            event = buffer.popleft()
            self._unyielded += 1
            if self._unyielded >= MAX_UNYIELDED_EVENTS:
                self._unyielded = 0
                await trio.lowlevel.cancel_shielded_checkpoint()
            if not buffer:
                # Drained: a held stream keeps no empty deque (a block of 64 slots, ~600 B).
                self._buffer = None
            return event
        self._unyielded = 0
        if self._ended:
            return self._overflow_failure()
        if self._waiter is not None:
            raise trio.BusyResourceError("another task is receiving from this subscription")
        self._waiter = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
        got, self._handed = self._handed, None
        if got is not None:
            return got
        if self._closed:
            raise trio.ClosedResourceError("the subscription is closed")
        return self._overflow_failure()

    def _abort_wait(self, _raise_cancel: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    def receive_nowait(self) -> wire.RunEvent | None:
        """The next event if one is already buffered, else None."""
        if self._closed:
            raise trio.ClosedResourceError("the subscription is closed")
        buffer = self._buffer
        if not buffer:
            return None
        event = buffer.popleft()
        if not buffer:
            self._buffer = None
        return event

    def close(self) -> None:
        self._ended = self._closed = True
        self._buffer = None
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            trio.lowlevel.reschedule(waiter)  # it raises ClosedResourceError


class TunnelRoute(Protocol):
    """Where a session delivers one tunnel's messages (implemented by ``dispatcher.paths.tunnel``).
    Called from the session's receive loop, for messages the protocol machine accepted:
    never blocks; raises :class:`SessionProtocolError` for a message that breaks the
    protocol (flow control is the route's)."""

    def deliver_start(self, message: wire.TunnelStart) -> None: ...
    def deliver_data(self, data: bytes) -> None: ...
    def deliver_end(self, message: wire.TunnelEnd) -> None: ...
    def lost(self, code: LostCode, message: str) -> None:
        """The session is over: end the tunnel with a synthesized, retryable error."""

    def late_end(self, message: wire.TunnelEnd) -> None:
        """``tunnel.end`` arrived after the route closed (the node confirms a cancel)."""


@attrs.define(eq=False)
class NodeSession:
    """One connected node: its announcement, its connection, its outbox, and its runs'
    routes."""

    node_id: str
    generation: int
    hello: wire.Hello
    _conn: Connection
    _outbox: collections.deque[Outgoing] = attrs.field(factory=collections.deque)
    _outbox_lot: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)
    protocol: wire.EdgeProtocol = attrs.field(factory=wire.EdgeProtocol)
    """The session's protocol state: what the node may send now (see :meth:`receive`)."""
    runs: dict[str, Subscription] = attrs.field(factory=dict)
    """Open subscriptions, by run id."""
    _late_runs: dict[str, LateEvents] = attrs.field(factory=dict)
    """Runs whose subscription closed before their terminal event, with what to do with their
    late events (a cancel confirmation, the last usage); as many as ``protocol`` remembers."""
    tunnels: dict[str, TunnelRoute] = attrs.field(factory=dict)
    """Open tunnel routes, by tunnel id."""
    _late_tunnels: dict[str, TunnelRoute] = attrs.field(factory=dict)
    """Tunnels whose route closed, until their late end arrives or ``protocol`` forgets
    them."""
    closed_reason: str | None = None
    credential: str | None = attrs.field(default=None, repr=False)
    """Who the node authenticated as (see ``nodelink.authenticate``); only a connection
    with the same credential may supersede this session."""
    draining: bool = False
    """The node said it is draining (``node.draining``): nothing new is routed to it."""
    drain_grace: float = 0.0
    """The grace the node gave its work when it said it is draining."""
    grant_serial: int = 0
    """The last grant of the node's (``capacity.serial``) this edge applied: its ``demand``
    reports say so."""
    demand_sent: dict[tuple[str, str], tuple[int, int, int]] = attrs.field(factory=dict)
    """The last ``demand`` told the node per (provider, model): waiting, held, serial."""
    end_code: LostCode | None = None
    """Why the session ended (set with :attr:`closed_reason`)."""
    ended: trio.Event = attrs.field(factory=trio.Event)
    """Set when the session is over (disconnected or superseded)."""
    frames_written: int = 0
    overflowed: bool = False
    """The outbox went over :data:`MAX_OUTBOX`: the writer ends the session."""
    connected_at: float = attrs.field(factory=time.time)
    """Unix time the session registered."""
    last_heard: float | None = None
    """``trio.current_time()`` of the node's latest frame (a pong, an event ...), kept by
    the connection's receive loop (``nodelink``); None before the first."""
    _stopping: bool = False

    @property
    def label(self) -> str:
        return self.hello.label or self.node_id

    @property
    def is_open(self) -> bool:
        return self.closed_reason is None

    @property
    def outbox_size(self) -> int:
        return len(self._outbox)

    def _gone(self) -> NodeGone:
        return NodeGone(f"node {self.node_id} session {self.generation}: {self.closed_reason}")

    def enqueue(self, message: wire.EdgeMessage | wire.TunnelData) -> Outgoing:
        """Hand ``message`` (or a tunnel's request body frame) to the writer; wait with
        :meth:`Outgoing.wait_taken`. Raises :class:`NodeGone` if the session is over."""
        if self.closed_reason is not None:
            raise self._gone()
        self.protocol.send(message)
        if isinstance(message, wire.TunnelData):
            outgoing = Outgoing(wire.encode_tunnel_data(message.tunnel_id, message.data))
        else:
            outgoing = Outgoing(wire.encode(message))
        self._push(outgoing)
        return outgoing

    def post(self, message: wire.EdgeMessage | bytes) -> None:
        """Hand a message (or a binary frame) to the writer without waiting: cancels,
        credits, pings, drain notices. Dropped if the session is over (its runs and tunnels
        are failed by the registry; there is nobody left to tell)."""
        if self.closed_reason is not None:
            return
        if isinstance(message, bytes):
            frame: str | bytes = message
        else:
            self.protocol.send(message)
            frame = wire.encode(message)
        self._push(Outgoing(frame))

    async def send(self, message: wire.EdgeMessage) -> None:
        """Send one message through the writer, waiting until it is taken; raises
        :class:`NodeGone` if the session is over first. Cancelled before the writer took
        it, the message is withdrawn."""
        if self.closed_reason is not None:
            await trio.lowlevel.checkpoint()
            raise self._gone()
        await self.enqueue(message).wait_taken()

    def _push(self, outgoing: Outgoing) -> None:
        if len(self._outbox) >= MAX_OUTBOX:
            # The node stopped reading: end its session instead of buffering without bound.
            self.overflowed = True
            self._outbox_lot.unpark_all()
        self._outbox.append(outgoing)
        self._outbox_lot.unpark()

    async def serve_writer(self) -> None:
        """The session's one writer: send what the outbox holds, in order, until cancelled
        or :meth:`stop_writing` (which it honours between frames). Raises
        ``ConnectionClosed`` when the connection breaks, and :class:`NodeGone` when the
        outbox overflowed. Runs in the node connection's nursery, never in a request's
        cancel scope: a request leaving can withdraw a frame, never interrupt one."""
        outbox = self._outbox
        try:
            while not self._stopping:
                if not outbox:
                    await self._outbox_lot.park()
                    continue
                if self.overflowed:
                    raise NodeGone(
                        f"node {self.node_id} is not reading: over {MAX_OUTBOX} frames queued"
                    )
                outgoing = outbox.popleft()
                if outgoing.withdrawn:
                    continue
                outgoing.taken = True
                outgoing._settle()
                await self._conn.send(outgoing.frame)
                self.frames_written += 1
        finally:
            self._drop_outbox(self.closed_reason or "the session's writer stopped")

    def stop_writing(self) -> None:
        """Ask :meth:`serve_writer` to return once the frame it is writing is written (the
        session is ending: a write cut half-way would abort the connection, and with it the
        close frame that tells the node why)."""
        self._stopping = True
        self._outbox_lot.unpark_all()

    def _drop_outbox(self, reason: str) -> None:
        while self._outbox:
            outgoing = self._outbox.popleft()
            if not outgoing.taken:
                outgoing.lost = reason
                outgoing._settle()

    @contextmanager
    def subscribe(self, run_id: str) -> Iterator[Subscription]:
        """Route this run's events to a new subscription while the block is open."""
        if self.closed_reason is not None:
            raise self._gone()
        subscription = Subscription(run_id)
        self.runs[run_id] = subscription
        try:
            yield subscription
        finally:
            del self.runs[run_id]
            late = subscription.on_late_event
            # Its callbacks belong to the run's handle, which holds the subscription: forget
            # them, so no reference cycle is left per run for the collector.
            subscription.on_late_event = subscription.on_terminal = None
            if late is not None and not subscription.finished:
                self._late_runs[run_id] = late
            forgotten = self.protocol.close_run(run_id)
            if forgotten is not None:
                self._late_runs.pop(forgotten, None)
            subscription.close()

    @contextmanager
    def route_tunnel_to(self, tunnel_id: str, route: TunnelRoute) -> Iterator[None]:
        """Deliver this tunnel's messages to ``route`` while the block is open."""
        if self.closed_reason is not None:
            raise self._gone()
        if tunnel_id in self.tunnels:
            raise ValueError(f"tunnel {tunnel_id!r} is already routed")
        self.tunnels[tunnel_id] = route
        try:
            yield
        finally:
            del self.tunnels[tunnel_id]
            self._late_tunnels[tunnel_id] = route
            forgotten = self.protocol.close_tunnel(tunnel_id)
            if forgotten is not None:
                self._late_tunnels.pop(forgotten, None)

    def receive(self, message: wire.Frame) -> wire.ProtocolError | None:
        """Judge one message (or binary frame) from the node with the session's protocol
        machine and deliver it: a run event to its subscription, a tunnel message to its
        route, a late one to what its run or tunnel left behind. Returns the violation that
        must close the session, if any; capacity and draining are the caller's."""
        verdict = self.protocol.receive(message)
        if verdict is wire.ACCEPTED:
            if isinstance(message, _RUN_EVENTS):
                subscription = self.runs.get(message.run_id)
                if subscription is not None:
                    if isinstance(message, wire.RunCancelled) and self.draining:
                        subscription.deliver_as(message, self._drain_cut(message.run_id))
                    else:
                        subscription.deliver(message)
            elif isinstance(message, _TUNNEL_FRAMES):
                route = self.tunnels.get(message.tunnel_id)
                if route is not None:
                    try:
                        if isinstance(message, wire.TunnelData):
                            route.deliver_data(message.data)
                        elif isinstance(message, wire.TunnelStart):
                            route.deliver_start(message)
                        else:
                            route.deliver_end(message)
                    except SessionProtocolError as exc:
                        return wire.ProtocolError(str(exc))
            return None
        if isinstance(verdict, wire.Tolerated):
            if isinstance(message, _LATE_RUN_EVENTS):
                if wire.is_terminal(message):
                    callback = self._late_runs.pop(message.run_id, None)
                else:
                    callback = self._late_runs.get(message.run_id)
                if callback is not None:
                    callback(message)
            elif isinstance(message, wire.TunnelEnd):
                route = self._late_tunnels.pop(message.tunnel_id, None)
                if route is not None:
                    route.late_end(message)
            return None
        return verdict if isinstance(verdict, wire.ProtocolError) else None

    def _drain_cut(self, run_id: str) -> wire.RunFailed:
        """What a run's client is told when the node's own drain cancelled it. Only the
        node's drain can: the edge asks for a cancel only as it leaves the run's block, which
        closes the subscription, so a ``run.cancelled`` arriving while it is open was not
        asked for."""
        return wire.RunFailed(
            run_id=run_id,
            seq=-1,
            code="node_draining",
            message=(
                f"node {self.node_id} is draining (its operator stopped it): its drain grace "
                f"of {self.drain_grace:g} s ended before this run did"
            ),
            retryable=True,
        )

    def fail_all(self, code: LostCode, message: str) -> None:
        """End every open run and tunnel with a synthesized retryable failure (the node is
        gone), and settle the runs that ended here unconfirmed: their confirmation will
        never come, so their usage rows need not wait for it."""
        self._drop_outbox(message)
        self.protocol.close()
        for run_id, subscription in list(self.runs.items()):
            subscription.deliver(
                wire.RunFailed(run_id=run_id, seq=-1, code=code, message=message, retryable=True)
            )
        ended, self._late_runs = self._late_runs, {}
        for run_id, late in ended.items():
            late(wire.RunFailed(run_id=run_id, seq=-1, code=code, message=message, retryable=True))
        for route in list(self.tunnels.values()):
            route.lost(code, message)
        self._late_tunnels.clear()


@attrs.define(eq=False)
class Registry:
    """The current node sessions. Listeners hear of joins and leaves synchronously."""

    sessions: dict[str, NodeSession] = attrs.field(factory=dict)
    _generations: Iterator[int] = attrs.field(factory=lambda: itertools.count(1))
    _joined: list[Callable[[NodeSession], None]] = attrs.field(factory=list)
    _left: list[Callable[[NodeSession], None]] = attrs.field(factory=list)
    _changed: trio.Event = attrs.field(factory=trio.Event)
    closing: bool = False
    """The edge is shutting down: a session that ends from here on ends for that reason
    (``shutting_down``), whatever its connection did meanwhile."""

    def on_join(self, callback: Callable[[NodeSession], None]) -> None:
        self._joined.append(callback)

    def on_leave(self, callback: Callable[[NodeSession], None]) -> None:
        self._left.append(callback)

    def register(
        self,
        hello: wire.Hello,
        conn: Connection,
        *,
        credential: str | None = None,
        protocol: wire.EdgeProtocol | None = None,
    ) -> NodeSession:
        """A new session for ``hello.node_id``, superseding the current one if it has the
        same ``credential``. Raises :class:`NodeIdInUse` (and changes nothing) if the current
        one has another. ``protocol``: the machine that received ``hello`` (a new one that
        is given ``hello`` if None); the session is open once the welcome is sent."""
        old = self.sessions.get(hello.node_id)
        if old is not None:
            if old.credential != credential:
                raise NodeIdInUse(f"node id {hello.node_id!r} is in use by another credential")
            self._end(
                old,
                "stale_generation",
                f"node {old.node_id} reconnected: its session {old.generation} was superseded",
            )
        if protocol is None:
            protocol = wire.EdgeProtocol()
            verdict = protocol.receive(hello)
            if isinstance(verdict, wire.ProtocolError):
                raise ValueError(f"not a hello this edge accepts: {verdict}")
        session = NodeSession(
            hello.node_id,
            next(self._generations),
            hello,
            conn,
            protocol=protocol,
            credential=credential,
        )
        self.sessions[hello.node_id] = session
        for callback in self._joined:
            callback(session)
        self._notify()
        return session

    def unregister(
        self, session: NodeSession, reason: str | None = None, code: LostCode = "node_lost"
    ) -> None:
        """End ``session`` (idempotent); its runs and tunnels fail with ``code`` and
        ``reason``, a sentence naming the node and why (default: the node was lost)."""
        if session.closed_reason is None:
            if reason is None:
                reason = f"node {session.node_id} was lost: it disconnected"
            self._end(session, code, reason)

    def _end(self, session: NodeSession, code: LostCode, reason: str) -> None:
        session.closed_reason = reason
        session.end_code = code
        session.ended.set()
        if self.sessions.get(session.node_id) is session:
            del self.sessions[session.node_id]
        # Admission hears of the leave first, so the slots that the failing runs release
        # below are void and cannot admit a waiter onto the session that just ended.
        for callback in self._left:
            callback(session)
        session.fail_all(code, reason)
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

    def routable_models(self) -> set[str]:
        """The model names a node that is not draining serves: what a request could be
        routed to now."""
        return {
            model.name
            for session in self.sessions.values()
            if not session.draining
            for provider in session.hello.providers
            for model in provider.models
        }


_RUN_EVENTS = (
    wire.RunDelta,
    wire.RunEmbeddings,
    wire.RunStarted,
    wire.RunUsage,
    wire.RunCompleted,
    wire.RunFailed,
    wire.RunCancelled,
)
_TUNNEL_FRAMES = (wire.TunnelData, wire.TunnelStart, wire.TunnelEnd)
_LATE_RUN_EVENTS = (wire.RunUsage, *wire.TERMINAL_EVENTS)
"""A run's late events that settle what it left behind (its usage row)."""
