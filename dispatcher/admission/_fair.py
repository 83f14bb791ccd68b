"""Fair queueing for the admission core: shares, flows' virtual time, lanes.

Sans-IO bookkeeping the core (:mod:`._core`) drives; nothing here knows candidates or
slots. The rule (see "Fairness" in ``docs/admission.md``): among the waiters that could use
a freed slot, the highest priority band first; within a band, the tenant with the smallest
*virtual start* (start-time fair queueing: each admission from the queue advances its
tenant's start by ``1 / weight``); FIFO within a tenant. A (band, tenant) of a group is a
*flow* (:class:`Flow`), fair queueing's word; the tenant is ``Share.tenant``, any string
(not the tenants of ``dispatcher.tenants``: the API layer sets it from the caller's key).

* :class:`Flows` (one per model group) keeps the virtual start of each flow with queued
  waiters. A flow that has none is forgotten; when its tenant queues again in the band it
  starts at the *floor*: the smallest start among the band's flows queued where it joins
  (the same class and capabilities: those it competes with), else among all the band's
  flows. So it banks no credit while idle, and a flow stuck elsewhere (waiting for a rare
  capability or a long-context slot) does not drag a newcomer's start down.
* :class:`Lanes` (one per queue key of the core: class, requeued?, capability mask) holds a
  FIFO deque per flow and a heap of those lanes by ``(-priority, virtual start, arrival of
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
"""A waiter's place among the waiters of one queue: (-priority, flow's start, arrival)."""


class Queued(Protocol):
    """What a lane needs of a waiter: its arrival number and whether it still waits."""

    @property
    def seq(self) -> int: ...

    @property
    def live(self) -> bool: ...


_W = TypeVar("_W", bound=Queued)


@attrs.define(eq=False)
class Flow:
    """A *flow*, in fair-queueing terms: the first-time waiters of one tenant in one priority
    band of a group, with their virtual start (the record lives while the flow has waiters
    queued)."""

    tenant: str
    """``Share.tenant`` of its waiters."""
    priority: int
    start: float = 0.0
    """Virtual start of its next admission from the queue."""
    queued: int = 0
    uid: int = 0


REQUEUED: Final = Flow(tenant="", priority=0)
"""The flow of every requeued waiter: one lane per queue (FIFO whatever their share; never
charged: a recovery's first admission was)."""


@attrs.define(eq=False)
class Starts:
    """A set of flows, the smallest virtual start first: a heap with one entry per member,
    fixed lazily when it surfaces (starts only grow); a member that leaves leaves a stale
    entry behind, dropped when it surfaces or at compaction."""

    members: dict[Flow, int] = attrs.Factory(dict)
    """Member -> the sequence number of its live entry."""
    heap: list[tuple[float, int, Flow]] = attrs.Factory(list)
    stale: int = 0
    _seqs: Iterator[int] = attrs.Factory(itertools.count)

    def add(self, flow: Flow) -> None:
        seq = self.members[flow] = next(self._seqs)
        heapq.heappush(self.heap, (flow.start, seq, flow))

    def discard(self, flow: Flow) -> None:
        del self.members[flow]
        self.stale += 1
        if self.stale > _COMPACT_MIN and self.stale > len(self.members):
            self.heap = [(t.start, seq, t) for t, seq in self.members.items()]
            heapq.heapify(self.heap)
            self.stale = 0

    def least(self) -> float | None:
        """The smallest start among the members (None when there is none)."""
        heap = self.heap
        while heap:
            start, seq, flow = heap[0]
            if self.members.get(flow) != seq:
                heapq.heappop(heap)
                self.stale -= 1
            elif start != flow.start:
                heapq.heapreplace(heap, (flow.start, seq, flow))
            else:
                return start
        return None


@attrs.define(eq=False)
class _Band:
    flows: dict[str, Flow] = attrs.Factory(dict)
    starts: Starts = attrs.Factory(Starts)


@attrs.define(eq=False)
class Flows:
    """One group's flows with waiters queued, per priority band: their virtual starts."""

    bands: dict[int, _Band] = attrs.Factory(dict)
    _uids: Iterator[int] = attrs.Factory(itertools.count)

    def enter(self, share: Share, floor: Callable[[], float | None]) -> Flow:
        """A waiter of ``share`` is queued: its flow. A new one (its tenant had no waiter
        queued in the band) is made at ``floor()`` (the smallest start among the band's
        flows in the queue the waiter joins), or, if that is None, at the smallest start
        among all the band's flows (0 when there is none)."""
        band = self.bands.get(share.priority)
        if band is None:
            band = self.bands[share.priority] = _Band()
        flow = band.flows.get(share.tenant)
        if flow is None:
            start = floor()
            if start is None:
                start = band.starts.least() or 0.0
            flow = Flow(share.tenant, share.priority, start, uid=next(self._uids))
            band.flows[share.tenant] = flow
            band.starts.add(flow)
        flow.queued += 1
        return flow

    def leave(self, flow: Flow) -> None:
        """A waiter of ``flow`` left the queue (admitted, cancelled, rejected)."""
        flow.queued -= 1
        if flow.queued:
            return
        band = self.bands[flow.priority]
        del band.flows[flow.tenant]
        if band.flows:
            band.starts.discard(flow)
        else:
            del self.bands[flow.priority]

    @staticmethod
    def charge(flow: Flow, weight: float) -> None:
        """``flow`` won a slot from the queue with a request of ``weight``."""
        flow.start += 1.0 / weight


@attrs.define(eq=False)
class Lane(Generic[_W]):
    """One flow's waiters in one queue, in arrival order (ended ones dropped lazily)."""

    flow: Flow
    uid: int
    waiters: deque[_W] = attrs.Factory(deque)
    live: int = 0

    def key(self, waiter: _W) -> LaneKey:
        return (-self.flow.priority, self.flow.start, waiter.seq)


_Entry: TypeAlias = tuple[int, float, int, int, Lane[_W]]


@attrs.define(eq=False)
class Lanes(Generic[_W]):
    """The waiters of one queue key: a lane per flow, a heap of lanes by their head's
    :data:`LaneKey` (one entry per lane, fixed lazily: keys only grow)."""

    lanes: dict[Flow, Lane[_W]] = attrs.Factory(dict)
    heap: list[_Entry[_W]] = attrs.Factory(list)
    starts: dict[int, Starts] = attrs.Factory(dict)
    """Per priority band, the flows with a lane here (for :meth:`floor`)."""
    live: int = 0
    """Queued waiters (the ended ones still in lanes are ``garbage``)."""
    garbage: int = 0
    stale: int = 0
    """Heap entries of dropped lanes."""
    _uids: Iterator[int] = attrs.Factory(itertools.count)

    def append(self, waiter: _W, flow: Flow) -> Lane[_W]:
        lane = self.lanes.get(flow)
        if lane is None:
            lane = self.lanes[flow] = Lane(flow, next(self._uids))
            heapq.heappush(self.heap, (*lane.key(waiter), lane.uid, lane))
            starts = self.starts.get(flow.priority)
            if starts is None:
                starts = self.starts[flow.priority] = Starts()
            starts.add(flow)
        lane.waiters.append(waiter)
        lane.live += 1
        self.live += 1
        return lane

    def remove(self, lane: Lane[_W]) -> None:
        """A waiter of ``lane`` ended (it is marked so; it leaves the deque lazily). A lane
        left with no live waiter is dropped at once, so a lane's flow is always the current
        record."""
        lane.live -= 1
        self.live -= 1
        self.garbage += 1
        if not lane.live:
            flow = lane.flow
            del self.lanes[flow]
            self.garbage -= len(lane.waiters)
            starts = self.starts[flow.priority]
            if len(starts.members) > 1:
                starts.discard(flow)
            else:
                del self.starts[flow.priority]
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
        """The smallest start among the flows of band ``priority`` with a lane here."""
        starts = self.starts.get(priority)
        return starts.least() if starts is not None else None

    def waiters(self) -> Iterator[_W]:
        """Every live waiter (in no particular order across lanes)."""
        for lane in self.lanes.values():
            yield from (w for w in lane.waiters if w.live)

    def first(self, fits: Callable[[_W], bool], bound: LaneKey | None) -> _W | None:
        """The first waiter in :data:`LaneKey` order that ``fits`` (and is before ``bound``,
        if given). O(log lanes) when the first lane's head fits; otherwise lanes are
        visited in key order until none can hold an earlier fit."""
        heap = self.heap
        best: _W | None = None
        visited: list[_Entry[_W]] = []
        try:
            while heap:
                entry = heap[0]
                lane = entry[4]
                if self.lanes.get(lane.flow) is not lane:
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

    def _entry(self, lane: Lane[_W]) -> _Entry[_W]:
        """``lane``'s heap entry as of now, after dropping its ended heads."""
        waiters = lane.waiters
        while not waiters[0].live:
            waiters.popleft()
            self.garbage -= 1
        return (*lane.key(waiters[0]), lane.uid, lane)
