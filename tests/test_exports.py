"""The storefront: ``dispatcher``'s public names are pinned, each resolves, and importing
``dispatcher.wire`` (as a node does) does not load the edge."""

from __future__ import annotations

import subprocess
import sys

import dispatcher
import dispatcher.edge
import dispatcher.errors
import dispatcher.service
from dispatcher.errors import DispatcherError

PUBLIC = {
    "__version__",
    "AdmissionError",
    "AllAttemptsFailed",
    "BadRequest",
    "ConfigError",
    "Connection",
    "ConnectionClosed",
    "DispatchRequest",
    "Dispatcher",
    "DispatcherError",
    "EdgeConfig",
    "GateRequest",
    "ModelUnavailable",
    "NoCapableCandidate",
    "NodeUnavailable",
    "NotFound",
    "PayloadTooLarge",
    "QueueFull",
    "QueueTimeout",
    "Run",
    "RunError",
    "RunSpec",
    "ShuttingDown",
    "StaleGeneration",
    "TunnelFailed",
    "Unauthorized",
    "UnknownModel",
    "UpstreamRejected",
    "UsageRow",
    "load_edge_config",
    "memory_connection_pair",
    "open_dispatcher",
}


def test_the_public_names_are_pinned_and_resolve() -> None:
    assert set(dispatcher.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(dispatcher, name) is not None


def test_every_error_has_one_root() -> None:
    errors = [
        getattr(dispatcher, name)
        for name in PUBLIC
        if isinstance(getattr(dispatcher, name), type)
        and issubclass(getattr(dispatcher, name), BaseException)
        and name not in ("ConnectionClosed", "ConfigError")
    ]
    assert errors
    for error in errors:
        assert issubclass(error, DispatcherError), error
        assert 400 <= error.status <= 599


def test_unknown_names_raise_attribute_error() -> None:
    try:
        dispatcher.not_a_name  # noqa: B018
    except AttributeError as exc:
        assert "not_a_name" in str(exc)
    else:
        raise AssertionError("no AttributeError")


def test_a_node_importing_the_wire_does_not_load_the_edge() -> None:
    code = (
        "import sys, dispatcher.wire; "
        "print(sorted(m for m in sys.modules if m.startswith('dispatcher')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "dispatcher.service" not in out
    assert "dispatcher.gate" not in out


def test_the_dispatcher_core_loads_no_http() -> None:
    code = (
        "import sys, dispatcher.service; "
        "print(sorted(m for m in sys.modules if m.startswith('dispatcher')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "dispatcher.service" in out
    assert "dispatcher.api" not in out
    assert "dispatcher.http" not in out
    assert "dispatcher.edge" not in out


def test_the_storefront_dispatcher_serves() -> None:
    assert dispatcher.Dispatcher is dispatcher.edge.Dispatcher
    assert issubclass(dispatcher.Dispatcher, dispatcher.service.Service)
    assert dispatcher.open_dispatcher is dispatcher.edge.open_dispatcher
    assert callable(dispatcher.Dispatcher.serve)
    assert not hasattr(dispatcher.service.Service, "serve")
