"""Engine adapters, and the one registry of them: adapter type -> :class:`AdapterSpec`.

``echo``, ``ollama``, ``openai``, ``cli`` and ``anthropic`` are registered in
:data:`ADAPTERS`. Adding a type is one module (the adapter, its options class) plus one line here::

    "mine": AdapterSpec(MyAdapter.from_provider, MyOptions),

The registry is what a config is checked against (``nodes.load_node_config(...,
adapters=...)``: the type exists, may be tunnelled, its ``options`` parse) and what
:func:`build_adapters` builds from. Both take another registry too, so a type can be added
without touching this package: ``{**ADAPTERS, "mine": AdapterSpec(...)}``.

A provider whose type is in no registry (one built in Python) gets a :class:`RefusingAdapter`
whose runs fail with code ``unsupported_adapter`` (retryable).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final, Protocol

import attrs

from dispatcher import wire
from nodes.adapters.anthropic import AnthropicAdapter, AnthropicOptions
from nodes.adapters.base import (
    EMBEDDING_ROUTES,
    Adapter,
    AdapterError,
    AdapterFactory,
    DropConnection,
    Embedder,
    HasLifetime,
    RefusingAdapter,
    RunOutput,
    estimate_tokens,
    open_adapters,
)
from nodes.adapters.cli import CLIAdapter, CLIOptions
from nodes.adapters.echo import EchoAdapter, EchoOptions
from nodes.adapters.ollama import OllamaAdapter, OllamaOptions
from nodes.adapters.openai import OpenAIAdapter, OpenAIOptions
from nodes.config import ProviderConfig

__all__ = [
    "ADAPTERS",
    "EMBEDDING_ROUTES",
    "Adapter",
    "AdapterError",
    "AdapterFactory",
    "AdapterSpec",
    "DropConnection",
    "EchoAdapter",
    "EchoOptions",
    "Embedder",
    "HasLifetime",
    "OptionsClass",
    "RefusingAdapter",
    "RunOutput",
    "build_adapters",
    "estimate_tokens",
    "make_adapter",
    "open_adapters",
    "validate_options",
]


class OptionsClass(Protocol):
    """An adapter's options class: parses a provider's ``options`` table."""

    def from_mapping(self, raw: Mapping[str, Any], /) -> object:
        """Raises :class:`nodes.config.OptionsError` (its key relative to the table)."""


@attrs.frozen
class AdapterSpec:
    """One adapter type: how to build it, and what its ``options`` table may hold."""

    factory: AdapterFactory
    """Builds the adapter for one configured provider (may raise ``NodeConfigError``)."""
    options: OptionsClass
    """The options class (``EchoOptions``...), which validates the ``options`` table."""
    tunnel: bool = False
    """May a provider of this type be served with ``path = "tunnel"`` (relayed raw to an
    OpenAI-compatible HTTP API by ``nodes.tunnel``)?"""
    routes: tuple[wire.RouteName, ...] = wire.NORMALIZED_ROUTES
    """What a normalized provider of this type serves, as its node's hello announces it:
    chat (and the Responses and Messages APIs the edge translates to it), and
    ``"embeddings"`` for an :class:`~nodes.adapters.base.Embedder` (:data:`EMBEDDING_ROUTES`)."""
    tunnel_routes: tuple[wire.RouteName, ...] = wire.DEFAULT_TUNNEL_ROUTES
    """What a tunnel provider of this type serves when it declares no ``routes``: an
    OpenAI-compatible server's chat, completions and embeddings; Anthropic's API, messages."""

    def check_options(self, raw: Mapping[str, Any]) -> None:
        self.options.from_mapping(raw)


ADAPTERS: Final[Mapping[str, AdapterSpec]] = {
    "echo": AdapterSpec(EchoAdapter.from_provider, EchoOptions, routes=EMBEDDING_ROUTES),
    "ollama": AdapterSpec(
        OllamaAdapter.from_provider, OllamaOptions, tunnel=True, routes=EMBEDDING_ROUTES
    ),
    "openai": AdapterSpec(
        OpenAIAdapter.from_provider, OpenAIOptions, tunnel=True, routes=EMBEDDING_ROUTES
    ),
    "cli": AdapterSpec(CLIAdapter.from_provider, CLIOptions),
    "anthropic": AdapterSpec(
        AnthropicAdapter.from_provider, AnthropicOptions, tunnel=True, tunnel_routes=("messages",)
    ),
}


def make_adapter(
    provider: ProviderConfig, adapters: Mapping[str, AdapterSpec] = ADAPTERS
) -> Adapter:
    spec = adapters.get(provider.type)
    if spec is None:
        return RefusingAdapter(
            "unsupported_adapter", f"this node cannot run {provider.type!r} providers yet"
        )
    return spec.factory(provider)


def build_adapters(
    providers: Iterable[ProviderConfig], adapters: Mapping[str, AdapterSpec] = ADAPTERS
) -> dict[str, Adapter]:
    """One adapter per provider, keyed by provider id, built by the registry ``adapters``."""
    return {provider.id: make_adapter(provider, adapters) for provider in providers}


def validate_options(
    adapter_type: str, options: Mapping[str, Any], adapters: Mapping[str, AdapterSpec] = ADAPTERS
) -> None:
    """Check a provider's ``options`` for its adapter type (a type in no registry accepts
    anything). Raises :class:`nodes.config.OptionsError`."""
    spec = adapters.get(adapter_type)
    if spec is not None:
        spec.check_options(options)
