"""What the HTTP adapters (``ollama``, ``openai``) are built on: :class:`HTTPAdapter`, whose
lifetime holds its provider's pooled client; their ``options`` tables parsed
(:func:`parse_options`: the timeouts, then each adapter's own keys); the URL they post to
(:func:`chat_url`).

Each provider gets one pooled client (:func:`nodes.upstream.pools.open_client`: at most as many
connections as the provider has slots, :func:`~nodes.upstream.pools.pool_size`). Its lifetime
is lexical: an adapter is an :class:`HTTPAdapter`, whose :meth:`~HTTPAdapter.open` block holds
the client and gives the adapter bound to it; ``nodes.adapters.open_adapters`` (entered by
``nodes.runner.open_runner``) opens every adapter that has such a block for as long as the runs
live. A run used without it (``adapter.run()`` called directly) opens a client of its own,
closed with the run. A run posts with :func:`nodes.adapters._post.post_chunks`.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Protocol

import attrs

from dispatcher import wire
from nodes.adapters.base import AdapterError, RunOutput
from nodes.config import OptionsError
from nodes.upstream.client import UpstreamPool
from nodes.upstream.pools import HTTPTimeouts, open_client, split_timeouts


def parse_options(
    raw: Mapping[str, Any], parsers: Mapping[str, Callable[[str, Any], Any]], *, kind: str
) -> dict[str, Any]:
    """An HTTP adapter's ``options`` table as its options class's fields: ``timeouts``
    (:func:`~nodes.upstream.pools.split_timeouts`), and each other key parsed by its entry in
    ``parsers``, which takes the key and the value and raises :class:`OptionsError`; a key
    with no entry is an ``unknown <kind> option``."""
    timeouts, rest = split_timeouts(raw)
    fields: dict[str, Any] = {"timeouts": timeouts}
    for key, value in rest.items():
        parse = parsers.get(key)
        if parse is None:
            raise OptionsError(key, f"unknown {kind} option")
        fields[key] = parse(key, value)
    return fields


RunOn = Callable[[UpstreamPool, wire.RunRequest, RunOutput], Awaitable[None]]
"""An HTTP adapter's run, on the client it is given."""


@attrs.frozen
class PooledAdapter:
    """An HTTP adapter bound to its provider's open client (what :meth:`HTTPAdapter.open`
    gives). It has no lifetime of its own: opening the adapters again leaves it as it is."""

    _run_on: RunOn
    _client: UpstreamPool = attrs.field(repr=False)
    _embed_on: RunOn | None = None

    async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
        await self._run_on(self._client, request, out)

    async def embed(self, request: wire.RunRequest, out: RunOutput) -> None:
        if self._embed_on is None:
            raise AdapterError(
                "unsupported_route", "this provider's adapter does not embed", retryable=True
            )
        await self._embed_on(self._client, request, out)


class HasTimeouts(Protocol):
    """An HTTP adapter's options: they carry its timeouts."""

    @property
    def timeouts(self) -> HTTPTimeouts: ...


@attrs.frozen(kw_only=True)
class HTTPAdapter(abc.ABC):
    """What the HTTP adapters share: where they post, and a lifetime holding the provider's
    pooled client (:meth:`open`). A subclass gives its own ``options`` (with a default) and
    :meth:`run_on`."""

    url: str
    """The full URL the adapter posts to."""
    options: HasTimeouts
    connections: int = 1
    """The size of the provider's connection pool: its slots
    (:func:`~nodes.upstream.pools.pool_size`)."""

    @abc.abstractmethod
    async def run_on(self, client: UpstreamPool, request: wire.RunRequest, out: RunOutput) -> None:
        """Run ``request`` with requests on ``client``."""

    async def embed_on(
        self, client: UpstreamPool, request: wire.RunRequest, out: RunOutput
    ) -> None:
        """Run the embeddings ``request`` with requests on ``client``: an adapter that embeds
        overrides it (and says so in its ``AdapterSpec.routes``); by default, refused."""
        raise AdapterError(
            "unsupported_route", f"a {type(self).__name__} does not embed", retryable=True
        )

    @asynccontextmanager
    async def open(self) -> AsyncIterator[PooledAdapter]:
        """The provider's pooled client for this block, and this adapter bound to it."""
        async with open_client(self.options.timeouts, max_connections=self.connections) as client:
            yield PooledAdapter(self.run_on, client, self.embed_on)

    async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
        """One run outside :meth:`open` (the runner always opens its adapters): on a client
        of its own, closed with the run -- correct, but nothing is reused."""
        async with self.open() as adapter:
            await adapter.run(request, out)

    async def embed(self, request: wire.RunRequest, out: RunOutput) -> None:
        """One embeddings run outside :meth:`open`, as :meth:`run`."""
        async with self.open() as adapter:
            await adapter.embed(request, out)


def chat_url(base_url: str, path: str) -> str:
    """``base_url`` (trailing slashes dropped) joined with ``path``."""
    return base_url.rstrip("/") + path
