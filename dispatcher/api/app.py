"""The edge's HTTP surface: one handler for our server, routing to the API modules.

Errors from every route are turned into the OpenAI error body here, in one place.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import attrs
import orjson

from ..admission import AdmissionError
from ..errors import (
    BadRequest,
    DispatcherError,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
    error_status_and_body,
)
from ..http import (
    BodyTooLarge,
    Handler,
    Headers,
    HTTPStream,
    PeerGone,
    Request,
    Responder,
    WebSocket,
    WebSocketClosed,
)
from ..metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..nodelink import serve_node_connection
from ..service import DRAIN_RETRY_AFTER, ShuttingDown, Work
from ..transport import ConnectionClosed
from ..usage import parse_usage_query, usage_report_json
from . import openai, tunnel_relay

if TYPE_CHECKING:
    from ..service import Dispatcher

log = logging.getLogger("dispatcher.api")

NODE_CONNECT_PATH = "/v1/nodes/connect"


@attrs.frozen
class RouteContext:
    headers: tuple[tuple[bytes, bytes], ...]
    """Response headers every answer carries (``x-request-id``)."""
    attribution: str | None
    """Who the request's usage is attributed to: the id of the client's API key."""

    @property
    def request_id(self) -> str:
        return dict(self.headers)[b"x-request-id"].decode("latin-1")


def key_id(key: bytes) -> str:
    """A stable, non-secret id for an API key (what the usage ledger records)."""
    return "key-" + hashlib.sha256(key).hexdigest()[:12]


class ServerWebSocketConnection:
    """A :class:`dispatcher.transport.Connection` over our server's websocket."""

    def __init__(self, ws: WebSocket) -> None:
        self._ws = ws

    async def send(self, frame: str | bytes) -> None:
        try:
            await self._ws.send(frame)
        except WebSocketClosed as exc:
            raise ConnectionClosed(exc.reason or "websocket closed", exc.code) from None
        except PeerGone as exc:
            raise ConnectionClosed(str(exc) or "peer gone") from None

    async def receive(self) -> str | bytes:
        try:
            return await self._ws.receive()
        except WebSocketClosed as exc:
            raise ConnectionClosed(exc.reason or "websocket closed", exc.code) from None
        except PeerGone as exc:
            raise ConnectionClosed(str(exc) or "peer gone") from None

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        try:
            await self._ws.aclose(code, reason)
        except (WebSocketClosed, PeerGone):
            pass


class _WorkResponder:
    """The responder a work route gets: it tells the drain when the answer starts (from
    then on only a stream's own scope may end it) and the handler whether it did."""

    def __init__(self, inner: Responder, work: Work) -> None:
        self._inner = inner
        self._work = work
        self.started = False

    @property
    def shutting_down(self) -> bool:
        return self._inner.shutting_down

    async def respond(self, status: int, headers: Headers = (), body: bytes = b"") -> None:
        self._work.answered = True
        await self._inner.respond(status, headers, body)
        self.started = True

    async def start_stream(self, status: int, headers: Headers = ()) -> HTTPStream:
        self._work.answered = True
        stream = await self._inner.start_stream(status, headers)
        self.started = True
        return stream

    async def accept_websocket(
        self, subprotocol: str | None = None, headers: Headers = ()
    ) -> WebSocket:
        self._work.answered = True
        ws = await self._inner.accept_websocket(subprotocol, headers)
        self.started = True
        return ws


Route = Callable[["Dispatcher", Request, Responder, RouteContext], Awaitable[None]]


