"""The node side of trio-dispatcher: an agent that dials out to the edge and runs requests.

See ``docs/node.md``. Public API::

    from nodes import NodeConfig, default_node_config, load_node_config, serve_node
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from nodes import config as _config
from nodes.adapters import ADAPTERS
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
    "run_node",
    "serve_node",
    "serve_node_session",
]
