"""Each provider's pooled client, as the node's config sets it: its timeouts (the provider's
``connect_timeout`` / ``read_timeout`` options, :class:`HTTPTimeouts`), its size (its slots,
:func:`pool_size`), opened with the shared TLS context (:func:`open_client`).

Connections are reused. Each provider gets one pooled client, an
:class:`~nodes.upstream.client.UpstreamPool`: at most as many connections as the provider has
slots (the sum of its models' ``slots``), all of them kept alive, and every client of the
process shares one TLS context per distinct TLS setting (:func:`~nodes.upstream.tls.
tls_context`). Its lifetime is lexical: :func:`open_client`'s block holds it, and whoever
opens it -- an HTTP adapter's ``open()``, a tunnel provider's ``open()`` -- holds that block
for as long as the runs or tunnels that use it live.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final

import attrs

from nodes.config import OptionsError, ProviderConfig
from nodes.upstream.client import UpstreamPool
from nodes.upstream.tls import tls_context

DEFAULT_CONNECT_TIMEOUT: Final = 10.0
DEFAULT_READ_TIMEOUT: Final = 600.0
"""Longest silence between two pieces of a response (a model loading before its first token
may take minutes). The edge keeps its own stall timeouts."""
WRITE_TIMEOUT: Final = 30.0


@attrs.frozen(kw_only=True)
class HTTPTimeouts:
    connect: float = DEFAULT_CONNECT_TIMEOUT
    read: float | None = DEFAULT_READ_TIMEOUT
    """None: wait for the upstream forever (until the run is cancelled)."""


def parse_timeout_option(key: str, value: Any, fields: dict[str, Any]) -> bool:
    """Parse ``connect_timeout`` / ``read_timeout`` into ``fields``; False for other keys.

    ``connect_timeout`` is a number > 0; ``read_timeout`` a number > 0, or 0 for none."""
    if key not in ("connect_timeout", "read_timeout"):
        return False
    ok = type(value) in (int, float) and math.isfinite(value)
    if key == "connect_timeout":
        if not ok or value <= 0:
            raise OptionsError(key, f"expected a number > 0, got {value!r}")
        fields["connect"] = float(value)
    else:
        if not ok or value < 0:
            raise OptionsError(key, f"expected a number >= 0 (0: no timeout), got {value!r}")
        fields["read"] = float(value) or None
    return True


def split_timeouts(raw: Mapping[str, Any]) -> tuple[HTTPTimeouts, dict[str, Any]]:
    """An HTTP provider's ``options``: its ``connect_timeout`` / ``read_timeout`` parsed (see
    :func:`parse_timeout_option`), and the other keys as they are."""
    timeouts: dict[str, Any] = {}
    rest = {
        key: value for key, value in raw.items() if not parse_timeout_option(key, value, timeouts)
    }
    return HTTPTimeouts(**timeouts), rest


def pool_size(provider: ProviderConfig) -> int:
    """How many upstream connections a provider needs at most: its slots, the sum of its
    models' ``slots`` (long-context slots are among them); 1 for a provider with no model."""
    return max(1, sum(model.slots for model in provider.models))


@asynccontextmanager
async def open_client(
    timeouts: HTTPTimeouts, *, max_connections: int
) -> AsyncIterator[UpstreamPool]:
    """A pooled client (:class:`~nodes.upstream.client.UpstreamPool`), closed (every
    connection with it) when the block is left: at most ``max_connections`` connections, all
    of them kept alive between requests, the shared :func:`~nodes.upstream.tls.tls_context`,
    proxies from the environment, no redirects followed. A request that finds every
    connection busy waits for one, up to the connect timeout."""
    async with UpstreamPool(
        connect=timeouts.connect,
        read=timeouts.read,
        write=WRITE_TIMEOUT,
        max_connections=max_connections,
        tls_context=tls_context(),
    ) as client:
        yield client
