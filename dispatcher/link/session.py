"""The edge's side of one node connection: handshake, authentication, heartbeats, routing.

:func:`serve_node_connection` owns one connection from ``hello`` to close. It is transport
agnostic: the HTTP endpoint runs it over our server's websocket, and embedded apps and tests
run it over an in-memory connection. Whatever the node sends that breaks the protocol closes
*that* session (code 1002, with the reason) and is logged; nothing it sends can hurt the edge
or other nodes. What the node may send when is not decided here: every message is judged by
the session's protocol state machine (:class:`dispatcher.wire.EdgeProtocol`, via
:meth:`NodeSession.receive`); this module owns the policy on top (tokens, identities, the
limits of a ``hello`` or ``capacity``, heartbeats).

**Who may be which node.** With node tokens configured, ``hello.token`` must be one of them,
and the token must be allowed the node id it claims (:class:`NodeCredential`: a plain token
may claim any id, a bound one only the ids its patterns match); otherwise the connection is
closed with 4001. A connection claiming the id of a *live* session authenticated with another
credential is refused with 4004 and the live session goes on untouched; one with the same
credential supersedes it (a node reconnecting; the old session is fenced by its generation).
On an open edge (no tokens) every connection has the same, empty credential: any of them may
take over any node id -- except the in-process node's, which is trusted
(``authenticated_as=LOCAL_CREDENTIAL``) and so never shares a credential with a connection.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import logging
import re
from collections.abc import Callable, Sequence
from typing import Final, Literal

import attrs
import trio

from .. import wire
from ..shared.transport import Connection, ConnectionClosed
from ..wire import (
    CLOSE_AUTH_FAILED,
    CLOSE_GOING_AWAY,
    CLOSE_HEARTBEAT,
    CLOSE_NODE_ID_IN_USE,
    CLOSE_POLICY,
    CLOSE_PROTOCOL_ERROR,
    CLOSE_SUPERSEDED,
)
from .registry import (
    LostCode,
    NodeGone,
    NodeIdInUse,
    NodeSession,
    Registry,
)

log = logging.getLogger("dispatcher.nodes")

CLOSE_ABNORMAL = 1006
"""Not sent: the code a websocket reports for a connection lost without a close frame (the
codes a session is closed with are the wire protocol's, ``wire.CLOSE_*``)."""

LOCAL_CREDENTIAL: Final = "in-process"
"""The credential of the in-process node (``Dispatcher.attach_local_node``): trusted without
a token, and never equal to a connection's (those are token digests, or None)."""

WRITER_STOP_TIMEOUT = 2.0
"""How long a session that is ending waits for its writer to finish the frame it is writing
(then the write is cut, which aborts the connection)."""
LAST_FRAMES_TIMEOUT = 1.0
"""After a write found the connection closed, how long the receive loop may still read the
frames the node sent before it closed."""


@attrs.frozen
class NodeCredential:
    """A node token and the node ids it may claim."""

    token: str = attrs.field(repr=False)
    ids: tuple[str, ...] | None = None
    """Glob patterns (``fnmatch``, case-sensitive) of the node ids this token may claim;
    None: any id."""

    def allows(self, node_id: str) -> bool:
        return self.ids is None or any(fnmatch.fnmatchcase(node_id, p) for p in self.ids)


@attrs.frozen(kw_only=True)
class NodeLinkSettings:
    node_tokens: tuple[str | NodeCredential, ...] = attrs.field(default=(), repr=False)
    """When non-empty, ``hello.token`` must equal one of these, and that token must allow
    the node id (a plain string allows any id)."""
    hello_timeout: float = 10.0
    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 15.0
    """A node silent for this long is dropped and its runs fail."""
    limits: HelloLimits = attrs.field(factory=lambda: HelloLimits())
    """What one node may announce (``hello`` and ``capacity`` beyond these are refused)."""


@attrs.frozen(kw_only=True)
class HelloLimits:
    """Bounds on what one node may announce: a node must not be able to grow the edge's
    memory or its metric series at will, nor put unsafe text into headers and logs."""

    max_slots: int = 4096
    """Per model of a provider (``slots``; ``long_context_slots`` may not exceed it)."""
    max_providers: int = 32
    max_models: int = 512
    """Models over all of the node's providers."""
    max_name_length: int = wire.MAX_ID_LENGTH
    """Node id, provider id, model names and capabilities; the label may be 200."""
    max_capabilities: int = 16


_ID = wire.ID_PATTERN
"""Node and provider ids: safe in a header, a metric label and a log line."""
_MODEL = re.compile(r"[A-Za-z0-9._:/@+=~-]+")
"""Model names (public and served): what model ids look like, nothing that needs escaping."""
_CAPABILITY = re.compile(r"[a-z0-9_]+")
MAX_LABEL = 200


def check_hello(hello: wire.Hello, limits: HelloLimits) -> str | None:
    """Why ``hello`` is refused, or None when it is within ``limits`` (pure)."""

    def bad_id(what: str, value: str, pattern: re.Pattern[str] = _ID) -> str | None:
        if not value or len(value) > limits.max_name_length:
            return f"{what} must be 1 to {limits.max_name_length} characters"
        if pattern.fullmatch(value) is None:
            return f"{what} {escape(value)} has characters outside [{pattern.pattern}]"
        return None

    reason = bad_id("node_id", hello.node_id)
    if reason is not None:
        return reason
    if len(hello.label) > MAX_LABEL or any(not ch.isprintable() for ch in hello.label):
        return f"label must be at most {MAX_LABEL} printable characters"
    if len(hello.providers) > limits.max_providers:
        return f"{len(hello.providers)} providers announced; at most {limits.max_providers}"
    models = sum(len(p.models) for p in hello.providers)
    if models > limits.max_models:
        return f"{models} models announced; at most {limits.max_models}"
    seen: set[str] = set()
    for provider in hello.providers:
        reason = bad_id("provider id", provider.id)
        if reason is None and provider.id in seen:
            reason = f"provider id {provider.id!r} announced twice"
        if reason is not None:
            return reason
        seen.add(provider.id)
        for what, value in (("provider type", provider.type), ("adapter", provider.adapter)):
            reason = bad_id(f"{provider.id}: {what}", value, _MODEL)
            if reason is not None:
                return reason
        for model in provider.models:
            where = f"{provider.id}/{model.name}"
            reason = (
                bad_id(f"{provider.id}: model name", model.name, _MODEL)
                or bad_id(f"{where}: served_name", model.served_name, _MODEL)
                or check_slots(model.slots, model.long_context_slots, limits)
            )
            if reason is not None:
                return f"{where}: {reason}" if reason.startswith("slots") else reason
            if model.context_window is not None and model.context_window < 1:
                return f"{where}: context_window must be positive"
            if len(model.capabilities) > limits.max_capabilities:
                return f"{where}: at most {limits.max_capabilities} capabilities"
            for capability in model.capabilities:
                reason = bad_id(f"{where}: capability", capability, _CAPABILITY)
                if reason is not None:
                    return reason
    return None


def check_slots(slots: int, long_context_slots: int, limits: HelloLimits) -> str | None:
    if not 0 <= slots <= limits.max_slots:
        return f"slots {slots} is outside 0..{limits.max_slots}"
    if not 0 <= long_context_slots <= slots:
        return f"slots: long_context_slots {long_context_slots} is outside 0..slots ({slots})"
    return None


def escape(text: str) -> str:
    """``text`` quoted, with anything unprintable escaped: safe in one log line."""
    return repr(text)


Parting = Literal["closed", "broken", "dropped", "superseded"]
"""How a session's connection came to an end, as the session saw it: the node closed it (a
close frame), it broke (no close frame: the node was killed, the network failed), the edge
dropped the node (heartbeat timeout, protocol error, outbox overflow), or a reconnect of the
node superseded the session."""


class _Closing(Exception):
    def __init__(self, code: int, reason: str, parting: Parting = "dropped") -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.parting: Parting = parting


def connection_parting(exc: ConnectionClosed) -> tuple[Parting, str]:
    """How a connection that raised ``exc`` ended (pure): closed by the node (its close
    frame's code and reason), or broken (no close frame: 1006, the code a websocket reports
    for a connection lost, or none at all)."""
    if exc.code is None or exc.code == CLOSE_ABNORMAL:
        return "broken", "its connection broke"
    detail = f"code {exc.code}: {exc.reason}" if exc.reason else f"code {exc.code}"
    return "closed", f"it closed its connection ({detail})"


def _connection_ended(exc: ConnectionClosed) -> _Closing:
    parting, detail = connection_parting(exc)
    return _Closing(CLOSE_GOING_AWAY, detail, parting)


@attrs.frozen
class SessionEnd:
    """Why a node session ended: the code its runs and tunnels in flight fail with (a
    :data:`~dispatcher.link.registry.LostCode`) and the sentence their clients and the edge's
    log are told."""

    code: LostCode
    message: str


def session_end(
    node_id: str,
    parting: Parting | None,
    detail: str = "",
    *,
    draining: bool = False,
    edge_closing: bool = False,
) -> SessionEnd:
    """Why ``node_id``'s session ended (pure): the edge shutting down first (whatever the
    connection did meanwhile), then a node that said it is draining (its operator stopped
    it: it left on purpose), else the node was lost -- how, as the session saw it end
    (``parting``, with ``detail``; None: the session was cancelled before it saw anything,
    which is how the HTTP layer tells a handler that its peer is gone)."""
    if edge_closing:
        return SessionEnd("shutting_down", "the edge is shutting down")
    if parting == "superseded":
        return SessionEnd("stale_generation", detail)
    if draining:
        return SessionEnd(
            "node_draining", f"node {node_id} left while draining (its operator stopped it)"
        )
    if parting is None or parting == "broken":
        return SessionEnd("node_lost", f"node {node_id} was lost: its connection broke")
    if parting == "closed":
        return SessionEnd("node_lost", f"node {node_id} was lost: {detail}")
    return SessionEnd("node_lost", f"node {node_id} was lost: the edge dropped it ({detail})")


@attrs.frozen
class Authenticated:
    """The credential a ``hello`` authenticated with: a digest of its token (never logged),
    or None on an open edge."""

    credential: str | None


@attrs.frozen
class Refused:
    """Why a ``hello``'s token is refused (close 4001)."""

    reason: str


def authenticate(
    token: str | None, node_id: str, allowed: Sequence[str | NodeCredential]
) -> Authenticated | Refused:
    """Whether ``token`` may claim ``node_id`` (pure). No tokens configured: anyone, with no
    credential."""
    if not allowed:
        return Authenticated(None)
    if token is None:
        return Refused("missing node token")
    given = token.encode()
    matched = False
    permitted = False
    for entry in allowed:  # no early exit: constant time over the configured tokens
        credential = entry if isinstance(entry, NodeCredential) else NodeCredential(entry)
        # An empty configured token matches nothing (not even an empty one).
        match = hmac.compare_digest(given, credential.token.encode()) and bool(credential.token)
        matched |= match
        permitted |= match and credential.allows(node_id)
    if not matched:
        return Refused("invalid node token")
    if not permitted:
        return Refused(f"node token not allowed for node id {escape(node_id)}")
    return Authenticated(hashlib.sha256(given).hexdigest())


async def serve_node_connection(
    conn: Connection,
    registry: Registry,
    settings: NodeLinkSettings,
    *,
    on_capacity: Callable[[NodeSession, wire.Capacity], None] | None = None,
    on_draining: Callable[[NodeSession], None] | None = None,
    peer: str = "in-memory",
    authenticated_as: str | None = None,
    edge_id: str = "",
    peers: Callable[[], tuple[wire.EdgePeer, ...]] | None = None,
) -> None:
    """Serve one node connection until it closes. Never raises for anything the node does.
    Every session that ends logs why (``node ... left: <reason>``).

    ``authenticated_as``: the connection is trusted as this credential (the in-process node,
    :data:`LOCAL_CREDENTIAL`): its ``hello.token`` is not checked. The welcome names this
    edge (``edge_id``) and the other live edges (``peers()``), for the node to serve them
    too."""
    session: NodeSession | None = None
    ending = _Ending()
    close_code, close_reason = CLOSE_GOING_AWAY, "session ended"
    try:
        protocol = wire.EdgeProtocol()
        hello, credential = await _receive_hello(conn, settings, authenticated_as, protocol)
        try:
            session = registry.register(hello, conn, credential=credential, protocol=protocol)
        except NodeIdInUse as exc:
            raise _Closing(CLOSE_NODE_ID_IN_USE, str(exc)) from None
        log.info(
            "node %s (%s) joined from %s, generation %d, models: %s",
            hello.node_id,
            escape(hello.label) if hello.label else "-",
            peer,
            session.generation,
            ", ".join(sorted({m.name for p in hello.providers for m in p.models})) or "none",
        )
        session.post(
            wire.Welcome(
                protocol=wire.PROTOCOL_VERSION,
                generation=session.generation,
                heartbeat_interval=settings.heartbeat_interval,
                edge_id=edge_id,
                edges=peers() if peers is not None else (),
            )
        )
        await _serve_session(conn, session, settings, on_capacity, on_draining, ending)
        closing = ending.seen or _Closing(CLOSE_GOING_AWAY, "session ended")
        close_code, close_reason = closing.code, closing.reason
        if closing.code in (CLOSE_PROTOCOL_ERROR, CLOSE_HEARTBEAT, CLOSE_POLICY):
            log.warning("node %s: closing session: %s", session.node_id, closing.reason)
    except _Closing as closing:
        close_code, close_reason = closing.code, closing.reason
        log.warning("node connection from %s refused: %s", peer, closing.reason)
    except (ConnectionClosed, NodeGone) as exc:
        close_reason = f"connection lost: {exc}"
        log.info("node connection from %s lost: %s", peer, exc)
    except Exception:
        log.exception("node connection from %s failed", peer)
        close_code, close_reason = 1011, "internal error"
        ending.end(_Closing(close_code, "an internal error"))
    finally:
        if session is not None:
            # Why it ended is what the session saw, not a cancellation's reason: the HTTP
            # layer cancels a handler whose peer is gone as it cancels one for a shutdown.
            seen = ending.seen
            end = session_end(
                session.node_id,
                None if seen is None else seen.parting,
                "" if seen is None else seen.reason,
                draining=session.draining,
                edge_closing=registry.closing,
            )
            registry.unregister(session, end.message, end.code)
            if seen is None:
                close_reason = end.message  # cancelled: the node, if still there, hears why
            if session.end_code == "stale_generation":
                close_code, close_reason = CLOSE_SUPERSEDED, session.closed_reason or ""
            log.info(
                "node %s generation %d left: %s",
                session.node_id,
                session.generation,
                session.closed_reason,
            )
        with trio.move_on_after(2, shield=True):
            await conn.aclose(close_code, close_reason)


@attrs.define
class _Ending:
    """How a session ended, as its tasks saw it: the first of them to see it says (kept
    here, so that a cancellation that follows cannot hide it)."""

    seen: _Closing | None = None

    def end(self, closing: _Closing) -> None:
        if self.seen is None:
            self.seen = closing


async def _receive_hello(
    conn: Connection,
    settings: NodeLinkSettings,
    authenticated_as: str | None,
    protocol: wire.EdgeProtocol,
) -> tuple[wire.Hello, str | None]:
    """The node's hello (judged by ``protocol``) and the credential it authenticated
    with."""
    with trio.move_on_after(settings.hello_timeout) as scope:
        frame = await conn.receive()
    if scope.cancelled_caught:
        raise _Closing(CLOSE_POLICY, f"no hello within {settings.hello_timeout} s")
    if isinstance(frame, bytes):
        raise _Closing(CLOSE_PROTOCOL_ERROR, "expected a hello text frame, got binary")
    try:
        message = wire.decode(frame)
    except wire.ProtocolError as exc:
        raise _Closing(CLOSE_PROTOCOL_ERROR, f"bad hello: {exc}") from None
    verdict = protocol.receive(message)
    if isinstance(verdict, wire.ProtocolError):
        raise _Closing(CLOSE_PROTOCOL_ERROR, str(verdict))
    assert isinstance(message, wire.Hello)  # the machine accepts nothing else first
    credential = authenticated_as
    if authenticated_as is None:
        auth = authenticate(message.token, message.node_id, settings.node_tokens)
        if isinstance(auth, Refused):
            raise _Closing(CLOSE_AUTH_FAILED, auth.reason)
        credential = auth.credential
    refused = check_hello(message, settings.limits)
    if refused is not None:
        raise _Closing(CLOSE_PROTOCOL_ERROR, f"bad hello: {refused}")
    return message, credential


async def _serve_session(
    conn: Connection,
    session: NodeSession,
    settings: NodeLinkSettings,
    on_capacity: Callable[[NodeSession, wire.Capacity], None] | None,
    on_draining: Callable[[NodeSession], None] | None,
    ending: _Ending,
) -> None:
    """Run the session until the connection ends or it must be closed; ``ending`` holds how
    it ended (the close code to send and the reason to log)."""
    last_seen = session.last_heard = trio.current_time()
    end = ending.end

    async def heartbeat(receiving: trio.CancelScope) -> None:
        nonce = 0
        while True:
            await trio.sleep(settings.heartbeat_interval)
            silent = trio.current_time() - last_seen
            if silent >= settings.heartbeat_timeout:
                end(_Closing(CLOSE_HEARTBEAT, f"heartbeat timeout: node silent for {silent:.1f} s"))
                break
            nonce += 1
            session.post(wire.Ping(nonce=nonce))
        receiving.cancel()

    async def writer(receiving: trio.CancelScope, stopped: trio.Event) -> None:
        try:
            await session.serve_writer()
        except ConnectionClosed as exc:
            end(_connection_ended(exc))
            # The node may have closed right after its last events (a drained node sends its
            # final run.completed, then leaves): let the receive loop take what is already
            # queued -- it ends when the closed connection runs dry -- within a bound.
            receiving.deadline = min(receiving.deadline, trio.current_time() + LAST_FRAMES_TIMEOUT)
            return
        except NodeGone as exc:
            end(_Closing(CLOSE_POLICY, str(exc)))
        finally:
            stopped.set()
        receiving.cancel()

    async def superseded(receiving: trio.CancelScope) -> None:
        await session.ended.wait()
        end(_Closing(CLOSE_SUPERSEDED, session.closed_reason or "session ended", "superseded"))
        receiving.cancel()

    async def receive_loop() -> None:
        nonlocal last_seen
        while True:
            frame = await conn.receive()
            last_seen = session.last_heard = trio.current_time()
            try:
                message = (
                    wire.decode_binary(frame) if isinstance(frame, bytes) else wire.decode(frame)
                )
            except wire.ProtocolError as exc:
                raise _Closing(CLOSE_PROTOCOL_ERROR, str(exc)) from None
            # The protocol machine judges it (and the session routes it): everything but the
            # two control messages whose policy is ours ends here.
            violation = session.receive(message)
            if violation is not None:
                raise _Closing(CLOSE_PROTOCOL_ERROR, str(violation))
            if isinstance(message, wire.Capacity):
                refused = check_slots(message.slots, message.long_context_slots, settings.limits)
                if refused is not None:
                    raise _Closing(CLOSE_PROTOCOL_ERROR, f"bad capacity: {refused}")
                if on_capacity is not None:
                    on_capacity(session, message)
            elif isinstance(message, wire.NodeDraining) and not session.draining:
                session.draining, session.drain_grace = True, message.grace
                log.info(
                    "node %s is draining (grace %.1f s): routing nothing new to it",
                    session.node_id,
                    message.grace,
                )
                if on_draining is not None:
                    on_draining(session)

    receiving = trio.CancelScope()
    writer_stopped = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer, receiving, writer_stopped, name=f"node {session.node_id} writer")
        nursery.start_soon(heartbeat, receiving)
        nursery.start_soon(superseded, receiving)
        with receiving:
            try:
                await receive_loop()
            except _Closing as exc:
                end(exc)
            except ConnectionClosed as exc:
                end(_connection_ended(exc))
        # Ending: the writer finishes the frame it is writing rather than have it cut (a
        # write cut half-way aborts the connection, and the close frame saying why with it).
        session.stop_writing()
        with trio.move_on_after(WRITER_STOP_TIMEOUT):
            await writer_stopped.wait()
        nursery.cancel_scope.cancel()
