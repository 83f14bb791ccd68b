"""Dialling the edge: the websocket a node's session runs over.

:func:`dial_edge` is the default dial of :func:`nodes.agent.serve_node`: a TCP (or TLS) stream
this module owns and our websocket client over it (:mod:`nodes.websocket`, on wsproto), whose
every websocket, stream and socket failure is ``transport.ConnectionClosed``. A refused
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

from dispatcher import wire
from dispatcher.shared.transport import Connection, ConnectionClosed
from nodes.config import NodeConfig, check_edge_url
from nodes.reconnect import DialCause, advice
from nodes.websocket import UpgradeRejected, WebSocketClient, handshake, open_websocket

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
"""Edge-to-node messages the websocket queues before it stops reading the socket."""


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


_WEBSOCKET_ERRORS: Final = (
    ConnectionClosed,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
)


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
    """The default dial: a websocket to ``config.edge_url`` (:mod:`nodes.websocket` over a TCP
    or TLS stream this function owns), with explicit limits: frames up to ``wire.MAX_FRAME_SIZE``,
    :data:`WEBSOCKET_QUEUE_SIZE` queued messages, :data:`CONNECT_TIMEOUT` for TCP + upgrade,
    :data:`WEBSOCKET_CLOSE_TIMEOUT` for the closing handshake.

    Owning the stream, we always close it, however the block is left (trio-websocket 0.12.2's
    ``open_websocket_url``, used before, left it open when the edge closed first or refused
    the upgrade -- the two usual ways a node session ends).

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
            yield ws
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
) -> AsyncIterator[WebSocketClient]:
    """Our websocket client over ``stream`` (:func:`nodes.websocket.open_websocket`, its
    reader task in a nursery around the block); a failed upgrade comes out translated by
    :func:`_upgrade_failure`, an exception from the block as itself."""
    try:
        with trio.fail_after(CONNECT_TIMEOUT):
            proto = await handshake(stream, address.host_header, address.resource)
    except (UpgradeRejected, trio.TooSlowError, *_WEBSOCKET_ERRORS) as exc:
        raise _upgrade_failure(exc, url, address) from exc
    async with open_websocket(
        stream,
        proto,
        max_message_size=wire.MAX_FRAME_SIZE,
        queue_size=WEBSOCKET_QUEUE_SIZE,
        close_timeout=WEBSOCKET_CLOSE_TIMEOUT,
        cancelled_close_timeout=CANCELLED_CLOSE_TIMEOUT,
    ) as ws:
        yield ws


def _upgrade_failure(exc: BaseException, url: str, address: _EdgeAddress) -> Exception:
    """What a failed websocket upgrade means for the reconnect loop."""
    host, port = address.host, address.port
    if isinstance(exc, UpgradeRejected):
        status = exc.status_code
        cause = DialCause(kind="http", host=host, port=port, status=status)
        if status in REJECTED_HTTP_STATUSES:
            return NodeRejected(advice(cause, url))
        reason = f"the edge refused the websocket upgrade with HTTP {status}"
        return DialFailed(reason, cause)
    if isinstance(exc, trio.TooSlowError):
        cause = DialCause(kind="timeout", host=host, port=port, stage="websocket upgrade")
        return DialFailed(f"cannot connect to {url}: websocket upgrade timed out", cause)
    cause = DialCause(kind="closed", host=host, port=port, detail=explain(exc))
    return DialFailed(f"cannot connect to {url}: {explain(exc)}", cause)


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
