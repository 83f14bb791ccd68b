"""The edge: a :class:`~dispatcher.service.Service` serving its HTTP front ends.

Serving HTTP lives here, above both the API and the dispatcher, so that
``dispatcher.service`` imports neither ``dispatcher.api`` nor ``dispatcher.http``:
:func:`serve_edge` builds the handler (:func:`dispatcher.api.app.make_handler` over the
front ends), the server limits and the TLS context from the config, and runs
``serve_http``::

    async with open_dispatcher(config) as dispatcher:
        server = await nursery.start(dispatcher.serve)     # or serve_edge(dispatcher, ...)

A second listener that serves only ``/metrics`` and ``/healthz`` with no key (``[metrics]
listen``) is :func:`serve_metrics` (``dispatcher.serve_metrics``), started beside
``serve`` in the same nursery by whoever starts that (``dispatcher serve`` does when the
config sets it): it reports its own :class:`~dispatcher.http.Server`, and stops when that
nursery is cancelled.

Why ``dispatcher.serve`` still works, and by a subclass: embedders and the tests call
``await dispatcher.serve(...)`` / ``nursery.start(dispatcher.serve)``, so this module's
:func:`open_dispatcher` (the one ``dispatcher.open_dispatcher`` names) yields a
:class:`Dispatcher` that adds ``serve`` (and ``serve_metrics``) to the
:class:`~dispatcher.service.Service` and nothing else. A serving function plugged into the
service's class instead would have to be typed in ``service.py``, which may not name
``http.ServerLimits`` or ``http.Server`` (what ``task_status`` reports): the plug's type would
erase both, and mypy could no longer check ``await dispatcher.serve(limits=...,
task_status=...)``. The subclass keeps every type, and ``service.py`` builds it through
:func:`~dispatcher.service.open_service_of` without knowing it exists.
"""

from __future__ import annotations

import gc
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from . import service
from .api.app import FRONT_ENDS, make_error_page, make_handler
from .api.front import FrontEnd
from .api.operations import SCRAPE_FRONT_END
from .api.seam import ApiSettings
from .config import EdgeConfig
from .http import Server, ServerLimits, serve_http

__all__ = [
    "SERVING_FULL_COLLECTION_THRESHOLD",
    "YOUNG_COLLECTION_INTERVAL",
    "Dispatcher",
    "collect_young_generation",
    "limits_from_config",
    "open_dispatcher",
    "serve_edge",
    "serve_metrics",
    "tune_collector_for_serving",
]

SERVING_FULL_COLLECTION_THRESHOLD = 1000
"""``gc``'s third threshold while the daemon serves: a full collection waits for this many
collections of the middle generation (CPython's default is 10). Measured with ``python -m
bench streams`` (issue #12): with 10,000 streams held, a full collection traverses every
stream's objects (~1-3 s on 2 busy cores) and frees nothing; with the default it ran every
3-10 s (a held new request's p99 +2.7 s, 13.8 s to release every slot)."""


def tune_collector_for_serving() -> None:
    """Make CPython's cycle collector cheap for a long-running edge: call once, after
    start-up (the modules, the config, the listening server), in the daemon's own process.

    * what exists now is collected once, then frozen (``gc.freeze``): start-up's ~300,000
      objects live as long as the process and are never traversed again;
    * full collections are rare (:data:`SERVING_FULL_COLLECTION_THRESHOLD`); the young
      generations keep CPython's thresholds, so short-lived cycles are still collected as
      soon as before, and a full collection still comes, only less often.

    It changes the whole process's collector, so the embedding API (:func:`open_dispatcher`,
    :func:`serve_edge`) never calls it: ``dispatcher serve`` does."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, SERVING_FULL_COLLECTION_THRESHOLD)


YOUNG_COLLECTION_INTERVAL = 0.1
"""Seconds between the serving daemon's own collections of the youngest generation."""


async def collect_young_generation(interval: float = YOUNG_COLLECTION_INTERVAL) -> None:
    """Collect the youngest generation every ``interval`` seconds, until cancelled (run it in
    the daemon's nursery, beside :func:`tune_collector_for_serving`).

    Why: CPython counts the young generation as allocations *minus* deallocations. With
    thousands of streams held, each token frees the previous token's chain of coroutines and
    scopes as it builds the next, so the count stays near zero and no collection triggers,
    while the generation grows to every held stream's live chain (~12 objects each). When a
    collection finally runs it walks all of them and frees nothing: 0.1-0.3 s at 2,000
    streams, seconds at 10,000, a stall for every request. Collected by time instead, what
    lives on is promoted out of the young generation at once, and each collection walks only
    what the last 0.1 s allocated."""
    while True:
        await trio.sleep(interval)
        gc.collect(0)


