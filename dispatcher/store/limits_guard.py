"""The edge's failure mode over a shared limit store: :class:`GuardedLimits`, a
:class:`~dispatcher.store.seam.LimitStore` in front of one that may not answer (Redis,
:mod:`.limits_redis`), opened by :func:`open_guarded_limits` (``[store] on_store_error``).

* An admission is asked of the shared store under a deadline (``timeout_s``). An error
  (:class:`~dispatcher.store.seam.StoreUnreachable`) or no answer in time starts an
  **outage**, as does a write the store finds the server down for
  (:attr:`SharedLimitStore.on_unreachable`): one WARNING naming the store and what happened,
  the shared store suspended (its writes parked, :meth:`SharedLimitStore.suspend`), and from
  then on every admission is decided on this edge at once, without waiting for the store:

  - ``refuse``: a request whose key has limits gets
    :class:`~dispatcher.errors.LimitStoreUnavailable` (503, ``Retry-After``);
  - ``local``: it is admitted against this edge's share of its key's limits (each divided by
    ``edge_count``, rounded up, at least 1; a budget's share counts this edge's share of what
    the store last said was spent), in a :class:`~dispatcher.store.limits.MemoryLimits` of
    the outage's own, with a WARNING every :data:`WARN_EVERY` seconds while it lasts.

  A key without limits is admitted on this edge in both modes (nothing to check).
* A task of the guard's (its nursery, :func:`open_guarded_limits`) probes the store every
  :data:`PROBE_EVERY` seconds during an outage; once it answers, the parked writes are
  written (at most :data:`RECOVERY_DRAIN` seconds) and admissions go to the store again, with
  one INFO line giving the outage's length and what was decided meanwhile.
* A reservation remembers the store it came from (:class:`Guarded`): its settles and release
  go there, however the store fares since. A request admitted on this edge settles its spend
  there and also posts it to the shared store (:meth:`LimitStore.spend`, parked until the
  store answers), so the budgets in the store count it once the outage is over.

What an outage loses: the rate windows of requests decided on this edge (the store never
sees them), and writes the shared store gives up (beyond its parking bound, or parked when
the edge closes; counted in :meth:`GuardedLimits.statistics` ``lost``).
"""

from __future__ import annotations

import collections
import logging
import math
import urllib.parse
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final, Literal, Protocol

import attrs
import trio

from ..config import Limits
from ..errors import LimitStoreUnavailable, StoreUnavailable
from .limits import MemoryLimits, month_start, periods
from .seam import (
    Hold,
    LimitStore,
    RateHeaders,
    Refusal,
    Reservation,
    Spent,
    StoreUnreachable,
    UsageLedger,
)

__all__ = [
    "PROBE_EVERY",
    "RECOVERY_DRAIN",
    "WARN_EVERY",
    "Guarded",
    "GuardedLimits",
    "LimitGuardStatistics",
    "Mode",
    "SharedLimitStore",
    "edge_share",
    "open_guarded_limits",
    "store_place",
]

log = logging.getLogger("dispatcher.store.limits_guard")

Mode = Literal["refuse", "local"]
PROBE_EVERY: Final = 0.5
"""Seconds between probes of a store that does not answer."""
RECOVERY_DRAIN: Final = 3.0
"""Seconds a store that answers again has to write what was parked before admissions go to
it (else it counts as still failing)."""
WARN_EVERY: Final = 30.0
"""Seconds between the WARNINGs of an outage decided ``local``."""

_UNAVAILABLE: Final = (
    "The limit store is not answering, so this API key's rate limits and budgets cannot be "
    "checked. Retry in a few seconds."
)


class WriteStatistics(Protocol):
    """What a shared store says of its writes."""

    @property
    def pending(self) -> int: ...
    @property
    def parked(self) -> int: ...
    @property
    def lost(self) -> int: ...


class SharedLimitStore(LimitStore[Any], Protocol):
    """A limit store on a server that may not answer (:class:`~.limits_redis.RedisLimits`)."""

    async def ping(self) -> None:
        """Return if the server answers now; raise
        :class:`~dispatcher.store.seam.StoreUnreachable` if not."""
        ...

    def suspend(self) -> None:
        """The server is known not to answer: park the writes, fail the admissions at once."""
        ...

    def resume(self) -> None:
        """The server answers again: write what was parked first."""
        ...

    async def flush(self) -> None:
        """Wait until what was posted before the call is written (or given up)."""
        ...

    def statistics(self) -> WriteStatistics: ...

    on_unreachable: Callable[[str], None] | None
    """Told (what failed) when a write finds the server not answering."""

    admit_bounded_by: float | None
    """Seconds within which every :meth:`admit` is called under a deadline of its caller's
    (the guard's :attr:`GuardedLimits.answer_within`; None: no such promise). A store may
    then leave out a timeout of its own that would come later."""


