"""Fair queueing for the admission core: shares, tenants' virtual time, lanes.

Sans-IO bookkeeping the core (:mod:`._core`) drives; nothing here knows candidates or
slots. The rule (see "Fairness" in ``docs/admission.md``): among the waiters that could use
a freed slot, the highest priority band first; within a band, the tenant with the smallest
*virtual start* (start-time fair queueing: each admission from the queue advances its
tenant's start by ``1 / weight``); FIFO within a tenant.

* :class:`Tenants` (one per model group) keeps the virtual start of each (band, tenant) with
  queued waiters. A tenant that has none is forgotten; when it queues again it starts at the
  *floor*: the smallest start among the band's tenants queued where it joins (the same
  class and capabilities: those it competes with), else among all the band's tenants. So it
  banks no credit while idle, and a tenant stuck elsewhere (waiting for a rare capability or
  a long-context slot) does not drag a newcomer's start down.
* :class:`Lanes` (one per queue key of the core: class, requeued?, capability mask) holds a
  FIFO deque per tenant and a heap of those lanes by ``(-priority, virtual start, arrival of
  the head)``. Keys only grow (a start only advances, a head only moves back), so the heap
  keeps one entry per lane and fixes a stale one lazily when it surfaces: O(log lanes) per
  decision, amortized.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Final, Generic, Protocol, TypeAlias, TypeVar

import attrs

_COMPACT_MIN: Final = 256


def _positive_weight(_instance: object, _attribute: object, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"a share's weight must be a finite number > 0, not {value!r}")


@attrs.frozen
class Share:
    """Whose request this is, for fair queueing: ``tenant`` (any string; one tenant per API
    key, say), ``priority`` (a higher band is always served first) and ``weight`` (within a
    band, a backlogged tenant's share of the admissions is proportional to it; > 0)."""

    tenant: str = ""
    priority: int = 0
    weight: float = attrs.field(default=1.0, validator=_positive_weight)


DEFAULT_SHARE: Final = Share()
"""Everyone is one tenant of one band: plain FIFO."""

LaneKey: TypeAlias = tuple[int, float, int]
"""A waiter's place among the waiters of one queue: (-priority, tenant's start, arrival)."""


class Queued(Protocol):
    """What a lane needs of a waiter: its arrival number and whether it still waits."""

    @property
    def seq(self) -> int: ...

    @property
    def live(self) -> bool: ...


W = TypeVar("W", bound=Queued)


@attrs.define(eq=False)
class Tenant:
    """The fair-queueing state of one tenant in one band of a group (while it has queued
    waiters there)."""

    name: str
    priority: int
    start: float = 0.0
    """Virtual start of its next admission from the queue."""
    queued: int = 0
    uid: int = 0


REQUEUED: Final = Tenant(name="", priority=0)
"""The one lane of the requeued waiters of a queue (FIFO whatever their share; never
charged: a recovery's first admission was)."""


@attrs.define(eq=False)
class Starts:
    """A set of tenants, the smallest virtual start first: a heap with one entry per member,
    fixed lazily when it surfaces (starts only grow); a member that leaves leaves a stale
    entry behind, dropped when it surfaces or at compaction."""

    members: dict[Tenant, int] = attrs.Factory(dict)
    """Member -> the sequence number of its live entry."""
    heap: list[tuple[float, int, Tenant]] = attrs.Factory(list)
    stale: int = 0
    _seqs: Iterator[int] = attrs.Factory(itertools.count)

    def add(self, tenant: Tenant) -> None:
        seq = self.members[tenant] = next(self._seqs)
        heapq.heappush(self.heap, (tenant.start, seq, tenant))

    def discard(self, tenant: Tenant) -> None:
        del self.members[tenant]
        self.stale += 1
        if self.stale > _COMPACT_MIN and self.stale > len(self.members):
            self.heap = [(t.start, seq, t) for t, seq in self.members.items()]
            heapq.heapify(self.heap)
            self.stale = 0

    def least(self) -> float | None:
        """The smallest start among the members (None when there is none)."""
        heap = self.heap
        while heap:
            start, seq, tenant = heap[0]
            if self.members.get(tenant) != seq:
                heapq.heappop(heap)
                self.stale -= 1
            elif start != tenant.start:
                heapq.heapreplace(heap, (tenant.start, seq, tenant))
            else:
                return start
        return None


@attrs.define(eq=False)
class _Band:
    tenants: dict[str, Tenant] = attrs.Factory(dict)
    starts: Starts = attrs.Factory(Starts)


@attrs.define(eq=False)
class Tenants:
    """The virtual starts of one group's queued tenants, per priority band."""

    bands: dict[int, _Band] = attrs.Factory(dict)
    _uids: Iterator[int] = attrs.Factory(itertools.count)

    def enter(self, share: Share, floor: Callable[[], float | None]) -> Tenant:
        """A waiter of ``share`` is queued: its tenant's record. A tenant that had no queued
        waiter in the band is made at ``floor()`` (the smallest start among the band's
        tenants in the queue the waiter joins), or, if that is None, at the smallest start
        among all the band's tenants (0 when there is none)."""
        band = self.bands.get(share.priority)
        if band is None:
            band = self.bands[share.priority] = _Band()
        tenant = band.tenants.get(share.tenant)
        if tenant is None:
            start = floor()
            if start is None:
                start = band.starts.least() or 0.0
            tenant = Tenant(share.tenant, share.priority, start, uid=next(self._uids))
            band.tenants[share.tenant] = tenant
            band.starts.add(tenant)
        tenant.queued += 1
        return tenant

    def leave(self, tenant: Tenant) -> None:
        """A waiter of ``tenant`` left the queue (admitted, cancelled, rejected)."""
        tenant.queued -= 1
        if tenant.queued:
            return
        band = self.bands[tenant.priority]
        del band.tenants[tenant.name]
        if band.tenants:
            band.starts.discard(tenant)
        else:
            del self.bands[tenant.priority]

    @staticmethod
    def charge(tenant: Tenant, weight: float) -> None:
        """``tenant`` won a slot from the queue with a request of ``weight``."""
        tenant.start += 1.0 / weight


@attrs.define(eq=False)
class Lane(Generic[W]):
    """One tenant's waiters in one queue, in arrival order (ended ones dropped lazily)."""

    tenant: Tenant
    uid: int
    waiters: deque[W] = attrs.Factory(deque)
    live: int = 0

    def key(self, waiter: W) -> LaneKey:
        return (-self.tenant.priority, self.tenant.start, waiter.seq)


_Entry: TypeAlias = tuple[int, float, int, int, Lane[W]]


@attrs.define(eq=False)
class Lanes(Generic[W]):
    """The waiters of one queue key: a lane per tenant, a heap of lanes by their head's
    :data:`LaneKey` (one entry per lane, fixed lazily: keys only grow)."""

    lanes: dict[Tenant, Lane[W]] = attrs.Factory(dict)
    heap: list[_Entry[W]] = attrs.Factory(list)
    starts: dict[int, Starts] = attrs.Factory(dict)
    """Per priority band, the tenants with a lane here (for :meth:`floor`)."""
    live: int = 0
    """Queued waiters (the ended ones still in lanes are ``garbage``)."""
    garbage: int = 0
    stale: int = 0
    """Heap entries of dropped lanes."""
    _uids: Iterator[int] = attrs.Factory(itertools.count)

    def append(self, waiter: W, tenant: Tenant) -> Lane[W]:
        lane = self.lanes.get(tenant)
        if lane is None:
            lane = self.lanes[tenant] = Lane(tenant, next(self._uids))
            heapq.heappush(self.heap, (*lane.key(waiter), lane.uid, lane))
            starts = self.starts.get(tenant.priority)
            if starts is None:
                starts = self.starts[tenant.priority] = Starts()
            starts.add(tenant)
        lane.waiters.append(waiter)
        lane.live += 1
        self.live += 1
        return lane

    def remove(self, lane: Lane[W]) -> None:
        """A waiter of ``lane`` ended (it is marked so; it leaves the deque lazily). A lane
        left with no live waiter is dropped at once, so a lane's tenant record is always
        the current one."""
        lane.live -= 1
        self.live -= 1
        self.garbage += 1
        if not lane.live:
            tenant = lane.tenant
            del self.lanes[tenant]
            self.garbage -= len(lane.waiters)
            starts = self.starts[tenant.priority]
            if len(starts.members) > 1:
                starts.discard(tenant)
            else:
                del self.starts[tenant.priority]
            self.stale += 1
            if self.stale > _COMPACT_MIN and self.stale > len(self.lanes):
                self.heap = [self._entry(kept) for kept in self.lanes.values()]
                heapq.heapify(self.heap)
                self.stale = 0
        elif self.garbage > _COMPACT_MIN and self.garbage > self.live:
            for kept in self.lanes.values():
                kept.waiters = deque(w for w in kept.waiters if w.live)
            self.garbage = 0

    def floor(self, priority: int) -> float | None:
        """The smallest start among the tenants of band ``priority`` with a lane here."""
        starts = self.starts.get(priority)
        return starts.least() if starts is not None else None

    def waiters(self) -> Iterator[W]:
        """Every live waiter (in no particular order across lanes)."""
        for lane in self.lanes.values():
            yield from (w for w in lane.waiters if w.live)

    def first(self, fits: Callable[[W], bool], bound: LaneKey | None) -> W | None:
        """The first waiter in :data:`LaneKey` order that ``fits`` (and is before ``bound``,
        if given). O(log lanes) when the first lane's head fits; otherwise lanes are
        visited in key order until none can hold an earlier fit."""
        heap = self.heap
        best: W | None = None
        visited: list[_Entry[W]] = []
        try:
            while heap:
                entry = heap[0]
                lane = entry[4]
                if self.lanes.get(lane.tenant) is not lane:
                    heapq.heappop(heap)
                    self.stale -= 1
                    continue
                fresh = self._entry(lane)
                if fresh[:3] != entry[:3]:
                    heapq.heapreplace(heap, fresh)
                    if heap[0] is not fresh:
                        continue
                if bound is not None and fresh[:3] >= bound:
                    break
                for waiter in lane.waiters:
                    if not waiter.live:
                        continue
                    key = lane.key(waiter)
                    if bound is not None and key >= bound:
                        break
                    if fits(waiter):
                        best, bound = waiter, key
                        break
                if best is not None and not visited and best is lane.waiters[0]:
                    return best  # the common case: the first lane's head
                visited.append(heapq.heappop(heap))
        finally:
            for entry in visited:
                heapq.heappush(heap, entry)
        return best

    def _entry(self, lane: Lane[W]) -> _Entry[W]:
        """``lane``'s heap entry as of now, after dropping its ended heads."""
        waiters = lane.waiters
        while not waiters[0].live:
            waiters.popleft()
            self.garbage -= 1
        return (*lane.key(waiters[0]), lane.uid, lane)
