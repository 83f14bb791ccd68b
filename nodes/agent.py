"""The node agent: dial the edge, register, serve runs, answer heartbeats, reconnect.

:func:`serve_node` is the daemon's main task: it dials the edge, runs one
:func:`serve_node_session` per connection, and reconnects with exponential backoff and full
jitter after any connection loss or dial failure. It stops only when cancelled or when the edge
rejects the node for good (:class:`NodeRejected`: a bad token, an unsupported protocol
version), which it raises so the process can exit non-zero instead of retrying forever.

One session::

    hello ->            (all providers and models; the token, never logged)
          <- welcome    (bounded by config.handshake_timeout)
    then, concurrently until the connection ends:
      receive loop:  ping -> pong, run.request -> runner.start, run.cancel -> runner.cancel,
                     tunnel.request / tunnel.credit / tunnel.cancel -> the tunnel runner
                     (nodes.tunnel), a malformed frame -> close 1002;
                     watchdog: each receive has a deadline; nothing from the edge for
                     heartbeat_timeout_factor x heartbeat_interval -> the edge is gone,
                     close 1001;
      runner:        the runs, and one writer task sending all their events (nodes.runner);
      tunnels:       each tunnel a task relaying one HTTP request to its provider
                     (nodes.tunnel).

Errors are split in two: :class:`NodeRejected` is permanent; everything else that ends a
session (``transport.ConnectionClosed``, ``OSError``, a timeout, a protocol error, even an
unexpected exception, which is logged with its traceback) is transient.
"""

from __future__ import annotations

import logging
import math
import random
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any, Final, NoReturn

import attrs
import trio
import trio_websocket

from dispatcher import wire
from dispatcher.excgroups import first_leaf, leaves
from dispatcher.transport import Connection, ConnectionClosed, Frame
from nodes.adapters import Adapter, DropConnection, build_adapters
from nodes.config import NodeConfig, hello_from_config
from nodes.runner import Runner, open_runner
from nodes.tunnel import TunnelProvider, TunnelRunner, open_tunnels, tunnel_providers

log = logging.getLogger("nodes.agent")

Dial = Callable[[], AbstractAsyncContextManager[Connection]]

CLOSE_NORMAL: Final = 1000
CLOSE_GOING_AWAY: Final = 1001
CLOSE_PROTOCOL_ERROR: Final = 1002
CLOSE_INTERNAL_ERROR: Final = 1011

PERMANENT_CLOSE_CODES: Final = frozenset({1002, 1003, 1007, 4001})
"""Close codes that, received *before* ``welcome``, mean the edge refuses this node for good:
protocol error (bad hello, unsupported protocol version), unsupported or invalid data, and
4001 (authentication failed: a missing or wrong token). Any other close before welcome --
going away, restarting, timeouts -- is transient and retried with backoff."""

REJECTED_HTTP_STATUSES: Final = frozenset({401, 403})
"""HTTP statuses of a refused websocket upgrade that mean the node is not allowed in."""

CLOSE_TIMEOUT: Final = 5.0
"""Bound on closing a connection (our close frame, the peer's answer)."""
CANCELLED_CLOSE_TIMEOUT: Final = 0.1
"""Bound on closing when cancelled: enough to write our close frame, no wait for the answer."""
CONNECT_TIMEOUT: Final = 10.0
WEBSOCKET_QUEUE_SIZE: Final = 16
"""Edge-to-node messages trio-websocket buffers before it stops reading the socket."""


class NodeRejected(Exception):
    """The edge refused this node for good (bad token, protocol version mismatch). Do not
    retry: fix the configuration. ``str()`` is the edge's reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _EndSession(Exception):
    """Internal: end the session, closing the connection with ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


# --------------------------------------------------------------------------- one session


