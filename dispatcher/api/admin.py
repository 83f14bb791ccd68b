"""The operator's routes: ``GET /admin/status``, the edge at a glance as JSON
(``docs/status.md``; the document is built by :mod:`dispatcher.observe.status`), and ``GET /``, the
status page that polls it. Access to the JSON is ``admin``: an admin key when any is
configured; with none, open only if the client routes are open too (see
``app.make_handler``). The page itself is ``open``: it is a fixed document with no data in
it, and it asks for the admin key (kept for the tab only) when the JSON needs one. Errors in
the OpenAI shape, like the edge's other own routes."""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import re
from typing import Final

from ..http import Request, Responder
from ..observe.status import status_json
from .common import JSON_HEADERS, openai_error
from .front import FrontEnd, RouteContext, RouteSpec
from .seam import EdgeServices

__all__ = ["FRONT_END", "PAGE_PATH", "STATUS_PATH"]

STATUS_PATH: Final = "/admin/status"
PAGE_PATH: Final = "/"

_NO_STORE = ((b"cache-control", b"no-store"),)

PAGE: Final = importlib.resources.files(__package__).joinpath("status_page.html").read_bytes()
"""The status page: one self-contained document (its style and script inline), nothing fetched
from anywhere but this edge's ``/admin/status``."""


def _inline_hashes(page: bytes, tag: bytes) -> str:
    """CSP source expressions allowing exactly the page's inline ``<tag>`` blocks."""
    blocks = re.findall(rb"<" + tag + rb">(.*?)</" + tag + rb">", page, re.DOTALL)
    assert blocks, f"the status page has no <{tag.decode()}>"
    return " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(block).digest()).decode()}'" for block in blocks
    )


_PAGE_HEADERS: Final = (
    (b"content-type", b"text/html; charset=utf-8"),
    *_NO_STORE,
    # Nothing runs or loads but the page's own script and style, and its only request is to
    # this edge; no framing (clickjacking), no referrer, no sniffing.
    (
        b"content-security-policy",
        (
            f"default-src 'none'; script-src {_inline_hashes(PAGE, b'script')}; "
            f"style-src {_inline_hashes(PAGE, b'style')}; connect-src 'self'; img-src data:; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
        ).encode(),
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)


async def _status(
    edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    body = status_json(await edge.status())
    await responder.respond(200, (*JSON_HEADERS, *_NO_STORE, *ctx.headers), body)


async def _page(
    edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    await responder.respond(200, (*_PAGE_HEADERS, *ctx.headers), PAGE)


FRONT_END = FrontEnd(
    "admin",
    {
        STATUS_PATH: RouteSpec(("GET", "HEAD"), _status, "admin"),
        PAGE_PATH: RouteSpec(("GET", "HEAD"), _page, "open"),
    },
    openai_error,
)
