"""The node agent: dial the edge, register, serve runs, answer heartbeats, reconnect.

:func:`serve_node` is the daemon's main task: it dials the edge, runs one
:func:`serve_node_session` per connection, and reconnects with exponential backoff and full
jitter after any connection loss or dial failure (the policy, sans-IO, is
:mod:`nodes.reconnect`: it also says when to warn, naming the cause, and when to give up). It
stops only when cancelled, when the edge rejects the node for good (:class:`NodeRejected`: a
bad token, an unsupported protocol version), or when a node that never got in gives up
(:class:`EdgeUnreachable`, after ``config.give_up_after`` unless ``config.keep_trying``),
which it raises so the process can exit non-zero instead of retrying forever. It holds the
providers' connection pools for the node's life, across reconnects.

One session::

    hello ->            (all providers and models; the token, never logged)
          <- welcome    (bounded by config.handshake_timeout; anything else: close 1002,
                         another protocol version: NodeRejected)
    then, concurrently until the connection ends:
      receive loop:  every frame is judged by the session's NodeProtocol machine
                     (dispatcher.wire); what it accepts is carried out: ping -> pong,
                     run.request -> runner.start, run.cancel -> runner.cancel,
                     tunnel.request / tunnel.credit / tunnel.cancel -> the tunnel runner
                     (nodes.tunnel), edge.draining -> noted (the edge's close that follows
                     is a normal end); what it tolerates (a cancel or credit crossing its
                     run's or tunnel's end) is dropped; a malformed frame or a message the
                     edge may not send now (a second run.request for a running run, a
                     node's message) -> close 1002;
                     watchdog: each receive has a deadline; nothing from the edge for
                     heartbeat_timeout_factor x heartbeat_interval -> the edge is gone,
                     close 1001;
      runner:        the runs, and one writer task sending all their events (nodes.runner);
      tunnels:       each tunnel a task relaying one HTTP request to its provider
                     (nodes.tunnel);
      drain:         once :class:`Drain` is requested: node.draining -> the edge, new
                     run.request / tunnel.request answered with a retryable failure
                     (``node_draining``), in-flight runs and tunnels get config.drain_grace;
                     what still runs then is cancelled and reported (run.cancelled,
                     tunnel.end), within :data:`CANCEL_REPORT_TIMEOUT`; then close 1000
                     and serve_node returns.

:func:`run_node` (``dispatcher node``) requests the drain on the first SIGINT or SIGTERM and
stops at once on the second.

The websocket itself -- :func:`dial_edge`, :class:`NodeRejected` for a refused upgrade -- is
:mod:`nodes.dial`; both names are re-exported here.

What this node sends is recorded in the same machine, in wire order: a run event out of its
run's ``seq`` order or a tunnel frame out of turn is ``LocalProtocolError``, a bug here
(close 1011), never sent.

Errors are split in two: :class:`NodeRejected` is permanent; everything else that ends a
session (``transport.ConnectionClosed``, ``OSError``, a timeout, a protocol error, even an
unexpected exception, which is logged with its traceback) is transient.
"""

from __future__ import annotations

import logging
import random
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, Final

import attrs
import trio

from dispatcher import wire
from dispatcher.shared.excgroups import first_leaf
from dispatcher.shared.transport import Connection, ConnectionClosed, RawFrame
from dispatcher.wire import CLOSE_GOING_AWAY, CLOSE_NODE_ID_IN_USE, CLOSE_PROTOCOL_ERROR
from nodes.adapters import ADAPTERS, Adapter, DropConnection, build_adapters, open_adapters
from nodes.config import NodeConfig, hello_from_config
from nodes.dial import WEBSOCKET_CLOSE_TIMEOUT, DialFailed, close_budget, edge_dial, explain
from nodes.dial import Dial as Dial
from nodes.dial import NodeRejected as NodeRejected
from nodes.dial import dial_edge as dial_edge
from nodes.granting import EdgeGrants, hello_with_grants
from nodes.grants import Key
from nodes.reconnect import Backoff as Backoff
from nodes.reconnect import DialCause, GiveUp, Reconnect, Retry, advice
from nodes.runner import Runner, open_runner
from nodes.tunnel import (
    AnyTunnelProvider,
    TunnelRunner,
    open_tunnel_pools,
    open_tunnels,
    tunnel_providers,
)

log = logging.getLogger("nodes.agent")

CLOSE_NORMAL: Final = 1000
CLOSE_INTERNAL_ERROR: Final = 1011

PERMANENT_CLOSE_CODES: Final = frozenset(
    {wire.CLOSE_PROTOCOL_ERROR, 1003, 1007, wire.CLOSE_AUTH_FAILED}
)
"""Close codes that, received *before* ``welcome``, mean the edge refuses this node for good:
protocol error (bad hello, unsupported protocol version), unsupported or invalid data, and
4001 (authentication failed: a missing or wrong token). Any other close before welcome --
going away, restarting, timeouts -- is transient and retried with backoff."""

NODE_DRAINING: Final = "node_draining"
BEYOND_GRANT: Final = "beyond_grant"
"""The failure code of a run or tunnel an edge sent beyond the slots this node granted it (a
protocol error of the edge's: refused, never run)."""
"""The failure code of a run or tunnel the edge sent after the node said it is draining."""

