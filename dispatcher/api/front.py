"""What a front end is: one module (or package) declaring its routes and how its errors look.

A front end (``api/openai/``'s OpenAI routes, ``api/operations.py``'s health, usage,
metrics and node endpoint, ``api/responses/``, ``api/anthropic/``) is a :class:`FrontEnd`:

* ``routes``: path -> :class:`RouteSpec` (methods, handler, who may call it, whether it runs
  a model);
* ``render_error``: the error tree (:mod:`dispatcher.errors`) in the front end's own shape,
  for every error its routes raise.

``api/app.py`` registers each front end with one line (``FRONT_ENDS``); ``make_handler`` takes
another tuple for an embedder's or a test's own. Handlers take the edge through the
:class:`~dispatcher.api.seam.EdgeServices` seam and the per-request :class:`RouteContext`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Literal

import attrs

from ..http import Request, Responder
from ..observe.traffic import RequestRecord
from ..tenants import Tenant
from .seam import ApiSettings, EdgeServices

__all__ = [
    "Access",
    "ErrorRenderer",
    "FrontEnd",
    "RenderedError",
    "Route",
    "RouteContext",
    "RouteSpec",
]


@attrs.frozen(kw_only=True)
class RouteContext:
    request_id: str
    """The edge's own id of the request (``app.new_request_id``): the usage ledger's key,
    never the client's."""
    client_request_id: str | None
    """The client's ``x-request-id`` when it sent one worth keeping: stored beside the edge's
    id, echoed back."""
    headers: tuple[tuple[bytes, bytes], ...]
    """Response headers every answer carries (``app.request_id_headers``)."""
    attribution: str | None
    """Who the request's usage is attributed to: the id of the client's API key."""
    record: RequestRecord | None = None
    """The request's record (``dispatcher.observe.traffic``), which a model route fills in."""
    tenant: Tenant | None = None
    """The client key's tenant (its limits, priority and weight); None on routes that take
    no client key, and when client auth is off."""
    admin: bool = False
    """The caller presented an admin key (or admin routes are open)."""
    settings: ApiSettings = attrs.field(factory=ApiSettings)
    """The HTTP surface's settings (what a front end may be configured to do)."""


Route = Callable[[EdgeServices, Request, Responder, RouteContext], Awaitable[None]]

Access = Literal["open", "client", "admin", "metrics", "usage"]
"""Who may call a route (see ``app.make_handler``)."""


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


@attrs.frozen
class RenderedError:
    """An error as a front end answers it. ``app`` adds what HTTP itself says about the
    error (``Retry-After`` from ``retry_after``, ``Allow``, ``WWW-Authenticate``) and the
    request's own headers."""

    status: int
    body: bytes
    content_type: bytes = b"application/json"
    retry_after: float | None = None


ErrorRenderer = Callable[[BaseException], RenderedError]
"""Any exception that leaves a route (an unexpected one as a 500) in the front end's shape."""


@attrs.frozen(eq=False)
class FrontEnd:
    name: str
    routes: Mapping[str, RouteSpec]
    render_error: ErrorRenderer
