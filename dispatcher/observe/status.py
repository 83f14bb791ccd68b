"""The edge at a glance: the document ``GET /admin/status`` answers (``docs/status.md``).

:func:`edge_status` builds it from what the edge holds now -- the node sessions, admission's
statistics, the request records (:mod:`dispatcher.observe.traffic`), the edges of its cluster
(``dispatcher.store.seam.Cluster``) -- as frozen attrs classes, so
its field names are fixed in one place; :func:`status_json` serialises it. Every list is
bounded (the in-flight list at :data:`MAX_IN_FLIGHT`, the failures at the traffic's ring,
nodes and models by what admission and the hello limits hold), and it holds no secret:
node tokens, API keys and prompts never appear, a key only by its id. Node labels, model names
and error messages are data, escaped by JSON itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import attrs
import orjson

from ..admission import AdmissionStatistics
from ..gate.catalog import candidates_for_session
from ..link.registry import NodeSession
from ..store.seam import EdgeList, EdgeRecord
from .traffic import REFUSAL_WINDOW, RequestSummary, Traffic

__all__ = [
    "MAX_IN_FLIGHT",
    "EdgeStatus",
    "ModelSlots",
    "NodeStatus",
    "ProviderStatus",
    "QueueStatus",
    "edge_status",
    "status_json",
]

MAX_IN_FLIGHT: Final = 200
"""Requests listed in flight (the oldest first); ``in_flight_total`` counts them all."""


@attrs.frozen(kw_only=True)
class ModelSlots:
    """One model of a provider, with its candidate's slots and health in admission."""

    name: str
    """The public model group."""
    served_name: str
    slots_total: int
    slots_in_use: int
    slots_draining: int
    health: str
    """``healthy``, ``ejected`` or ``probing`` (failure-aware selection)."""


@attrs.frozen(kw_only=True)
class ProviderStatus:
    id: str
    type: str
    path: str
    """``normalized`` or ``tunnel``."""
    models: list[ModelSlots]


@attrs.frozen(kw_only=True)
class NodeStatus:
    id: str
    label: str
    generation: int
    connected_at: float
    """Unix time the session registered."""
    last_heard_s: float | None
    """Seconds since the node's latest frame (heartbeats included)."""
    draining: bool
    slots_total: int
    slots_in_use: int
    providers: list[ProviderStatus]


@attrs.frozen(kw_only=True)
class QueueStatus:
    """One model group's queue: admission's depth, this edge's waiting requests, and its
    recent refusals (429 queue full, 503 timed out or nothing to serve it)."""

    model: str
    depth: int
    depth_long: int
    """Of ``depth``, the long-context requests (0 for a group without classes)."""
    oldest_wait_s: float | None
    refused_429: int
    refused_503: int
    """Within the last ``refusal_window_s``."""
    last_refused_at: float | None
    affinity: dict[str, int] | None = None
    """With affinity on for the group (``docs/admission.md``, "Affinity"): its admissions by
    result (``hit``, the spills ``over_load``, ``busy``, ``ineligible``, ``ejected``, and
    ``unkeyed``), as ``dispatcher_affinity_total`` counts them; None while it is off."""


@attrs.frozen(kw_only=True)
class EdgeStatus:
    generated_at: float
    started_at: float
    uptime_s: float
    draining: bool
    edge_id: str
    """This edge's id among the edges of its cluster."""
    edges: list[EdgeRecord]
    """The live edges sharing its Redis, this one included, by id (this edge alone without
    one)."""
    edges_as_of: float
    """Unix time ``edges`` was read."""
    edges_error: str | None
    """Why the list could not be read now (it is then the last one read)."""
    refusal_window_s: float
    nodes: list[NodeStatus]
    queues: list[QueueStatus]
    in_flight_total: int
    in_flight: list[RequestSummary]
    recent_failures: list[RequestSummary]


def _node(session: NodeSession, stats: AdmissionStatistics, now: float) -> NodeStatus:
    by_model = {
        (candidate.provider_id, candidate.model): stats.candidates.get(candidate.key)
        for candidate in candidates_for_session(session)
    }
    providers = []
    total = in_use = 0
    for provider in session.hello.providers:
        models = []
        for model in provider.models:
            found = by_model.get((provider.id, model.name))
            slots = (found.total, found.in_use, found.draining) if found else (0, 0, 0)
            total, in_use = total + slots[0], in_use + slots[1]
            models.append(
                ModelSlots(
                    name=model.name,
                    served_name=model.served_name,
                    slots_total=slots[0],
                    slots_in_use=slots[1],
                    slots_draining=slots[2],
                    health=found.health if found else "healthy",
                )
            )
        providers.append(
            ProviderStatus(id=provider.id, type=provider.type, path=provider.path, models=models)
        )
    heard = session.last_heard
    return NodeStatus(
        id=session.node_id,
        label=session.hello.label,
        generation=session.generation,
        connected_at=round(session.connected_at, 3),
        last_heard_s=None if heard is None else round(max(0.0, now - heard), 3),
        draining=session.draining,
        slots_total=total,
        slots_in_use=in_use,
        providers=providers,
    )


def _queues(stats: AdmissionStatistics, traffic: Traffic, now: float) -> list[QueueStatus]:
    waiting = traffic.waiting(now)
    refusals = traffic.refusals(now)
    queues = []
    for model in sorted({*stats.groups, *refusals}):
        group = stats.groups.get(model)
        refused = refusals.get(model)
        oldest = waiting.get(model)
        queues.append(
            QueueStatus(
                model=model,
                depth=group.depth if group else 0,
                depth_long=group.long if group else 0,
                oldest_wait_s=None if oldest is None else round(oldest[1], 3),
                refused_429=refused.too_many_requests if refused else 0,
                refused_503=refused.unavailable if refused else 0,
                last_refused_at=refused.last_at if refused else None,
                affinity=(
                    {str(r): n for r, n in group.affinity.items()}
                    if group and group.affinity_on
                    else None
                ),
            )
        )
    return queues


def edge_status(
    *,
    sessions: Iterable[NodeSession],
    stats: AdmissionStatistics,
    traffic: Traffic,
    now: float,
    wall: float,
    started_at: float,
    draining: bool,
    edge_id: str,
    edges: EdgeList,
) -> EdgeStatus:
    """The status document (``now``: ``trio.current_time()``, ``wall``: unix time)."""
    working = [record for record in traffic.in_flight.values() if record.work]
    return EdgeStatus(
        generated_at=round(wall, 3),
        started_at=round(started_at, 3),
        uptime_s=round(max(0.0, wall - started_at), 3),
        draining=draining,
        edge_id=edge_id,
        edges=[_rounded(record) for record in edges.edges],
        edges_as_of=round(edges.as_of, 3),
        edges_error=edges.error,
        refusal_window_s=REFUSAL_WINDOW,
        nodes=[_node(session, stats, now) for session in sorted(sessions, key=_by_id)],
        queues=_queues(stats, traffic, now),
        in_flight_total=len(working),
        in_flight=[record.summary(now) for record in working[:MAX_IN_FLIGHT]],
        recent_failures=list(traffic.failures),
    )


def _rounded(record: EdgeRecord) -> EdgeRecord:
    reloaded = record.reloaded_at
    return attrs.evolve(
        record,
        started_at=round(record.started_at, 3),
        heard_s=round(record.heard_s, 3),
        reloaded_at=None if reloaded is None else round(reloaded, 3),
    )


def _by_id(session: NodeSession) -> str:
    return session.node_id


def status_json(status: EdgeStatus) -> bytes:
    return orjson.dumps(attrs.asdict(status))
