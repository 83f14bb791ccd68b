"""Dialling the edge: the websocket a node's session runs over.

:func:`dial_edge` is the default dial of :func:`nodes.agent.serve_node`: a TCP (or TLS) stream
this module owns, trio-websocket over it, and a :class:`WebSocketClientConnection` that turns
every websocket, stream and socket failure into ``transport.ConnectionClosed``. A refused
upgrade is ``ConnectionClosed`` too, except 401 and 403, which are :class:`NodeRejected` (the
edge does not let this node in; retrying cannot help).

Every close here is bounded: :data:`WEBSOCKET_CLOSE_TIMEOUT` for a closing handshake, and
:func:`close_budget` when the closer is being cancelled.
"""

from __future__ import annotations

import errno
import math
import socket
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from functools import partial
from typing import Final

import attrs
import trio
import trio_websocket

from dispatcher import wire
from dispatcher.shared.excgroups import first_leaf, leaves
from dispatcher.shared.transport import Connection, ConnectionClosed, RawFrame
from nodes.config import NodeConfig, check_edge_url
from nodes.reconnect import DialCause, advice

Dial = Callable[[], AbstractAsyncContextManager[Connection]]
"""Opens one connection to the edge (an async context manager that closes it)."""

REJECTED_HTTP_STATUSES: Final = frozenset({401, 403})
"""HTTP statuses of a refused websocket upgrade that mean the node is not allowed in."""

WEBSOCKET_CLOSE_TIMEOUT: Final = 5.0
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


class DialFailed(ConnectionClosed):
    """A dial that did not reach the edge's node endpoint; ``cause`` says why, typed (what
    :func:`nodes.reconnect.advice` words for a person). ``str()`` is the error as it
    happened."""

    def __init__(self, reason: str, cause: DialCause) -> None:
        super().__init__(reason)
        self.cause = cause


def close_budget() -> float:
    """How long a close may wait for the peer's answer. When we are being cancelled (the node
    is shutting down) the websocket's reader task is cancelled too, so the answer could never
    be read: send the close frame, then drop the connection at once."""
    if trio.current_effective_deadline() == -math.inf:
        return CANCELLED_CLOSE_TIMEOUT
    return WEBSOCKET_CLOSE_TIMEOUT


class WebSocketClientConnection:
    """A :class:`~dispatcher.shared.transport.Connection` over a trio-websocket client connection:
    trio-websocket's ``ConnectionClosed``, ``HandshakeError`` and ``OSError`` become
    ``transport.ConnectionClosed`` (with the close code and reason when there is one)."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self._ws = ws

    async def send(self, frame: RawFrame) -> None:
        try:
            await self._ws.send_message(frame)
        except _WEBSOCKET_ERRORS as exc:
            raise _closed(exc) from None

    async def receive(self) -> RawFrame:
        try:
            message: RawFrame = await self._ws.get_message()
            return message
        except _WEBSOCKET_ERRORS as exc:
            raise _closed(exc) from None

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        try:
            with trio.move_on_after(WEBSOCKET_CLOSE_TIMEOUT):
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
        """Raises ``ValueError`` (the reason and the likely fix) for a URL that is not an
        edge's node endpoint (:func:`nodes.config.check_edge_url`)."""
        reason = check_edge_url(url)
        if reason is not None:
            raise ValueError(f"edge_url: {reason}")
        parts = urllib.parse.urlsplit(url)
        assert parts.hostname is not None  # checked by check_edge_url
        tls = parts.scheme.lower() == "wss"
        resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(parts.hostname, parts.port or (443 if tls else 80), resource, tls)


def edge_ssl_context(config: NodeConfig) -> ssl.SSLContext:
    """The TLS context a ``wss://`` dial verifies the edge with: the system's CAs, or only
    those of ``config.edge_ca_file``. Raises ``OSError`` or ``ssl.SSLError`` for a CA file
    that cannot be read or holds no certificate."""
    return ssl.create_default_context(cafile=config.edge_ca_file)


