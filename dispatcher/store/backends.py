"""The one place the edge's stores are chosen from its configuration: :func:`open_stores`.

* **Embedded** (the default: one process, nothing to run): the usage ledger on SQLite
  (``usage_db``, in memory without one), the stored responses on SQLite beside it, the
  tenants' limits in memory.
* **Shared** (``[store]``, ``docs/cluster.md``): with ``redis_url`` the limits and budgets on
  Redis (:mod:`.limits_redis`); with ``database_url`` the ledger and the stored responses on
  PostgreSQL (:mod:`.postgres`). Either may be set alone. Their client libraries are imported
  only here, and only when named (the ``cluster`` extra installs them).

Every backend passes the same contract suite (``tests/store/``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import (
    AbstractAsyncContextManager,
    AsyncExitStack,
    asynccontextmanager,
    nullcontext,
)
from typing import Any

import attrs

from ..config import EdgeConfig, StoreSettings
from .cluster import LocalCluster, edge_identity
from .ledger import open_usage_ledger
from .limits import MemoryLimits
from .responses import beside_ledger, open_response_store
from .seam import Cluster, LimitStore, ResponseStore, UsageLedger

__all__ = ["Stores", "migrate_database", "open_stores"]


@attrs.frozen
class Stores:
    """What an edge keeps, each behind its seam."""

    ledger: UsageLedger
    responses: ResponseStore
    limits: LimitStore[Any]
    cluster: Cluster
    """The edges sharing these stores (this edge alone without ``redis_url``)."""


@asynccontextmanager
async def open_stores(config: EdgeConfig) -> AsyncIterator[Stores]:
    """The stores ``config`` names, open for the block; leaving it, however it is left,
    writes what is pending and closes them. A shared server down at start is no error: the
    ledger keeps its rows in the outbox, the limits serve in their failure mode
    (``[store] on_store_error``), until it answers."""
    store = config.store
    async with AsyncExitStack() as stack:
        ledger = await stack.enter_async_context(_open_ledger(config))
        responses = await stack.enter_async_context(_open_responses(config))
        limits = await stack.enter_async_context(_open_limits(store))
        cluster = await stack.enter_async_context(_open_cluster(config))
        yield Stores(ledger, responses, limits, cluster)


@asynccontextmanager
async def _open_limits(store: StoreSettings) -> AsyncIterator[LimitStore[Any]]:
    if store.redis_url is None:
        yield MemoryLimits()
        return
    from .limits_guard import open_guarded_limits, store_place
    from .limits_redis import COMMAND_TIMEOUT, open_redis_limits

    async with (
        open_redis_limits(
            store.redis_url,
            hold_lease=store.hold_lease_s,
            command_timeout=max(store.timeout_s, COMMAND_TIMEOUT),
        ) as redis,
        open_guarded_limits(
            redis,
            f"the limit store ({store_place(store.redis_url)})",
            mode="local" if store.on_store_error == "local" else "refuse",
            edge_count=store.edge_count,
            answer_within=store.timeout_s,
        ) as limits,
    ):
        yield limits


def _open_ledger(config: EdgeConfig) -> AbstractAsyncContextManager[UsageLedger]:
    url = config.store.database_url
    if url is None:
        return open_usage_ledger(config.usage_db or ":memory:")
    from .postgres import open_postgres_ledger

    return open_postgres_ledger(url, outbox=config.store.outbox or ":memory:")


def _open_responses(config: EdgeConfig) -> AbstractAsyncContextManager[ResponseStore]:
    bounds: dict[str, Any] = {
        "max_entries": config.responses.max_stored,
        "max_bytes": config.responses.max_stored_bytes,
        "max_age": config.responses.max_age_s,
    }
    url = config.store.database_url
    if url is None:
        return open_response_store(beside_ledger(config.usage_db), **bounds)
    from .postgres import open_postgres_response_store

    return open_postgres_response_store(url, **bounds)


def migrate_database(store: StoreSettings) -> list[str]:
    """``dispatcher migrate``: the shared database's tables brought to this dispatcher's
    version (blocking), a line per component. Raises :class:`ValueError` when ``[store]``
    names no database."""
    if store.database_url is None:
        raise ValueError(
            "nothing to migrate: [store] names no database_url (the embedded SQLite files "
            "migrate themselves when the edge opens them)"
        )
    from .postgres import migrate

    return migrate(store.database_url)


def _open_cluster(config: EdgeConfig) -> AbstractAsyncContextManager[Cluster]:
    """The edges sharing the Redis of ``redis_url`` (:mod:`.cluster_redis`: heartbeats,
    reloads told to all); without it, this edge alone (:class:`.cluster.LocalCluster`)."""
    identity = edge_identity(config)
    url = config.store.redis_url
    if url is None:
        return nullcontext(LocalCluster(identity))
    from .cluster_redis import open_redis_cluster

    return open_redis_cluster(url, identity, heartbeat=config.store.heartbeat_s)