EXIT_REJECTED: Final = 2
""":func:`run_node`'s exit status when the edge rejected the node for good."""
EXIT_GAVE_UP: Final = 3
""":func:`run_node`'s exit status when the node never got in to the edge and gave up
(:class:`EdgeUnreachable`)."""

CANCEL_REPORT_TIMEOUT: Final = 5.0
"""At the end of a drain's grace: how long the runs and tunnels still going get to report
their cancellation to the edge (``run.cancelled``, ``tunnel.end``) before the node leaves."""


class Drain:
    """A request to drain a node: tell the edge, take no new work, finish what runs (within
    ``config.drain_grace``), leave. Pass it to :func:`serve_node` (or
    :func:`serve_node_session`) and call :meth:`request` from any task in the same Trio run
    (a signal watcher, say); ``serve_node`` then returns once the node has left."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self._callbacks: list[Callable[[], None]] = []

    def is_requested(self) -> bool:
        return self._event.is_set()

    def request(self) -> None:
        """Ask for the drain (idempotent, never blocks)."""
        if self._event.is_set():
            return
        self._event.set()
        for callback in self._callbacks:
            callback()

    async def wait(self) -> None:
        await self._event.wait()

    def _on_request(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` when the drain is requested; returns the unsubscribe."""
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback)


class EdgeUnreachable(Exception):
    """The node never got in to the edge (no ``welcome``) within ``config.give_up_after``
    and gave up (not with ``config.keep_trying``). ``str()`` is one line: the edge URL, the
    attempts, and the last attempt's cause in words a person can act on."""


class _EndSession(Exception):
    """Internal: end the session, closing the connection with ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


# --------------------------------------------------------------------------- one session


_ANSWERS: Final = (*wire.TERMINAL_EVENTS, wire.TunnelEnd)
"""What this node sends to finish a run or a tunnel the edge gave it."""

_SendFrames = Callable[[Sequence[RawFrame]], Awaitable[None]]
"""A batching connection's ``send_many``."""


