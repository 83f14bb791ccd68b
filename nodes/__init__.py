"""The node side of trio-dispatcher: an agent that dials out to the edge and runs requests.

See ``docs/node.md``. Public API::

    from nodes import NodeConfig, default_node_config, load_node_config, serve_node
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence

import attrs

from nodes import config as _config
from nodes.adapters import ADAPTERS, AdapterSpec, build_adapters
from nodes.agent import EdgeUnreachable, run_node, serve_node, serve_node_session
from nodes.config import (
    AdapterKind,
    ModelConfig,
    NodeConfig,
    NodeConfigError,
    ProviderConfig,
    default_node_config,
    hello_from_config,
)
from nodes.dial import NodeRejected, dial_edge
from nodes.runner import Runner, RunnerStatistics, open_runner
from nodes.tunnel import tunnel_providers


def load_node_config(
    path: str | os.PathLike[str],
    *,
    environ: Mapping[str, str] | None = None,
    adapters: Mapping[str, AdapterKind] = ADAPTERS,
) -> NodeConfig:
    """Load and validate a node configuration file (``docs/node.md``), its provider types
    checked against ``adapters`` (the built-in registry unless given). Raises
    :class:`NodeConfigError`."""
    return _config.read_node_config(path, environ=environ, adapters=adapters)


def provider_startup_problems(
    providers: Sequence[ProviderConfig],
    adapters: Mapping[str, AdapterSpec] = ADAPTERS,
    *,
    environ: Mapping[str, str] | None = None,
) -> Iterator[tuple[int, NodeConfigError]]:
    """What a node reads of each provider when it starts -- its key from ``api_key_env`` in
    ``environ`` (default ``os.environ``), a tunnel's base URL, a ``cli`` provider's command
    --, checked now: (the provider's index, the error its adapter or tunnel would raise),
    whose ``key`` is relative to the provider (``api_key_env``). ``dispatcher node`` and
    ``dispatcher serve`` (the edge's own ``[[providers]]``) report these before anything
    starts."""
    for index, provider in enumerate(providers):
        try:
            provider.api_key(environ)
            keyless = attrs.evolve(provider, api_key_env=None)  # its key is checked above
            build_adapters((keyless,), adapters)
            tunnel_providers((keyless,))
        except NodeConfigError as exc:
            yield index, exc


__all__ = [
    "EdgeUnreachable",
    "ModelConfig",
    "NodeConfig",
    "NodeConfigError",
    "NodeRejected",
    "ProviderConfig",
    "Runner",
    "RunnerStatistics",
    "default_node_config",
    "dial_edge",
    "hello_from_config",
    "load_node_config",
    "open_runner",
    "provider_startup_problems",
    "run_node",
    "serve_node",
    "serve_node_session",
]
