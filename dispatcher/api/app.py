"""The edge's HTTP surface: one handler for our server, routing to the front ends.

A front end is one module (:mod:`dispatcher.api.front`): its routes and its error shape. Each
is registered here with one line in :data:`FRONT_ENDS`; :func:`make_handler` takes another
tuple (an embedder's or a test's own front ends). Whatever a route raises is answered in its
front end's shape; what is no front end's (an unknown path, the errors the HTTP layer answers
itself: :func:`make_error_page`, given to ``serve_http``) in the first front end's.
Every request gets an edge request id here (:func:`new_request_id`), the usage ledger's key;
a client's own ``x-request-id`` is kept beside it, never used in its place.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable, Iterable, Sequence

import attrs

from ..admission import AdmissionError
from ..errors import (
    DispatcherError,
    NotFound,
    PayloadTooLarge,
    ShuttingDown,
    Unauthorized,
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
)
from ..tenants import KeyDirectory, Tenant
from ..tenants import legacy_key_id as key_id
from . import (
    admin,
    anthropic,
    openai,
    operations,
    responses,
)
from .front import (
    Access,
    ErrorRenderer,
    FrontEnd,
    RenderedError,
    RouteContext,
    RouteSpec,
)
from .recorded import RecordingResponder
from .seam import ApiSettings, EdgeServices, WorkTicket

__all__ = [
    "FRONT_ENDS",
    "MethodNotAllowed",
    "client_request_id",
    "key_id",
    "make_error_page",
    "make_handler",
    "new_request_id",
    "presented_key",
    "request_id_headers",
]

log = logging.getLogger("dispatcher.api")

FRONT_ENDS: tuple[FrontEnd, ...] = (
    openai.FRONT_END,
    operations.FRONT_END,
    responses.FRONT_END,
    anthropic.FRONT_END,
    admin.FRONT_END,
)
"""The edge's front ends, one line each; the first one's error shape is the default."""

_CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:@/+=~-]{1,128}")
"""A client's ``x-request-id`` worth keeping: 1 to 128 characters, safe in a header, a log line
and a query string. Anything else is ignored (the edge's own id stands in for it)."""

_NODE_HEADERS = frozenset({b"x-dispatcher-node", b"x-dispatcher-provider"})
"""Response headers that name a node: sent only with ``expose_node_ids``."""


def new_request_id() -> str:
    """A fresh edge request id, ``req-`` and 24 hex digits."""
    return "req-" + secrets.token_hex(12)


def client_request_id(request: Request) -> str | None:
    """The client's ``x-request-id`` when it is one to keep (:data:`_CLIENT_REQUEST_ID`)."""
    value = request.header(b"x-request-id")
    if value is None or _CLIENT_REQUEST_ID.fullmatch(value) is None:
        return None
    return value.decode("ascii")


def request_id_headers(request_id: str, client_id: str | None) -> tuple[tuple[bytes, bytes], ...]:
    """``x-request-id`` (the client's own id echoed, else the edge's) and
    ``x-dispatcher-request-id`` (the edge's, the usage ledger's key)."""
    edge_id = request_id.encode("ascii")
    echoed = client_id.encode("ascii") if client_id is not None else edge_id
    return ((b"x-request-id", echoed), (b"x-dispatcher-request-id", edge_id))


def presented_key(request: Request) -> bytes | None:
    """The API key the client sent: ``Authorization: Bearer <key>``, else ``x-api-key: <key>``
    (what Anthropic's clients send: Claude Code, older SDKs, the API's examples)."""
    scheme, _, token = (request.header(b"authorization") or b"").partition(b" ")
    token = token.strip()
    if scheme.lower() == b"bearer" and token:
        return token
    return (request.header(b"x-api-key") or b"").strip() or None


@attrs.frozen
class _Caller:
    """Who called, as :func:`make_handler`'s ``authorize`` found it."""

    attribution: str | None = None
    tenant: Tenant | None = None
    admin: bool = False


class _WorkResponder:
    """The responder a work route gets: it tells the drain when the answer starts (from
    then on only a stream's own scope may end it) and the handler whether it did, and it
    keeps node names out of the answer unless the edge exposes them."""

    def __init__(self, inner: Responder, work: WorkTicket, *, expose_node_ids: bool) -> None:
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


class MethodNotAllowed(
    DispatcherError, status=405, error_type="invalid_request_error", code="method_not_allowed"
):
    """405, with the methods the path takes (the response's ``Allow``)."""

    def __init__(self, message: str, *, allow: str) -> None:
        super().__init__(message)
        self.allow = allow


def make_handler(
    edge: EdgeServices,
    settings: ApiSettings,
    front_ends: Sequence[FrontEnd] = FRONT_ENDS,
) -> Handler:
    """The edge's handler over ``front_ends`` (no path may be in two). Who may call what:

    * ``open`` routes (health, readiness, the node websocket, whose hello carries the node
      token) need no key;
    * ``client`` routes need a client key when any is configured (an admin key is not one);
    * ``admin`` routes need an admin key when any is configured; with none, they are open
      only if the client routes are open too;
    * ``metrics`` (``/metrics``, whose series name nodes and providers) takes the metrics
      token (``[metrics] token``) when one is configured, which opens nothing else; besides
      it, an admin key when any is configured, else a client key when any is; with none of
      the three configured, nothing;
    * ``usage`` (``GET /v1/usage``) is an admin route that a ``[[keys]]`` tenant's key may
      call too, for its own rows (``RouteContext.admin`` False, ``tenant`` set).

    The keys are read per request from ``edge.tenants.keys``, which a reload swaps.
    """
    routes = _route_table(front_ends)
    default = front_ends[0].render_error
    allow_any = _allow_any(spec for spec, _ in routes.values())
    expose_node_ids = settings.expose_node_ids

    def authorize(access: Access, request: Request) -> _Caller:
        if access == "open":
            return _Caller()
        keys = edge.tenants.keys
        # The key headers are read only when keys are configured (none: nothing to check).
        token = presented_key(request) if keys.clients or keys.admins or keys.scrapers else None
        if access == "metrics" and keys.scrapers:
            return _metrics_caller(keys, token)
        if access == "usage" and token is not None:
            tenant = keys.client(token)
            if tenant is not None and tenant.own_usage:
                return _Caller(tenant.id, tenant)
        admin = access in ("admin", "usage") or (access == "metrics" and bool(keys.admins))
        if not (keys.admins if admin else keys.clients):
            if admin and keys.clients:
                raise Unauthorized("admin routes need an admin key (configure admin_keys)")
            return _Caller(admin=admin)
        if token is None:
            raise Unauthorized(
                "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )
        if admin:
            if not keys.admin(token):
                raise Unauthorized("invalid admin key")
            return _Caller(key_id(token), admin=True)
        tenant = keys.client(token)
        if tenant is None:
            raise Unauthorized("invalid API key")
        return _Caller(tenant.id, tenant)

    async def handler(request: Request, responder: Responder) -> None:
        # One coroutine for the whole request: a held stream keeps every frame on its stack.
        request_id, client_id = new_request_id(), client_request_id(request)
        with edge.traffic.open(
            request_id, client_id, request.method, request.path, left_on=PeerGone
        ) as record:
            responder = RecordingResponder(responder, record)
            headers = request_id_headers(request_id, client_id)
            render = default
            try:
                path, method = request.path, request.method
                if method == "OPTIONS" and request.target == "*":
                    await responder.respond(204, ((b"allow", allow_any), *headers))
                    return
                key = path
                if key not in routes:
                    # A pattern route: its last segment is "{id}" (``/v1/responses/{id}``).
                    parent, _, last = path.rpartition("/")
                    key = parent + "/{id}" if last else path
                found = routes.get(key)
                if found is None:
                    raise NotFound(f"no route for {method} {_shorten(path)}", code="unknown_url")
                route, render = found
                record.routed(key, work=route.work)
                if method == "OPTIONS":
                    await responder.respond(204, ((b"allow", route.allow.encode()), *headers))
                    return
                if method not in route.methods:
                    raise MethodNotAllowed(
                        f"{method} is not allowed on {path}; use {' or '.join(route.methods)}",
                        allow=route.allow,
                    )
                caller = authorize(route.access, request)
                ctx = RouteContext(
                    request_id=request_id,
                    client_request_id=client_id,
                    headers=headers,
                    attribution=caller.attribution,
                    tenant=caller.tenant,
                    admin=caller.admin,
                    record=record,
                    settings=settings,
                )
                record.key_id = ctx.attribution
                if not route.work:
                    await route.func(edge, request, responder, ctx)
                    return
                # A request that runs a model: the drain waits for it (track_work refuses it
                # with 503 once draining), and ends it when the grace is over.
                with edge.track_work() as work:
                    watched = _WorkResponder(responder, work, expose_node_ids=expose_node_ids)
                    await route.func(edge, request, watched, ctx)
                if work.scope.cancelled_caught and not watched.started:
                    raise ShuttingDown(
                        "the dispatcher shut down before answering; retry the request"
                    )
            except BodyTooLarge:
                error = PayloadTooLarge("request body is over the size limit")
                record.failed(error.code, str(error))
                await _respond_error(responder, error, render(error), headers)
            except (DispatcherError, AdmissionError) as exc:
                record.failed(exc.code, str(exc))
                await _respond_error(responder, exc, render(exc), headers)

    return handler


def _metrics_caller(keys: KeyDirectory, token: bytes | None) -> _Caller:
    """Who calls ``/metrics`` when a metrics token is configured: its scraper (a caller of
    no rights elsewhere), an admin key (when any is configured), else a client key (when
    any is); anyone else is refused."""
    if token is None:
        raise Unauthorized(
            "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        )
    if keys.scraper(token):
        return _Caller(key_id(token))
    if keys.admins:
        if keys.admin(token):
            return _Caller(key_id(token), admin=True)
    elif keys.clients:
        tenant = keys.client(token)
        if tenant is not None:
            return _Caller(tenant.id, tenant)
    also = " or an admin key" if keys.admins else " or a client key" if keys.clients else ""
    raise Unauthorized(f"invalid key: /metrics takes the metrics token{also}")


def _route_table(
    front_ends: Sequence[FrontEnd],
) -> dict[str, tuple[RouteSpec, ErrorRenderer]]:
    if not front_ends:
        raise ValueError("make_handler needs at least one front end")
    table: dict[str, tuple[RouteSpec, ErrorRenderer]] = {}
    owner: dict[str, str] = {}
    for front_end in front_ends:
        for path, spec in front_end.routes.items():
            if path in table:
                raise ValueError(
                    f"{path} is a route of both {owner[path]!r} and {front_end.name!r}"
                )
            table[path] = (spec, front_end.render_error)
            owner[path] = front_end.name
    return table


_METHOD_ORDER = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def _allow_any(specs: Iterable[RouteSpec]) -> bytes:
    """``OPTIONS *``: every method some route takes."""
    methods = {method for spec in specs for method in spec.methods}
    known = [method for method in _METHOD_ORDER if method in methods]
    others = sorted(methods.difference(_METHOD_ORDER))
    return ", ".join((*known, *others, "OPTIONS")).encode()


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


def make_error_page(
    front_ends: Sequence[FrontEnd] = FRONT_ENDS,
) -> Callable[[int, str], tuple[Headers, bytes]]:
    """``serve_http``'s ``error_page`` hook: the errors the HTTP layer answers itself
    (malformed or ambiguous requests, timeouts, limits) in the first front end's shape, like
    every other answer of the API."""
    render = front_ends[0].render_error

    def error_page(status: int, message: str) -> tuple[Headers, bytes]:
        code = _ERROR_PAGE_CODES.get(status, f"http_{status}")
        rendered = render(DispatcherError(message, code=code, status=status))
        return [(b"content-type", rendered.content_type)], rendered.body

    return error_page


async def _respond_error(
    responder: Responder,
    exc: BaseException,
    rendered: RenderedError,
    headers: tuple[tuple[bytes, bytes], ...],
) -> None:
    extra = [(b"content-type", rendered.content_type), *headers]
    if isinstance(exc, DispatcherError):
        extra.extend(exc.headers)
    if rendered.retry_after is not None:
        extra.append((b"retry-after", str(max(1, round(rendered.retry_after))).encode()))
    if isinstance(exc, MethodNotAllowed):
        extra.append((b"allow", exc.allow.encode()))
    elif isinstance(exc, Unauthorized):
        extra.append((b"www-authenticate", b"Bearer"))  # RFC 9110 section 15.5.2
    if rendered.status >= 500:
        log.info("answering %d: %s", rendered.status, exc)
    await responder.respond(rendered.status, extra, rendered.body)
