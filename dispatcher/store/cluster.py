"""The edges as one cluster, without the event loop's or a server's part: who this edge is
(:func:`edge_identity`: its id, address and version), its heartbeat's record as a store
keeps it (:func:`encode_record`, :func:`decode_record`), and :class:`LocalCluster`, the
:class:`~dispatcher.store.seam.Cluster` of the embedded default: this edge alone, so callers
never ask whether there is a cluster. Several edges on one Redis are
:mod:`dispatcher.store.cluster_redis`.
"""

from __future__ import annotations

import importlib.metadata
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import orjson
import trio

from ..config import EdgeConfig
from .seam import EdgeList, EdgeRecord, EdgeReport

__all__ = [
    "VERSION",
    "EdgeIdentity",
    "LocalCluster",
    "decode_record",
    "edge_identity",
    "encode_record",
    "record_of",
]

_T = TypeVar("_T")


def _version() -> str:
    try:
        return importlib.metadata.version("trio-dispatcher")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


VERSION = _version()
"""This edge's version, as its heartbeat tells the others."""
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


@attrs.frozen(kw_only=True)
class EdgeIdentity:
    """Who an edge is among the others, fixed for its life."""

    id: str
    address: str
    version: str = VERSION
    node_url: str = ""
    """Where nodes dial it (told to the nodes of the other edges)."""


def edge_identity(config: EdgeConfig, hostname: str | None = None) -> EdgeIdentity:
    """This edge's identity from its config: ``store.edge_id``, else ``hostname:port``; its
    address is ``host:port`` as configured, with the host name for a wildcard host (``""``,
    ``0.0.0.0``, ``::``); its node URL ``store.node_url``, else its node endpoint at that
    address (none on port 0: the port is not known yet, and no node is told of it)."""
    hostname = hostname or socket.gethostname()
    host = hostname if config.host in _WILDCARDS else config.host
    address = f"[{host}]:{config.port}" if ":" in host else f"{host}:{config.port}"
    scheme = "wss" if config.http.tls_certificate is not None else "ws"
    node_url = config.store.node_url or (
        f"{scheme}://{address}/v1/nodes/connect" if config.port else ""  # port 0: unknown yet
    )
    return EdgeIdentity(id=config.edge_id(hostname), address=address, node_url=node_url)


def record_of(identity: EdgeIdentity, report: EdgeReport, heard_s: float) -> EdgeRecord:
    return EdgeRecord(
        id=identity.id,
        address=identity.address,
        version=identity.version,
        node_url=identity.node_url,
        started_at=report.started_at,
        in_flight=report.in_flight,
        heard_s=heard_s,
        reloaded_at=report.reloaded_at,
        reload_error=report.reload_error,
    )


def encode_record(identity: EdgeIdentity, instance: str, report: EdgeReport) -> str:
    """The heartbeat's record as the store keeps it (JSON). ``instance`` tells two processes
    that were given one id apart."""
    return orjson.dumps(
        {
            "id": identity.id,
            "instance": instance,
            "address": identity.address,
            "node_url": identity.node_url,
            "version": identity.version,
            **attrs.asdict(report),
        }
    ).decode()


def decode_record(text: str, now_ms: int) -> EdgeRecord | None:
    """A record the store kept (``heard_ms`` added by the store's clock, as ``now_ms``), or
    None when it is not one (written by something else)."""
    try:
        fields: Any = orjson.loads(text)
        heard_ms = int(fields["heard_ms"])
        return EdgeRecord(
            id=str(fields["id"]),
            address=str(fields["address"]),
            version=str(fields["version"]),
            node_url=str(fields.get("node_url", "")),
            started_at=float(fields["started_at"]),
            in_flight=int(fields["in_flight"]),
            heard_s=max(0.0, (now_ms - heard_ms) / 1000),
            reloaded_at=_optional(fields.get("reloaded_at"), float),
            reload_error=_optional(fields.get("reload_error"), str),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def _optional(value: object, kind: Callable[[Any], _T]) -> _T | None:
    return None if value is None else kind(value)


def _nothing_in_flight() -> EdgeReport:
    return EdgeReport(started_at=time.time(), in_flight=0)


@attrs.define(eq=False)
class LocalCluster:
    """The embedded default's :class:`~dispatcher.store.seam.Cluster`: this edge alone. Its
    list is this edge; a reload told to the others tells nobody."""

    identity: EdgeIdentity
    _report: Callable[[], EdgeReport] = attrs.field(
        default=_nothing_in_flight, alias="report", kw_only=True
    )

    @property
    def edge_id(self) -> str:
        return self.identity.id

    def bind(
        self, report: Callable[[], EdgeReport], on_reload: Callable[[], Awaitable[None]]
    ) -> None:
        self._report = report

    def changed(self) -> None:
        pass

    async def edges(self) -> EdgeList:
        await trio.lowlevel.checkpoint()
        return EdgeList(edges=(record_of(self.identity, self._report(), 0.0),), as_of=time.time())

    async def publish_reload(self) -> int:
        await trio.lowlevel.checkpoint()
        return 0
