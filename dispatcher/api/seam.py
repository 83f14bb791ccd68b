"""The narrow seam between the HTTP surface and the edge: what routes need, nothing more.

Routes take an :class:`EdgeServices`, a ``typing.Protocol``, never the ``Dispatcher`` class:
the API layer imports nothing above the gate, and a route can be tested against anything that
offers these members. ``dispatcher.service.Service`` satisfies it structurally (mypy checks
that where ``dispatcher.edge`` hands the dispatcher to :func:`dispatcher.api.app.make_handler`).

What the edge decides once for the whole HTTP surface (who may call, what is exposed) is not
asked of it per request: :class:`ApiSettings`, built from the config where the handler is built.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from contextlib import AbstractContextManager
from typing import Protocol

import attrs
import trio

from ..config import EdgeConfig
from ..gate.attempts import Gate
from ..observe.metrics import Metrics
from ..observe.status import EdgeStatus
from ..observe.traffic import Traffic
from ..shared.transport import Connection
from ..store.seam import ResponseStore, UsageLedger
from ..tenants import Tenants

__all__ = ["ApiSettings", "EdgeServices", "RegistryView", "WorkTicket"]


class NodeView(Protocol):
    """What routes read of one connected node."""

    @property
    def draining(self) -> bool:
        """The node said it is draining: nothing new is routed to it."""
        ...


class RegistryView(Protocol):
    """What routes read of the node registry: who is connected and which models are served."""

    @property
    def sessions(self) -> Mapping[str, NodeView]:
        """Connected node sessions by node id (routes count them, and those draining)."""
        ...

    def models(self) -> Mapping[str, object]:
        """Served model names (the keys; routes never look at the values)."""
        ...

    def routable_models(self) -> set[str]:
        """The model names a node that is not draining serves."""
        ...


class WorkTicket(Protocol):
    """One request being served (see :meth:`EdgeServices.track_work`)."""

    scope: trio.CancelScope
    """Cancelled when a drain's grace is over and the answer has not started."""
    answered: bool
    """Set by the route's responder when the answer starts."""


class EdgeServices(Protocol):
    """What the API routes use of the edge.

    The parts the dispatcher holds as fields are plain attributes here, of exactly the
    fields' types; routes only read them (mypy would not refuse an assignment: a Protocol
    makes a member read-only only as a property). The two properties are the members that
    need one: ``registry``, a narrower view than the dispatcher's, and ``draining``, a
    computed state."""

    gate: Gate
    """Where every model request goes: attempts, recovery, the commit point."""
    metrics: Metrics
    """The edge's metrics: every route's request is counted in them."""
    traffic: Traffic
    """The request records: the handler opens one per request (``dispatcher.observe.traffic``)."""
    ledger: UsageLedger
    """The usage ledger (routes only query it; the gate records)."""
    response_store: ResponseStore
    """The Responses API's stored responses (owned by ``open_dispatcher``, beside the
    ledger)."""
    tenants: Tenants
    """Who the keys are (``tenants.keys``, swapped by a reload) and their limits."""
    started_at: float
    """Unix time the edge started (``/v1/models``' ``created``)."""

    @property
    def registry(self) -> RegistryView:
        """The node registry, read only: who is connected, which models are served."""
        ...

    @property
    def draining(self) -> bool:
        """True once the edge admits nothing new."""
        ...

    def track_work(self) -> AbstractContextManager[WorkTicket]:
        """Count one request as in flight for the drain; raises ``ShuttingDown`` when
        draining."""
        ...

    def stream_scope(self) -> AbstractContextManager[trio.CancelScope]:
        """A scope for one streamed answer, cancelled when the drain's grace is over."""
        ...

    def serve_node_connection(self, conn: Connection, peer: str) -> Awaitable[None]:
        """Serve one node's connection (hello, session, events) until it closes."""
        ...

    async def reload_config(self) -> tuple[str, ...]:
        """Read the edge's config again and apply what may change without a restart;
        returns what changed and was not applied. Raises ``ConfigError`` (nothing changed)
        or ``LookupError`` (no config file to read)."""
        ...

    def model_aliases(self) -> Mapping[str, str]:
        """The configured aliases: public name -> the model group it means."""
        ...

    def metric_model_label(self, model: str) -> str:
        """A model name safe as a metric label (served or configured, else "unknown")."""
        ...

    def affinity_wanted(self, model: str) -> bool:
        """Whether a request for ``model`` may be routed by its affinity key: affinity is on
        for the model's group or one of its fallbacks (else no key is made for it)."""
        ...

    async def reload_cluster(self) -> tuple[tuple[str, ...], int]:
        """:meth:`reload_config`, then ask every other edge sharing this edge's Redis to
        reload its own file; returns what was not applied here and how many edges were told.
        Raises as :meth:`reload_config` (nothing told), or ``RuntimeError`` (the store is
        unreachable; this edge has reloaded)."""
        ...

    async def status(self) -> EdgeStatus:
        """The edge at a glance: the edges of its cluster, nodes, queues, requests in
        flight, recent failures."""
        ...


@attrs.frozen(kw_only=True)
class ApiSettings:
    """The HTTP surface's own settings. Who may call what is not one of them: the keys are
    the edge's (``EdgeServices.tenants``), which a reload swaps (see ``make_handler``)."""

    expose_node_ids: bool = False
    """``x-dispatcher-node`` / ``-provider`` reach clients only when set."""
    refuse_built_in_tools: bool = False
    """``/v1/responses`` refuses a request offering the API's built-in tools (``[responses]
    built_in_tools = "refuse"``) instead of dropping them."""

    @classmethod
    def from_config(cls, config: EdgeConfig) -> ApiSettings:
        return cls(
            expose_node_ids=config.expose_node_ids,
            refuse_built_in_tools=config.responses.built_in_tools == "refuse",
        )