def store_place(url: str) -> str:
    """Where a store's URL points, for logs: ``redis://host:port/db`` without its user and
    password."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def edge_share(limits: Limits, edge_count: int, spent: Spent) -> tuple[Limits, Spent]:
    """This edge's share of ``limits`` when ``edge_count`` edges each decide alone: every
    limit divided by ``edge_count`` (rates and places rounded up, at least 1), and the share
    of ``spent`` (what the store last said the key spent) its budgets start from, so that the
    edges together admit about what the budgets have left."""
    if edge_count <= 1:
        return limits, spent

    def rate(value: int | None) -> int | None:
        return None if value is None else max(1, math.ceil(value / edge_count))

    def tokens(value: int | None) -> int | None:
        return None if value is None else max(1, math.ceil(value / edge_count))

    def usd(value: float | None) -> float | None:
        return None if value is None else value / edge_count

    share = Limits(
        rpm=rate(limits.rpm),
        tpm=rate(limits.tpm),
        max_concurrent=rate(limits.max_concurrent),
        budget_tokens_day=tokens(limits.budget_tokens_day),
        budget_tokens_month=tokens(limits.budget_tokens_month),
        budget_usd_day=usd(limits.budget_usd_day),
        budget_usd_month=usd(limits.budget_usd_month),
    )
    spent_share = Spent(
        spent.tokens_day // edge_count,
        spent.usd_day / edge_count,
        spent.tokens_month // edge_count,
        spent.usd_month / edge_count,
    )
    return share, spent_share


def _limited(limits: Limits) -> bool:
    return any(getattr(limits, field.name) is not None for field in attrs.fields(Limits))


def _budgeted(limits: Limits) -> bool:
    return any(
        value is not None
        for value in (
            limits.budget_tokens_day,
            limits.budget_tokens_month,
            limits.budget_usd_day,
            limits.budget_usd_month,
        )
    )


@attrs.define(eq=False, slots=True)
class Guarded:
    """A reservation of :class:`GuardedLimits` (a :class:`~dispatcher.store.seam.Reservation`):
    the store's own and the store it came from."""

    inner: Reservation
    store: LimitStore[Any]
    local: bool
    """Decided on this edge during an outage (its spend is also posted to the shared store)."""
    settled: set[int] = attrs.field(factory=set, repr=False)
    released: bool = False

    @property
    def hold(self) -> Hold:
        return self.inner.hold

    @property
    def headers(self) -> RateHeaders:
        return self.inner.headers


@attrs.frozen(kw_only=True)
class LimitGuardStatistics:
    store: str
    """The store, as the logs name it (no password)."""
    mode: Mode
    up: bool
    """Admissions go to the store (False: an outage is on)."""
    outages: int
    """Outages since the edge started."""
    refused: int
    """Requests refused (503) because the store did not answer."""
    local: int
    """Requests admitted or refused on this edge because the store did not answer."""
    pending: int
    """The store's writes posted and not yet written."""
    parked: int
    """The store's writes held back until it answers again."""
    lost: int
    """The store's writes given up."""


@attrs.define(eq=False, slots=True)
class _Outage:
    started: float
    reason: str
    local: MemoryLimits
    """Where this outage's requests are decided on this edge."""
    seeded: set[str] = attrs.field(factory=set)
    """Tenants whose budgets' share of the store's spend is in :attr:`local`."""
    refused: int = 0
    decided: int = 0
    next_warning: float = 0.0


