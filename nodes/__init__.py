"""The node side of trio-dispatcher: an agent that dials out to the edge and runs requests.

See ``docs/node.md``. Public API::

    from nodes import NodeConfig, default_node_config, load_node_config, serve_node
"""

from __future__ import annotations

from nodes.agent import run_node, serve_node, serve_node_session
from nodes.config import (
    ModelConfig,
    NodeConfig,
    NodeConfigError,
    ProviderConfig,
    default_node_config,
    hello_from_config,
    load_node_config,
)
from nodes.dial import NodeRejected, dial_edge
from nodes.runner import Runner, RunnerStatistics, open_runner

__all__ = [
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
