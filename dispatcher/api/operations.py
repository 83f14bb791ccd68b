"""The edge's own routes, a front end like any other: liveness and readiness, the usage
report, Prometheus metrics, the config reload, and the websocket nodes dial. They answer
errors in the OpenAI shape, like the OpenAI routes beside them."""

from __future__ import annotations

import urllib.parse

import attrs
import orjson

from ..config import ConfigError
from ..errors import (
    BadRequest,
    DispatcherError,
    Forbidden,
    NoConfigFile,
    ShuttingDown,
)
from ..http import (
    PeerGone,
    Request,
    Responder,
    WebSocket,
    WebSocketClosed,
)
from ..observe.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..shared.transport import ConnectionClosed
from ..wire import NODE_CONNECT_PATH
from .common import JSON_HEADERS, openai_error
from .front import FrontEnd, RouteContext, RouteSpec
from .seam import EdgeServices
from .usage_report import parse_usage_query, usage_report_json

__all__ = [
    "FRONT_END",
    "METRICS_PATH",
    "SCRAPE_FRONT_END",
    "ServerWebSocketConnection",
]

METRICS_PATH = "/metrics"


class ServerWebSocketConnection:
    """A :class:`dispatcher.shared.transport.Connection` over our server's websocket."""

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


async def _node_connect(
    edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    if not request.is_websocket_upgrade:
        raise BadRequest("this endpoint takes a websocket upgrade from a node")
    if edge.draining:
        # Refused before the upgrade: the node retries with backoff (a 503 is transient to
        # it), by then maybe to the edge's successor.
        raise ShuttingDown("the edge is shutting down; reconnect later")
    ws = await responder.accept_websocket()
    client = request.client
    peer = f"{client.host}:{client.port}" if client else "unknown"
    await edge.serve_node_connection(ServerWebSocketConnection(ws), peer)


async def _healthz(
    edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    body = orjson.dumps({"status": "ok", "nodes": len(edge.registry.sessions)})
    await responder.respond(200, (*JSON_HEADERS, *ctx.headers), body)


async def _readyz(
    edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    """Readiness (``/healthz`` is liveness): 200 while the edge takes requests -- not
    draining, at least one model served by a node that is not draining -- else 503, the body
    saying why (``{"ready": false, "status": "no_models", "reason": "no node serves a
    model", ...}``). ``models`` are those a request could be routed to now."""
    sessions = edge.registry.sessions.values()
    models = sorted(edge.registry.routable_models())
    draining_nodes = sum(session.draining for session in sessions)
    ready = not edge.draining and bool(models)
    body: dict[str, object] = {"ready": ready}
    if edge.draining:
        body.update(status="draining", reason="the edge is draining")
    elif not models:
        reason = "no node serves a model"
        if draining_nodes:
            reason += f" ({draining_nodes} node(s) draining)"
        body.update(status="no_models", reason=reason)
    else:
        body.update(status="ready")
    body.update(nodes=len(sessions), draining_nodes=draining_nodes, models=models)
    await responder.respond(
        200 if ready else 503, (*JSON_HEADERS, *ctx.headers), orjson.dumps(body)
    )


async def _metrics(
    edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    body = edge.metrics.render()
    content_type = (b"content-type", METRICS_CONTENT_TYPE.encode())
    await responder.respond(200, (content_type, *ctx.headers), body)


async def _usage(
    edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    """The usage report: an admin key reads every row, a tenant's key its own (its id is
    the ``attribution`` filter, and naming another one is refused)."""
    try:
        query = parse_usage_query(request.query)
    except ValueError as exc:
        raise BadRequest(str(exc), code="invalid_query") from None
    rows = query.filter
    if not ctx.admin:
        own = ctx.attribution
        if rows.attribution is None:
            rows = attrs.evolve(rows, attribution=own or "")
        if rows.attribution != own:
            raise Forbidden("a key may read only its own usage", param="attribution")
    report = await edge.ledger.query(rows, limit=query.limit)
    groups = await edge.ledger.query_groups(rows, group_by=query.group_by)
    body = usage_report_json(report, groups, query.group_by)
    await responder.respond(200, (*JSON_HEADERS, *ctx.headers), body)


def _reload_scope(query: str) -> str:
    scopes = urllib.parse.parse_qs(query).get("scope", ["edge"])
    if len(scopes) != 1 or scopes[0] not in ("edge", "cluster"):
        raise BadRequest(
            "scope must be edge (this edge, the default) or cluster (this edge, then every "
            "edge sharing its Redis)",
            param="scope",
        )
    return scopes[0]


async def _reload(
    edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    """``POST /admin/reload``: what SIGHUP does. A file that cannot be used is a 400 with
    the loader's message (the old config keeps serving). ``?scope=cluster``: then every
    other edge sharing this edge's Redis is told to reload its own file; the answer says
    how many were told (``edges_told``); nothing is told when this edge's file is refused,
    and a Redis that cannot be reached is a 503 (this edge has reloaded)."""
    scope = _reload_scope(request.query)
    try:
        if scope == "cluster":
            kept, told = await edge.reload_cluster()
        else:
            kept, told = await edge.reload_config(), 0
    except ConfigError as exc:
        raise BadRequest(f"reload refused: {exc}", code="invalid_config") from None
    except LookupError as exc:
        raise NoConfigFile(str(exc)) from None
    except RuntimeError as exc:
        message = f"this edge reloaded, but {exc}"
        raise DispatcherError(message, code="cluster_unreachable", status=503) from None
    answer: dict[str, object] = {"status": "reloaded", "restart_required": list(kept)}
    if scope == "cluster":
        answer.update(scope=scope, edges_told=told)
    await responder.respond(200, (*JSON_HEADERS, *ctx.headers), orjson.dumps(answer))


_GET = ("GET", "HEAD")

FRONT_END = FrontEnd(
    "operations",
    {
        NODE_CONNECT_PATH: RouteSpec(("GET",), _node_connect, "open"),
        "/healthz": RouteSpec(_GET, _healthz, "open"),
        "/readyz": RouteSpec(_GET, _readyz, "open"),
        "/v1/usage": RouteSpec(_GET, _usage, "usage"),
        "/admin/reload": RouteSpec(("POST",), _reload, "admin"),
        METRICS_PATH: RouteSpec(_GET, _metrics, "metrics"),
    },
    openai_error,
)

SCRAPE_FRONT_END = FrontEnd(
    "scrape",
    {
        METRICS_PATH: RouteSpec(_GET, _metrics, "open"),
        "/healthz": RouteSpec(_GET, _healthz, "open"),
    },
    openai_error,
)
"""What the metrics listener (``[metrics] listen``) serves, alone and with no key: the
metrics and liveness. Whoever can reach that address may read them, and nothing else."""
