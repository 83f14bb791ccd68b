"""Engine adapters, and the registry that builds one per configured provider by its ``type``.

``echo``, ``ollama``, ``openai`` (normalized path) and ``cli`` are implemented. A provider of
a type without a factory gets an :class:`UnsupportedAdapter`, whose runs fail with code
``unsupported_adapter``; adding a type means adding its factory (and, if it takes options, its
validator) to :data:`ADAPTER_FACTORIES` / :data:`OPTION_VALIDATORS`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs

from dispatcher import wire
from nodes.adapters.base import (
    Adapter,
    AdapterError,
    AdapterFactory,
    DropConnection,
    OptionsValidator,
    RunOutput,
    estimate_tokens,
)
from nodes.adapters.cli import CLIAdapter, validate_cli_options
from nodes.adapters.echo import EchoAdapter, EchoOptions, validate_echo_options
from nodes.adapters.ollama import OllamaAdapter, validate_ollama_options
from nodes.adapters.openai import OpenAIAdapter, validate_openai_options
from nodes.config import ProviderConfig

__all__ = [
    "ADAPTER_FACTORIES",
    "OPTION_VALIDATORS",
    "Adapter",
    "AdapterError",
    "AdapterFactory",
    "DropConnection",
    "EchoAdapter",
    "EchoOptions",
    "RunOutput",
    "UnsupportedAdapter",
    "build_adapters",
    "estimate_tokens",
    "make_adapter",
    "validate_options",
]

ADAPTER_FACTORIES: Final[Mapping[str, AdapterFactory]] = {
    "echo": EchoAdapter.from_provider,
    "ollama": OllamaAdapter.from_provider,
    "openai": OpenAIAdapter.from_provider,
    "cli": CLIAdapter.from_provider,
}
OPTION_VALIDATORS: Final[Mapping[str, OptionsValidator]] = {
    "echo": validate_echo_options,
    "ollama": validate_ollama_options,
    "openai": validate_openai_options,
    "cli": validate_cli_options,
}


@attrs.frozen
class UnsupportedAdapter:
    """Stands in for a declared provider type this node cannot run yet."""

    type: str

    async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
        raise AdapterError(
            "unsupported_adapter",
            f"this node cannot run {self.type!r} providers yet",
            retryable=True,
        )


def make_adapter(provider: ProviderConfig) -> Adapter:
    factory = ADAPTER_FACTORIES.get(provider.type)
    if factory is None:
        return UnsupportedAdapter(provider.type)
    return factory(provider)


def build_adapters(providers: Iterable[ProviderConfig]) -> dict[str, Adapter]:
    """One adapter per provider, keyed by provider id."""
    return {provider.id: make_adapter(provider) for provider in providers}


def validate_options(adapter_type: str, options: Mapping[str, Any]) -> None:
    """Check a provider's ``options`` for its adapter type (types without a validator accept
    anything for now). Raises :class:`nodes.config.OptionsError`."""
    validator = OPTION_VALIDATORS.get(adapter_type)
    if validator is not None:
        validator(options)