class _SendTurn:
    """The link's send lock (a ``trio.Lock``), taken as ``Lock`` takes it but without its
    schedule point when the lock is free: the send made under it has schedule points of its
    own (the websocket's), so a frame costs one trip through the scheduler fewer. A cancelled
    task is still stopped before it takes its turn."""

    def __init__(self) -> None:
        self._lock = trio.Lock()

    @trio.lowlevel.enable_ki_protection  # as trio.Lock's (a code flag: no cost per call)
    async def __aenter__(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    @trio.lowlevel.enable_ki_protection
    async def __aexit__(self, *_: object) -> None:
        self._lock.release()


class _Link:
    """The connection to the edge, seen through this node's half of the protocol state machine
    (:class:`~dispatcher.wire.NodeProtocol`): every frame the edge sends is judged by it,
    every frame this node sends is recorded in it, in wire order.

    Over a connection with ``send_many`` (:class:`nodes.websocket.WebSocketClient`: frames
    handed in, in call order, before its first schedule point, and written even if the
    caller is then cancelled) a send records its messages and hands their frames in without
    a lock: what the runner's writer, pongs and tunnels send while a write is in flight
    joins the next socket write. Over any other connection one send lock serializes them."""

    def __init__(self, conn: Connection, grants: EdgeGrants | None = None, edge: str = "") -> None:
        self._conn = conn
        self._batch: _SendFrames | None = getattr(conn, "send_many", None)
        self._lock = _SendTurn()
        self._idle = trio.lowlevel.ParkingLot()
        self.protocol = wire.NodeProtocol()
        self.draining = False
        """This node decided to drain: it refuses new runs and tunnels (set before
        ``node.draining`` is on the wire)."""
        self.grants = grants
        """The node's slots over its edges (None: this session has them all, unchecked)."""
        self.edge = edge
        """This session's edge, as :attr:`grants` knows it (its URL)."""
        self.counted: dict[str, Key] = {}
        """The runs and tunnels :attr:`grants` counts, by id, until they end."""

    def start_work(self, message: wire.RunRequest | wire.TunnelRequest) -> bool:
        """Count a run or tunnel against this edge's grant: False if it is beyond it."""
        if self.grants is None or (isinstance(message, wire.TunnelRequest) and not message.model):
            return True
        key = (message.provider_id, message.model)
        if not self.grants.run_started(self.edge, key):
            return False
        work_id = message.run_id if isinstance(message, wire.RunRequest) else message.tunnel_id
        self.counted[work_id] = key
        return True

    async def send(self, message: wire.NodeMessage) -> None:
        await self.send_many((message,))

    async def send_data(self, tunnel_id: str, data: bytes) -> None:
        await self.send_many((wire.TunnelData(tunnel_id, data),))

    async def send_many(self, messages: Sequence[wire.NodeMessage | wire.TunnelData]) -> None:
        """Send ``messages`` in order (one socket write over a batching connection)."""
        batch = self._batch
        if batch is None:
            for message in messages:
                async with self._lock:
                    frames: list[RawFrame] = []
                    self._record(message, frames)
                    for frame in frames:
                        await self._conn.send(frame)
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
            frames = []
            for message in messages:
                self._record(message, frames)
            await batch(frames)
        if self.protocol.is_idle() and any(isinstance(m, _ANSWERS) for m in messages):
            self._idle.unpark_all()

    def _record(self, message: wire.NodeMessage | wire.TunnelData, frames: list[RawFrame]) -> None:
        """``message`` recorded in the machine and its frame added to ``frames``; before an
        answer, the lowered grants it frees (this edge sees a lowered grant before it sees
        the slot free)."""
        if isinstance(message, wire.TunnelData):
            data_frame = wire.encode_tunnel_data(message.tunnel_id, message.data)
            self.protocol.send(message)
            frames.append(data_frame)
            return
        frame = wire.encode(message)
        if self.counted and isinstance(message, _ANSWERS):
            ended = message.tunnel_id if isinstance(message, wire.TunnelEnd) else message.run_id
            key = self.counted.pop(ended, None)
            if key is not None and self.grants is not None:
                for grant in self.grants.run_ended(self.edge, key):
                    self.protocol.send(grant)
                    frames.append(wire.encode(grant))
        self.protocol.send(message)
        frames.append(frame)

    async def receive(self) -> wire.Frame | None:
        """The next frame from the edge, once the machine accepted it; None when it tolerated
        it (a cancel or credit that crossed its run's or tunnel's end: nothing to do). Raises
        ``wire.ProtocolError`` for a frame that is not the protocol's or a message the edge
        may not send now (``wire.UnsupportedVersion`` for a welcome in another version)."""
        frame = await self._conn.receive()
        message = wire.decode_binary(frame) if isinstance(frame, bytes) else wire.decode(frame)
        verdict = self.protocol.receive(message)
        if isinstance(verdict, wire.ProtocolError):
            raise verdict
        return message if verdict is wire.ACCEPTED else None

    async def wait_idle(self) -> None:
        """Until every run and tunnel the edge gave has been answered."""
        while not self.protocol.is_idle():
            await self._idle.park()

    def in_flight(self) -> str:
        return (
            f"{len(self.protocol.running())} run(s) and "
            f"{len(self.protocol.open_tunnels())} tunnel(s)"
        )


async def serve_node_session(
    conn: Connection,
    config: NodeConfig,
    *,
    adapters: Mapping[str, Adapter] | None = None,
    tunnels: Mapping[str, AnyTunnelProvider] | None = None,
    drain: Drain | None = None,
    grants: EdgeGrants | None = None,
    task_status: trio.TaskStatus[wire.Welcome] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one connection to the edge, from ``hello`` until the connection ends.

    ``grants``: the node's slots shared over its edge sessions (:mod:`nodes.granting`): the
    hello announces this edge's grants (``config.edge_url`` names the edge), the session
    sends the grants that follow and counts its runs against them. None: the session has
    every slot (the in-process node, the tests of one session).

    Returns when the session is over for a transient reason (connection lost, edge silent,
    protocol error, handshake timeout), or once it has drained after ``drain`` was requested,
    after closing ``conn``. Raises :class:`NodeRejected` when the edge refuses the node for
    good. ``task_status.started(welcome)`` is called once the edge has welcomed the node.
    ``adapters`` defaults to ``build_adapters(config.providers)``, ``tunnels`` to
    ``tunnel_providers(config.providers)``. Their pooled HTTP clients not yet open are opened
    for this session (:func:`~nodes.adapters.open_adapters`,
    :func:`~nodes.tunnel.open_tunnel_pools`); pass them opened to keep the pools across
    sessions, as :func:`serve_node` does.
    """
    if adapters is None:
        adapters = build_adapters(config.providers)
    if tunnels is None:
        tunnels = tunnel_providers(config.providers)
    edge = config.edge_url
    link = _Link(conn, grants, edge)
    hello = hello_from_config(config, ADAPTERS)
    if grants is not None:
        hello = hello_with_grants(hello, grants.join(edge))
    code, reason = CLOSE_GOING_AWAY, "node shutting down"  # unless the session ends otherwise
    try:
        welcome = await _handshake(conn, link, config, hello)
        log.info(
            "node %s registered with the edge: generation %d, heartbeat every %.1f s",
            config.node_id,
            welcome.generation,
            welcome.heartbeat_interval,
        )
        task_status.started(welcome)
        silence_limit = (
            config.heartbeat_timeout_factor * welcome.heartbeat_interval
            if welcome.heartbeat_interval > 0
            else float("inf")
        )
        code, reason = await _serve_welcomed(
            link, adapters, tunnels, silence_limit, drain, config.drain_grace
        )
    except _EndSession as exc:
        code, reason = exc.code, exc.reason
        log.warning("ending session with the edge: %s", reason)
    except ConnectionClosed as exc:
        code, reason = CLOSE_NORMAL, f"connection lost: {exc.reason}"
        log.info("connection to the edge lost: %s (code %s)", exc.reason, exc.code)
    except NodeRejected as exc:
        code, reason = CLOSE_NORMAL, exc.reason
        raise
    except Exception:
        code, reason = CLOSE_INTERNAL_ERROR, "internal error"
        log.exception("node session failed")
    finally:
        link.protocol.close()
        if grants is not None:
            grants.leave(edge)
        with trio.move_on_after(close_budget(), shield=True):
            await conn.aclose(code, reason)


async def _handshake(
    conn: Connection, link: _Link, config: NodeConfig, hello: wire.Hello
) -> wire.Welcome:
    log.info(
        "connected; announcing node %s with %d provider(s), %d model(s)",
        config.node_id,
        len(hello.providers),
        sum(len(p.models) for p in hello.providers),
    )
    try:
        with trio.move_on_after(config.handshake_timeout) as scope:
            await link.send(hello)
            await link.receive()
    except ConnectionClosed as exc:
        if exc.code in PERMANENT_CLOSE_CODES:
            raise NodeRejected(f"{exc.reason} (close code {exc.code})") from None
        if exc.code == CLOSE_NODE_ID_IN_USE:
            log.warning(
                "the edge refused node id %s: %s; another node with another token holds it "
                "(retrying with backoff)",
                config.node_id,
                exc.reason,
            )
        raise
    except wire.UnsupportedVersion as exc:
        with trio.move_on_after(WEBSOCKET_CLOSE_TIMEOUT, shield=True):
            await conn.aclose(CLOSE_PROTOCOL_ERROR, "protocol version mismatch")
        raise NodeRejected(str(exc)) from None
    except wire.ProtocolError as exc:
        raise _EndSession(CLOSE_PROTOCOL_ERROR, str(exc)) from None
    if scope.cancelled_caught:
        raise _EndSession(
            CLOSE_GOING_AWAY, f"no welcome from the edge within {config.handshake_timeout} s"
        )
    welcome = link.protocol.welcome
    assert welcome is not None  # the machine accepted the edge's first frame: its welcome
    return welcome


async def _serve_welcomed(
    link: _Link,
    adapters: Mapping[str, Adapter],
    tunnel_providers: Mapping[str, AnyTunnelProvider],
    silence_limit: float,
    drain: Drain | None,
    drain_grace: float,
) -> tuple[int, str]:
    """Run the welcomed session; return the close code and reason when it must end."""
    end: tuple[int, str] = (CLOSE_NORMAL, "session ended")
    try:
        async with (
            open_runner(link.send, adapters=adapters, send_many=link.send_many) as runner,
            open_tunnels(
                link.send, link.send_data, tunnel_providers, send_many=link.send_many
            ) as tunnels,
            trio.open_nursery() as nursery,
        ):

            async def receive() -> None:
                nonlocal end
                end = await _receive_loop(link, runner, tunnels, silence_limit)
                nursery.cancel_scope.cancel(reason="session over")

            async def drain_when_asked(drain: Drain) -> None:
                nonlocal end
                await drain.wait()
                end = await _drain(link, runner, tunnels, drain_grace)
                nursery.cancel_scope.cancel(reason="node drained")

            nursery.start_soon(receive)
            if drain is not None:
                nursery.start_soon(drain_when_asked, drain)
            if link.grants is not None:
                nursery.start_soon(link.grants.send_grants, link.edge, link.send)
    except* DropConnection as group:
        reason = str(first_leaf(group, DropConnection))
        log.warning("dropping the connection to the edge (%s)", reason)
        end = (CLOSE_INTERNAL_ERROR, f"connection dropped: {reason}")
    except* ConnectionClosed as group:
        # The runner's nursery wraps the tunnels' nursery: the group may be nested.
        closed = first_leaf(group, ConnectionClosed)
        assert closed is not None  # except* matched, so there is one at some depth
        if link.protocol.edge_draining:
            log.info("the edge closed the session after draining (code %s)", closed.code)
        else:
            log.info("connection to the edge lost: %s (code %s)", closed.reason, closed.code)
        end = (CLOSE_NORMAL, f"connection lost: {closed.reason}")
    return end


async def _drain(
    link: _Link, runner: Runner, tunnels: TunnelRunner, grace: float
) -> tuple[int, str]:
    """Tell the edge, refuse new work, give what runs ``grace`` seconds, then cancel what is
    left and let it report so; the close to send (a normal one: the node left on purpose)."""
    link.draining = True
    grace_over = trio.current_time() + grace
    log.info("draining: taking no new work; %s in flight get %.1f s", link.in_flight(), grace)
    # The announcement has its own bound: with a grace of 0 the edge is still told.
    with trio.move_on_after(CANCEL_REPORT_TIMEOUT):
        await link.send(wire.NodeDraining(grace=grace))
    with trio.move_on_at(grace_over):
        await link.wait_idle()
        log.info("drained: leaving the edge")
        return CLOSE_NORMAL, "node drained"
    log.warning("drain grace of %.1f s is over: cancelling %s", grace, link.in_flight())
    for run_id in link.protocol.running():
        runner.cancel(run_id, "node drain grace over")
    for tunnel_id in link.protocol.open_tunnels():
        tunnels.cancel(tunnel_id)
    with trio.move_on_after(CANCEL_REPORT_TIMEOUT) as reporting:
        await link.wait_idle()
    if reporting.cancelled_caught:
        log.warning("leaving with %s that did not report their end", link.in_flight())
    return CLOSE_NORMAL, "node drain grace over"


async def _receive_loop(
    link: _Link, runner: Runner, tunnels: TunnelRunner, silence_limit: float
) -> tuple[int, str]:
    while True:
        try:
            with trio.move_on_after(silence_limit) as watchdog:
                message = await link.receive()
        except wire.ProtocolError as exc:
            log.warning("protocol error from the edge: %s; closing the session", exc)
            return CLOSE_PROTOCOL_ERROR, str(exc)
        if watchdog.cancelled_caught:
            reason = f"edge silent for {silence_limit:.1f} s"
            log.warning("ending session: %s", reason)
            return CLOSE_GOING_AWAY, reason
        if message is not None:
            await _carry_out(message, link, runner, tunnels)


async def _carry_out(
    message: wire.Frame, link: _Link, runner: Runner, tunnels: TunnelRunner
) -> None:
    """Do what a message the machine accepted from the edge asks."""
    if isinstance(message, wire.Ping):
        await link.send(wire.Pong(nonce=message.nonce))
    elif isinstance(message, wire.RunRequest | wire.TunnelRequest) and link.draining:
        log.info("%s: refused, this node is draining", _describe_work(message))
        await link.send(_draining_refusal(message))
    elif isinstance(message, wire.RunRequest | wire.TunnelRequest) and not link.start_work(message):
        log.warning(
            "%s: refused, the edge at %s sent it beyond the slots this node granted it "
            "(a protocol error of the edge's)",
            _describe_work(message),
            link.edge,
        )
        await link.send(_beyond_grant_refusal(message))
    elif isinstance(message, wire.Demand):
        if link.grants is not None:
            link.grants.report(link.edge, message)
    elif isinstance(message, wire.RunRequest):
        log.debug(
            "run %s: request for %s on provider %s",
            message.run_id,
            message.served_model,
            message.provider_id,
        )
        runner.start(message)
    elif isinstance(message, wire.RunCancel):
        runner.cancel(message.run_id, message.reason)
    elif isinstance(message, wire.TunnelCredit):
        tunnels.credit(message.tunnel_id, message.bytes)
    elif isinstance(message, wire.TunnelRequest):
        log.debug(
            "tunnel %s: %s %s on provider %s",
            message.tunnel_id,
            message.method,
            message.path,
            message.provider_id,
        )
        tunnels.start(message)
    elif isinstance(message, wire.TunnelCancel):
        tunnels.cancel(message.tunnel_id)
    elif isinstance(message, wire.EdgeDraining):
        log.info(
            "the edge is draining (grace %.1f s): finishing what runs here, then reconnecting",
            message.grace,
        )
    elif isinstance(message, wire.TunnelData):
        tunnels.body(message.tunnel_id, message.data)
    # Nothing else gets here: the machine refuses what is not the edge's to send.


def _draining_refusal(message: wire.RunRequest | wire.TunnelRequest) -> wire.NodeMessage:
    """The answer to work the edge sent after this node said it is draining: a retryable
    failure with code :data:`NODE_DRAINING`."""
    if isinstance(message, wire.RunRequest):
        return wire.RunFailed(
            run_id=message.run_id,
            seq=0,
            code=NODE_DRAINING,
            message="this node is draining: it takes no new runs",
            retryable=True,
        )
    return wire.TunnelEnd(
        tunnel_id=message.tunnel_id,
        error=f"{NODE_DRAINING}: this node is draining: it takes no new tunnels",
        retryable=True,
    )


def _beyond_grant_refusal(message: wire.RunRequest | wire.TunnelRequest) -> wire.NodeMessage:
    """The answer to work an edge sent beyond its grant: a failure with code
    :data:`BEYOND_GRANT`, not retryable here (the edge's own count is wrong)."""
    why = "beyond the slots this node granted this edge"
    if isinstance(message, wire.RunRequest):
        return wire.RunFailed(
            run_id=message.run_id, seq=0, code=BEYOND_GRANT, message=f"run refused: {why}"
        )
    return wire.TunnelEnd(tunnel_id=message.tunnel_id, error=f"{BEYOND_GRANT}: {why}")


def _describe_work(message: wire.RunRequest | wire.TunnelRequest) -> str:
    if isinstance(message, wire.RunRequest):
        return f"run {message.run_id}"
    return f"tunnel {message.tunnel_id}"


# --------------------------------------------------------------------------- reconnecting


@attrs.define(eq=False)
class _Attempt:
    """One dial and session of :func:`serve_node`."""

    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    welcomed: bool = False

    def abandon_unless_welcomed(self) -> None:
        if not self.welcomed:
            self.scope.cancel(reason="node draining")


class _WelcomeStatus:
    """A ``task_status`` for :func:`serve_node_session` that reports the first welcome."""

    def __init__(self, on_welcome: Callable[[wire.Welcome], None]) -> None:
        self._on_welcome = on_welcome

    def started(self, value: Any = None) -> None:
        assert isinstance(value, wire.Welcome)
        self._on_welcome(value)


async def serve_node(  # noqa: ASYNC128 (task_status is passed on to _reconnect_loop)
    config: NodeConfig,
    *,
    dial: Dial | None = None,
    rng: random.Random | None = None,
    drain: Drain | None = None,
    dials: Mapping[str, Dial] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep this node connected to the edge until cancelled, or until it has drained.

    With several edges (``config.edges``), one session per edge, each reconnecting on its
    own, all over the same provider pools, sharing the node's slots
    (:class:`~nodes.granting.EdgeGrants`); ``dials`` gives the dial of an edge by its URL
    (the tests' seam). ``task_status.started()`` comes with the first welcome from any.

    Dials with ``dial`` (default :func:`dial_edge`), serves a session, and after any
    connection loss or dial failure waits a :class:`Backoff` delay (reset after a session
    that lasted ``config.reconnect_reset_after``) and dials again. ``task_status.started()``
    is called after the *first* welcome, so ``await nursery.start(serve_node, config)``
    returns once the node is registered. Raises :class:`NodeRejected` (logged at ERROR) when
    the edge refuses the node for good.

    Attempts that fail in a row are logged at INFO, then at WARNING naming the cause in
    words a person can act on (the third, then one a minute; see :mod:`nodes.reconnect`). A
    node that was never welcomed gives up ``config.give_up_after`` seconds after its first
    attempt and raises :class:`EdgeUnreachable` (logged at ERROR), unless
    ``config.keep_trying``; once welcomed, it reconnects for ever.

    When ``drain`` is requested the session drains (see :func:`serve_node_session`) and
    ``serve_node`` returns; requested while not connected (or before welcome), it returns at
    once.

    The providers' pooled HTTP clients (the normalized adapters' and the tunnels', one per
    provider, sized to its slots) are opened once and held for the whole call, around every
    session: the connections to the providers survive a reconnect to the edge (the runs and
    tunnels of a lost session are cancelled, which closes *their* connections).

    Raises ``ValueError`` at once, before dialling, when the default dial is used and
    ``config.edge_url`` is not an edge's node endpoint (a mistake no retry can fix).
    """
    edges = config.edge_urls
    if dial is not None and len(edges) > 1:
        raise ValueError("serve_node(dial=...) dials one edge: this config names several")
    if dial is not None:
        dials = {edges[0]: dial}
    for url in edges:  # a URL that can never work is said before dialling
        if dials is None or url not in dials:
            edge_dial(attrs.evolve(config, edge_url=url, edges=()))
    if drain is None:
        drain = Drain()  # never requested
    grants = EdgeGrants(config)
    # The providers' pools live as long as the node, around every session: the connections
    # to the providers survive a reconnect to the edge.
    async with (
        open_adapters(build_adapters(config.providers)) as adapters,
        open_tunnel_pools(tunnel_providers(config.providers)) as tunnels,
    ):
        edges_served = _Edges(config, dials or {}, rng, drain, adapters, tunnels, grants)
        await edges_served.serve(task_status)
    log.info("node %s drained: stopping", config.node_id)


class _FirstStarted:
    """One ``task_status`` for several loops: started once, by the first welcome."""

    def __init__(self, task_status: trio.TaskStatus[None]) -> None:
        self._task_status = task_status
        self._started = False

    def started(self, value: None = None) -> None:
        if not self._started:
            self._started = True
            self._task_status.started()


@attrs.define(eq=False)
class _EdgeLoop:
    """One edge the node serves: its reconnect loop's scope, and what its welcomes said."""

    url: str
    learned: bool
    """Told by another edge's welcome (not in the node's config)."""
    edges: _Edges
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    edge_id: str | None = None
    in_session: bool = False

    def welcomed(self, welcome: wire.Welcome) -> None:
        self.in_session = True
        self.edges.welcomed(self, welcome)

    def ended(self) -> None:
        self.in_session = False


@attrs.define(eq=False)
class _Edges:
    """:func:`serve_node`'s edges: one reconnect loop per edge, each on its own (a lost,
    superseded or unreachable edge touches no other session), all over the same provider
    pools and grants.

    The configured edges are served from the start; each welcome names the other live edges
    sharing the stores (``welcome.edges``), and those the node does not serve yet are
    dialled too (**learned**), so adding an edge needs no change on any node. A learned edge
    no welcome lists any more, and not in a session, is forgotten. Two loops that reach the
    same edge (its id, ``welcome.edge_id``, under two URLs) keep the configured one.

    With one configured edge, its loop is the node's as before: it gives up
    (:class:`EdgeUnreachable`) or is rejected (:class:`NodeRejected`) as configured. With
    several, an edge that cannot be reached is tried for ever (it is restarting, not a
    wrong URL); one that rejects the node is left. When every configured edge rejected the
    node (or was given up on), the first reason is raised and the learned ones end too."""

    config: NodeConfig
    dials: Mapping[str, Dial]
    rng: random.Random | None
    drain: Drain
    adapters: Mapping[str, Adapter]
    tunnels: Mapping[str, AnyTunnelProvider]
    grants: EdgeGrants
    loops: dict[str, _EdgeLoop] = attrs.Factory(dict)
    failures: list[NodeRejected | EdgeUnreachable] = attrs.Factory(list)
    _nursery: trio.Nursery | None = None
    _started: _FirstStarted | None = None

    async def serve(self, task_status: trio.TaskStatus[None]) -> None:  # noqa: ASYNC128
        # (task_status is started by the first welcome of any loop: _FirstStarted)
        self._started = _FirstStarted(task_status)
        configured = self.config.edge_urls
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for url in configured:
                self._start(url, learned=False)
        self._nursery = None
        if len(self.failures) == len(configured) and not self.drain.is_requested():
            raise self.failures[0]

    def welcomed(self, loop: _EdgeLoop, welcome: wire.Welcome) -> None:
        loop.edge_id = welcome.edge_id or None
        if loop.edge_id is not None:
            for other in list(self.loops.values()):
                if other is loop or other.edge_id != loop.edge_id:
                    continue
                extra = loop if loop.learned else other if other.learned else None
                if extra is not None:
                    log.info(
                        "edge %s is served at %s already: not dialling %s",
                        loop.edge_id,
                        (other if extra is loop else loop).url,
                        extra.url,
                    )
                    self._forget(extra)
        listed_ids = {peer.id for peer in welcome.edges}
        listed_urls = {peer.node_url for peer in welcome.edges}
        for other in list(self.loops.values()):
            gone = other.edge_id not in listed_ids and other.url not in listed_urls
            if other is not loop and other.learned and not other.in_session and gone:
                log.info("the edge at %s is no longer listed: not dialling it", other.url)
                self._forget(other)
        known_ids = {other.edge_id for other in self.loops.values()}
        for peer in welcome.edges:
            if peer.node_url in self.loops or peer.id in known_ids:
                continue
            log.info(
                "edge %s at %s told of edge %s: serving it too at %s",
                loop.edge_id or "?",
                loop.url,
                peer.id,
                peer.node_url,
            )
            self._start(peer.node_url, learned=True)

    def _start(self, url: str, *, learned: bool) -> None:
        if self._nursery is None or url in self.loops:
            return
        loop = self.loops[url] = _EdgeLoop(url, learned, self)
        self._nursery.start_soon(self._run, loop, name=f"edge {url}")

    def _forget(self, loop: _EdgeLoop) -> None:
        loop.scope.cancel(reason="edge forgotten")
        if self.loops.get(loop.url) is loop:
            del self.loops[loop.url]

    async def _run(self, loop: _EdgeLoop) -> None:
        alone = len(self.config.edge_urls) == 1 and not loop.learned
        edge_config = attrs.evolve(
            self.config,
            edge_url=loop.url,
            edges=(),
            keep_trying=self.config.keep_trying or not alone,
        )
        dial = self.dials.get(loop.url) or edge_dial(edge_config)
        assert self._started is not None
        try:
            with loop.scope:
                await _reconnect_loop(
                    edge_config,
                    dial,
                    self.rng,
                    self.drain,
                    self.adapters,
                    self.tunnels,
                    self.grants,
                    self._started,  # its started() is all the loop calls
                    loop,
                )
        except (NodeRejected, EdgeUnreachable) as exc:
            if self.loops.get(loop.url) is loop:
                del self.loops[loop.url]
            if loop.learned:
                log.warning("leaving the edge at %s (told of by another edge)", loop.url)
                return
            self.failures.append(exc)
            configured = len(self.config.edge_urls)
            if len(self.failures) == configured:
                assert self._nursery is not None
                self._nursery.cancel_scope.cancel(reason="every configured edge failed")
            else:
                left = configured - len(self.failures)
                log.warning("leaving the edge at %s; %d other edge(s) still served", loop.url, left)


async def _reconnect_loop(
    config: NodeConfig,
    dial: Dial,
    rng: random.Random | None,
    drain: Drain,
    adapters: Mapping[str, Adapter],
    tunnels: Mapping[str, AnyTunnelProvider],
    grants: EdgeGrants,
    task_status: trio.TaskStatus[None],
    watcher: _EdgeLoop | None = None,
) -> None:
    """:func:`serve_node`'s loop for one edge (``config.edge_url``): dial, serve a session,
    back off, until drained; what to do after each attempt is the
    :class:`~nodes.reconnect.Reconnect` policy's decision."""
    policy = Reconnect(
        Backoff(config.reconnect_min_backoff, config.reconnect_max_backoff, rng=rng),
        give_up_after=None if config.keep_trying else config.give_up_after,
        reset_after=config.reconnect_reset_after,
    )

    def on_welcome(attempt: _Attempt, welcome: wire.Welcome) -> None:
        attempt.welcomed = True
        if not policy.welcomed_once:
            task_status.started()
        policy.welcomed()
        if watcher is not None:
            watcher.welcomed(welcome)

    while not drain.is_requested():
        connected_at: float | None = None
        attempt = _Attempt()
        # A drain asked for while dialling or before welcome abandons the attempt; once
        # welcomed, the session drains itself.
        unsubscribe = drain._on_request(attempt.abandon_unless_welcomed)
        policy.dialling(trio.current_time())
        try:
            with attempt.scope:
                async with dial() as conn:
                    connected_at = trio.current_time()
                    await serve_node_session(
                        conn,
                        config,
                        adapters=adapters,
                        tunnels=tunnels,
                        drain=drain,
                        grants=grants,
                        task_status=_WelcomeStatus(partial(on_welcome, attempt)),
                    )
            cause = DialCause.other(
                "session ended"
                if attempt.welcomed
                else "the edge ended the session before welcoming the node"
            )
            if watcher is not None:
                watcher.ended()
        except NodeRejected as exc:
            _log_rejection(config, exc)
            raise
        except DialFailed as exc:
            cause = exc.cause
        except (ConnectionClosed, OSError) as exc:
            cause = DialCause.other(explain(exc))
        except Exception as exc:
            rejected = _find_rejection(exc)
            if rejected is not None:
                _log_rejection(config, rejected)
                raise rejected from exc
            log.exception("unexpected error in the node session")
            cause = DialCause.other(f"error: {explain(exc)}")
        finally:
            unsubscribe()
        if drain.is_requested():
            break
        now = trio.current_time()
        if attempt.welcomed and connected_at is not None:
            decision: Retry | GiveUp = policy.session_ended(now, connected_at=connected_at)
        else:
            decision = policy.failed(now)
        if isinstance(decision, GiveUp):
            message = _give_up_message(config, decision, cause)
            log.error("%s", message)
            raise EdgeUnreachable(message)
        _log_retry(config, policy, decision, cause)
        with trio.move_on_after(decision.delay):
            await drain.wait()


def _log_retry(config: NodeConfig, policy: Reconnect, retry: Retry, cause: DialCause) -> None:
    why = advice(cause, config.edge_url)
    if retry.level < logging.WARNING:
        log.log(
            retry.level,
            "reconnecting to %s in %.2f s (attempt %d; %s)",
            config.edge_url,
            retry.delay,
            policy.backoff.failures,
            why,
        )
        return
    if retry.gives_up_in is None:
        then = f"next attempt in {retry.delay:.1f} s"
    elif retry.gives_up_in <= retry.delay:
        then = f"one last attempt in {retry.delay:.1f} s, then it gives up"
    else:
        then = (
            f"next attempt in {retry.delay:.1f} s; it gives up in {retry.gives_up_in:.0f} s "
            "unless it gets in (--keep-trying, or keep_trying = true, never does)"
        )
    log.warning(
        "cannot reach the edge at %s (%d attempts in a row over %.0f s; %s): %s",
        config.edge_url,
        retry.failures,
        retry.failing_for,
        then,
        why,
    )


def _give_up_message(config: NodeConfig, decision: GiveUp, cause: DialCause) -> str:
    return (
        f"node {config.node_id} gave up: it never got in to the edge at {config.edge_url} "
        f"({decision.failures} attempts in {decision.failing_for:.0f} s): "
        f"{advice(cause, config.edge_url)} (--keep-trying, or keep_trying = true, keeps "
        "trying for ever)"
    )


def _log_rejection(config: NodeConfig, exc: NodeRejected) -> None:
    # An expected, permanent condition: the reason, not a traceback.
    log.error("the edge rejected node %s: %s; not reconnecting", config.node_id, exc.reason)


def _find_rejection(exc: BaseException) -> NodeRejected | None:
    return first_leaf(exc, NodeRejected)


def run_node(config: NodeConfig, *, dial: Dial | None = None) -> int:
    """Run :func:`serve_node` in a fresh Trio loop (main thread only) and return the process
    exit status. The first SIGINT (Ctrl-C) or SIGTERM drains the node
    (``config.drain_grace``), then it exits 0; a second one stops it at once (exit status
    128 + the signal number). :data:`EXIT_REJECTED` (2) when the edge rejected the node for
    good, :data:`EXIT_GAVE_UP` (3) when the node never got in and gave up
    (:class:`EdgeUnreachable`); each is logged at ERROR in one line."""
    try:
        return trio.run(partial(_serve_until_signalled, config, dial))
    except KeyboardInterrupt:  # only before the signal receiver is in place
        log.info("node %s stopped", config.node_id)
        return 0


async def _serve_until_signalled(config: NodeConfig, dial: Dial | None) -> int:
    status = 0
    drain = Drain()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                nonlocal status
                try:
                    await serve_node(config, dial=dial, drain=drain)
                except NodeRejected:
                    status = EXIT_REJECTED
                except EdgeUnreachable:
                    status = EXIT_GAVE_UP
                nursery.cancel_scope.cancel(reason="node stopped")

            nursery.start_soon(serve)
            async for signum in signals:
                name = signal.Signals(signum).name
                if not drain.is_requested():
                    log.info(
                        "%s: draining (in-flight work gets %.1f s; again to stop at once)",
                        name,
                        config.drain_grace,
                    )
                    drain.request()
                else:
                    log.warning("%s again: stopping now", name)
                    status = 128 + signum
                    nursery.cancel_scope.cancel(reason="second signal")
                    break
    return status