def make_handler(dispatcher: Dispatcher) -> Handler:
    api_keys = [key.encode() for key in dispatcher.config.client_api_keys()]
    admin_keys = [key.encode() for key in dispatcher.config.admin_api_keys()]

    def authorize(request: Request) -> str | None:
        """Client routes need a client key when any is configured. Admin routes need an
        admin key when any is configured; with none, they are as open as the client routes
        only if those are open too."""
        admin = request.path in _ADMIN_PATHS
        keys = admin_keys if admin else api_keys
        if not keys:
            if admin and api_keys:
                raise Unauthorized("admin routes need an admin key (configure admin_keys)")
            return None
        header = request.header(b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        ok = False
        for key in keys:  # no early exit: constant time over the configured keys
            ok |= hmac.compare_digest(token.strip(), key)
        if not ok:
            raise Unauthorized("invalid admin key" if admin else "invalid API key")
        return key_id(token.strip())

    async def handler(request: Request, responder: Responder) -> None:
        request_id = (request.header(b"x-request-id") or secrets.token_hex(8).encode())[:64]
        headers = ((b"x-request-id", request_id),)
        try:
            path, method = request.path, request.method
            if path == NODE_CONNECT_PATH:
                if not request.is_websocket_upgrade:
                    raise BadRequest("this endpoint takes a websocket upgrade from a node")
                if dispatcher.draining:
                    # Refused before the upgrade: the node retries with backoff (a 503 is
                    # transient to it), by then maybe to the edge's successor.
                    raise ShuttingDown(
                        "the edge is shutting down; reconnect later",
                        retry_after=DRAIN_RETRY_AFTER,
                    )
                ws = await responder.accept_websocket()
                client = request.client
                peer = f"{client.host}:{client.port}" if client else "unknown"
                await serve_node_connection(
                    ServerWebSocketConnection(ws),
                    dispatcher.registry,
                    dispatcher.nodelink_settings,
                    on_capacity=dispatcher.on_capacity,
                    on_draining=dispatcher.on_draining,
                    peer=peer,
                )
                return
            if path == "/healthz":
                body = orjson.dumps({"status": "ok", "nodes": len(dispatcher.registry.sessions)})
                await responder.respond(200, (*openai.JSON_HEADERS, *headers), body)
                return
            if path == "/readyz":
                await _readyz(dispatcher, responder, headers)
                return
            route = _ROUTES.get(path)
            if route is None:
                raise NotFound(f"no route for {method} {path}", code="unknown_url")
            allowed, func = route
            if method != allowed and not (method == "HEAD" and allowed == "GET"):
                raise DispatcherError(
                    f"{method} is not allowed on {path}; use {allowed}",
                    status=405,
                    code="method_not_allowed",
                )
            attribution = authorize(request)
            ctx = RouteContext(headers, attribution)
            if path not in _WORK_PATHS:
                await func(dispatcher, request, responder, ctx)
                return
            # A request that runs a model: the drain waits for it (track_work refuses it
            # with 503 once draining), and ends it when the grace is over.
            with dispatcher.track_work() as work:
                watched = _WorkResponder(responder, work)
                await func(dispatcher, request, watched, ctx)
            if work.scope.cancelled_caught and not watched.started:
                raise ShuttingDown(
                    "the dispatcher shut down before answering; retry the request",
                    retry_after=DRAIN_RETRY_AFTER,
                )
        except BodyTooLarge:
            await _respond_error(
                responder, PayloadTooLarge("request body is over the size limit"), headers
            )
        except (DispatcherError, AdmissionError) as exc:
            await _respond_error(responder, exc, headers)

    return handler


async def _readyz(
    dispatcher: Dispatcher, responder: Responder, headers: tuple[tuple[bytes, bytes], ...]
) -> None:
    """Readiness (``/healthz`` is liveness): 200 while the edge takes requests -- not
    draining, at least one model served -- else 503."""
    models = sorted(dispatcher.registry.models())
    if dispatcher.draining:
        status = "draining"
    elif not models:
        status = "no_models"
    else:
        status = "ready"
    body = orjson.dumps(
        {"status": status, "nodes": len(dispatcher.registry.sessions), "models": models}
    )
    code = 200 if status == "ready" else 503
    await responder.respond(code, (*openai.JSON_HEADERS, *headers), body)


async def _respond_error(
    responder: Responder, exc: BaseException, headers: tuple[tuple[bytes, bytes], ...]
) -> None:
    status, body, retry_after = error_status_and_body(exc)
    extra = list(headers)
    if retry_after is not None:
        extra.append((b"retry-after", str(max(1, round(retry_after))).encode()))
    if status >= 500:
        log.info("answering %d: %s", status, exc)
    await responder.respond(status, (*openai.JSON_HEADERS, *extra), body)


async def _chat(
    dispatcher: Dispatcher,
    request: Request,
    responder: Responder,
    ctx: RouteContext,
) -> None:
    await openai.chat_completions(dispatcher, request, responder, ctx)


async def _models(
    dispatcher: Dispatcher,
    request: Request,
    responder: Responder,
    ctx: RouteContext,
) -> None:
    await openai.list_models(dispatcher, responder, ctx.headers)


async def _metrics(
    dispatcher: Dispatcher,
    request: Request,
    responder: Responder,
    ctx: RouteContext,
) -> None:
    body = dispatcher.metrics.render()
    content_type = (b"content-type", METRICS_CONTENT_TYPE.encode())
    await responder.respond(200, (content_type, *ctx.headers), body)


async def _usage(
    dispatcher: Dispatcher,
    request: Request,
    responder: Responder,
    ctx: RouteContext,
) -> None:
    try:
        query = parse_usage_query(request.query)
    except ValueError as exc:
        raise BadRequest(str(exc), code="invalid_query") from None
    report = await dispatcher.ledger.query(**query)
    await responder.respond(200, (*openai.JSON_HEADERS, *ctx.headers), usage_report_json(report))


_ADMIN_PATHS = frozenset({"/v1/usage"})
_WORK_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
"""Routes that run a model: refused while draining, waited for by the drain."""

_ROUTES: dict[str, tuple[str, Route]] = {
    "/v1/usage": ("GET", _usage),
    "/v1/chat/completions": ("POST", _chat),
    "/v1/completions": ("POST", tunnel_relay.tunnel_route),
    "/v1/embeddings": ("POST", tunnel_relay.tunnel_route),
    "/v1/models": ("GET", _models),
    "/metrics": ("GET", _metrics),
}
