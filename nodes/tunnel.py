"""The node's side of tunnels: relay one raw HTTP request to a provider and its response back.

::

    async with open_tunnels(send, send_data, providers) as tunnels:
        tunnels.start(tunnel_request)     # tunnel.start, body frames, tunnel.end
        tunnels.body(tunnel_id, data)     # a piece of its request body (binary frames)
        tunnels.credit(tunnel_id, 65536)  # the edge consumed that much: send more
        tunnels.cancel(tunnel_id)         # close the upstream stream now; tunnel.end follows

Each tunnel is a task with its own cancel scope in one nursery, keyed by tunnel id (like the
runs of :mod:`nodes.runner`). It performs the request with the provider's pooled client
(:class:`~nodes.upstream.client.UpstreamPool`) against its
``base_url`` + path (+ query), with the edge's headers minus hop-by-hop ones and the
provider's own key, read from the environment variable the provider's ``api_key_env`` names
(the key never leaves the node): ``Authorization: Bearer <key>``, or for a provider of type
``anthropic`` ``x-api-key: <key>`` with ``anthropic-version: 2023-06-01`` unless the client
sent one. The response comes back as ``tunnel.start`` (status, headers minus hop-by-hop ones
and ``content-length``), the body as binary frames of at most
:data:`~dispatcher.wire.MAX_TUNNEL_CHUNK` bytes, and exactly one ``tunnel.end`` -- with
``error`` set when the upstream could not be reached, broke mid-body, or the edge cancelled
(``"cancelled"``, the confirmation the edge waits for).

The request body is ``tunnel.request.body`` (text), or, when the request announces a
``body_size``, that many bytes in the binary frames that follow it (:meth:`TunnelRunner.body`:
a multipart upload); the tunnel waits for the last of them before it calls the provider, then
sends the body whole (its size is what the edge accepted under its request-body limit).

Flow control: a tunnel may send only as many body bytes as the edge granted (the request's
``window``, then each ``tunnel.credit``). Two tasks per tunnel: a reader that takes the
upstream body into a buffer of at most :data:`MAX_PENDING` bytes (it stops reading the
upstream while the buffer is full, so TCP pushes back on the provider) and a writer that
sends what is buffered -- coalesced into one frame when the connection to the edge is slower
than the provider -- as credit allows. So a slow client slows the provider's reads, and a
tunnel holds at most about ``MAX_PENDING`` plus one upstream read in memory.

The upstream is asked for ``Accept-Encoding: identity``: the edge reads ``usage`` from the
body, which it could not do through a compressed one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Final, Literal

import attrs
import httpx  # noqa: ASYNC127  (the project depends on httpx; see pyproject.toml)
import trio

from dispatcher import wire
from dispatcher.shared.excgroups import first_leaf
from dispatcher.shared.transport import ConnectionClosed
from nodes.adapters.anthropic import ANTHROPIC_BASE_URL, ANTHROPIC_VERSION
from nodes.adapters.base import open_each
from nodes.adapters.ollama import OLLAMA_BASE_URL
from nodes.adapters.openai import OPENAI_BASE_URL
from nodes.coalesce import take_body
from nodes.config import NodeConfigError, ProviderConfig
from nodes.runner import Send as SendMessage
from nodes.upstream.client import Response, UpstreamPool, finished, request_target
from nodes.upstream.pools import HTTPTimeouts, open_client, pool_size, split_timeouts
from nodes.upstream.redact import Redactor, display_url, shown_url

log = logging.getLogger("nodes.tunnel")

SendData = Callable[[str, bytes], Awaitable[None]]
"""Sends one binary body frame: ``(tunnel_id, data)``."""
SendFrames = Callable[[Sequence[wire.NodeMessage | wire.TunnelData]], Awaitable[None]]
"""Sends messages and body frames in order, at once (one socket write over the websocket)."""

MAX_PENDING: Final = 64 * 1024
"""Upstream body bytes a tunnel buffers before it stops reading the upstream."""
MAX_CONNECTIONS: Final = 256
"""Concurrent upstream connections of a provider built without a config (no slots known);
one from the config gets its slots (:func:`~nodes.upstream.pools.pool_size`)."""


DEFAULT_BASE_URLS: Final[Mapping[str, str]] = {
    "openai": OPENAI_BASE_URL,
    "ollama": OLLAMA_BASE_URL,
    "anthropic": ANTHROPIC_BASE_URL,
}
"""A provider's ``base_url`` when its config has none: its adapter type's default."""

_HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
"""Headers that describe one hop, never relayed (RFC 9110 section 7.6.1)."""
_REQUEST_DROP: Final = _HOP_BY_HOP | {
    "host",
    "content-length",
    "authorization",
    "x-api-key",
    "accept-encoding",
    "expect",
}
_RESPONSE_DROP: Final = _HOP_BY_HOP | {"content-length"}

Auth = Literal["bearer", "x-api-key"]

CANCELLED: Final = "cancelled"
"""``tunnel.end.error`` confirming a ``tunnel.cancel``."""


@attrs.frozen(kw_only=True)
class TunnelProvider:
    """What a tunnel needs of a provider served with ``path = "tunnel"``."""

    id: str
    base_url: str
    api_key: str | None = attrs.field(default=None, repr=False)
    timeouts: HTTPTimeouts = attrs.field(factory=HTTPTimeouts)
    connections: int = MAX_CONNECTIONS
    """The size of the provider's connection pool, all kept alive: its slots when built from
    the config (the edge sends it no more tunnels at once)."""
    auth: Auth = "bearer"
    """How the key is sent: ``Authorization: Bearer <key>``, or Anthropic's ``x-api-key``
    (with a default ``anthropic-version``) for a provider of type ``anthropic``."""

    @classmethod
    def from_config(
        cls, provider: ProviderConfig, *, environ: Mapping[str, str] | None = None
    ) -> TunnelProvider:
        """Raises :class:`NodeConfigError` when ``api_key_env`` names a variable that is not
        set (or empty) in ``environ`` (default ``os.environ``)."""
        api_key = provider.api_key(environ)
        timeouts, _ = split_timeouts(provider.options)  # the rest is the adapter's
        base_url = provider.base_url or DEFAULT_BASE_URLS.get(provider.type, "")
        if not base_url:
            raise NodeConfigError(f"provider {provider.id!r}", "base_url", "missing")
        return cls(
            id=provider.id,
            base_url=base_url,
            api_key=api_key,
            timeouts=timeouts,
            connections=pool_size(provider),
            auth="x-api-key" if provider.type == "anthropic" else "bearer",
        )

    @asynccontextmanager
    async def open(self) -> AsyncIterator[PooledTunnelProvider]:
        """The provider's pooled client for this block (:func:`~nodes.upstream.pools.
        open_client`: :attr:`connections` connections kept alive, the shared TLS context),
        and the provider bound to it."""
        async with open_client(self.timeouts, max_connections=self.connections) as client:
            yield PooledTunnelProvider(self, client)

    def url(self, path: str, query: str = "") -> str:
        """``base_url`` joined with the request's path: a ``base_url`` that ends in ``/v1``
        and a path that starts with ``/v1/`` share that prefix."""
        root = self.base_url.rstrip("/")
        if root.endswith("/v1") and (path == "/v1" or path.startswith("/v1/")):
            root = root[: -len("/v1")]
        if not path.startswith("/"):
            path = "/" + path
        return root + path + (f"?{query}" if query else "")


@attrs.frozen
class PooledTunnelProvider:
    """A :class:`TunnelProvider` bound to its open pooled client (what
    :meth:`TunnelProvider.open` gives). It has no lifetime of its own: opening it again
    (:func:`open_tunnel_pools`) leaves it as it is."""

    provider: TunnelProvider
    client: UpstreamPool = attrs.field(repr=False)


AnyTunnelProvider = TunnelProvider | PooledTunnelProvider
"""A tunnel provider, its pool opened or not."""


def open_tunnel_pools(
    providers: Mapping[str, AnyTunnelProvider],
) -> AbstractAsyncContextManager[dict[str, PooledTunnelProvider]]:
    """``providers`` with every pool not yet open opened for this block (one client per
    provider) and closed, every connection with it, when the block is left; those already
    open as they are. So a caller that holds the pools for longer (the agent, for the
    node's life) keeps them open across the blocks of :func:`open_tunnels` inside."""
    return open_each(providers, _open_pool)


def _open_pool(provider: AnyTunnelProvider) -> AbstractAsyncContextManager[PooledTunnelProvider]:
    return provider.open() if isinstance(provider, TunnelProvider) else nullcontext(provider)


def tunnel_providers(
    providers: Iterable[ProviderConfig], *, environ: Mapping[str, str] | None = None
) -> dict[str, TunnelProvider]:
    """The providers served through a tunnel, by id."""
    return {
        provider.id: TunnelProvider.from_config(provider, environ=environ)
        for provider in providers
        if provider.path == "tunnel"
    }


def request_headers(
    headers: Iterable[tuple[str, str]], api_key: str | None, auth: Auth = "bearer"
) -> list[tuple[str, str]]:
    """The edge's headers minus hop-by-hop ones (and any the ``Connection`` header names),
    ``Host``, ``Content-Length``, ``Authorization``, ``X-Api-Key`` and ``Accept-Encoding``;
    plus this node's own key (``Authorization: Bearer``, or ``x-api-key`` and, unless the
    client sent one, ``anthropic-version`` for an Anthropic provider) and
    ``Accept-Encoding: identity``."""
    headers = list(headers)
    listed = {
        name.strip().lower()
        for key, value in headers
        if key.lower() == "connection"
        for name in value.split(",")
    }
    out = [(k, v) for k, v in headers if k.lower() not in _REQUEST_DROP and k.lower() not in listed]
    out.append(("accept-encoding", "identity"))
    if auth == "x-api-key":
        if not any(key.lower() == "anthropic-version" for key, _ in out):
            out.append(("anthropic-version", ANTHROPIC_VERSION))
        if api_key is not None:
            out.append(("x-api-key", api_key))
    elif api_key is not None:
        out.append(("authorization", f"Bearer {api_key}"))
    return out


def response_headers(response: Response) -> tuple[tuple[str, str], ...]:
    """The upstream's response headers, in order, minus hop-by-hop ones (and any its
    ``Connection`` header names) and ``Content-Length`` (the body is relayed in pieces)."""
    raw = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.headers.raw]
    listed = {
        name.strip().lower()
        for key, value in raw
        if key.lower() == "connection"
        for name in value.split(",")
    }
    return tuple(
        (k, v) for k, v in raw if k.lower() not in _RESPONSE_DROP and k.lower() not in listed
    )


@attrs.frozen
class TunnelRunnerStatistics:
    active_tunnels: int
    peak_pending: int
    """The most upstream body bytes any tunnel held unsent at once."""
    frames_sent: int
    bytes_sent: int


@attrs.define(eq=False)
class _Tunnel:
    tunnel_id: str
    credit: int
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    pending: bytearray = attrs.Factory(bytearray)
    eof: bool = False
    upstream_error: str | None = None
    changed: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)
    """Unparked when credit arrives, the writer took bytes, or the reader added some."""
    body_left: int = 0
    """Request body bytes still to come in binary frames."""
    body: bytearray = attrs.Factory(bytearray)
    body_complete: trio.Event = attrs.Factory(trio.Event)
    answer: list[wire.NodeMessage | wire.TunnelData] = attrs.Factory(list)
    """A whole answer not yet sent (``tunnel.start`` and its body): it leaves with the end."""


class _UpstreamFailed(Exception):
    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


class TunnelRunner:
    """Runs tunnels. Create with :func:`open_tunnels`."""

    def __init__(
        self,
        nursery: trio.Nursery,
        send: SendMessage,
        send_data: SendData,
        providers: Mapping[str, PooledTunnelProvider],
        send_many: SendFrames | None = None,
    ) -> None:
        self._nursery = nursery
        self._send = send
        self._send_data = send_data
        self._send_many = send_many or self._one_by_one
        self._providers = providers
        self._tunnels: dict[str, _Tunnel] = {}
        self._peak_pending = 0
        self._frames_sent = 0
        self._bytes_sent = 0
        self._closed = False

    def start(self, request: wire.TunnelRequest) -> None:
        """Start a tunnel in its own cancel scope. The session's protocol machine refuses a
        second ``tunnel.request`` for a running tunnel before it gets here (the edge gives an
        id once); starting one anyway is ``wire.LocalProtocolError``, a bug of the caller."""
        if self._closed:
            raise RuntimeError("the tunnel runner is closed")
        tunnel_id = request.tunnel_id
        if tunnel_id in self._tunnels:
            raise wire.LocalProtocolError(f"tunnel {tunnel_id!r} is already running")
        tunnel = self._tunnels[tunnel_id] = _Tunnel(
            tunnel_id, credit=request.window, body_left=max(0, request.body_size)
        )
        if not tunnel.body_left:
            tunnel.body_complete.set()
        self._nursery.start_soon(self._run, tunnel, request, name=f"tunnel {tunnel_id}")

    def body(self, tunnel_id: str, data: bytes) -> None:
        """A piece of the tunnel's request body (the session's protocol machine accepted it:
        it is within the size ``tunnel.request`` announced). Unknown ids are ignored (the
        tunnel ended before its body came: it was refused, or its upstream failed)."""
        tunnel = self._tunnels.get(tunnel_id)
        if tunnel is None or tunnel.body_complete.is_set():
            return
        piece = data[: tunnel.body_left]
        tunnel.body += piece
        tunnel.body_left -= len(piece)
        if not tunnel.body_left:
            tunnel.body_complete.set()

    def credit(self, tunnel_id: str, amount: int) -> None:
        """The edge may take ``amount`` more body bytes. Unknown ids are ignored (the tunnel
        just ended)."""
        tunnel = self._tunnels.get(tunnel_id)
        if tunnel is None or amount <= 0:
            return
        tunnel.credit += amount
        tunnel.changed.unpark_all()

    def cancel(self, tunnel_id: str) -> None:
        """Close the tunnel's upstream request now; it answers ``tunnel.end`` with
        ``error="cancelled"``. Unknown or finished ids are ignored."""
        tunnel = self._tunnels.get(tunnel_id)
        if tunnel is not None:
            tunnel.scope.cancel(reason="tunnel.cancel")

    def statistics(self) -> TunnelRunnerStatistics:
        return TunnelRunnerStatistics(
            active_tunnels=len(self._tunnels),
            peak_pending=self._peak_pending,
            frames_sent=self._frames_sent,
            bytes_sent=self._bytes_sent,
        )

    # ----------------------------------------------------------------------- internals

    async def _run(self, tunnel: _Tunnel, request: wire.TunnelRequest) -> None:
        tunnel_id = tunnel.tunnel_id
        try:
            end: wire.TunnelEnd | None = None
            try:
                with tunnel.scope:
                    end = await self._perform(tunnel, request)
            except Exception as exc:
                closed = _find_closed(exc)
                if closed is not None:
                    raise closed from None  # the connection to the edge is gone: the session's
                log.exception("tunnel %s failed", tunnel_id)
                end = wire.TunnelEnd(tunnel_id=tunnel_id, error=f"internal: {_name(exc)}")
            if end is None or tunnel.scope.cancel_called:
                end = wire.TunnelEnd(tunnel_id=tunnel_id, error=CANCELLED)
                tunnel.answer.clear()  # none of it was sent: the end alone
            if tunnel.answer:
                await self._send_many([*tunnel.answer, end])
            else:
                await self._send(end)
        finally:
            if self._tunnels.get(tunnel_id) is tunnel:
                del self._tunnels[tunnel_id]

    async def _perform(self, tunnel: _Tunnel, request: wire.TunnelRequest) -> wire.TunnelEnd:
        tunnel_id = request.tunnel_id
        pooled = self._providers.get(request.provider_id)
        if pooled is None:
            return wire.TunnelEnd(
                tunnel_id=tunnel_id,
                error=f"unknown_provider: this node serves no provider {request.provider_id!r} "
                "through a tunnel",
                retryable=True,
            )
        if request.window <= 0:
            return wire.TunnelEnd(
                tunnel_id=tunnel_id, error=f"bad_request: window {request.window} is not positive"
            )
        await tunnel.body_complete.wait()
        if request.body_size:
            body, tunnel.body = bytes(tunnel.body), bytearray()
        else:
            body = request.body.encode("utf-8")
        provider, client = pooled.provider, pooled.client
        url = provider.url(request.path, request.query)
        headers = request_headers(request.headers, provider.api_key, provider.auth)
        # The edge relays these errors to clients: they name "the provider", never its URL,
        # host or the node's key (the node's own log keeps the URL).
        redact = Redactor.for_request(url, dict(headers))
        where = "the provider"
        started = False
        try:
            target = request_target(url)  # parsed once per provider path
            async with client.stream(request.method, target, headers, body) as response:
                started = True
                log.debug(
                    "tunnel %s: %s answered %d", tunnel_id, shown_url(url), response.status_code
                )
                start = wire.TunnelStart(
                    tunnel_id=tunnel_id,
                    status=response.status_code,
                    headers=response_headers(response),
                )
                whole = response.take_whole()
                if whole is not None and len(whole) <= tunnel.credit:
                    # The whole answer came with its head (a non-streamed one): tunnel.start,
                    # its body frames and tunnel.end leave together, in one socket write.
                    tunnel.answer = [start, *self._body_frames(tunnel, whole)]
                    return wire.TunnelEnd(tunnel_id=tunnel_id)
                await self._send(start)
                if whole:
                    tunnel.pending += whole  # more than the credit: the writer sends it
                await self._pump(tunnel, response, where)
        except httpx.TimeoutException as exc:
            log.info("tunnel %s: %s timed out: %s", tunnel_id, display_url(url), _name(exc))
            if started:
                error = f"upstream_disconnected: {where} timed out mid-response ({_kind(exc)})"
            else:
                error = f"upstream_unreachable: {where} timed out ({_kind(exc)})"
            return wire.TunnelEnd(tunnel_id=tunnel_id, error=error, retryable=not started)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            log.info("tunnel %s: %s failed: %s", tunnel_id, display_url(url), _name(exc))
            kind = "upstream_disconnected" if started else "upstream_unreachable"
            return wire.TunnelEnd(
                tunnel_id=tunnel_id,
                error=f"{kind}: {where}: {redact(_name(exc))}",
                retryable=not started,
            )
        except _UpstreamFailed as exc:
            return wire.TunnelEnd(tunnel_id=tunnel_id, error=redact(exc.error))
        return wire.TunnelEnd(tunnel_id=tunnel_id)

    def _body_frames(self, tunnel: _Tunnel, body: bytes) -> list[wire.TunnelData]:
        """``body`` (within the credit) as body frames, the credit taken."""
        pending = bytearray(body)
        frames = []
        while pending:
            data = take_body(pending, tunnel.credit)
            tunnel.credit -= len(data)
            frames.append(wire.TunnelData(tunnel.tunnel_id, data))
            self._frames_sent += 1
            self._bytes_sent += len(data)
        return frames

    async def _one_by_one(self, messages: Sequence[wire.NodeMessage | wire.TunnelData]) -> None:
        for message in messages:
            if isinstance(message, wire.TunnelData):
                await self._send_data(message.tunnel_id, message.data)
            else:
                await self._send(message)

    async def _pump(self, tunnel: _Tunnel, response: Response, where: str) -> None:
        """Relay the body: a reader task fills ``pending``, this task sends it."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read, tunnel, response, where)
            await self._write(tunnel)
        if tunnel.upstream_error is not None:
            raise _UpstreamFailed(tunnel.upstream_error)

    async def _read(self, tunnel: _Tunnel, response: Response, where: str) -> None:
        """Read the upstream body into ``pending`` while it has room. A failure of the
        upstream is recorded, not raised: what was read before it is still sent."""
        # finished(): however this is left (cancelled too), the response is closed; unless
        # it was read to its end, so is its connection when the request's block is left.
        async with finished(response, response.aiter_raw()) as iterator:
            try:
                async for piece in iterator:
                    while len(tunnel.pending) >= MAX_PENDING:
                        await tunnel.changed.park()
                    tunnel.pending += piece
                    self._peak_pending = max(self._peak_pending, len(tunnel.pending))
                    tunnel.changed.unpark_all()
            except httpx.HTTPError as exc:
                tunnel.upstream_error = (
                    f"upstream_disconnected: {where}: the body broke off: {_name(exc)}"
                )
            finally:
                tunnel.eof = True
                tunnel.changed.unpark_all()

    async def _write(self, tunnel: _Tunnel) -> None:
        """Send ``pending`` as credit allows, until the reader is done and all is sent."""
        pending = tunnel.pending
        while True:
            while not (pending and tunnel.credit > 0) and not (tunnel.eof and not pending):
                await tunnel.changed.park()
            if not pending:
                return
            # Everything buffered that fits one frame and the credit (nodes.coalesce).
            data = take_body(pending, tunnel.credit)
            size = len(data)
            tunnel.credit -= size
            tunnel.changed.unpark_all()  # room for the reader
            await self._send_data(tunnel.tunnel_id, data)
            self._frames_sent += 1
            self._bytes_sent += size


def _find_closed(exc: BaseException) -> ConnectionClosed | None:
    return first_leaf(exc, ConnectionClosed)


def _kind(exc: BaseException) -> str:
    return type(exc).__name__


def _name(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@asynccontextmanager
async def open_tunnels(
    send: SendMessage,
    send_data: SendData,
    providers: Mapping[str, AnyTunnelProvider],
    *,
    send_many: SendFrames | None = None,
) -> AsyncIterator[TunnelRunner]:
    """A :class:`TunnelRunner` whose tunnels live inside this block. The providers' pools
    (one pooled HTTP client per provider) not yet open are opened for the block
    (:func:`open_tunnel_pools`; those the caller opened stay open after it). Leaving it
    cancels every tunnel, which closes their upstream connections (a connection whose answer
    was not read to its end is never pooled); nothing more is sent. ``send_many``, when
    given, sends a whole answer that came at once (``tunnel.start``, its body, ``tunnel.end``)
    together."""
    async with open_tunnel_pools(providers) as pooled, trio.open_nursery() as nursery:
        runner = TunnelRunner(nursery, send, send_data, pooled, send_many)
        try:
            yield runner
        finally:
            runner._closed = True
            nursery.cancel_scope.cancel(reason="tunnel runner closed")