@asynccontextmanager
async def dial_edge(
    config: NodeConfig, *, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[Connection]:
    """The default dial: a websocket to ``config.edge_url`` (trio-websocket over a TCP or TLS
    stream this function owns), with explicit limits: frames up to ``wire.MAX_FRAME_SIZE``,
    :data:`WEBSOCKET_QUEUE_SIZE` queued messages, :data:`CONNECT_TIMEOUT` for TCP + upgrade,
    :data:`WEBSOCKET_CLOSE_TIMEOUT` for the closing handshake.

    Why not ``trio_websocket.open_websocket_url``: in trio-websocket 0.12.2 it leaves the TCP
    socket open (a ``ResourceWarning`` and a file descriptor held until garbage collection)
    when the edge closes first or refuses the upgrade -- the two usual ways a node session
    ends. Owning the stream, we always close it.

    Dial failures raise ``transport.ConnectionClosed``, or :class:`NodeRejected` when the
    upgrade is refused with 401 or 403.

    For ``wss://`` the edge's certificate is verified with ``ssl_context`` (default
    :func:`edge_ssl_context`) against ``config.edge_tls_server_name`` or the URL's host; a
    certificate that does not verify fails the dial (``ConnectionClosed``, retried).
    """
    url = config.edge_url
    address = _EdgeAddress.parse(url)
    stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]
    with _connect_failures(url, address, "connect"):
        with trio.fail_after(CONNECT_TIMEOUT):
            stream = await trio.open_tcp_stream(address.host, address.port)
    try:
        if address.tls:
            stream = trio.SSLStream(
                stream,
                ssl_context or edge_ssl_context(config),
                server_hostname=config.edge_tls_server_name or address.host,
                https_compatible=True,
            )
            # Here, not inside the websocket's reader (which would leave the upgrade to time
            # out): a certificate that does not verify says so.
            with _connect_failures(url, address, "TLS handshake"), trio.fail_after(CONNECT_TIMEOUT):
                await stream.do_handshake()
        async with _open_websocket(stream, address, url) as ws:
            yield WebSocketClientConnection(ws)
    finally:
        await trio.aclose_forcefully(stream)


@contextmanager
def _connect_failures(url: str, address: _EdgeAddress, stage: str) -> Iterator[None]:
    """A failed or timed-out connect (``stage``: TCP or TLS) as :class:`DialFailed`."""
    try:
        yield
    except trio.TooSlowError:
        cause = DialCause(kind="timeout", host=address.host, port=address.port, stage=stage)
        raise DialFailed(f"cannot connect to {url}: {stage} timed out", cause) from None
    except (OSError, trio.BrokenResourceError) as exc:
        cause = _connect_cause(exc, address.host, address.port)
        raise DialFailed(f"cannot connect to {url}: {explain(exc)}", cause) from None


_REFUSED: Final = frozenset({errno.ECONNREFUSED})
_UNREACHABLE: Final = frozenset({errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL})