_IS_LIMIT = attrs.filters.include(*(field.name for field in attrs.fields(ServerLimits)))


def limits_from_config(config: EdgeConfig) -> ServerLimits:
    """The server limits ``config.http`` sets: its settings named after a ``ServerLimits``
    field (all but the TLS files), which have the field's type; the rest are
    ``ServerLimits``' defaults."""
    return ServerLimits(**attrs.asdict(config.http, filter=_IS_LIMIT))


def _ssl_context(config: EdgeConfig) -> ssl.SSLContext | None:
    http = config.http
    if not (http.tls_certificate and http.tls_private_key):
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(http.tls_certificate, http.tls_private_key)
    return context


async def serve_edge(  # noqa: ASYNC128 (task_status is passed on to serve_http)
    dispatcher: service.Service,
    *,
    host: str | None = None,
    port: int | None = None,
    limits: ServerLimits | None = None,
    front_ends: Sequence[FrontEnd] = FRONT_ENDS,
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``front_ends`` (the OpenAI routes, the edge's own and the node websocket) until
    cancelled or shut down through the server handle passed to ``task_status``:
    ``server.shutdown()`` drains (``dispatcher.drain``, ``http.shutdown_grace``) while the
    server still answers, then closes the node websockets with 1001 and stops.

    ``limits`` replaces the server limits built from ``config.http`` (an embedder's own
    timeouts, e.g. ``body_timeout``, which the config does not set). Errors the HTTP layer
    answers itself get the first front end's error shape (``api.app.make_error_page``)."""
    config = dispatcher.config

    async def drain() -> None:
        await dispatcher.drain(config.http.shutdown_grace)

    await serve_http(
        make_handler(dispatcher, ApiSettings.from_config(config), front_ends),
        host=host if host is not None else config.host,
        port=port if port is not None else config.port,
        limits=limits if limits is not None else limits_from_config(config),
        ssl_context=_ssl_context(config),
        on_drain=drain,
        on_shutdown=dispatcher.begin_shutdown,
        error_page=make_error_page(front_ends),
        task_status=task_status,
    )


async def serve_metrics(  # noqa: ASYNC128 (task_status is passed on to serve_http)
    dispatcher: service.Service,
    *,
    host: str | None = None,
    port: int | None = None,
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` and ``GET /healthz``, and nothing else, with no key, on
    ``config.metrics.listen`` (``host`` and ``port`` replace its parts; without it, both are
    needed) over plain HTTP, until cancelled: Prometheus scrapes it without any of the
    edge's keys, and it opens no other route. Each scrape is a request like any other (the
    access log, its record). Start it in the nursery that serves the edge, beside
    :func:`serve_edge`; cancelling that nursery stops it."""
    config = dispatcher.config
    listen = config.metrics.listen_address()
    if listen is None and (host is None or port is None):
        raise ValueError("serve_metrics needs metrics.listen in the config, or host and port")
    default_host, default_port = listen if listen is not None else ("", 0)
    front_ends = (SCRAPE_FRONT_END,)
    await serve_http(
        make_handler(dispatcher, ApiSettings.from_config(config), front_ends),
        host=host if host is not None else default_host,
        port=port if port is not None else default_port,
        limits=limits_from_config(config),
        error_page=make_error_page(front_ends),
        task_status=task_status,
    )


class Dispatcher(service.Service):
    """The dispatcher with its HTTP front ends: what :func:`open_dispatcher` yields."""

    __slots__ = ()

    serve = serve_edge
    """:func:`serve_edge` on this dispatcher: ``await dispatcher.serve(...)``,
    ``await nursery.start(dispatcher.serve)``."""
    serve_metrics = serve_metrics
    """:func:`serve_metrics` on this dispatcher:
    ``await nursery.start(dispatcher.serve_metrics)``."""


@asynccontextmanager
async def open_dispatcher(config: EdgeConfig | None = None) -> AsyncIterator[Dispatcher]:
    """The embedding entry point: a running dispatcher that can :meth:`~Dispatcher.serve`,
    stopped when the block exits."""
    async with service.open_service_of(Dispatcher, config) as dispatcher:
        yield dispatcher