class _Sender:
    """Serializes every send on the connection (the runner's writer, pongs, tunnels)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = trio.Lock()

    async def send(self, message: wire.NodeMessage) -> None:
        frame = wire.encode(message)
        async with self._lock:
            await self._conn.send(frame)

    async def send_data(self, tunnel_id: str, data: bytes) -> None:
        frame = wire.encode_tunnel_data(tunnel_id, data)
        async with self._lock:
            await self._conn.send(frame)


async def serve_node_session(
    conn: Connection,
    config: NodeConfig,
    *,
    adapters: Mapping[str, Adapter] | None = None,
    tunnels: Mapping[str, TunnelProvider] | None = None,
    task_status: trio.TaskStatus[wire.Welcome] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one connection to the edge, from ``hello`` until the connection ends.

    Returns when the session is over for a transient reason (connection lost, edge silent,
    protocol error, handshake timeout), after closing ``conn``. Raises :class:`NodeRejected`
    when the edge refuses the node for good. ``task_status.started(welcome)`` is called once
    the edge has welcomed the node. ``adapters`` defaults to
    ``build_adapters(config.providers)``, ``tunnels`` to
    ``tunnel_providers(config.providers)``.
    """
    if adapters is None:
        adapters = build_adapters(config.providers)
    if tunnels is None:
        tunnels = tunnel_providers(config.providers)
    sender = _Sender(conn)
    code, reason = CLOSE_GOING_AWAY, "node shutting down"  # unless the session ends otherwise
    try:
        welcome = await _handshake(conn, sender, config)
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
        code, reason = await _serve_welcomed(conn, sender, adapters, tunnels, silence_limit)
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
        with trio.move_on_after(_close_budget(), shield=True):
            await conn.aclose(code, reason)


async def _handshake(conn: Connection, sender: _Sender, config: NodeConfig) -> wire.Welcome:
    hello = hello_from_config(config)
    log.info(
        "connected; announcing node %s with %d provider(s), %d model(s)",
        config.node_id,
        len(hello.providers),
        sum(len(p.models) for p in hello.providers),
    )
    try:
        with trio.move_on_after(config.handshake_timeout) as scope:
            await sender.send(hello)
            frame = await conn.receive()
    except ConnectionClosed as exc:
        if exc.code in PERMANENT_CLOSE_CODES:
            raise NodeRejected(f"{exc.reason} (close code {exc.code})") from None
        raise
    if scope.cancelled_caught:
        raise _EndSession(
            CLOSE_GOING_AWAY, f"no welcome from the edge within {config.handshake_timeout} s"
        )
    message = _decode(frame)
    if not isinstance(message, wire.Welcome):
        raise _EndSession(
            CLOSE_PROTOCOL_ERROR, f"expected welcome, got {_describe(message)} from the edge"
        )
    if message.protocol != wire.PROTOCOL_VERSION:
        reason = (
            f"the edge speaks protocol version {message.protocol}, "
            f"this node {wire.PROTOCOL_VERSION}"
        )
        with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
            await conn.aclose(CLOSE_PROTOCOL_ERROR, "protocol version mismatch")
        raise NodeRejected(reason)
    return message


async def _serve_welcomed(
    conn: Connection,
    sender: _Sender,
    adapters: Mapping[str, Adapter],
    tunnel_providers: Mapping[str, TunnelProvider],
    silence_limit: float,
) -> tuple[int, str]:
    """Run the welcomed session; return the close code and reason when it must end."""
    end: tuple[int, str] = (CLOSE_NORMAL, "session ended")
    try:
        async with (
            open_runner(sender.send, adapters=adapters) as runner,
            open_tunnels(sender.send, sender.send_data, tunnel_providers) as tunnels,
        ):
            end = await _receive_loop(conn, sender, runner, tunnels, silence_limit)
    except* DropConnection as group:
        reason = str(first_leaf(group, DropConnection))
        log.warning("dropping the connection to the edge (%s)", reason)
        end = (CLOSE_INTERNAL_ERROR, f"connection dropped: {reason}")
    except* ConnectionClosed as group:
        # The runner's nursery wraps the tunnels' nursery: the group may be nested.
        closed = first_leaf(group, ConnectionClosed)
        assert closed is not None  # except* matched, so there is one at some depth
        log.info("connection to the edge lost: %s (code %s)", closed.reason, closed.code)
        end = (CLOSE_NORMAL, f"connection lost: {closed.reason}")
    return end


