"""The storage seam: what an edge keeps that several edges must share, as typed
``Protocol`` classes. The gate, the API and the tenants see only these; a backend
implements them, and :func:`dispatcher.store.backends.open_stores` picks the backends from
the configuration, in one place.

* :class:`UsageLedger` -- one row per attempt, keyed by ``(request_id, attempt)`` and recorded
  exactly once; queries, grouped queries and the billable spend the budgets are seeded from.
  The embedded one is :class:`~dispatcher.store.ledger.BatchedLedger` (an outbox written in
  batches) over a :class:`UsageDatabase` (:class:`~dispatcher.store.usage_sqlite.SQLiteUsage`).
* :class:`ResponseStore` -- the Responses API's stored responses, found by id and owner.
* :class:`LimitStore` -- the tenants' rate windows and budgets: a request is admitted with a
  reservation of its estimate, each billable attempt's usage row settles it (keyed by request
  and attempt, so a settle may be retried), and leaving the request releases what it holds.
  The embedded one is :class:`~dispatcher.store.limits.MemoryLimits`.
* :class:`Cluster` -- the edges sharing the stores: who is alive (each edge's heartbeat), and
  a reload asked of all of them. The embedded one is
  :class:`~dispatcher.store.cluster.LocalCluster` (this edge alone).

What admission learns about capacity it does not own comes from the nodes themselves (their
``capacity`` messages, :mod:`dispatcher.link`), not from a store: the node is the one place
that knows what runs on it.

Every backend passes one contract suite (``tests/store/``), parametrized by backend.
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, Protocol, TypeVar, Unpack

import attrs

from ..config import Limits
from ..wire import JSONObject
from .usage import (
    FilterFields,
    GroupBy,
    UsageFilter,
    UsageGroup,
    UsageLedgerStatistics,
    UsageReport,
    UsageRow,
)

__all__ = [
    "Cluster",
    "EdgeList",
    "EdgeRecord",
    "EdgeReport",
    "Hold",
    "LimitName",
    "LimitStore",
    "RateHeaders",
    "Refusal",
    "Reservation",
    "ResponseDatabase",
    "ResponseStore",
    "ResponseStoreStatistics",
    "Spent",
    "StoreUnreachable",
    "StoredResponse",
    "UsageDatabase",
    "UsageLedger",
    "WriteResult",
]


# --------------------------------------------------------------------------- the usage ledger


class UsageLedger(Protocol):
    """Where each attempt's usage row goes, and what ``GET /v1/usage`` and the budgets read."""

    def record(self, row: UsageRow) -> None:
        """Accept ``row`` for writing. Synchronous and never blocks: the gate calls it from
        ``finally:`` blocks, even in a cancelled scope. Raises
        :class:`~dispatcher.store.usage.DuplicateUsageRow` for a ``(request_id, attempt)``
        it already holds, ``trio.ClosedResourceError`` once closed. Failures to write are the
        ledger's own (retried, then counted in :meth:`statistics`), never the caller's."""
        ...

    async def flush(self) -> None:
        """Wait until every row recorded before the call is written (or given up)."""
        ...

    async def query(
        self, where: UsageFilter = ..., /, *, limit: int = ..., **filters: Unpack[FilterFields]
    ) -> UsageReport:
        """The rows ``where`` covers, newest first, at most ``limit``; totals over all of them.
        Everything recorded before the call is included."""
        ...

    async def query_groups(
        self,
        where: UsageFilter = ...,
        /,
        *,
        group_by: Sequence[GroupBy] = ...,
        billable: bool = False,
        **filters: Unpack[FilterFields],
    ) -> list[UsageGroup]:
        """Sums of the rows covered, grouped by ``group_by``, ordered by the groups' values."""
        ...

    async def billable_spend(self, since: float) -> list[UsageGroup]:
        """What was billed to clients since ``since`` (Unix time), per key and UTC day: what
        a restarted edge seeds its budgets from."""
        ...

    def statistics(self) -> UsageLedgerStatistics: ...


@attrs.frozen
class WriteResult:
    """What one batch's transaction did."""

    inserted: int
    duplicates: list[tuple[str, int]]
    """Keys already in the database: the new rows were skipped."""
    refused: list[tuple[tuple[str, int], str]]
    """Keys the database refused, with its reason: those rows are lost."""


class UsageDatabase(Protocol):
    """A ledger's database as the batch writer drives it: synchronous, one call at a time in a
    worker thread (``trio.to_thread``), one transaction per :meth:`write`."""

    @property
    def errors(self) -> tuple[type[Exception], ...]:
        """What a failed transaction raises (the writer retries it, then gives the batch up)."""
        ...

    def write(self, rows: Sequence[UsageRow]) -> WriteResult:
        """Insert ``rows`` in one transaction, skipping (and reporting) keys already there."""
        ...

    def query(self, matching: UsageFilter, limit: int) -> UsageReport: ...

    def query_groups(
        self, matching: UsageFilter, group_by: tuple[GroupBy, ...], billable: bool
    ) -> list[UsageGroup]: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- stored responses


