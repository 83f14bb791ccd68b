"""The edge's side of one node connection: handshake, authentication, heartbeats, routing.

:func:`serve_node_connection` owns one connection from ``hello`` to close. It is transport
agnostic: the HTTP endpoint runs it over our server's websocket, and embedded apps and tests
run it over an in-memory connection. Whatever the node sends that breaks the protocol closes
*that* session (code 1002, with the reason) and is logged; nothing it sends can hurt the edge
or other nodes.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Sequence

import attrs
import trio

from . import wire
from .registry import NodeGone, NodeSession, Registry, SessionProtocolError
from .transport import Connection, ConnectionClosed

log = logging.getLogger("dispatcher.nodes")

CLOSE_PROTOCOL_ERROR = 1002
CLOSE_POLICY = 1008
CLOSE_GOING_AWAY = 1001
CLOSE_AUTH_FAILED = 4001
CLOSE_SUPERSEDED = 4002
CLOSE_HEARTBEAT = 4003


@attrs.frozen(kw_only=True)
class NodeLinkSettings:
    node_tokens: tuple[str, ...] = attrs.field(default=(), repr=False)
    """When non-empty, ``hello.token`` must equal one of these."""
    hello_timeout: float = 10.0
    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 15.0
    """A node silent for this long is dropped and its runs fail."""


class _Closing(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _token_ok(token: str | None, allowed: Sequence[str]) -> bool:
    if not allowed:
        return True
    if token is None:
        return False
    given = token.encode()
    ok = False
    for candidate in allowed:  # no early exit: constant time over the configured tokens
        ok |= hmac.compare_digest(given, candidate.encode())
    return ok


async def serve_node_connection(
    conn: Connection,
    registry: Registry,
    settings: NodeLinkSettings,
    *,
    on_capacity: Callable[[NodeSession, wire.Capacity], None] | None = None,
    on_draining: Callable[[NodeSession], None] | None = None,
    peer: str = "in-memory",
) -> None:
    """Serve one node connection until it closes. Never raises for anything the node does.
    Every session that ends logs why (``node ... left: <reason>``)."""
    session: NodeSession | None = None
    close_code, close_reason = CLOSE_GOING_AWAY, "session ended"
    try:
        hello = await _receive_hello(conn, settings)
        session = registry.register(hello, conn)
        log.info(
            "node %s (%s) joined from %s, generation %d, models: %s",
            hello.node_id,
            hello.label or "-",
            peer,
            session.generation,
            ", ".join(sorted({m.name for p in hello.providers for m in p.models})) or "none",
        )
        session.post(
            wire.Welcome(
                protocol=wire.PROTOCOL_VERSION,
                generation=session.generation,
                heartbeat_interval=settings.heartbeat_interval,
            )
        )
        closing = await _serve_session(conn, session, settings, on_capacity, on_draining)
        close_code, close_reason = closing.code, closing.reason
        if closing.code in (CLOSE_PROTOCOL_ERROR, CLOSE_HEARTBEAT, CLOSE_POLICY):
            log.warning("node %s: closing session: %s", session.node_id, closing.reason)
    except _Closing as closing:
        close_code, close_reason = closing.code, closing.reason
        log.warning("node connection from %s refused: %s", peer, closing.reason)
    except (ConnectionClosed, NodeGone) as exc:
        close_reason = f"connection lost: {exc}"
        log.info("node connection from %s lost: %s", peer, exc)
    except trio.Cancelled:
        close_reason = "the edge is shutting down"
        raise
    except Exception:
        log.exception("node connection from %s failed", peer)
        close_code, close_reason = 1011, "internal error"
    finally:
        if session is not None:
            if session.closed_reason is not None and session.closed_reason.startswith("superseded"):
                close_code, close_reason = CLOSE_SUPERSEDED, session.closed_reason
            registry.unregister(session, close_reason)
            log.info(
                "node %s generation %d left: %s", session.node_id, session.generation, close_reason
            )
        with trio.move_on_after(2, shield=True):
            await conn.aclose(close_code, close_reason)


async def _receive_hello(conn: Connection, settings: NodeLinkSettings) -> wire.Hello:
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
    if not isinstance(message, wire.Hello):
        raise _Closing(CLOSE_PROTOCOL_ERROR, f"expected hello, got {message.TYPE!r}")
    if message.protocol != wire.PROTOCOL_VERSION:
        raise _Closing(
            CLOSE_PROTOCOL_ERROR,
            f"protocol version {message.protocol} is not supported "
            f"(this edge speaks {wire.PROTOCOL_VERSION})",
        )
    if not _token_ok(message.token, settings.node_tokens):
        reason = "missing node token" if message.token is None else "invalid node token"
        raise _Closing(CLOSE_AUTH_FAILED, reason)
    return message


async def _serve_session(
    conn: Connection,
    session: NodeSession,
    settings: NodeLinkSettings,
    on_capacity: Callable[[NodeSession, wire.Capacity], None] | None,
    on_draining: Callable[[NodeSession], None] | None,
) -> _Closing:
    """Run the session until the connection ends or it must be closed; return how it
    ended (the close code to send and the reason to log)."""
    last_seen = trio.current_time()
    closing: _Closing | None = None

    def end(reason: _Closing) -> None:
        nonlocal closing
        if closing is None:
            closing = reason

    async def heartbeat(scope: trio.CancelScope) -> None:
        nonce = 0
        while True:
            await trio.sleep(settings.heartbeat_interval)
            silent = trio.current_time() - last_seen
            if silent >= settings.heartbeat_timeout:
                end(_Closing(CLOSE_HEARTBEAT, f"heartbeat timeout: node silent for {silent:.1f} s"))
                break
            nonce += 1
            session.post(wire.Ping(nonce=nonce))
        scope.cancel()

    async def writer(scope: trio.CancelScope) -> None:
        try:
            await session.serve_writer()
        except ConnectionClosed as exc:
            end(_Closing(CLOSE_GOING_AWAY, f"connection lost while sending: {exc.reason}"))
        except NodeGone as exc:
            end(_Closing(CLOSE_POLICY, str(exc)))
        scope.cancel()

    async def superseded(scope: trio.CancelScope) -> None:
        await session.ended.wait()
        end(_Closing(CLOSE_SUPERSEDED, session.closed_reason or "session ended"))
        scope.cancel()

    async def receive_loop() -> None:
        nonlocal last_seen
        while True:
            frame = await conn.receive()
            last_seen = trio.current_time()
            try:
                if isinstance(frame, bytes):
                    session.route_tunnel(wire.decode_binary(frame))
                    continue
                message = wire.decode(frame)
                if isinstance(message, wire.Pong):
                    continue
                if isinstance(message, _RUN_EVENTS):
                    session.route(message)
                    continue
                if isinstance(message, wire.TunnelStart | wire.TunnelEnd):
                    session.route_tunnel(message)
                    continue
            except (wire.ProtocolError, SessionProtocolError) as exc:
                raise _Closing(CLOSE_PROTOCOL_ERROR, str(exc)) from None
            if isinstance(message, wire.Capacity):
                if on_capacity is not None:
                    on_capacity(session, message)
            elif isinstance(message, wire.NodeDraining):
                if not session.draining:
                    session.draining = True
                    log.info(
                        "node %s is draining (grace %.1f s): routing nothing new to it",
                        session.node_id,
                        message.grace,
                    )
                    if on_draining is not None:
                        on_draining(session)
            else:
                raise _Closing(
                    CLOSE_PROTOCOL_ERROR, f"unexpected {message.TYPE!r} message from a node"
                )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer, nursery.cancel_scope, name=f"node {session.node_id} writer")
        nursery.start_soon(heartbeat, nursery.cancel_scope)
        nursery.start_soon(superseded, nursery.cancel_scope)
        try:
            await receive_loop()
        except _Closing as exc:
            end(exc)
        except ConnectionClosed as exc:
            end(_Closing(CLOSE_GOING_AWAY, f"connection lost: {exc.reason}"))
        nursery.cancel_scope.cancel()
    return closing or _Closing(CLOSE_GOING_AWAY, "session ended")


_RUN_EVENTS = (
    wire.RunStarted,
    wire.RunDelta,
    wire.RunUsage,
    wire.RunCompleted,
    wire.RunFailed,
    wire.RunCancelled,
)