def _connect_cause(exc: BaseException, host: str, port: int) -> DialCause:
    """What a failed TCP connect or TLS handshake means, from the error's type and errno
    (trio's "all attempts to connect failed" ``OSError`` carries one error per address in
    its cause)."""
    errors = [leaf for leaf in _causes(exc) if isinstance(leaf, OSError)]
    detail = explain(exc)
    if any(isinstance(error, socket.gaierror) for error in errors):
        gai = next(error for error in errors if isinstance(error, socket.gaierror))
        return DialCause(kind="dns", host=host, port=port, detail=gai.strerror or str(gai))
    if any(isinstance(error, ssl.SSLCertVerificationError) for error in errors):
        verify = next(e for e in errors if isinstance(e, ssl.SSLCertVerificationError))
        reason = verify.verify_message or verify.reason or str(verify)
        return DialCause(kind="certificate", host=host, port=port, detail=str(reason))
    if any(isinstance(error, ssl.SSLError) for error in errors):
        tls = next(e for e in errors if isinstance(e, ssl.SSLError))
        reason = tls.reason or str(tls)
        return DialCause(kind="tls", host=host, port=port, detail=str(reason))
    numbers = {error.errno for error in errors if error.errno is not None}
    if numbers and numbers <= _REFUSED:
        return DialCause(kind="refused", host=host, port=port, detail=detail)
    if numbers & _UNREACHABLE:
        return DialCause(kind="unreachable", host=host, port=port, detail=detail)
    if errno.ETIMEDOUT in numbers:
        return DialCause(kind="timeout", host=host, port=port, detail=detail, stage="connect")
    if isinstance(exc, trio.BrokenResourceError):
        # A TLS handshake the peer cut without a TLS error (a plain server closing).
        return DialCause(kind="tls", host=host, port=port, detail=detail)
    return DialCause(kind="other", host=host, port=port, detail=detail)


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc``, its causes and contexts, and the leaves of every exception group among them."""
    found: list[BaseException] = []
    pending = [exc]
    while pending:
        current = pending.pop()
        if current in found:
            continue
        found.append(current)
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                pending.append(linked)
    return found


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
                with trio.move_on_after(close_budget(), shield=True):
                    await ws.aclose()
                nursery.cancel_scope.cancel(reason="websocket closed")
    except BaseExceptionGroup as group:
        if body_error is not None:
            # The reader task only ever fails with the connection; the block's own error
            # is the one that matters.
            raise body_error from None
        failure = _upgrade_failure(group, url, address)
        if failure is None:
            raise  # cancellation, or a bug: as it is
        raise failure from group


def _upgrade_failure(
    group: BaseExceptionGroup[BaseException], url: str, address: _EdgeAddress
) -> Exception | None:
    """What a failed websocket upgrade means for the reconnect loop."""
    host, port = address.host, address.port
    rejected, _ = group.split(trio_websocket.ConnectionRejected)
    if rejected is not None:
        refused = first_leaf(rejected, trio_websocket.ConnectionRejected)
        assert refused is not None
        status = refused.status_code
        cause = DialCause(kind="http", host=host, port=port, status=status)
        if status in REJECTED_HTTP_STATUSES:
            return NodeRejected(advice(cause, url))
        reason = f"the edge refused the websocket upgrade with HTTP {status}"
        return DialFailed(reason, cause)
    if group.subgroup(trio.TooSlowError) is not None:
        cause = DialCause(kind="timeout", host=host, port=port, stage="websocket upgrade")
        return DialFailed(f"cannot connect to {url}: websocket upgrade timed out", cause)
    broken = group.subgroup(_WEBSOCKET_ERRORS)
    if broken is not None:
        first = leaves(broken)[0]
        cause = DialCause(kind="closed", host=host, port=port, detail=explain(first))
        return DialFailed(f"cannot connect to {url}: {explain(first)}", cause)
    return None


def explain(exc: BaseException) -> str:
    """An error for a log line or a close reason: its message, its cause's when it has none
    (``trio.BrokenResourceError`` from a failed TLS handshake), or its type's name."""
    if not str(exc) and exc.__cause__ is not None:
        return explain(exc.__cause__)
    return str(exc) or type(exc).__name__


def edge_dial(config: NodeConfig) -> Dial:
    """The default :data:`Dial` for ``config``: :func:`dial_edge` each time it is called.

    Raises ``ValueError`` at once when ``config.edge_url`` is not an edge's node endpoint (a
    mistake no retry can fix). A ``wss://`` URL's TLS context is made once, here (raising
    as :func:`edge_ssl_context` does)."""
    if _EdgeAddress.parse(config.edge_url).tls:
        return partial(dial_edge, config, ssl_context=edge_ssl_context(config))
    return partial(dial_edge, config)