@attrs.define(eq=False)
class GuardedLimits:
    """A shared limit store with the edge's failure mode (see the module docstring). Open it
    with :func:`open_guarded_limits`."""

    inner: SharedLimitStore
    name: str
    """How the logs name the store: ``the limit store (redis://host:port/0)``."""
    mode: Mode = "refuse"
    edge_count: int = 1
    answer_within: float = 0.5
    """Seconds an admission may wait for the store."""
    probe_every: float = PROBE_EVERY
    warn_every: float = WARN_EVERY
    clock: Callable[[], float] = trio.current_time
    _outage: _Outage | None = attrs.field(init=False, default=None)
    _failed: trio.Event = attrs.field(init=False, factory=trio.Event)
    """Set when an outage starts (wakes the prober)."""
    _outages: int = attrs.field(init=False, default=0)
    _refused: int = attrs.field(init=False, default=0)
    _decided: int = attrs.field(init=False, default=0)
    _local_in_flight: collections.Counter[str] = attrs.field(
        init=False, factory=collections.Counter
    )

    # -- the LimitStore ----------------------------------------------------------------

    async def admit(self, hold: Hold) -> Guarded | Refusal:
        """The store decides within :attr:`answer_within` seconds, else (and during an outage at
        once) this edge: :class:`~dispatcher.errors.LimitStoreUnavailable` (``refuse``, for
        a key with limits) or its share of the limits (``local``)."""
        if self._outage is None:
            reason = f"no answer within {self.answer_within:g} s"
            try:
                with trio.move_on_after(self.answer_within):
                    decision = await self.inner.admit(hold)
                    if isinstance(decision, Refusal):
                        return decision
                    return Guarded(decision, self.inner, local=False)
            except StoreUnreachable as error:
                reason = str(error)
            self._fail(reason)
        return self._decide_here(hold)

    def settle(self, reservation: Guarded, attempt: int, tokens: int, usd: float) -> None:
        reservation.store.settle(reservation.inner, attempt, tokens, usd)
        if reservation.local and attempt not in reservation.settled:
            # The shared budgets count it when the store answers again.
            self.inner.spend(reservation.hold.tenant_id, tokens, usd)
        reservation.settled.add(attempt)

    def release(self, reservation: Guarded, *, answered: bool) -> None:
        if reservation.local and not reservation.released:
            tenant_id = reservation.hold.tenant_id
            self._local_in_flight[tenant_id] -= 1
            if self._local_in_flight[tenant_id] <= 0:
                del self._local_in_flight[tenant_id]
        reservation.released = True
        reservation.store.release(reservation.inner, answered=answered)

    def spend(self, tenant_id: str, tokens: int, usd: float) -> None:
        self.inner.spend(tenant_id, tokens, usd)

    def spent(self, tenant_id: str) -> Spent:
        """What the store last said, with this edge's spend it has not yet acknowledged
        (what outages' requests spent included)."""
        return self.inner.spent(tenant_id)

    def in_flight(self, tenant_id: str) -> int:
        return self.inner.in_flight(tenant_id) + self._local_in_flight[tenant_id]

    async def seed(self, ledger: UsageLedger) -> None:
        """The store's seeding. A store that does not answer starts an outage (the edge
        serves in its failure mode) and raises
        :class:`~dispatcher.errors.StoreUnavailable`: the tenants' driver tries again."""
        try:
            await self.inner.seed(ledger)
        except StoreUnreachable as error:
            self._fail(str(error))
            raise StoreUnavailable(f"{self.name} does not answer: {error}") from error

    # -- beyond the Protocol -----------------------------------------------------------

    @property
    def up(self) -> bool:
        return self._outage is None

    def statistics(self) -> LimitGuardStatistics:
        writes = self.inner.statistics()
        return LimitGuardStatistics(
            store=self.name,
            mode=self.mode,
            up=self._outage is None,
            outages=self._outages,
            refused=self._refused,
            local=self._decided,
            pending=writes.pending,
            parked=writes.parked,
            lost=writes.lost,
        )

    # -- internals ---------------------------------------------------------------------

    def _decide_here(self, hold: Hold) -> Guarded | Refusal:
        outage = self._outage
        assert outage is not None
        limits = hold.limits
        if _limited(limits):
            if self.mode == "refuse":
                outage.refused += 1
                self._refused += 1
                raise LimitStoreUnavailable(_UNAVAILABLE)
            limits, spent = edge_share(limits, self.edge_count, self.inner.spent(hold.tenant_id))
            if _budgeted(limits) and hold.tenant_id not in outage.seeded:
                outage.seeded.add(hold.tenant_id)
                self._seed(outage.local, hold.tenant_id, spent)
            hold = attrs.evolve(hold, limits=limits)
        outage.decided += 1
        self._decided += 1
        decision = outage.local.counters.admit(
            hold, now=outage.local.clock(), wall=outage.local.wall()
        )
        if isinstance(decision, Refusal):
            return decision
        self._local_in_flight[hold.tenant_id] += 1
        return Guarded(decision, outage.local, local=True)

    @staticmethod
    def _seed(local: MemoryLimits, tenant_id: str, spent: Spent) -> None:
        """This edge's share of what the tenant spent, in the outage's own counters: today's
        in the day (and month), the rest of the month's in the month only."""
        wall = local.wall()
        now = local.clock()
        counters = local.counters
        counters.spend(tenant_id, spent.tokens_day, spent.usd_day, now=now, wall=wall)
        earlier_tokens = max(0, spent.tokens_month - spent.tokens_day)
        earlier_usd = max(0.0, spent.usd_month - spent.usd_day)
        if earlier_tokens or earlier_usd:
            start = month_start(wall)
            if periods(start)[0] == periods(wall)[0]:  # the 1st of the month: no earlier day
                start = wall
            counters.spend(tenant_id, earlier_tokens, earlier_usd, now=now, wall=start)

    def _fail(self, reason: str) -> None:
        """The store did not answer an admission: an outage starts, unless one is on."""
        if self._outage is not None:
            return
        now = self.clock()
        self._outage = _Outage(now, reason, MemoryLimits(), next_warning=now + self.warn_every)
        self._outages += 1
        self.inner.suspend()
        self._failed.set()
        if self.mode == "refuse":
            log.warning(
                "%s is not answering (%s): refusing the requests of keys with limits "
                "(503 limit_store_unavailable) until it answers; keys without limits are "
                "served",
                self.name,
                reason,
            )
        else:
            log.warning(
                "%s is not answering (%s): each key's limits are enforced on this edge "
                "alone, divided by edge_count = %d, until it answers (not shared with the "
                "other edges meanwhile)",
                self.name,
                reason,
                self.edge_count,
            )

    def _recovered(self) -> None:
        outage, self._outage = self._outage, None
        self._failed = trio.Event()
        assert outage is not None
        log.info(
            "%s answers again after %.1f s without it: %d requests refused, %d decided on "
            "this edge meanwhile",
            self.name,
            self.clock() - outage.started,
            outage.refused,
            outage.decided,
        )

    def _nag(self) -> None:
        """The WARNING every :attr:`warn_every` seconds of a ``local`` outage."""
        outage = self._outage
        if outage is None or self.mode != "local":
            return
        now = self.clock()
        if now < outage.next_warning:
            return
        outage.next_warning = now + self.warn_every
        log.warning(
            "%s still not answering after %.0f s: limits enforced on this edge alone "
            "(divided by edge_count = %d); %d requests decided here so far",
            self.name,
            now - outage.started,
            self.edge_count,
            outage.decided,
        )

    async def _probe(self) -> bool:
        """Whether the store answers again and has written what was parked."""
        answered = False
        with trio.move_on_after(self.answer_within):
            try:
                await self.inner.ping()
            except StoreUnreachable:
                return False
            answered = True
        if not answered:
            return False
        self.inner.resume()
        with trio.move_on_after(RECOVERY_DRAIN):
            await self.inner.flush()
            return True
        self.inner.suspend()  # writing the backlog took too long: still failing
        return False

    async def _watch(self) -> None:
        """The prober: during an outage, probes the store until it answers."""
        while True:
            await self._failed.wait()
            while self._outage is not None:
                await trio.sleep(self.probe_every)
                self._nag()
                if await self._probe():
                    self._recovered()


@asynccontextmanager
async def open_guarded_limits(
    inner: SharedLimitStore,
    name: str,
    *,
    mode: Mode = "refuse",
    edge_count: int = 1,
    answer_within: float = 0.5,
    probe_every: float = PROBE_EVERY,
    warn_every: float = WARN_EVERY,
) -> AsyncIterator[GuardedLimits]:
    """``inner`` with the failure mode ``mode``, its prober running until the block is
    left."""
    if edge_count < 1:
        raise ValueError(f"edge_count must be at least 1, got {edge_count}")
    guard = GuardedLimits(inner, name, mode, edge_count, answer_within, probe_every, warn_every)
    inner.on_unreachable = guard._fail  # a write that finds the store down starts an outage
    inner.admit_bounded_by = answer_within  # GuardedLimits.admit's move_on_after
    async with trio.open_nursery() as nursery:
        nursery.start_soon(guard._watch)
        try:
            yield guard
        finally:
            inner.on_unreachable = None
            inner.admit_bounded_by = None
            nursery.cancel_scope.cancel(reason="limit store closed")
