"""Failure-aware selection's health: a sans-IO sub-machine the core drives.

It keeps the health of each candidate *identity* (node, provider, model; no generation, so
it survives reconnects) and makes its transitions; it never waits, sleeps or reads a clock
(the core passes ``now``). An identity is *healthy*, *ejected* (after
``eject_after_failures`` consecutive failures, for a cool-down) or *probing* (the
cool-down ended: one request at a time). Which waiter may use which candidate given that
health (the fallback onto ejected candidates, the one probe in flight) is the core's
(:mod:`._core`); nothing here knows waiters, queues or groups.

The interface: :class:`HealthTable` makes every change of an :class:`IdentityHealth`'s
``state`` (:meth:`~HealthTable.fail`, :meth:`~HealthTable.succeed`,
:meth:`~HealthTable.end_cooldown`, :meth:`~HealthTable.set_policy`) and keeps its records
(:meth:`~HealthTable.join`, :meth:`~HealthTable.left`, :meth:`~HealthTable.remember`); the
core reads ``state``, ``ejected_until`` and the counters to select and to report, sets the
two fields that name its own objects (``live``, the joined candidate; ``probe``, the slot of
a probing identity's one request), and acts on what a transition means for its waiters (an
ejection: re-resolve the group; a recovery or a cool-down's end: admit waiters).

* cool-down ends live in a heap with lazy deletion (and compaction);
  :attr:`HealthTable.unhealthy` counts the identities ejected or probing: while it is 0 the
  core skips every health check.

Bounded memory (nodes are not trusted: one may announce hundreds of new model names at each
reconnect):

* an identity's health outlives its node session only while there is something to remember,
  and at most :data:`HEALTH_MEMORY` departed identities are remembered (the longest gone is
  forgotten first);
* the table of records is rebuilt when it shrank to a quarter of its peak (Python dicts
  never shrink by themselves), amortized O(1) per removal.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Final, Generic, Literal, TypeAlias, TypeVar

import attrs

from ._candidates import CandidateIdentity
from ._policy import Policy, PolicySnapshot

HealthState: TypeAlias = Literal["healthy", "ejected", "probing"]

HEALTH_STATES: Final[tuple[HealthState, ...]] = ("healthy", "ejected", "probing")
HEALTH_MEMORY: Final = 10_000
"""Departed identities (no joined candidate) whose health the core remembers; beyond that
the one that left first is forgotten (it comes back healthy)."""

_COMPACT_MIN: Final = 256
_SHRINK_MIN: Final = 8
"""The table is rebuilt when it shrank to a quarter of a peak above this."""

_L = TypeVar("_L")
"""What the core links a record to while its identity is joined (its candidate's state)."""


@attrs.define(eq=False)
class IdentityHealth(Generic[_L]):
    """The health of one candidate identity, shared by its generations."""

    identity: CandidateIdentity
    state: HealthState = "healthy"
    failures: int = 0
    """Consecutive failures since the last success."""
    ejections: int = 0
    """Ejections in a row without a success: the cool-down level."""
    ejected_until: float | None = None
    heap_seq: int = -1
    """The sequence number of its live entry in the cool-down heap (while ejected)."""
    probe: int | None = None
    """The slot of the one request a probing candidate took (the core's to set)."""
    live: _L | None = None
    """The candidate of the node's current session, if it is joined (the core's to set)."""
    ejections_total: int = 0
    """Every ejection since this record was made (for metrics; not part of ``pristine``)."""

    @property
    def pristine(self) -> bool:
        """Nothing to remember: healthy, no failures, no candidate."""
        return (
            self.state == "healthy"
            and self.failures == 0
            and self.ejections == 0
            and self.live is None
        )


_Cooldown: TypeAlias = tuple[float, int, IdentityHealth[_L]]


class HealthTable(Generic[_L]):
    """The health of every identity the core tracks: the transitions, the cool-downs, and
    the bounded memory of departed identities. See the module docstring."""

    def __init__(self) -> None:
        self._records: dict[CandidateIdentity, IdentityHealth[_L]] = {}
        self._peak = 0
        self._away: OrderedDict[CandidateIdentity, None] = OrderedDict()
        """The identities of ``_records`` with no joined candidate, in the order they left."""
        self._cooldowns: list[_Cooldown[_L]] = []
        self._cooldowns_dead = 0
        self._cooldown_seq = itertools.count()
        self.ejections = 0
        """Ejections since the start (each cool-down counts once)."""
        self.unhealthy = 0
        """Identities ejected or probing: while 0, selection skips every health check."""

    def get(self, identity: CandidateIdentity) -> IdentityHealth[_L] | None:
        return self._records.get(identity)

    # ------------------------------------------------------------------ records

    def join(self, identity: CandidateIdentity) -> IdentityHealth[_L]:
        """``identity`` has a joined candidate now (the core links it as ``live``): its
        record, taken back from the departed ones or made healthy."""
        health = self._records.get(identity)
        if health is None:
            health = self._new(identity)
        else:
            self._away.pop(identity, None)
        return health

    def left(self, health: IdentityHealth[_L]) -> None:
        """``health`` has no joined candidate any more (the core unlinked ``live``)."""
        if health.pristine:
            self._forget(health)
        else:
            self._depart(health)

    def remember(self, identity: CandidateIdentity) -> IdentityHealth[_L]:
        """A new record for ``identity``, which has no joined candidate (a failure reported
        after its node left), remembered among the departed."""
        health = self._new(identity)
        self._depart(health)
        return health

    def _new(self, identity: CandidateIdentity) -> IdentityHealth[_L]:
        health = self._records[identity] = IdentityHealth(identity)
        self._peak = max(self._peak, len(self._records))
        return health

    def _depart(self, health: IdentityHealth[_L]) -> None:
        """``health`` has no joined candidate now: remember it among the last HEALTH_MEMORY
        departed identities."""
        away = self._away
        away[health.identity] = None
        if len(away) > HEALTH_MEMORY:
            oldest, _ = away.popitem(last=False)
            self._forget(self._records[oldest])

    def _forget(self, health: IdentityHealth[_L]) -> None:
        """Drop the health of an identity that has no joined candidate."""
        if health.state != "healthy":
            self._reset(health)  # its cool-down entry goes stale
        identity = health.identity
        del self._records[identity]
        self._away.pop(identity, None)
        if self._peak > _SHRINK_MIN and len(self._records) * 4 < self._peak:
            self._records = dict(self._records)
            self._peak = len(self._records)

    # ------------------------------------------------------------------ transitions

    def fail(self, health: IdentityHealth[_L], now: float, policy: Policy) -> bool:
        """An attempt failed for a reason that is the candidate's (the core checked that
        ``policy`` ejects at all): count it, and eject a healthy identity at
        ``eject_after_failures`` consecutive ones, a probing one at once (with the next
        longer cool-down). Returns whether it ejected ``health``."""
        health.failures += 1
        if health.state == "probing" or (
            health.state == "healthy" and health.failures >= policy.eject_after_failures
        ):
            self._eject(health, now, policy)
            return True
        return False

    def succeed(self, health: IdentityHealth[_L]) -> HealthState:
        """An attempt worked: healthy again, whatever the state (failures and cool-down level
        back to 0; a record left with nothing to remember is forgotten). Returns the state
        before."""
        before = health.state
        self._reset(health)
        if health.pristine:
            self._forget(health)
        return before

    def set_policy(self, policy: PolicySnapshot) -> None:
        """Identities of a group whose policy no longer ejects are healthy; records left with
        nothing to remember are forgotten."""
        for health in self._records.values():
            if policy.policy_for(health.identity.model).eject_after_failures == 0:
                self._reset(health)
        for health in [h for h in self._records.values() if h.pristine]:
            self._forget(health)

    def next_cooldown(self) -> float | None:
        """When the first running cool-down ends, or None."""
        heap = self._cooldowns
        while heap:
            if self._cooldown_live(heap[0]):
                return heap[0][0]
            heapq.heappop(heap)
            self._cooldowns_dead = max(0, self._cooldowns_dead - 1)
        return None

    def end_cooldown(self) -> IdentityHealth[_L]:
        """The first cool-down ended (call it once :meth:`next_cooldown` is due): its
        identity is probing. Returns it."""
        _, _, health = heapq.heappop(self._cooldowns)
        health.state = "probing"
        health.ejected_until = None
        return health

    def _eject(self, health: IdentityHealth[_L], now: float, policy: Policy) -> None:
        if health.state == "healthy":
            self.unhealthy += 1
        health.ejections += 1
        health.state = "ejected"
        health.probe = None
        until = now + policy.cool_down(health.ejections)
        health.ejected_until = until
        health.heap_seq = next(self._cooldown_seq)
        heapq.heappush(self._cooldowns, (until, health.heap_seq, health))
        self.ejections += 1
        health.ejections_total += 1

    def _reset(self, health: IdentityHealth[_L]) -> None:
        """Healthy, no failures, cool-down level 0 (its heap entry, if any, goes stale)."""
        was_ejected = health.state == "ejected"
        if health.state != "healthy":
            self.unhealthy -= 1
        health.state = "healthy"
        health.failures = 0
        health.ejections = 0
        health.ejected_until = None
        health.probe = None
        if was_ejected:
            self._cooldowns_dead += 1
            heap = self._cooldowns
            if self._cooldowns_dead > _COMPACT_MIN and self._cooldowns_dead * 2 > len(heap):
                self._cooldowns = [entry for entry in heap if self._cooldown_live(entry)]
                heapq.heapify(self._cooldowns)
                self._cooldowns_dead = 0

    @staticmethod
    def _cooldown_live(entry: _Cooldown[_L]) -> bool:
        _, seq, health = entry
        return health.state == "ejected" and health.heap_seq == seq