async def _receive_loop(
    conn: Connection, sender: _Sender, runner: Runner, tunnels: TunnelRunner, silence_limit: float
) -> tuple[int, str]:
    while True:
        with trio.move_on_after(silence_limit) as watchdog:
            frame = await conn.receive()
        if watchdog.cancelled_caught:
            reason = f"edge silent for {silence_limit:.1f} s"
            log.warning("ending session: %s", reason)
            return CLOSE_GOING_AWAY, reason
        if isinstance(frame, bytes):
            try:
                data = wire.decode_binary(frame)
            except wire.ProtocolError as exc:
                return _protocol_error(str(exc))
            log.debug(
                "ignoring %d tunnel bytes for %s (request bodies travel in tunnel.request)",
                len(data.data),
                data.tunnel_id,
            )
            continue
        try:
            message = wire.decode(frame)
        except wire.ProtocolError as exc:
            return _protocol_error(str(exc))
        if isinstance(message, wire.Ping):
            await sender.send(wire.Pong(nonce=message.nonce))
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
        else:
            return _protocol_error(f"unexpected {_describe(message)} from the edge")


def _protocol_error(reason: str) -> tuple[int, str]:
    log.warning("malformed frame from the edge: %s; closing the session", reason)
    return CLOSE_PROTOCOL_ERROR, reason


def _decode(frame: Frame) -> wire.Message:
    if isinstance(frame, bytes):
        raise _EndSession(CLOSE_PROTOCOL_ERROR, "binary frame during the handshake")
    try:
        return wire.decode(frame)
    except wire.ProtocolError as exc:
        raise _EndSession(CLOSE_PROTOCOL_ERROR, str(exc)) from None


def _describe(message: wire.Message) -> str:
    return repr(type(message).TYPE)


def _close_budget() -> float:
    """How long a close may wait for the peer's answer. When we are being cancelled (the node
    is shutting down) the websocket's reader task is cancelled too, so the answer could never
    be read: send the close frame, then drop the connection at once."""
    if trio.current_effective_deadline() == -math.inf:
        return CANCELLED_CLOSE_TIMEOUT
    return CLOSE_TIMEOUT


# --------------------------------------------------------------------------- the websocket