@attrs.frozen
class StoredResponse:
    response: JSONObject
    """The response object as ``GET`` answers it."""
    conversation: tuple[JSONObject, ...]
    """The input items of the whole chain (without instructions) and this response's output
    items: what a later ``previous_response_id`` prepends."""
    size: int
    stored_at: float
    owner: str | None = None
    """Whose it is: the id of the API key that created it (None when the edge has none)."""


@attrs.frozen(kw_only=True)
class ResponseStoreStatistics:
    entries: int
    """Responses held now (some may be past their age until the next write forgets them;
    no read finds those)."""
    bytes: int
    evicted: int
    """Responses forgotten for a bound (not deleted by a client) since the store opened."""


class ResponseDatabase(Protocol):
    """A response store's database as :class:`~dispatcher.store.responses.BoundedResponseStore`
    drives it: synchronous, called in worker threads (``trio.to_thread``), each call one
    transaction. ``entries`` and ``bytes`` are what it holds, as its last call saw them."""

    @property
    def entries(self) -> int: ...

    @property
    def bytes(self) -> int: ...

    def put(
        self,
        response_id: str,
        owner: str | None,
        response: builtins.bytes,
        conversation: builtins.bytes,
        now: float,
        horizon: float,
        max_entries: int,
        max_bytes: int,
    ) -> int:
        """Keep one response (replacing one of the same id), then forget what is past the
        bounds or stored at ``horizon`` or before, oldest first. Returns how many went."""
        ...

    def get(self, response_id: str, owner: str | None, horizon: float) -> StoredResponse | None: ...

    def delete(self, response_id: str, owner: str | None, horizon: float) -> bool: ...

    def close(self) -> None: ...


class ResponseStore(Protocol):
    """Stored responses of the Responses API, each found only by its owner."""

    async def put(
        self, response: JSONObject, conversation: Sequence[JSONObject], owner: str | None = None
    ) -> bool:
        """Keep ``response`` (by its ``id``) for ``owner``; False if it is too big to keep.
        Once this returns, :meth:`get` finds it."""
        ...

    async def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """``owner``'s response ``response_id``, unless it is past its age or evicted."""
        ...

    async def delete(self, response_id: str, owner: str | None = None) -> bool:
        """Forget ``owner``'s response ``response_id``; False if it was not there."""
        ...

    def statistics(self) -> ResponseStoreStatistics: ...


# --------------------------------------------------------------------------- tenants' limits

LimitName = Literal[
    "rpm",
    "tpm",
    "max_concurrent",
    "budget_tokens_day",
    "budget_tokens_month",
    "budget_usd_day",
    "budget_usd_month",
]
RateHeaders = tuple[tuple[bytes, bytes], ...]
"""OpenAI's ``x-ratelimit-*`` headers of an answer."""


@attrs.frozen
class Hold:
    """What admitting one client request asks to hold."""

    request_id: str
    tenant_id: str
    limits: Limits
    """The tenant's limits as the request is admitted (a reload later does not change them)."""
    tokens: int
    """The request's estimate: its prompt and the output it may produce."""
    usd: float
    """The estimate's cost at the prices in force."""


@attrs.frozen
class Refusal:
    """A request refused before admission."""

    limit: LimitName
    message: str
    retry_after: float
    headers: RateHeaders

    @property
    def quota(self) -> bool:
        """A budget is spent (429 ``insufficient_quota``), not a rate."""
        return self.limit.startswith("budget_")


class Reservation(Protocol):
    """An admitted request's hold, as a store gives it back: the handle :meth:`LimitStore.settle`
    and :meth:`LimitStore.release` take."""

    @property
    def hold(self) -> Hold: ...

    @property
    def headers(self) -> RateHeaders:
        """The ``x-ratelimit-*`` headers of its answer (empty when no rate limit is set)."""
        ...


ReservationT = TypeVar("ReservationT", bound=Reservation)
"""A store's own reservation type."""


@attrs.frozen
class Spent:
    """A tenant's billed spend in the current UTC day and month."""

    tokens_day: int
    usd_day: float
    tokens_month: int
    usd_month: float


class StoreUnreachable(Exception):
    """A shared store did not answer an operation a caller waits for (its server is down,
    unreachable, or answered past the store's deadline): what a shared
    :class:`LimitStore` raises from :meth:`LimitStore.admit` and what
    :mod:`~dispatcher.store.limits_guard` turns into the edge's failure mode. The message
    names what failed, never a password."""


