"""The operator's routes: ``GET /admin/status``, the edge at a glance as JSON
(``docs/status.md``; the document is built by :mod:`dispatcher.status`). Access ``admin``:
an admin key when any is configured; with none, open only if the client routes are open too
(see ``app.make_handler``). Errors in the OpenAI shape, like the edge's other own routes."""

from __future__ import annotations

from ..http import Request, Responder
from ..status import status_json
from .common import JSON_HEADERS, openai_error
from .front import FrontEnd, RouteContext, RouteSpec
from .seam import EdgeServices

__all__ = ["FRONT_END", "STATUS_PATH"]

STATUS_PATH = "/admin/status"

_NO_STORE = ((b"cache-control", b"no-store"),)


async def _status(
    edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    body = status_json(edge.status())
    await responder.respond(200, (*JSON_HEADERS, *_NO_STORE, *ctx.headers), body)


FRONT_END = FrontEnd(
    "admin",
    {STATUS_PATH: RouteSpec(("GET", "HEAD"), _status, "admin")},
    openai_error,
)
