"""trio-dispatcher: one OpenAI-compatible endpoint in front of your LLM nodes and providers.

The storefront for embedders::

    import dispatcher

    async with dispatcher.open_dispatcher(dispatcher.EdgeConfig()) as edge:
        await edge.attach_local_node()
        async with edge.open_run(dispatcher.RunSpec(model="echo", body=body)) as run:
            ...

Names are loaded on first use (PEP 562), so a node importing ``dispatcher.wire`` does not
load the edge. ``tests/test_exports.py`` pins this surface.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

_EXPORTS: dict[str, str] = {
    # the edge
    "open_dispatcher": "dispatcher.edge",
    "Dispatcher": "dispatcher.edge",
    "EdgeConfig": "dispatcher.config",
    "ConfigError": "dispatcher.config",
    "load_edge_config": "dispatcher.config",
    "RunSpec": "dispatcher.paths.runs",
    "Run": "dispatcher.paths.runs",
    "GateRequest": "dispatcher.gate.attempts",
    "DispatchRequest": "dispatcher.gate.pool",
    "UsageRow": "dispatcher.store.usage",
    # connecting nodes
    "Connection": "dispatcher.shared.transport",
    "ConnectionClosed": "dispatcher.shared.transport",
    "memory_connection_pair": "dispatcher.shared.transport",
    # the error tree
    "DispatcherError": "dispatcher.errors",
    "BadRequest": "dispatcher.errors",
    "PayloadTooLarge": "dispatcher.errors",
    "Unauthorized": "dispatcher.errors",
    "NotFound": "dispatcher.errors",
    "UpstreamRejected": "dispatcher.errors",
    "ShuttingDown": "dispatcher.errors",
    "RunError": "dispatcher.errors",
    "StaleGeneration": "dispatcher.errors",
    "NodeUnavailable": "dispatcher.errors",
    "TunnelFailed": "dispatcher.errors",
    "AllAttemptsFailed": "dispatcher.errors",
    "AdmissionError": "dispatcher.admission",
    "UnknownModel": "dispatcher.admission",
    "ModelUnavailable": "dispatcher.admission",
    "NoCapableCandidate": "dispatcher.admission",
    "QueueFull": "dispatcher.admission",
    "QueueTimeout": "dispatcher.admission",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dispatcher' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:
    from .admission import AdmissionError as AdmissionError
    from .admission import ModelUnavailable as ModelUnavailable
    from .admission import NoCapableCandidate as NoCapableCandidate
    from .admission import QueueFull as QueueFull
    from .admission import QueueTimeout as QueueTimeout
    from .admission import UnknownModel as UnknownModel
    from .config import ConfigError as ConfigError
    from .config import EdgeConfig as EdgeConfig
    from .config import load_edge_config as load_edge_config
    from .edge import Dispatcher as Dispatcher
    from .edge import open_dispatcher as open_dispatcher
    from .errors import AllAttemptsFailed as AllAttemptsFailed
    from .errors import BadRequest as BadRequest
    from .errors import DispatcherError as DispatcherError
    from .errors import NodeUnavailable as NodeUnavailable
    from .errors import NotFound as NotFound
    from .errors import PayloadTooLarge as PayloadTooLarge
    from .errors import RunError as RunError
    from .errors import ShuttingDown as ShuttingDown
    from .errors import StaleGeneration as StaleGeneration
    from .errors import TunnelFailed as TunnelFailed
    from .errors import Unauthorized as Unauthorized
    from .errors import UpstreamRejected as UpstreamRejected
    from .gate.attempts import GateRequest as GateRequest
    from .gate.pool import DispatchRequest as DispatchRequest
    from .paths.runs import Run as Run
    from .paths.runs import RunSpec as RunSpec
    from .shared.transport import Connection as Connection
    from .shared.transport import ConnectionClosed as ConnectionClosed
    from .shared.transport import memory_connection_pair as memory_connection_pair
    from .store.usage import UsageRow as UsageRow
