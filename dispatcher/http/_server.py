"""The server: listening, the accept loop, connection tasks and graceful shutdown."""

from __future__ import annotations

import errno
import signal
import ssl
from collections.abc import AsyncIterator, Iterable
from functools import partial
from typing import TypedDict, Unpack

import trio

from ._connection import STREAM_CLOSE_TIMEOUT, HTTPConnection, logger
from ._types import (
    Address,
    ErrorPage,
    Handler,
    ServerLimits,
    ShutdownHook,
)
from ._websocket import ServerWebSocket

_DEFAULT_LIMITS = ServerLimits()

_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_ACCEPT_RETRY_DELAY = 0.1


class Server:
    """A running server, as :func:`serve_http` reports it through ``task_status``."""

    def __init__(
        self,
        *,
        handler: Handler,
        limits: ServerLimits,
        address: Address,
        ssl_context: ssl.SSLContext | None,
        error_page: ErrorPage | None = None,
        drains: bool = False,
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.ssl_context = ssl_context
        self.error_page = error_page
        self._address = address
        self._shutting_down = False
        self._drains = drains
        self._draining = False
        self._closing = False
        self._shutdown_requested = trio.Event()
        self._all_closed = trio.Event()
        self._stopped = trio.Event()
        self._connections: set[HTTPConnection] = set()
        self._writing: set[HTTPConnection] = set()
        """Connections with a write in progress (watched for the write timeout)."""
        self._slots = trio.Semaphore(limits.max_connections)

    @property
    def address(self) -> Address:
        """The bound host and port (the real port when 0 was asked for)."""
        return self._address

    @property
    def shutting_down(self) -> bool:
        """True once graceful shutdown has begun (the drain phase included)."""
        return self._shutting_down

    @property
    def draining(self) -> bool:
        """True during the drain phase (only with an ``on_drain`` hook): the server still
        accepts and serves, every response carries ``Connection: close``."""
        return self._draining

    @property
    def closing(self) -> bool:
        """True once the server stops accepting: idle connections close, websockets get
        1001, in-flight requests get what is left of the grace."""
        return self._closing

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    def shutdown(self) -> None:
        """Begin graceful shutdown (idempotent); ``serve_http`` returns once it is over.

        Call it from the Trio thread (``trio.from_thread.run_sync`` from another thread).
        """
        if not self._shutting_down:
            self._shutting_down = True
            if self._drains:
                self._draining = True
            else:
                self._closing = True
            self._shutdown_requested.set()

    # --- accepting --------------------------------------------------------------------

    async def _accept_all(
        self,
        listeners: list[trio.SocketListener],
        scope: trio.CancelScope,
        connections: trio.Nursery,
    ) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for listener in listeners:
                    nursery.start_soon(self._accept_loop, listener, connections)

    async def _accept_loop(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        slots = self._slots
        while True:
            await slots.acquire()
            stream = None
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                    raise
                logger.error("accept failed: %s; retrying in %s s", exc, _ACCEPT_RETRY_DELAY)
                await trio.sleep(_ACCEPT_RETRY_DELAY)
            except trio.ClosedResourceError:
                return
            finally:
                if stream is None:
                    slots.release()
            if stream is not None:
                connections.start_soon(self._run_connection, stream)

    async def _run_connection(self, stream: trio.SocketStream) -> None:
        conn = HTTPConnection(self, stream)
        self._connections.add(conn)
        try:
            await conn.run()
        except Exception:
            # One connection's failure stays with that connection.
            logger.exception("connection from %s crashed", conn.client)
        finally:
            self._connections.discard(conn)
            self._slots.release()
            if self._closing and not self._connections:
                self._all_closed.set()

    async def _watch_writes(self) -> None:
        """Cut off connections whose current write is older than the write timeout.

        One task for the whole server instead of a cancel scope around every write; the
        timeout fires at most min(write_timeout / 4, 1 s) late.
        """
        timeout = self.limits.write_timeout
        tick = min(max(timeout / 4, 0.005), 1.0)
        writing = self._writing
        while True:
            await trio.sleep(tick)
            if writing:
                started_before = trio.current_time() - timeout
                for conn in [c for c in writing if c.write_started <= started_before]:
                    writing.discard(conn)
                    conn.cut_off_slow_writer()

    # --- graceful shutdown ------------------------------------------------------------

    async def _shut_down(
        self,
        listeners: list[trio.SocketListener],
        accept_scope: trio.CancelScope,
        connections: trio.Nursery,
        on_shutdown: ShutdownHook | None,
        on_drain: ShutdownHook | None = None,
    ) -> None:
        deadline = trio.current_time() + self.limits.shutdown_grace
        if on_drain is not None:
            # The drain phase: everything still works (the app answers what it will no
            # longer take), until the app says it is drained or the grace is over.
            with trio.move_on_at(deadline):
                await _run_hook(on_drain)
            self._draining = False
            self._closing = True
            # What the drain left gets its last words (a final event, a close frame).
            deadline = max(deadline, trio.current_time() + self.limits.linger_timeout)
        accept_scope.cancel(reason="server shutting down")
        with trio.move_on_after(STREAM_CLOSE_TIMEOUT):
            for listener in listeners:
                await listener.aclose()
        for conn in list(self._connections):
            ws = conn.notify_shutdown()  # idle keep-alive connections close at once
            if ws is not None:
                connections.start_soon(_close_websocket, ws)
        with trio.move_on_at(deadline):
            async with trio.open_nursery() as nursery:
                if on_shutdown is not None:
                    nursery.start_soon(_run_hook, on_shutdown)
                if self._connections:
                    nursery.start_soon(self._all_closed.wait)
        if self._connections:
            logger.warning(
                "%d connections still open after the %s s shutdown grace: cancelling them",
                len(self._connections),
                self.limits.shutdown_grace,
            )


async def _close_websocket(ws: ServerWebSocket) -> None:
    try:
        await ws.close_for_shutdown()
    except Exception:
        logger.exception("closing a websocket for shutdown failed")


async def _run_hook(hook: ShutdownHook) -> None:
    try:
        await hook()
    except Exception:
        logger.exception("the on_shutdown hook failed")


# ASYNC114 (flake8-async) wants startable functions listed in its options; the noqa keeps
# a plain `flake8-async` run clean too.
async def serve_http(  # noqa: ASYNC114
    handler: Handler,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: ServerLimits = _DEFAULT_LIMITS,
    ssl_context: ssl.SSLContext | None = None,
    on_shutdown: ShutdownHook | None = None,
    on_drain: ShutdownHook | None = None,
    error_page: ErrorPage | None = None,
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve HTTP/1.1 and websockets with ``handler`` until shut down.

    Reports the :class:`Server` through ``task_status.started`` once listening.
    ``server.shutdown()`` shuts down gracefully (see the docs): with ``on_drain``, that hook
    runs first while the server still serves, for up to ``shutdown_grace``; then
    ``on_shutdown`` runs and the server stops accepting. Cancelling this task stops
    everything at once.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    host_port = listeners[0].socket.getsockname()
    server = Server(
        handler=handler,
        limits=limits,
        address=Address(str(host_port[0]), int(host_port[1])),
        ssl_context=ssl_context,
        error_page=error_page,
        drains=on_drain is not None,
    )
    try:
        async with trio.open_nursery() as connections:
            accept_scope = trio.CancelScope()
            connections.start_soon(server._accept_all, listeners, accept_scope, connections)
            connections.start_soon(server._watch_writes)
            task_status.started(server)
            await server._shutdown_requested.wait()
            await server._shut_down(listeners, accept_scope, connections, on_shutdown, on_drain)
            connections.cancel_scope.cancel(reason="shutdown grace period is over")
    finally:
        server._stopped.set()
        with trio.move_on_after(STREAM_CLOSE_TIMEOUT, shield=True):
            for listener in listeners:
                await trio.aclose_forcefully(listener)


class ServeOptions(TypedDict, total=False):
    """The keyword arguments of :func:`serve_http` that :func:`serve_http_until_signal`
    passes on (besides the handler and ``task_status``)."""

    host: str
    port: int
    limits: ServerLimits
    ssl_context: ssl.SSLContext | None
    on_shutdown: ShutdownHook | None
    on_drain: ShutdownHook | None
    error_page: ErrorPage | None


async def serve_http_until_signal(  # noqa: ASYNC114
    handler: Handler,
    *,
    signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM),
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
    **options: Unpack[ServeOptions],
) -> None:
    """:func:`serve_http` (with ``options``), shut down gracefully on the first SIGINT or
    SIGTERM; a second signal cancels everything at once. Must run in the main thread."""
    with trio.open_signal_receiver(*signals) as received:
        async with trio.open_nursery() as nursery:
            server: Server = await nursery.start(partial(serve_http, handler, **options))
            task_status.started(server)
            nursery.start_soon(_watch_signals, received, server, nursery.cancel_scope)
            await server._stopped.wait()
            nursery.cancel_scope.cancel(reason="server shut down")


async def _watch_signals(
    received: AsyncIterator[int], server: Server, scope: trio.CancelScope
) -> None:
    async for signum in received:
        if not server.shutting_down:
            logger.info("signal %d: shutting down gracefully", signum)
            server.shutdown()
        else:
            logger.warning("signal %d again: stopping now", signum)
            scope.cancel(reason=f"second signal ({signum})")
