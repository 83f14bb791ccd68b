"""The edge's HTTP surface: one handler for our server, routing to the API modules.

Errors from every route are turned into the OpenAI error body here, in one place; so are the
errors the HTTP layer answers itself (:func:`error_page`, given to ``serve_http``).
Every request gets an edge request id here (:func:`new_request_id`), the usage ledger's key;
a client's own ``x-request-id`` is kept beside it, never used in its place.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Literal

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
    openai_error_object,
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
from . import openai, tunnel_relay
from .usage_report import parse_usage_query, usage_report_json

if TYPE_CHECKING:
    from ..service import Dispatcher

log = logging.getLogger("dispatcher.api")

NODE_CONNECT_PATH = "/v1/nodes/connect"

_CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:@/+=~-]{1,128}")
"""A client's ``x-request-id`` worth keeping: 1 to 128 characters, safe in a header, a log line
and a query string. Anything else is ignored (the edge's own id stands in for it)."""

_NODE_HEADERS = frozenset({b"x-dispatcher-node", b"x-dispatcher-provider"})
"""Response headers that name a node: sent only with ``expose_node_ids``."""


@attrs.frozen(kw_only=True)
class RouteContext:
    request_id: str
    """The edge's own id of the request (:func:`new_request_id`): the usage ledger's key,
    never the client's."""
    client_request_id: str | None
    """The client's ``x-request-id`` when it sent one worth keeping (:func:`client_request_id`):
    stored beside the edge's id, echoed back."""
    headers: tuple[tuple[bytes, bytes], ...]
    """Response headers every answer carries (:func:`request_headers`)."""
    attribution: str | None
    """Who the request's usage is attributed to: the id of the client's API key."""


def new_request_id() -> str:
    """A fresh edge request id, ``req-`` and 24 hex digits."""
    return "req-" + secrets.token_hex(12)


def client_request_id(request: Request) -> str | None:
    """The client's ``x-request-id`` when it is one to keep (:data:`_CLIENT_REQUEST_ID`)."""
    value = request.header(b"x-request-id")
    if value is None or _CLIENT_REQUEST_ID.fullmatch(value) is None:
        return None
    return value.decode("ascii")


def request_headers(request_id: str, client_id: str | None) -> tuple[tuple[bytes, bytes], ...]:
    """``x-request-id`` (the client's own id echoed, else the edge's) and
    ``x-dispatcher-request-id`` (the edge's, the usage ledger's key)."""
    edge_id = request_id.encode("ascii")
    echoed = client_id.encode("ascii") if client_id is not None else edge_id
    return ((b"x-request-id", echoed), (b"x-dispatcher-request-id", edge_id))


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
    then on only a stream's own scope may end it) and the handler whether it did, and it
    keeps node names out of the answer unless the edge exposes them."""

    def __init__(self, inner: Responder, work: Work, *, expose_node_ids: bool) -> None:
        self._inner = inner
        self._work = work
        self._expose_node_ids = expose_node_ids
        self.started = False

    @property
    def shutting_down(self) -> bool:
        return self._inner.shutting_down

    def _headers(self, headers: Headers) -> Headers:
        if self._expose_node_ids:
            return headers
        return [header for header in headers if header[0] not in _NODE_HEADERS]

    async def respond(self, status: int, headers: Headers = (), body: bytes = b"") -> None:
        self._work.answered = True
        await self._inner.respond(status, self._headers(headers), body)
        self.started = True

    async def start_stream(self, status: int, headers: Headers = ()) -> HTTPStream:
        self._work.answered = True
        stream = await self._inner.start_stream(status, self._headers(headers))
        self.started = True
        return stream

    async def accept_websocket(
        self, subprotocol: str | None = None, headers: Headers = ()
    ) -> WebSocket:
        self._work.answered = True
        ws = await self._inner.accept_websocket(subprotocol, self._headers(headers))
        self.started = True
        return ws


class MethodNotAllowed(DispatcherError):
    """405, with the methods the path takes (the response's ``Allow``)."""

    status = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"

    def __init__(self, message: str, *, allow: str) -> None:
        super().__init__(message)
        self.allow = allow


Route = Callable[["Dispatcher", Request, Responder, RouteContext], Awaitable[None]]

Access = Literal["open", "client", "admin", "metrics"]
"""Who may call a route (see :func:`make_handler`)."""


@attrs.frozen
class RouteSpec:
    methods: tuple[str, ...]
    """What the route answers (besides OPTIONS)."""
    func: Route
    access: Access
    work: bool = False
    """The route runs a model: refused while draining, waited for by the drain."""

    @property
    def allow(self) -> str:
        """The ``Allow`` header's value."""
        return ", ".join((*self.methods, "OPTIONS"))


def make_handler(dispatcher: Dispatcher) -> Handler:
    """The edge's handler. Who may call what:

    * ``open`` routes (health, readiness, the node websocket, whose hello carries the node
      token) need no key;
    * ``client`` routes need a client key when any is configured (an admin key is not one);
    * ``admin`` routes need an admin key when any is configured; with none, they are open
      only if the client routes are open too;
    * ``metrics`` (``/metrics``, whose series name nodes and providers) needs an admin key
      when any is configured, else a client key when any is configured, else nothing.
    """
    api_keys = [key.encode() for key in dispatcher.config.client_api_keys()]
    admin_keys = [key.encode() for key in dispatcher.config.admin_api_keys()]
    expose_node_ids = dispatcher.config.expose_node_ids

    def authorize(access: Access, request: Request) -> str | None:
        if access == "open":
            return None
        admin = access == "admin" or (access == "metrics" and bool(admin_keys))
        keys = admin_keys if admin else api_keys
        if not keys:
            if admin and api_keys:
                raise Unauthorized("admin routes need an admin key (configure admin_keys)")
            return None
        header = request.header(b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        ok = False
        for key in keys:  # no early exit: constant time over the configured keys
            ok |= hmac.compare_digest(token, key)
        if not ok:
            raise Unauthorized("invalid admin key" if admin else "invalid API key")
        return key_id(token)

    async def handler(request: Request, responder: Responder) -> None:
        request_id = new_request_id()
        client_id = client_request_id(request)
        headers = request_headers(request_id, client_id)
        try:
            path, method = request.path, request.method
            if method == "OPTIONS" and request.target == "*":
                await responder.respond(204, ((b"allow", _ALLOW_ANY), *headers))
                return
            route = _ROUTES.get(path)
            if route is None:
                raise NotFound(f"no route for {method} {_shorten(path)}", code="unknown_url")
            if method == "OPTIONS":
                await responder.respond(204, ((b"allow", route.allow.encode()), *headers))
                return
            if method not in route.methods:
                raise MethodNotAllowed(
                    f"{method} is not allowed on {path}; use {' or '.join(route.methods)}",
                    allow=route.allow,
                )
            ctx = RouteContext(
                request_id=request_id,
                client_request_id=client_id,
                headers=headers,
                attribution=authorize(route.access, request),
            )
            if not route.work:
                await route.func(dispatcher, request, responder, ctx)
                return
            # A request that runs a model: the drain waits for it (track_work refuses it
            # with 503 once draining), and ends it when the grace is over.
            with dispatcher.track_work() as work:
                watched = _WorkResponder(responder, work, expose_node_ids=expose_node_ids)
                await route.func(dispatcher, request, watched, ctx)
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


def _shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


_ERROR_PAGE_CODES: dict[int, str] = {
    400: "invalid_request",
    408: "request_timeout",
    413: "payload_too_large",
    414: "uri_too_long",
    431: "headers_too_large",
    500: "internal_error",
    501: "not_implemented",
    505: "http_version_not_supported",
}


def error_page(status: int, message: str) -> tuple[Headers, bytes]:
    """``serve_http``'s ``error_page`` hook: the errors the HTTP layer answers itself
    (malformed or ambiguous requests, timeouts, limits) in the OpenAI error shape, like every
    other answer of the API."""
    body = openai_error_object(
        message,
        error_type="invalid_request_error" if status < 500 else "server_error",
        code=_ERROR_PAGE_CODES.get(status, f"http_{status}"),
    )
    return openai.JSON_HEADERS, orjson.dumps(body)


async def _node_connect(
    dispatcher: Dispatcher, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    if not request.is_websocket_upgrade:
        raise BadRequest("this endpoint takes a websocket upgrade from a node")
    if dispatcher.draining:
        # Refused before the upgrade: the node retries with backoff (a 503 is transient to
        # it), by then maybe to the edge's successor.
        raise ShuttingDown(
            "the edge is shutting down; reconnect later", retry_after=DRAIN_RETRY_AFTER
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


async def _healthz(
    dispatcher: Dispatcher, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    body = orjson.dumps({"status": "ok", "nodes": len(dispatcher.registry.sessions)})
    await responder.respond(200, (*openai.JSON_HEADERS, *ctx.headers), body)


async def _readyz(
    dispatcher: Dispatcher, request: Request, responder: Responder, ctx: RouteContext
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
    await responder.respond(code, (*openai.JSON_HEADERS, *ctx.headers), body)


async def _respond_error(
    responder: Responder, exc: BaseException, headers: tuple[tuple[bytes, bytes], ...]
) -> None:
    status, body, retry_after = error_status_and_body(exc)
    extra = list(headers)
    if retry_after is not None:
        extra.append((b"retry-after", str(max(1, round(retry_after))).encode()))
    if isinstance(exc, MethodNotAllowed):
        extra.append((b"allow", exc.allow.encode()))
    elif isinstance(exc, Unauthorized):
        extra.append((b"www-authenticate", b"Bearer"))  # RFC 9110 section 15.5.2
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


_GET = ("GET", "HEAD")
_POST = ("POST",)

_ROUTES: dict[str, RouteSpec] = {
    NODE_CONNECT_PATH: RouteSpec(("GET",), _node_connect, "open"),
    "/healthz": RouteSpec(_GET, _healthz, "open"),
    "/readyz": RouteSpec(_GET, _readyz, "open"),
    "/v1/usage": RouteSpec(_GET, _usage, "admin"),
    "/v1/chat/completions": RouteSpec(_POST, _chat, "client", work=True),
    "/v1/completions": RouteSpec(_POST, tunnel_relay.tunnel_route, "client", work=True),
    "/v1/embeddings": RouteSpec(_POST, tunnel_relay.tunnel_route, "client", work=True),
    "/v1/models": RouteSpec(_GET, _models, "client"),
    "/metrics": RouteSpec(_GET, _metrics, "metrics"),
}

_ALLOW_ANY = b"GET, HEAD, POST, OPTIONS"
"""``OPTIONS *``: every method some route takes."""
