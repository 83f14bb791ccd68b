"""The one place the edge's stores are chosen from its configuration: :func:`open_stores`.

Today every backend is embedded (the default, and the only one: one process, SQLite and
memory, never a server to run): the usage ledger on SQLite (``usage_db``, in memory without
one), the stored responses on SQLite beside it, the tenants' limits in memory. A shared backend
(Redis for the limits, PostgreSQL for the ledger and the responses) is one more branch here,
and passes the same contract suite (``tests/store/``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs

from ..config import EdgeConfig
from .ledger import open_usage_ledger
from .limits import MemoryLimits
from .responses import beside_ledger, open_response_store
from .seam import LimitStore, ResponseStore, UsageLedger

__all__ = ["Stores", "open_stores"]


@attrs.frozen
class Stores:
    """What an edge keeps, each behind its seam."""

    ledger: UsageLedger
    responses: ResponseStore
    limits: LimitStore[Any]


@asynccontextmanager
async def open_stores(config: EdgeConfig) -> AsyncIterator[Stores]:
    """The stores ``config`` names, open for the block; leaving it, however it is left,
    writes what is pending and closes them."""
    async with (
        open_usage_ledger(config.usage_db or ":memory:") as ledger,
        open_response_store(
            beside_ledger(config.usage_db),
            max_entries=config.responses.max_stored,
            max_bytes=config.responses.max_stored_bytes,
            max_age=config.responses.max_age_s,
        ) as responses,
    ):
        yield Stores(ledger, responses, MemoryLimits())