class LimitStore(Protocol[ReservationT]):
    """Every tenant's rate windows (``rpm``, ``tpm``), places in flight (``max_concurrent``)
    and budgets (tokens and USD per UTC day and month).

    Overshoot is bounded by what is reserved: an admitted request holds its estimate in the
    token window and the budgets until its usage settles it."""

    async def admit(self, hold: Hold) -> ReservationT | Refusal:
        """Admit one client request, holding a place in flight, one request in the minute
        window and its estimate in the token window and the budgets; or refuse it (which
        limit, when to retry, the headers). A shared store that does not answer raises
        :class:`StoreUnreachable`; the edge's guard over it
        (:class:`~dispatcher.store.limits_guard.GuardedLimits`) raises
        :class:`~dispatcher.errors.LimitStoreUnavailable` (503) instead, or decides on this
        edge, as ``[store] on_store_error`` says."""
        ...

    def settle(self, reservation: ReservationT, attempt: int, tokens: int, usd: float) -> None:
        """The billable usage row of the request's ``attempt``: the first one replaces the
        estimate in the token window (another attempt's adds to it), the reservation leaves
        the budgets and the row's spend is added. Settling one ``(request, attempt)`` again
        does nothing. Never blocks (a shared store writes it behind the request)."""
        ...

    def release(self, reservation: ReservationT, *, answered: bool) -> None:
        """The request ended, however it ended: its place in flight and what it still
        reserves of the budgets go. Unless it was ``answered`` (a billable row is then on its
        way) or settled, its estimate leaves the token window too: a request that failed
        before its answer costs its tenant nothing. Idempotent; never blocks."""
        ...

    def spend(self, tenant_id: str, tokens: int, usd: float) -> None:
        """Spend without a reservation: a billable row whose request is long gone."""
        ...

    def spent(self, tenant_id: str) -> Spent:
        """What the tenant spent today and this month (UTC)."""
        ...

    def in_flight(self, tenant_id: str) -> int:
        """The tenant's requests admitted and not released."""
        ...

    async def seed(self, ledger: UsageLedger) -> None:
        """At start-up: this month's billable spend per tenant, from ``ledger``, so a restart
        does not reset a budget. A shared store that keeps its own counters does nothing."""
        ...


# --------------------------------------------------------------------------- the edges


@attrs.frozen(kw_only=True)
class EdgeReport:
    """What an edge says of itself at each heartbeat, besides who it is."""

    started_at: float
    """Unix time the edge started."""
    in_flight: int
    """Requests it is serving now."""
    reloaded_at: float | None = None
    """Unix time of its latest reload of its config file (None: none since it started)."""
    reload_error: str | None = None
    """Why that reload was refused (None: it was applied)."""


@attrs.frozen(kw_only=True)
class EdgeRecord:
    """One live edge, as its latest heartbeat described it (``GET /admin/status``'s
    ``edges``)."""

    id: str
    address: str
    """Where it listens (``host:port`` as configured; the host name for a wildcard host)."""
    version: str
    started_at: float
    in_flight: int
    heard_s: float
    """Seconds since its latest heartbeat (by the store's clock, not the edges')."""
    reloaded_at: float | None
    reload_error: str | None
    node_url: str = ""
    """Where nodes dial it ("" from an edge of an earlier release)."""


@attrs.frozen(kw_only=True)
class EdgeList:
    """The live edges, as read at ``as_of``."""

    edges: tuple[EdgeRecord, ...]
    """By id."""
    as_of: float
    """Unix time they were read (older than the question when the store did not answer)."""
    error: str | None = None
    """Why the store did not answer (``edges`` is then the last list read, or this edge
    alone)."""


class Cluster(Protocol):
    """The edges that share this edge's stores: each announces itself by a heartbeat, and a
    reload asked of one can be told to all. Every edge reloads its own config file, and
    refuses a broken one on its own."""

    @property
    def edge_id(self) -> str:
        """This edge's name among them."""
        ...

    def bind(
        self, report: Callable[[], EdgeReport], on_reload: Callable[[], Awaitable[None]]
    ) -> None:
        """What this edge says at each heartbeat (``report``, called then), and what it runs
        when another edge publishes a reload (``on_reload``, which must not raise). Called
        once, when the edge is assembled; before that it reports nothing in flight and does
        not listen for reloads."""
        ...

    def changed(self) -> None:
        """What ``report`` says has changed: the next heartbeat goes now."""
        ...

    async def edges(self) -> EdgeList:
        """The live edges, this one included, by id. Never raises for the store: when it
        does not answer, the list says so (:attr:`EdgeList.error`)."""
        ...

    async def publish_reload(self) -> int:
        """Ask every other edge to reload its config file; how many were told (0 alone).
        Raises ``RuntimeError`` naming the store when it cannot be reached."""
        ...