class WebSocketClientConnection:
    """A :class:`~dispatcher.transport.Connection` over a trio-websocket client connection:
    trio-websocket's ``ConnectionClosed``, ``HandshakeError`` and ``OSError`` become
    ``transport.ConnectionClosed`` (with the close code and reason when there is one)."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self._ws = ws

    async def send(self, frame: Frame) -> None:
        try:
            await self._ws.send_message(frame)
        except _WEBSOCKET_ERRORS as exc:
            raise _closed(exc) from None

    async def receive(self) -> Frame:
        try:
            message: Frame = await self._ws.get_message()
            return message
        except _WEBSOCKET_ERRORS as exc:
            raise _closed(exc) from None

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        try:
            with trio.move_on_after(CLOSE_TIMEOUT):
                await self._ws.aclose(code, reason or None)
        except _WEBSOCKET_ERRORS:
            pass


_WEBSOCKET_ERRORS: Final = (
    trio_websocket.ConnectionClosed,
    trio_websocket.HandshakeError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
)


def _closed(exc: BaseException) -> ConnectionClosed:
    close = getattr(exc, "reason", None)
    if isinstance(exc, trio_websocket.ConnectionClosed) and close is not None:
        return ConnectionClosed(close.reason or close.name, close.code)
    return ConnectionClosed(str(exc) or type(exc).__name__)


@attrs.frozen
class _EdgeAddress:
    host: str
    port: int
    resource: str
    tls: bool

    @property
    def host_header(self) -> str:
        default = 443 if self.tls else 80
        return self.host if self.port == default else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, url: str) -> _EdgeAddress:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise ValueError(f"not a ws:// or wss:// URL: {url!r}")
        tls = parts.scheme == "wss"
        resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(parts.hostname, parts.port or (443 if tls else 80), resource, tls)


@asynccontextmanager
async def dial_edge(config: NodeConfig) -> AsyncIterator[Connection]:
    """The default dial: a websocket to ``config.edge_url`` (trio-websocket over a TCP or TLS
    stream this function owns), with explicit limits: frames up to ``wire.MAX_FRAME_SIZE``,
    :data:`WEBSOCKET_QUEUE_SIZE` queued messages, :data:`CONNECT_TIMEOUT` for TCP + upgrade,
    :data:`CLOSE_TIMEOUT` for the closing handshake.

    Why not ``trio_websocket.open_websocket_url``: in trio-websocket 0.12.2 it leaves the TCP
    socket open (a ``ResourceWarning`` and a file descriptor held until garbage collection)
    when the edge closes first or refuses the upgrade -- the two usual ways a node session
    ends. Owning the stream, we always close it.

    Dial failures raise ``transport.ConnectionClosed``, or :class:`NodeRejected` when the
    upgrade is refused with 401 or 403.
    """
    url = config.edge_url
    address = _EdgeAddress.parse(url)
    stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]
    try:
        with trio.fail_after(CONNECT_TIMEOUT):
            if address.tls:
                stream = await trio.open_ssl_over_tcp_stream(
                    address.host,
                    address.port,
                    ssl_context=ssl.create_default_context(),
                    https_compatible=True,
                )
            else:
                stream = await trio.open_tcp_stream(address.host, address.port)
    except trio.TooSlowError:
        raise ConnectionClosed(f"cannot connect to {url}: timed out") from None
    except (OSError, trio.BrokenResourceError) as exc:
        raise ConnectionClosed(f"cannot connect to {url}: {_explain(exc)}") from None
    try:
        async with _open_websocket(stream, address, url) as ws:
            yield WebSocketClientConnection(ws)
    finally:
        await trio.aclose_forcefully(stream)


@asynccontextmanager
async def _open_websocket(
    stream: trio.SocketStream | trio.SSLStream[trio.SocketStream],
    address: _EdgeAddress,
    url: str,
) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """trio-websocket over ``stream``, its reader task in a nursery around the block.

    An exception from the block comes out as itself, not wrapped in a group, so callers can
    catch ``NodeRejected`` and friends; a failed upgrade comes out translated by
    :func:`_upgrade_failure`."""
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(CONNECT_TIMEOUT):
                ws = await trio_websocket.wrap_client_stream(
                    nursery,
                    stream,
                    address.host_header,
                    address.resource,
                    max_message_size=wire.MAX_FRAME_SIZE,
                    message_queue_size=WEBSOCKET_QUEUE_SIZE,
                )
            try:
                yield ws
            except BaseException as exc:
                body_error = exc
                raise
            finally:
                with trio.move_on_after(_close_budget(), shield=True):
                    await ws.aclose()
                nursery.cancel_scope.cancel(reason="websocket closed")
    except BaseExceptionGroup as group:
        if body_error is not None:
            # The reader task only ever fails with the connection; the block's own error
            # is the one that matters.
            raise body_error from None
        failure = _upgrade_failure(group, url)
        if failure is None:
            raise  # cancellation, or a bug: as it is
        raise failure from group


def _upgrade_failure(group: BaseExceptionGroup[BaseException], url: str) -> Exception | None:
    """What a failed websocket upgrade means for the reconnect loop."""
    rejected, _ = group.split(trio_websocket.ConnectionRejected)
    if rejected is not None:
        refused = first_leaf(rejected, trio_websocket.ConnectionRejected)
        assert refused is not None
        status = refused.status_code
        reason = f"the edge refused the websocket upgrade with HTTP {status}"
        if status in REJECTED_HTTP_STATUSES:
            return NodeRejected(reason)
        return ConnectionClosed(reason)
    if group.subgroup(trio.TooSlowError) is not None:
        return ConnectionClosed(f"cannot connect to {url}: websocket upgrade timed out")
    broken = group.subgroup(_WEBSOCKET_ERRORS)
    if broken is not None:
        first = leaves(broken)[0]
        return ConnectionClosed(f"cannot connect to {url}: {_explain(first)}")
    return None


def _explain(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


# --------------------------------------------------------------------------- reconnecting


class Backoff:
    """Exponential backoff with full jitter above a floor: after the n-th consecutive failure
    (n = 1, 2, ...) the delay is uniform in ``[minimum, min(maximum, minimum * 2**n)]``.
    The floor keeps a failing dial from ever busy-looping."""

    def __init__(self, minimum: float, maximum: float, *, rng: random.Random | None = None) -> None:
        self.minimum = minimum
        self.maximum = maximum
        self.failures = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        self.failures += 1
        ceiling = min(self.maximum, self.minimum * 2.0 ** min(self.failures, 60))
        return self._rng.uniform(self.minimum, max(self.minimum, ceiling))

    def reset(self) -> None:
        self.failures = 0


class _WelcomeStatus:
    """A ``task_status`` for :func:`serve_node_session` that reports the first welcome."""

    def __init__(self, on_welcome: Callable[[], None]) -> None:
        self._on_welcome = on_welcome

    def started(self, value: Any = None) -> None:
        self._on_welcome()


async def serve_node(
    config: NodeConfig,
    *,
    dial: Dial | None = None,
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Keep this node connected to the edge until cancelled.

    Dials with ``dial`` (default :func:`dial_edge`), serves a session, and after any
    connection loss or dial failure waits a :class:`Backoff` delay (reset after a session
    that lasted ``config.reconnect_reset_after``) and dials again. ``task_status.started()``
    is called after the *first* welcome, so ``await nursery.start(serve_node, config)``
    returns once the node is registered. Raises :class:`NodeRejected` (logged at ERROR) when
    the edge refuses the node for good.
    """
    if dial is None:

        def dial() -> AbstractAsyncContextManager[Connection]:
            return dial_edge(config)

    adapters = build_adapters(config.providers)
    tunnels = tunnel_providers(config.providers)
    backoff = Backoff(config.reconnect_min_backoff, config.reconnect_max_backoff, rng=rng)
    welcomed = False

    def on_welcome() -> None:
        nonlocal welcomed
        if not welcomed:
            welcomed = True
            task_status.started()

    while True:
        connected_at: float | None = None
        try:
            async with dial() as conn:
                connected_at = trio.current_time()
                await serve_node_session(
                    conn,
                    config,
                    adapters=adapters,
                    tunnels=tunnels,
                    task_status=_WelcomeStatus(on_welcome),
                )
            outcome = "session ended"
        except NodeRejected as exc:
            _log_rejection(config, exc)
            raise
        except (ConnectionClosed, OSError) as exc:
            outcome = _explain(exc)
        except Exception as exc:
            rejected = _find_rejection(exc)
            if rejected is not None:
                _log_rejection(config, rejected)
                raise rejected from exc
            log.exception("unexpected error in the node session")
            outcome = f"error: {_explain(exc)}"
        if (
            connected_at is not None
            and trio.current_time() - connected_at > config.reconnect_reset_after
        ):
            backoff.reset()
        delay = backoff.next_delay()
        log.info(
            "reconnecting to %s in %.2f s (attempt %d; %s)",
            config.edge_url,
            delay,
            backoff.failures,
            outcome,
        )
        await trio.sleep(delay)


def _log_rejection(config: NodeConfig, exc: NodeRejected) -> None:
    # An expected, permanent condition: the reason, not a traceback.
    log.error("the edge rejected node %s: %s; not reconnecting", config.node_id, exc.reason)


def _find_rejection(exc: BaseException) -> NodeRejected | None:
    return first_leaf(exc, NodeRejected)


def run_node(config: NodeConfig, *, dial: Dial | None = None) -> int:
    """Run :func:`serve_node` in a fresh Trio loop until interrupted (Ctrl-C) and return the
    process exit status: 2 when the edge rejected the node for good, 0 otherwise."""
    try:
        trio.run(partial(serve_node, config, dial=dial))
    except NodeRejected:
        return 2
    except KeyboardInterrupt:
        log.info("node %s stopped", config.node_id)
    return 0
