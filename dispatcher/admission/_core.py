"""The admission core: a synchronous, sans-IO state machine.

It decides which waiter gets which slot on which candidate; it never waits, sleeps or reads
a clock. Every input carries ``now`` (seconds, any monotonic origin) and returns the list of
:data:`Decision` it produced, in order. The Trio layer (:mod:`._queue`) carries them out.

Inputs: :meth:`AdmissionCore.submit`, ``cancel``, ``release``, ``begin_drain``,
``confirm_drain``, ``node_joined``, ``node_left``, ``capacity_changed``, ``set_policy``,
``report_success``, ``report_failure``, ``tick``. Every input first expires what is due at
``now`` (queue timeouts, drain deadlines, ends of cool-downs), so a waiter is never admitted
at or after its deadline.

Failure-aware selection: each candidate identity is *healthy*, *ejected* or *probing*; that
health and its transitions are a sub-machine of their own (:mod:`._health`), which the core
feeds with the reports and the ends of cool-downs. What health means for the slots is the
core's: a waiter uses an ejected candidate only when none of the candidates that can serve
it is healthy or probing (the fallback: a group is never stranded by its own ejections),
and a probing candidate takes one request at a time.

Data layout (what keeps an operation O(1) in the common case, whatever the queue length):

* per group, one queue per (class, requeued?, needed-capability bitmask): at most 16 per
  class. A freed slot on candidate ``c`` only looks at the queues whose capabilities ``c``
  has, and takes the first waiter in queue order among their heads; a waiter is skipped
  only when something rarer fails (context window, predicate, exclusion).
* queue order (fair queueing, :mod:`._fair`): requeued waiters first, FIFO; then by
  priority band, highest first; within a band, the tenant with the smallest virtual start
  (each admission from the queue advances it by ``1 / weight``; a tenant with nothing
  queued is forgotten and re-enters at the smallest start of the band's tenants queued
  where it joins); FIFO within a tenant. A (band, tenant) is a *flow*.
  So a queue is a FIFO *lane* per flow and a heap of lanes by
  ``(-priority, start, head's arrival)``, fixed lazily (keys only grow): O(log lanes) per
  decision. With the default share (one tenant, one band) it is exactly FIFO.
* ended waiters (cancelled, admitted from the middle, timed out) are marked and dropped
  lazily from lane heads; a lane with no live waiter is dropped at once; a queue's lanes
  are compacted when the garbage outgrows the live entries.
* queue deadlines and drain deadlines live in heaps with lazy deletion (and compaction),
  as do the ends of cool-downs in :mod:`._health`.
* a queued waiter carries a *fallback* flag: set when none of its capable candidates may be
  healthy or probing (it is exact after every event that could make it true, and may be
  stale-true afterwards: it is checked again before use). Each queue counts its flagged
  waiters, so a freed slot on an ejected candidate skips every queue without one.
* invariant: no queued waiter could use a candidate that has a free slot in its class (with
  health taken into account: an ejected candidate only for a fallback waiter, a probing one
  only while its probe is not in flight; a waiter in its affinity hold only its preferred
  candidate). So a release only has to look for waiters when it turned a full candidate
  free (or ended a probe).
* affinity (see "Affinity" in ``docs/admission.md``): a keyed waiter of a group with
  affinity on ranks the group's candidates by rendezvous hashing (:mod:`._affinity`), after
  the candidate that last served its key when it was submitted (its *placement*, at most
  PLACEMENT_MEMORY keys remembered), and takes the first with room within the bounded
  load; while its *hold* lasts (``submitted + affinity_wait_s``, a deadline in its own
  heap) and its first-ranked candidate has no room, it can use that one only, and blocks
  nobody behind it. An input that may change a held waiter's preferred candidate (a node
  leaving or re-announcing, an ejection, a capacity change) refills every candidate of the
  group while some waiter holds; a placement made meanwhile does not change it (the
  waiter keeps the one of its submit).

Bounded memory (nodes are not trusted: one may announce hundreds of new model names at each
reconnect):

* invariant: a group exists only while it has a candidate, a queued waiter, or the policy
  names it. The input that takes its last candidate or waiter away drops it (O(1) per
  group it touched); ``set_policy`` drops the ones it no longer names.
* at most :data:`NODE_MEMORY` departed nodes are remembered (the one that left first is
  forgotten first); departed identities' health is bounded by :mod:`._health`
  (``HEALTH_MEMORY``).
* a table that shrank to a quarter of its peak is rebuilt (Python dicts never shrink by
  themselves), amortized O(1) per removal.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Literal, TypeAlias, TypeVar

import attrs

from ._affinity import AFFINITY_RESULTS, AffinityResult, identity_seed, key_hash, preference
from ._candidates import (
    CAPABILITIES,
    Candidate,
    CandidateKey,
    Needs,
    RequestClass,
)
from ._fair import (
    DEFAULT_SHARE,
    REQUEUED,
    Flow,
    Flows,
    Lane,
    Lanes,
    Share,
)
from ._health import HealthState, HealthTable, IdentityHealth
from ._policy import Policy, PolicySnapshot

WaiterId: TypeAlias = int | str
SlotId: TypeAlias = int
AdmitReason: TypeAlias = Literal["immediate", "queued", "requeued"]
RejectCause: TypeAlias = Literal[
    "queue_full", "timeout", "no_capable_candidate", "unknown_model", "model_unavailable"
]

ADMIT_REASONS: Final[tuple[AdmitReason, ...]] = ("immediate", "queued", "requeued")
REJECT_CAUSES: Final[tuple[RejectCause, ...]] = (
    "queue_full",
    "timeout",
    "no_capable_candidate",
    "unknown_model",
    "model_unavailable",
)
SESSION_MEMORY: Final = 10_000
"""Sessions whose last node the core remembers (least recently used ones are forgotten)."""
NODE_MEMORY: Final = 10_000
"""Departed nodes whose newest generation the core remembers (to ignore their stale
announcements); beyond that the one that left first is forgotten."""
PLACEMENT_MEMORY: Final = 100_000
"""Affinity keys whose placement (the candidate that last served the key) the core
remembers, per group and key (least recently placed ones are forgotten: a forgotten key
goes by its ranking again)."""
MODEL_MEMORY: Final = 10_000
"""Dropped groups whose last candidate's departure the core remembers (a request for one
within ``model_linger_s`` is ``model_unavailable``, not ``unknown_model``); beyond that the
one dropped first is forgotten, as is any older than the linger."""


@attrs.frozen(kw_only=True)
class Admit:
    """``waiter_id`` holds ``slot_id`` on ``candidate`` from now on. ``queued_for`` is the
    time it waited (0 when admitted at submit)."""

    waiter_id: WaiterId
    slot_id: SlotId
    candidate: Candidate
    reason: AdmitReason
    queued_for: float
    request_class: RequestClass = "short"


@attrs.frozen(kw_only=True)
class Reject:
    """``waiter_id`` ended without a slot. ``reasons`` names why each candidate could not
    serve it (``no_capable_candidate`` only)."""

    waiter_id: WaiterId
    cause: RejectCause
    message: str
    retry_after: float | None = None
    reasons: tuple[str, ...] = ()
    only_excluded: bool = False
    """``no_capable_candidate`` only: every candidate was refused because the request
    excluded it (each already failed for this request), none for what the request needs."""


Decision: TypeAlias = Admit | Reject


@attrs.frozen(kw_only=True)
class CandidateStatistics:
    """``total``: effective slots (after ``per_candidate_cap``); ``long_total``: how many of
    them long requests may hold (0 when the group has no classes). ``in_use`` and
    ``draining`` count both classes; ``long_*`` the long ones among them.

    The health fields, from ``health`` on, are of the candidate's identity, so they carry
    over a reconnect."""

    total: int
    in_use: int
    draining: int
    long_total: int
    long_in_use: int
    long_draining: int
    health: HealthState = "healthy"
    consecutive_failures: int = 0
    """Failures since the last success."""
    ejections: int = 0
    """Ejections in a row without a success (the cool-down level)."""
    ejected_until: float | None = None
    """While ejected, when the ejection ends (same clock as the inputs' ``now``); else None."""
    probe_in_flight: bool = False
    """Probing, with its one request admitted."""
    ejections_total: int = 0
    """Every ejection of the identity since the core last started remembering it (a counter;
    see "Bounded memory" in ``docs/admission.md``)."""


@attrs.frozen(kw_only=True)
class GroupStatistics:
    """Queue depth of one model group per class."""

    short: int
    long: int
    affinity_on: bool = False
    """The group's policy turns affinity on."""
    affinity: Mapping[AffinityResult, int] = attrs.field(factory=dict)
    """Admissions while affinity was on, by :data:`AffinityResult` (counters since the
    group exists; every result present, zeros included)."""

    @property
    def depth(self) -> int:
        return self.short + self.long


@attrs.frozen(kw_only=True)
class AdmissionStatistics:
    groups: Mapping[str, GroupStatistics]
    candidates: Mapping[CandidateKey, CandidateStatistics]
    admissions: Mapping[AdmitReason, int]
    """Admissions since the start, by reason."""
    rejections: Mapping[RejectCause, int]
    """Rejections since the start, by cause."""
    cancellations: int
    """Waiters cancelled while queued."""
    drains_expired: int
    """Draining slots freed by their drain deadline rather than a confirmation."""
    ejections: int = 0
    """Candidates ejected since the start (each cool-down counts once)."""

    @property
    def waiting(self) -> int:
        return sum(group.depth for group in self.groups.values())

    @property
    def in_use(self) -> int:
        return sum(candidate.in_use for candidate in self.candidates.values())

    @property
    def draining(self) -> int:
        return sum(candidate.draining for candidate in self.candidates.values())


# --------------------------------------------------------------------------- internal state

_SHORT: Final = 0
_LONG: Final = 1
_CLASSES: Final[tuple[RequestClass, RequestClass]] = ("short", "long")
_COMPACT_MIN: Final = 256
_Order: TypeAlias = tuple[int, int, float, int]
"""``_Waiter.order``: (requeued first, -priority, flow's virtual start, arrival)."""
_SHRINK_MIN: Final = 8
"""A table is rebuilt when it shrank to a quarter of a peak above this."""
_NOT_EJECTED: Final = float("-inf")
"""Selection rank of a candidate that is not ejected: before any cool-down's end."""


def _known_names(policy: PolicySnapshot) -> frozenset[str]:
    """The groups ``policy`` names (``PolicySnapshot.knows``), as a set: O(1) to test."""
    return frozenset(policy.groups) | frozenset(policy.aliases.values())


def _capmask(capabilities: Iterable[str]) -> int:
    mask = 0
    for bit, name in enumerate(CAPABILITIES):
        if name in capabilities:
            mask |= 1 << bit
    return mask


@attrs.define(eq=False)
class _Waiter:
    id: WaiterId
    group: _Group
    needs: Needs
    klass: int
    capmask: int
    retry: bool
    seq: int
    submitted: float
    deadline: float
    share: Share = DEFAULT_SHARE
    live: bool = True
    fallback: bool = False
    """None of its capable candidates may be healthy or probing (see the module docstring;
    counted in ``group.fallbacks`` while queued)."""
    flow: Flow = REQUEUED
    """While queued: its flow, its tenant in its band (``REQUEUED`` for a requeued one)."""
    lane: Lane[_Waiter] | None = None
    """While queued: its flow's lane in its queue."""
    affinity: int | None = None
    """The affinity key's hash (``key_hash``), None without a key."""
    placed: int | None = None
    """Affinity: the seed of the candidate its key was placed on when it was submitted
    (None: not placed). Its own, so a later placement of the same key (another request
    admitted meanwhile) does not change the candidate it holds for."""
    hold_until: float | None = None
    """Affinity: until when it may wait for its preferred candidate while another has a
    free slot (set at submit, kept)."""
    hold_pending: bool = False
    """Its hold's end is in the core's heap (counted in ``group.holding``)."""

    @property
    def order(self) -> tuple[int, int, float, int]:
        """Queue order (as of now): requeued waiters first, by arrival; then the higher
        priority band, the flow with the smaller virtual start, the earlier arrival."""
        flow = self.flow
        return (0 if self.retry else 1, -flow.priority, flow.start, self.seq)

    @property
    def queue_key(self) -> tuple[int, bool, int]:
        return (self.klass, self.retry, self.capmask)


@attrs.define(eq=False)
class _CandidateState:
    candidate: Candidate
    group: _Group
    health: IdentityHealth[_CandidateState]
    key: CandidateKey = attrs.field(init=False)
    seed: int = attrs.field(init=False)
    """The identity's rendezvous seed (``identity_seed``)."""
    capmask: int = attrs.field(init=False)
    limits: tuple[int, int, int] = attrs.field(init=False)
    """(total, short limit, long limit) under the group's current policy."""
    in_use: list[int] = attrs.Factory(lambda: [0, 0])
    draining: list[int] = attrs.Factory(lambda: [0, 0])
    slot_ids: set[SlotId] = attrs.Factory(set)
    last_pick: int = 0

    def __attrs_post_init__(self) -> None:
        self.key = self.candidate.key
        self.seed = identity_seed(self.candidate.identity)
        self.update(self.candidate)

    def update(self, candidate: Candidate) -> None:
        """A new announcement for the same key (or the group's policy changed)."""
        self.candidate = candidate
        self.capmask = _capmask(candidate.capabilities)
        policy = self.group.policy
        total = max(0, candidate.slots)
        if policy.per_candidate_cap is not None:
            total = min(total, policy.per_candidate_cap)
        if policy.long_context_tokens is None:
            self.limits = (total, total, 0)
        else:
            long = min(max(0, candidate.long_context_slots), total)
            self.limits = (total, total - long, long)

    def room(self) -> tuple[bool, bool]:
        """Whether a short / a long request could take a slot now."""
        total, short_limit, long_limit = self.limits
        short = self.in_use[_SHORT] + self.draining[_SHORT]
        long = self.in_use[_LONG] + self.draining[_LONG]
        if short + long >= total:
            return (False, False)
        return (short < short_limit, long < long_limit)

    def free(self, klass: int) -> bool:
        return self.room()[klass]

    @property
    def ejected(self) -> bool:
        return self.health.state == "ejected"

    def accepting(self) -> bool:
        """False while probing with the probe in flight: it takes one request at a time."""
        health = self.health
        return health.probe is None or health.state != "probing"

    def occupied(self) -> int:
        return (
            self.in_use[_SHORT] + self.in_use[_LONG] + self.draining[_SHORT] + self.draining[_LONG]
        )

    def load(self) -> float:
        total = self.limits[0]
        occupied = self.occupied()
        return occupied / total if total else float("inf")


@attrs.define(eq=False)
class _Slot:
    id: SlotId
    state: _CandidateState
    klass: int
    draining: bool = False
    drain_deadline: float = 0.0


@attrs.define(eq=False)
class _Group:
    name: str
    policy: Policy
    candidates: dict[CandidateKey, _CandidateState] = attrs.Factory(dict)
    queues: dict[tuple[int, bool, int], Lanes[_Waiter]] = attrs.Factory(dict)
    """Per queue key, its live waiters' lanes (a key with none is dropped)."""
    flows: Flows = attrs.Factory(Flows)
    """The virtual start of each flow (band, tenant) with a first-time waiter queued."""
    depth: list[int] = attrs.Factory(lambda: [0, 0])
    fallbacks: dict[tuple[int, bool, int], int] = attrs.Factory(dict)
    """Per queue key, how many of its live waiters are flagged ``fallback`` (no zeros)."""
    left_at: float | None = None
    """When its last candidate left (None: it never lost one)."""
    holding: int = 0
    """Queued waiters whose affinity hold has not ended (``_Waiter.hold_pending``)."""
    affinity: dict[AffinityResult, int] = attrs.Factory(lambda: dict.fromkeys(AFFINITY_RESULTS, 0))

    def waiters(self) -> list[_Waiter]:
        """Live waiters in queue order (O(n); for rare operations only)."""
        found = [w for queue in self.queues.values() for w in queue.waiters()]
        found.sort(key=lambda w: w.order)
        return found


_K = TypeVar("_K")
_V = TypeVar("_V")


def _remember(memory: OrderedDict[_K, _V], key: _K, value: _V, limit: int) -> None:
    """``memory[key] = value`` as its most recent entry; beyond ``limit`` entries the least
    recent is forgotten."""
    memory[key] = value
    memory.move_to_end(key)
    if len(memory) > limit:
        memory.popitem(last=False)


# --------------------------------------------------------------------------- the core


class AdmissionCore:
    """The admission state machine. See the module docstring and ``docs/admission.md``."""

    def __init__(self, policy: PolicySnapshot | None = None) -> None:
        self._policy = policy if policy is not None else PolicySnapshot()
        self._known = _known_names(self._policy)
        self._now = float("-inf")
        self._groups: dict[str, _Group] = {}
        """Only groups with a candidate, a queued waiter, or named by the policy."""
        self._groups_peak = 0
        self._nodes: dict[str, tuple[int, bool]] = {}
        """node id -> (newest generation seen, still joined?)"""
        self._gone_nodes: OrderedDict[str, None] = OrderedDict()
        """The departed nodes of ``_nodes``, in the order they left."""
        self._gone_groups: OrderedDict[str, float] = OrderedDict()
        """Dropped groups that had a candidate -> when their last one left, in the order
        they were dropped (at most MODEL_MEMORY, none much older than the linger)."""
        self._gone_groups_peak = 0
        self._by_node: dict[tuple[str, int], list[_CandidateState]] = {}
        self._waiters: dict[WaiterId, _Waiter] = {}
        self._slots: dict[SlotId, _Slot] = {}
        self._seq = itertools.count()
        self._slot_ids = itertools.count(1)
        self._picks = itertools.count(1)
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._deadlines_dead = 0
        self._drains: list[tuple[float, SlotId]] = []
        self._holds: list[tuple[float, int, _Waiter]] = []
        """The ends of affinity holds (lazy deletion)."""
        self._holds_dead = 0
        self._health: HealthTable[_CandidateState] = HealthTable()
        """The health of every candidate identity the core tracks (:mod:`._health`)."""
        self._sessions: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._placements: OrderedDict[tuple[str, int], int] = OrderedDict()
        """Affinity: (group, key hash) -> the seed of the candidate identity that last served
        the key (at most PLACEMENT_MEMORY, least recently placed forgotten first)."""
        self._admissions: dict[AdmitReason, int] = dict.fromkeys(ADMIT_REASONS, 0)
        self._rejections: dict[RejectCause, int] = dict.fromkeys(REJECT_CAUSES, 0)
        self._cancellations = 0
        self._drains_expired = 0

    # ------------------------------------------------------------------ inputs

    @property
    def policy(self) -> PolicySnapshot:
        return self._policy

    def submit(
        self,
        waiter_id: WaiterId,
        model: str,
        needs: Needs,
        now: float,
        *,
        requeue: bool = False,
        share: Share = DEFAULT_SHARE,
    ) -> list[Decision]:
        """A request for a slot of ``model`` (a group name or an alias).

        ``requeue=True`` is for a request that was admitted before and failed (recovery): it
        goes ahead of first-time waiters, is not refused for a full queue, and its admission
        reason is ``"requeued"``. ``share`` says whose request it is: queued first-time
        waiters are served by priority band, then weighted fair between tenants, then FIFO
        (see "Fairness" in ``docs/admission.md``). Raises ``ValueError`` if ``waiter_id`` is
        still queued.
        """
        if waiter_id in self._waiters:
            raise ValueError(f"waiter {waiter_id!r} is already queued")
        decisions = self._advance(now)
        name = self._policy.resolve(model)
        if name not in self._groups and name not in self._known:
            self._reject(decisions, self._not_served(waiter_id, model, name, share))
            return decisions
        group = self._group(name)
        policy = group.policy
        klass = _LONG if needs.request_class(policy.long_context_tokens) == "long" else _SHORT
        waiter = _Waiter(
            id=waiter_id,
            group=group,
            needs=needs,
            klass=klass,
            capmask=needs.tools | needs.json << 1 | needs.vision << 2,
            retry=requeue,
            seq=next(self._seq),
            submitted=self._now,
            deadline=self._now + policy.queue_timeout_s,
            share=share,
        )
        if needs.affinity_key is not None:
            waiter.affinity = key_hash(needs.affinity_key)
            waiter.placed = self._placements.get((group.name, waiter.affinity))
            hold_until = self._now + policy.affinity_wait_s
            if (
                policy.affinity
                and hold_until > self._now
                and hold_until < waiter.deadline
                and (requeue or group.depth[_SHORT] + group.depth[_LONG] < policy.max_queue)
            ):
                waiter.hold_until = hold_until
        if group.candidates:
            fit: list[_CandidateState] = []
            reasons: list[str] = []
            for state in group.candidates.values():
                reason = self._unfit(state, waiter)
                if reason is None:
                    fit.append(state)
                else:
                    reasons.append(reason)
            if not fit:
                self._reject_incapable(decisions, waiter_id, name, reasons, waiter, group)
                return decisions
            if self._health.unhealthy:
                waiter.fallback = all(s.ejected for s in fit)
            affine, chosen = self._pick_affine(waiter, fit)
            if affine:
                pass
            elif not self._health.unhealthy:
                chosen = self._pick(waiter, (s for s in fit if s.free(klass)))
            else:
                fallback = waiter.fallback
                chosen = self._pick(
                    waiter,
                    (
                        s
                        for s in fit
                        if s.free(klass) and s.accepting() and (fallback or not s.ejected)
                    ),
                )
            if chosen is not None:
                self._admit(decisions, waiter, chosen, "requeued" if requeue else "immediate")
                return decisions
        depth = group.depth[_SHORT] + group.depth[_LONG]
        if not requeue and depth >= policy.max_queue:
            self._reject(
                decisions,
                Reject(
                    waiter_id=waiter_id,
                    cause="queue_full",
                    message=f"the queue for model {name!r} is full ({depth} waiting)",
                    retry_after=policy.retry_after_s,
                ),
            )
            return decisions
        self._enqueue(waiter)
        if waiter.deadline <= self._now:  # queue_timeout_s == 0: no waiting at all
            decisions.extend(self._advance(self._now))
        return decisions

    def cancel(self, waiter_id: WaiterId, now: float) -> list[Decision]:
        """The waiter gave up. No-op if it is not queued (already ended or unknown)."""
        decisions = self._advance(now)
        waiter = self._waiters.get(waiter_id)
        if waiter is not None:
            self._end(waiter)
            self._cancellations += 1
            self._prune(waiter.group)
        return decisions

    def release(self, slot_id: SlotId, now: float) -> list[Decision]:
        """The slot is free (in use or draining). No-op if unknown or already released."""
        decisions = self._advance(now)
        slot = self._slots.get(slot_id)
        if slot is not None:
            self._free_slot(decisions, slot)
        return decisions

    def begin_drain(self, slot_id: SlotId, now: float) -> list[Decision]:
        """A cancel was sent to the node: the slot stays occupied (draining) until
        :meth:`confirm_drain` or ``drain_timeout_s``. No-op unless the slot is in use."""
        decisions = self._advance(now)
        slot = self._slots.get(slot_id)
        if slot is not None and not slot.draining:
            state = slot.state
            state.in_use[slot.klass] -= 1
            state.draining[slot.klass] += 1
            slot.draining = True
            slot.drain_deadline = self._now + state.group.policy.drain_timeout_s
            heapq.heappush(self._drains, (slot.drain_deadline, slot.id))
        return decisions

    def confirm_drain(self, slot_id: SlotId, now: float) -> list[Decision]:
        """The node confirmed the cancel: the slot is free. Like :meth:`release`, it frees
        the slot in any state (the confirmation may overtake ``begin_drain``)."""
        return self.release(slot_id, now)

    def node_joined(self, candidates: Sequence[Candidate], now: float) -> list[Decision]:
        """Candidates of a node session. A newer generation of a node supersedes the older
        one's candidates (their slots become void); an older or departed generation is
        ignored. A known key is updated in place (its slots stay). Parked waiters are
        admitted at once. A group the superseded session served and the new one does not
        is dropped if nothing else keeps it (see :meth:`node_left`)."""
        decisions = self._advance(now)
        touched: dict[str, list[_CandidateState]] = {}
        reresolve: set[str] = set()
        superseded: set[str] = set()
        left: list[IdentityHealth[_CandidateState]] = []
        for candidate in candidates:
            node = candidate.node_id
            seen = self._nodes.get(node)
            if seen is not None:
                generation, joined = seen
                if candidate.generation < generation or (
                    candidate.generation == generation and not joined
                ):
                    continue
                if candidate.generation > generation:
                    superseded |= self._remove_node(node, generation, left)
                if not joined:
                    del self._gone_nodes[node]
            self._nodes[node] = (candidate.generation, True)
            group = self._group(candidate.model)
            state = group.candidates.get(candidate.key)
            if state is None:
                if not group.candidates:
                    reresolve.add(group.name)
                health = self._health.join(candidate.identity)
                state = _CandidateState(candidate=candidate, group=group, health=health)
                health.live = state
                group.candidates[candidate.key] = state
                self._by_node.setdefault((node, candidate.generation), []).append(state)
            else:
                state.update(candidate)
                reresolve.add(group.name)
            touched.setdefault(group.name, []).append(state)
        for name in reresolve | superseded:
            self._reresolve(decisions, self._groups[name])
        for name, states in touched.items():
            self._fill(decisions, self._groups[name], states)
        for name in reresolve | superseded:
            self._unhold(decisions, self._groups[name])
        for name in superseded:
            self._prune(self._groups[name])
        for health in left:  # unless the new session announced it again
            if health.live is None:
                self._health.left(health)
        return decisions

    def node_left(self, node_id: str, generation: int, now: float) -> list[Decision]:
        """The node session ended: its candidates go, their in-use and draining slots become
        void (a later release or confirm is a no-op), and waiters that no remaining candidate
        can serve are rejected (those of a group left with no candidate at all keep
        waiting: a node may join). A group left with no candidate and no waiter is dropped
        unless the policy names it: a request for it is then ``unknown_model``."""
        decisions = self._advance(now)
        seen = self._nodes.get(node_id)
        groups: set[str] = set()
        if seen is None or generation >= seen[0]:
            self._nodes[node_id] = (generation, False)
            self._depart_node(node_id)
            if seen is not None and generation > seen[0]:  # a newer session ended: both go
                groups |= self._remove_node(node_id, seen[0])
        groups |= self._remove_node(node_id, generation)
        for name in groups:
            group = self._groups[name]
            self._reresolve(decisions, group)
            self._unhold(decisions, group)
            self._prune(group)
        return decisions

    def capacity_changed(
        self, key: CandidateKey, slots: int, long_context_slots: int, now: float
    ) -> list[Decision]:
        """The node changed a candidate's slot counts. No-op for an unknown or stale key."""
        decisions = self._advance(now)
        group = self._groups.get(key.model)
        state = group.candidates.get(key) if group is not None else None
        if group is None or state is None:
            return decisions
        before = state.candidate
        state.update(attrs.evolve(before, slots=slots, long_context_slots=long_context_slots))
        if (before.long_context_slots > 0) != (long_context_slots > 0):
            self._reresolve(decisions, group)
        self._fill(decisions, group, [state])
        self._unhold(decisions, group)
        return decisions

    def set_policy(self, policy: PolicySnapshot, now: float) -> list[Decision]:
        """Replace the policy. Admitted slots are untouched (a candidate over its new limits
        just admits nobody until it is below them); queued waiters keep their deadline, are
        re-classified if the group's ``long_context_tokens`` changed, and get any capacity
        the new limits open."""
        decisions = self._advance(now)
        self._policy = policy
        self._known = _known_names(policy)
        self._health.set_policy(policy)
        for group in list(self._groups.values()):
            old = group.policy
            group.policy = policy.policy_for(group.name)
            for state in group.candidates.values():
                state.update(state.candidate)
            if group.policy.long_context_tokens != old.long_context_tokens:
                self._reclassify(group)
                self._reresolve(decisions, group)
            self._fill(decisions, group, list(group.candidates.values()))
        for group in list(self._groups.values()):  # the ones it no longer names
            self._prune(group)
        return decisions

    def report_success(self, key: CandidateKey, now: float) -> list[Decision]:
        """An attempt on ``key``'s candidate worked (report it as soon as that is known, e.g.
        at the first token). Its identity is healthy again, whatever its state: failures
        and cool-down level go back to 0, and waiters it can serve now are admitted. Any
        generation of the node counts; no-op for an identity the core does not track."""
        decisions = self._advance(now)
        health = self._health.get(key.identity)
        if health is None:
            return decisions
        before = self._health.succeed(health)
        state = health.live
        if state is not None and before != "healthy":
            self._fill(decisions, state.group, [state])
        return decisions

    def report_failure(self, key: CandidateKey, now: float) -> list[Decision]:
        """An attempt on ``key``'s candidate failed for a reason that is the candidate's
        (node lost, upstream 5xx or 429, first-token timeout, a retryable ``run.failed``);
        never report a client's error. A healthy identity is ejected after
        ``eject_after_failures`` consecutive ones, a probing one at once (with the next
        longer cool-down); failures while ejected are only counted. Any generation of the
        node counts (the identity is the provider, not the session). No-op when the group's
        policy has ``eject_after_failures == 0``, and for an identity the core has no health
        of unless its node is remembered and its group has a candidate now."""
        decisions = self._advance(now)
        policy = self._policy.policy_for(key.model)
        if policy.eject_after_failures == 0:
            return decisions
        identity = key.identity
        health = self._health.get(identity)
        if health is None:  # so not joined: a joined candidate always has its health
            group = self._groups.get(key.model)
            if key.node_id not in self._nodes or group is None or not group.candidates:
                return decisions
            health = self._health.remember(identity)
        if self._health.fail(health, self._now, policy):
            state = health.live
            if state is not None:  # waiters it was the last candidate for may fall back now
                self._reresolve(decisions, state.group)
                self._unhold(decisions, state.group)
        return decisions

    def tick(self, now: float) -> list[Decision]:
        """Expire what is due: queue timeouts (-> ``timeout`` rejections), drain deadlines
        (the slot is freed, possibly admitting a waiter) and cool-down ends (the candidate
        is probing, possibly admitting a waiter)."""
        return self._advance(now)

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do, or None."""
        waiter = self._peek_deadline()
        drain = self._peek_drain()
        cooldown = self._health.next_cooldown()
        hold = self._peek_hold()
        times = [t for t in (waiter, drain, cooldown, hold) if t is not None]
        return min(times) if times else None

    def knows_model(self, model: str) -> bool:
        """Whether ``model`` (a group or an alias) names a group: one the core holds (it has
        a candidate or a queued waiter) or one the policy names. :meth:`submit` refuses any
        other as ``unknown_model``."""
        name = self._policy.resolve(model)
        return name in self._groups or name in self._known

    def statistics(self) -> AdmissionStatistics:
        groups = {
            name: GroupStatistics(
                short=group.depth[_SHORT],
                long=group.depth[_LONG],
                affinity_on=group.policy.affinity,
                affinity=dict(group.affinity),
            )
            for name, group in self._groups.items()
        }
        candidates: dict[CandidateKey, CandidateStatistics] = {}
        for group in self._groups.values():
            for key, state in group.candidates.items():
                total, _, long = state.limits
                health = state.health
                candidates[key] = CandidateStatistics(
                    total=total,
                    in_use=state.in_use[_SHORT] + state.in_use[_LONG],
                    draining=state.draining[_SHORT] + state.draining[_LONG],
                    long_total=long,
                    long_in_use=state.in_use[_LONG],
                    long_draining=state.draining[_LONG],
                    health=health.state,
                    consecutive_failures=health.failures,
                    ejections=health.ejections,
                    ejected_until=health.ejected_until,
                    probe_in_flight=health.state == "probing" and health.probe is not None,
                    ejections_total=health.ejections_total,
                )
        return AdmissionStatistics(
            groups=groups,
            candidates=candidates,
            admissions=dict(self._admissions),
            rejections=dict(self._rejections),
            cancellations=self._cancellations,
            drains_expired=self._drains_expired,
            ejections=self._health.ejections,
        )

    def demand(self, key: CandidateKey) -> tuple[int, int, int] | None:
        """What the node behind ``key`` is told this edge wants of it (``demand``): the
        requests its group has queued, the candidate's slots held (in use and draining), and
        its slots now; None if the candidate is not known. O(1)."""
        group = self._groups.get(key.model)
        state = group.candidates.get(key) if group is not None else None
        if group is None or state is None:
            return None
        held = state.in_use[_SHORT] + state.in_use[_LONG]
        held += state.draining[_SHORT] + state.draining[_LONG]
        return group.depth[_SHORT] + group.depth[_LONG], held, state.limits[0]

    def is_queued(self, waiter_id: WaiterId) -> bool:
        return waiter_id in self._waiters

    def slot_state(self, slot_id: SlotId) -> Literal["in_use", "draining"] | None:
        """``None`` once the slot is released, confirmed, expired or void."""
        slot = self._slots.get(slot_id)
        if slot is None:
            return None
        return "draining" if slot.draining else "in_use"

    # ------------------------------------------------------------------ helpers

    def _group(self, name: str) -> _Group:
        group = self._groups.get(name)
        if group is None:
            group = self._groups[name] = _Group(
                name=name,
                policy=self._policy.policy_for(name),
                left_at=self._gone_groups.pop(name, None),
            )
            self._groups_peak = max(self._groups_peak, len(self._groups))
        return group

    def _prune(self, group: _Group) -> None:
        """Drop ``group`` unless something keeps it: a candidate, a queued waiter, or the
        policy naming it. Call it after any input that may have taken the last of them."""
        if group.candidates or group.depth[_SHORT] or group.depth[_LONG]:
            return
        name = group.name
        if name in self._known or self._groups.get(name) is not group:
            return
        del self._groups[name]
        if group.left_at is not None:
            self._remember_gone_group(name, group.left_at)
        group.queues.clear()  # only ended waiters are left in them
        group.fallbacks.clear()
        if self._groups_peak > _SHRINK_MIN and len(self._groups) * 4 < self._groups_peak:
            self._groups = dict(self._groups)
            self._groups_peak = len(self._groups)

    def _not_served(self, waiter_id: WaiterId, model: str, name: str, share: Share) -> Reject:
        """The rejection of a request for a group the core does not hold: unavailable (a
        node may come back: retry) while a node served it within the linger or the
        requesting tenant's allowed models name it, else unknown."""
        policy = self._policy
        left_at = self._gone_groups.get(name)
        if left_at is not None and self._now < left_at + policy.model_linger_s:
            ago = self._now - left_at
            when = f"{ago:.0f} s ago" if ago >= 1 else "less than a second ago"
            why = f"a node served it until {when}"
        elif name in policy.tenant_models.get(share.tenant, ()):
            why = "your key's allowed models name it"
        else:
            return Reject(
                waiter_id=waiter_id,
                cause="unknown_model",
                message=f"model {model!r} does not exist",
            )
        return Reject(
            waiter_id=waiter_id,
            cause="model_unavailable",
            message=f"no node serves model {model!r} right now ({why}); retry shortly",
            retry_after=policy.unavailable_retry_after_s,
        )

    def _remember_gone_group(self, name: str, left_at: float) -> None:
        """A group that had a candidate was dropped: remember when its last one left, among
        the last MODEL_MEMORY."""
        if self._now >= left_at + self._policy.model_linger_s:
            return  # its waiters kept it past the linger: nothing to remember
        gone = self._gone_groups
        gone[name] = left_at
        gone.move_to_end(name)
        if len(gone) > MODEL_MEMORY:
            gone.popitem(last=False)
        self._gone_groups_peak = max(self._gone_groups_peak, len(gone))

    def _forget_gone_groups(self) -> None:
        """Forget the dropped groups whose linger is over, from the first dropped on, and
        give the table's memory back once it shrank to a quarter of its peak (each input;
        O(1) when there is nothing to forget)."""
        gone = self._gone_groups
        linger = self._policy.model_linger_s
        while gone and self._now >= next(iter(gone.values())) + linger:
            gone.popitem(last=False)
        if self._gone_groups_peak > _SHRINK_MIN and len(gone) * 4 < self._gone_groups_peak:
            self._gone_groups = OrderedDict(gone)
            self._gone_groups_peak = len(gone)

    def _depart_node(self, node_id: str) -> None:
        """``node_id`` left: remember it (its generation) among the last NODE_MEMORY."""
        gone = self._gone_nodes
        gone[node_id] = None
        gone.move_to_end(node_id)
        if len(gone) > NODE_MEMORY:
            oldest, _ = gone.popitem(last=False)
            del self._nodes[oldest]  # departed: no candidate or slot of it is left

    def _unfit(self, state: _CandidateState, waiter: _Waiter) -> str | None:
        return waiter.needs.unfit(state.candidate, _CLASSES[waiter.klass])

    def _pick(self, waiter: _Waiter, options: Iterable[_CandidateState]) -> _CandidateState | None:
        """The session's last node if free, else the least loaded, ties round-robin. Among
        ejected candidates (a fallback waiter's options are all ejected), the one whose
        cool-down ends first goes before those."""
        session = waiter.needs.session_id
        preferred = (
            self._sessions.get((waiter.group.name, session)) if session is not None else None
        )
        best: _CandidateState | None = None
        best_key: tuple[float, int, float, int] | None = None
        unhealthy = self._health.unhealthy
        for state in options:
            until = state.health.ejected_until if unhealthy else None  # None unless ejected
            key = (
                _NOT_EJECTED if until is None else until,
                0 if state.candidate.node_id == preferred else 1,
                state.load(),
                state.last_pick,
            )
            if best_key is None or key < best_key:
                best, best_key = state, key
        return best

    # ------------------------------------------------------------------ affinity

    def _preferable(
        self, waiter: _Waiter, states: Iterable[_CandidateState]
    ) -> list[_CandidateState]:
        """The ``states`` an affine ``waiter`` may prefer (unordered): those that fit its
        needs, have slots of its class, and are not ejected."""
        klass = waiter.klass
        unhealthy = self._health.unhealthy
        return [
            s
            for s in states
            if s.limits[1 + klass] > 0
            and not (unhealthy and s.ejected)
            and self._unfit(s, waiter) is None
        ]

    def _has_room(self, state: _CandidateState, klass: int) -> bool:
        return state.free(klass) and (not self._health.unhealthy or state.accepting())

    def _holding(self, waiter: _Waiter) -> _CandidateState | None:
        """The candidate a queued affine ``waiter`` waits for while its hold lasts (its
        preferred one, which has no room for it now), or None: it may take any."""
        hold_until = waiter.hold_until
        key = waiter.affinity
        if hold_until is None or key is None or self._now >= hold_until:
            return None
        group = waiter.group
        if not group.policy.affinity:
            return None
        klass = waiter.klass
        unhealthy = self._health.unhealthy
        placed = waiter.placed
        best: _CandidateState | None = None
        best_weight = (-1, -1)
        for state in group.candidates.values():
            if state.limits[1 + klass] == 0 or (unhealthy and state.ejected):
                continue
            w = preference(key, state.seed, placed)
            if w > best_weight and self._unfit(state, waiter) is None:
                best, best_weight = state, w
        if best is None or self._has_room(best, klass):
            return None
        return best

    def _pick_affine(
        self, waiter: _Waiter, states: Iterable[_CandidateState]
    ) -> tuple[bool, _CandidateState | None]:
        """Affinity's choice for ``waiter`` among the group's ``states``: (False, None) when
        affinity does not apply (off, no key, or every candidate that can serve it is
        ejected: the usual selection then); (True, None) when it must wait (nothing has
        room, or it holds for its preferred candidate); else (True, the candidate).

        The rule: the first in its key's ranking that has room and is within the bounded
        load (``occupied + 1 <= ceil(f * (occupied of all + 1) * slots / slots of all)``,
        over the ranked candidates); none within it: the least loaded with room. While its
        hold lasts and its first-ranked candidate has no room, nothing."""
        key = waiter.affinity
        group = waiter.group
        policy = group.policy
        if key is None or not policy.affinity:
            return False, None
        ranked = self._preferable(waiter, states)
        if not ranked:
            return False, None
        klass = waiter.klass
        roomy = [s for s in ranked if self._has_room(s, klass)]
        if not roomy:
            return True, None
        placed = waiter.placed

        def heaviest(state: _CandidateState) -> tuple[int, int]:
            return preference(key, state.seed, placed)

        if waiter.hold_until is not None and self._now < waiter.hold_until:
            first = max(ranked, key=heaviest)
            if not self._has_room(first, klass):
                return True, None  # it waits for ``first`` (its hold's end is a deadline)
        if len(roomy) == 1:
            return True, roomy[0]  # within the bound or not, the one choice
        roomy.sort(key=heaviest, reverse=True)
        occupied = sum(s.occupied() for s in ranked) + 1
        total = sum(s.limits[0] for s in ranked)
        factor = policy.affinity_load_factor
        for state in roomy:
            if state.occupied() + 1 <= math.ceil(factor * occupied * state.limits[0] / total):
                return True, state
        return True, min(roomy, key=lambda s: (s.load(), s.last_pick))

    def _affinity_result(self, waiter: _Waiter, state: _CandidateState) -> AffinityResult:
        """How the admission of ``waiter`` onto ``state`` counts (its group has affinity
        on): against its key's home among all the group's candidates."""
        key = waiter.affinity
        if key is None:
            return "unkeyed"
        placed = waiter.placed
        home = max(waiter.group.candidates.values(), key=lambda s: preference(key, s.seed, placed))
        if home is state:
            return "hit"
        if home.limits[1 + waiter.klass] == 0 or self._unfit(home, waiter) is not None:
            return "ineligible"
        if self._health.unhealthy and home.ejected:
            return "ejected"
        if self._has_room(home, waiter.klass):
            return "over_load"
        return "busy"

    def _unhold(self, decisions: list[Decision], group: _Group) -> None:
        """Candidates of ``group`` changed (one left, was ejected, changed its slots): a
        held waiter's preferred candidate may be another now, so let every candidate with
        room look at the queue again (only while some waiter holds)."""
        if group.holding:
            self._fill(decisions, group, list(group.candidates.values()))

    def _admit(
        self,
        decisions: list[Decision],
        waiter: _Waiter,
        state: _CandidateState,
        reason: AdmitReason,
    ) -> None:
        if self._waiters.get(waiter.id) is waiter:
            if not waiter.retry:
                Flows.charge(waiter.flow, waiter.share.weight)
            self._end(waiter)
        group = waiter.group
        if group.policy.affinity:
            group.affinity[self._affinity_result(waiter, state)] += 1
            if waiter.affinity is not None:
                _remember(
                    self._placements, (group.name, waiter.affinity), state.seed, PLACEMENT_MEMORY
                )
        slot = _Slot(id=next(self._slot_ids), state=state, klass=waiter.klass)
        self._slots[slot.id] = slot
        state.slot_ids.add(slot.id)
        state.in_use[waiter.klass] += 1
        state.last_pick = next(self._picks)
        if self._health.unhealthy:
            health = state.health
            if health.state == "probing":
                health.probe = slot.id
        session = waiter.needs.session_id
        if session is not None:
            _remember(
                self._sessions, (group.name, session), state.candidate.node_id, SESSION_MEMORY
            )
        self._admissions[reason] += 1
        decisions.append(
            Admit(
                waiter_id=waiter.id,
                slot_id=slot.id,
                candidate=state.candidate,
                reason=reason,
                queued_for=self._now - waiter.submitted,
                request_class=_CLASSES[waiter.klass],
            )
        )

    def _reject(self, decisions: list[Decision], reject: Reject) -> None:
        """Decide ``reject`` and count it under its cause."""
        self._rejections[reject.cause] += 1
        decisions.append(reject)

    def _reject_incapable(
        self,
        decisions: list[Decision],
        waiter_id: WaiterId,
        name: str,
        reasons: list[str],
        waiter: _Waiter,
        group: _Group,
    ) -> None:
        needs = waiter.needs
        why = "; ".join(reasons)
        self._reject(
            decisions,
            Reject(
                waiter_id=waiter_id,
                cause="no_capable_candidate",
                message=f"no candidate for model {name!r} can serve this request: {why}",
                reasons=tuple(reasons),
                only_excluded=all(needs.excludes(s.candidate) for s in group.candidates.values()),
            ),
        )

    def _enqueue(self, waiter: _Waiter) -> None:
        group = waiter.group
        if not waiter.retry:
            queue = group.queues.get(waiter.queue_key)
            priority = waiter.share.priority

            def floor() -> float | None:
                return queue.floor(priority) if queue is not None else None

            waiter.flow = group.flows.enter(waiter.share, floor)
        self._place(waiter)
        self._waiters[waiter.id] = waiter
        heapq.heappush(self._deadlines, (waiter.deadline, waiter.seq, waiter))
        if waiter.hold_until is not None:
            waiter.hold_pending = True
            group.holding += 1
            heapq.heappush(self._holds, (waiter.hold_until, waiter.seq, waiter))

    def _end(self, waiter: _Waiter, *, popped: bool = False) -> None:
        """Take a queued waiter out (lazily: it stays in its lane and, unless ``popped``,
        in the deadline heap, marked as ended)."""
        if waiter.fallback:
            self._flag(waiter, False)
        waiter.live = False
        del self._waiters[waiter.id]
        group = waiter.group
        if waiter.hold_pending:
            waiter.hold_pending = False
            group.holding -= 1
            self._holds_dead += 1
            dead = self._holds_dead
            if dead > _COMPACT_MIN and dead > len(self._holds) - dead:
                self._holds = [entry for entry in self._holds if entry[2].hold_pending]
                heapq.heapify(self._holds)
                self._holds_dead = 0
        group.depth[waiter.klass] -= 1
        key = waiter.queue_key
        queue = group.queues[key]
        assert waiter.lane is not None
        queue.remove(waiter.lane)
        waiter.lane = None
        if not queue.live:
            del group.queues[key]
        if not waiter.retry:
            group.flows.leave(waiter.flow)
        if not popped:
            self._deadlines_dead += 1
        if self._deadlines_dead > _COMPACT_MIN and self._deadlines_dead > len(self._waiters):
            self._deadlines = [entry for entry in self._deadlines if entry[2].live]
            heapq.heapify(self._deadlines)
            self._deadlines_dead = 0

    def _place(self, waiter: _Waiter) -> None:
        """Put a queued waiter in its queue's lane (its flow already set)."""
        group = waiter.group
        key = waiter.queue_key
        queue = group.queues.get(key)
        if queue is None:
            queue = group.queues[key] = Lanes()
        waiter.lane = queue.append(waiter, waiter.flow)
        group.depth[waiter.klass] += 1
        if waiter.fallback:
            group.fallbacks[key] = group.fallbacks.get(key, 0) + 1

    def _reclassify(self, group: _Group) -> None:
        waiters = group.waiters()
        group.queues.clear()
        group.depth[:] = [0, 0]
        group.fallbacks.clear()
        for waiter in waiters:  # in queue order, so each lane keeps its FIFO
            long = waiter.needs.request_class(group.policy.long_context_tokens) == "long"
            waiter.klass = _LONG if long else _SHORT
            self._place(waiter)

    def _free_slot(self, decisions: list[Decision], slot: _Slot) -> None:
        del self._slots[slot.id]
        state = slot.state
        was_free = state.room()
        if slot.draining:
            state.draining[slot.klass] -= 1
        else:
            state.in_use[slot.klass] -= 1
        state.slot_ids.discard(slot.id)
        now_free = state.room()
        health = state.health
        if self._health.unhealthy and health.probe == slot.id:  # the probe ended, not reported
            health.probe = None
            opened = [k for k in (_SHORT, _LONG) if now_free[k]]
        else:
            opened = [k for k in (_SHORT, _LONG) if now_free[k] and not was_free[k]]
        if opened:
            self._fill(decisions, state.group, [state], opened)

    def _oldest_for(
        self, group: _Group, klass: int, state: _CandidateState, bound: _Order | None
    ) -> _Waiter | None:
        """The first queued waiter of ``klass`` in queue order (``_Waiter.order``) that
        ``state`` can serve (before ``bound``, if given). An ejected ``state`` serves
        fallback waiters only."""
        best: _Waiter | None = None
        ejected = self._health.unhealthy and state.ejected

        def fits(waiter: _Waiter) -> bool:
            if ejected and not waiter.fallback:
                return False
            if self._unfit(state, waiter) is not None:
                return False
            if ejected and self._healthy_fit(waiter):
                self._flag(waiter, False)  # stale: a candidate recovered meanwhile
                return False
            # a waiter in its hold waits for its preferred candidate, which is not ``state``
            return not (waiter.hold_pending and self._holding(waiter) is not None)

        for key, queue in group.queues.items():
            if key[0] != klass or key[2] & ~state.capmask:
                continue
            if ejected and key not in group.fallbacks:
                continue
            rank = 0 if key[1] else 1
            if bound is not None and rank > bound[0]:
                continue
            found = queue.first(fits, bound[1:] if bound is not None and rank == bound[0] else None)
            if found is not None:
                best, bound = found, found.order
        return best

    def _fill(
        self,
        decisions: list[Decision],
        group: _Group,
        states: Sequence[_CandidateState],
        classes: Sequence[int] = (_SHORT, _LONG),
    ) -> None:
        """Give free slots of ``states`` to the first waiters in queue order that can use
        them."""
        states = [s for s in states if group.candidates.get(s.key) is s]
        while True:
            oldest: _Waiter | None = None
            for state in states:
                if self._health.unhealthy and not state.accepting():
                    continue
                for klass in classes:
                    if not state.free(klass):
                        continue
                    found = self._oldest_for(
                        group, klass, state, oldest.order if oldest is not None else None
                    )
                    if found is not None:
                        oldest = found
            if oldest is None:
                return
            waiter = oldest
            affine, chosen = self._pick_affine(waiter, list(group.candidates.values()))
            if affine:
                pass
            elif self._health.unhealthy:
                chosen = self._pick(waiter, self._usable(waiter, states))
            else:
                chosen = self._pick(
                    waiter,
                    (s for s in states if s.free(waiter.klass) and self._unfit(s, waiter) is None),
                )
            assert chosen is not None
            self._admit(decisions, waiter, chosen, "requeued" if waiter.retry else "queued")

    def _reresolve(self, decisions: list[Decision], group: _Group) -> None:
        """Reject queued waiters no candidate of ``group`` can serve (none when the group
        has no candidate at all: they wait for a node to join)."""
        if not group.candidates or group.depth[_SHORT] + group.depth[_LONG] == 0:
            return
        flagged = False
        for waiter in group.waiters():
            reasons = []
            fit = healthy = False
            for state in group.candidates.values():
                reason = self._unfit(state, waiter)
                if reason is None:
                    fit = True
                    if not state.ejected:
                        healthy = True
                        break
                else:
                    reasons.append(reason)
            if not fit:
                self._end(waiter)
                self._reject_incapable(decisions, waiter.id, group.name, reasons, waiter, group)
            elif not healthy and not waiter.fallback:
                self._flag(waiter, True)
                flagged = True
            elif healthy:
                self._flag(waiter, False)
        if flagged:  # they may use the ejected candidates now
            self._fill(decisions, group, [s for s in group.candidates.values() if s.ejected])

    def _remove_node(
        self,
        node_id: str,
        generation: int,
        left: list[IdentityHealth[_CandidateState]] | None = None,
    ) -> set[str]:
        """Drop the candidates of (node, generation) and void their slots; returns the names
        of the groups that lost candidates. The identities that have no joined candidate
        now are forgotten or remembered as departed, or, if ``left`` is given, added to it
        for the caller to do so."""
        states = self._by_node.pop((node_id, generation), [])
        groups: set[str] = set()
        for state in states:
            group = state.group
            if group.candidates.get(state.key) is state:
                del group.candidates[state.key]
                groups.add(group.name)
                if not group.candidates:
                    group.left_at = self._now
            health = state.health
            if health.probe in state.slot_ids:
                health.probe = None
            for slot_id in state.slot_ids:
                self._slots.pop(slot_id, None)
            state.slot_ids.clear()
            if health.live is state:
                health.live = None
                if left is None:
                    self._health.left(health)
                else:
                    left.append(health)
        return groups

    # ------------------------------------------------------------------ health in selection

    def _flag(self, waiter: _Waiter, fallback: bool) -> None:
        """Set a queued waiter's fallback flag, keeping its queue's count."""
        if waiter.fallback == fallback:
            return
        waiter.fallback = fallback
        counts = waiter.group.fallbacks
        key = waiter.queue_key
        count = counts.get(key, 0) + (1 if fallback else -1)
        if count:
            counts[key] = count
        else:
            del counts[key]

    def _healthy_fit(self, waiter: _Waiter) -> bool:
        """Whether a candidate that is not ejected can serve ``waiter`` (O(candidates))."""
        return any(
            not state.ejected and self._unfit(state, waiter) is None
            for state in waiter.group.candidates.values()
        )

    def _usable(
        self, waiter: _Waiter, states: Iterable[_CandidateState]
    ) -> Iterable[_CandidateState]:
        """The ``states`` that may take ``waiter`` now: room in its class, not a probing
        one with its probe in flight, fit for its needs, and not ejected unless no
        candidate that is not ejected can serve it."""
        fallback: bool | None = None
        for state in states:
            if not (
                state.free(waiter.klass)
                and state.accepting()
                and self._unfit(state, waiter) is None
            ):
                continue
            if state.ejected:
                if fallback is None:
                    fallback = not self._healthy_fit(waiter)
                if not fallback:
                    continue
            yield state

    # ------------------------------------------------------------------ time

    def _peek_deadline(self) -> float | None:
        heap = self._deadlines
        while heap and not heap[0][2].live:
            heapq.heappop(heap)
            self._deadlines_dead -= 1
        return heap[0][0] if heap else None

    def _peek_hold(self) -> float | None:
        heap = self._holds
        while heap and not heap[0][2].hold_pending:
            heapq.heappop(heap)
            self._holds_dead -= 1
        return heap[0][0] if heap else None

    def _peek_drain(self) -> float | None:
        heap = self._drains
        while heap:
            deadline, slot_id = heap[0]
            slot = self._slots.get(slot_id)
            if slot is not None and slot.draining and slot.drain_deadline == deadline:
                return deadline
            heapq.heappop(heap)
        return None

    def _advance(self, now: float) -> list[Decision]:
        """Expire everything due at ``now``, in time order; at the same instant a waiter's
        deadline goes first (nobody is admitted at or after its deadline), then a drain
        deadline, then the end of a cool-down."""
        self._now = max(self._now, float(now))
        self._forget_gone_groups()
        decisions: list[Decision] = []
        while True:
            waiter_due = self._peek_deadline()
            drain_due = self._peek_drain()
            cool_due = self._health.next_cooldown()
            hold_due = self._peek_hold()
            if (
                hold_due is not None
                and hold_due <= self._now
                and (waiter_due is None or hold_due < waiter_due)
                and (drain_due is None or hold_due < drain_due)
                and (cool_due is None or hold_due < cool_due)
            ):
                _, _, waiter = heapq.heappop(self._holds)
                group = waiter.group
                waiter.hold_pending = False
                group.holding -= 1
                # the waiter may take any candidate now (and so may others whose hold ended)
                self._fill(decisions, group, list(group.candidates.values()))
            elif (
                cool_due is not None
                and cool_due <= self._now
                and (waiter_due is None or cool_due < waiter_due)
                and (drain_due is None or cool_due < drain_due)
            ):
                state = self._health.end_cooldown().live
                if state is not None:
                    self._fill(decisions, state.group, [state])
            elif (
                drain_due is not None
                and drain_due <= self._now
                and (waiter_due is None or drain_due < waiter_due)
            ):
                _, slot_id = heapq.heappop(self._drains)
                self._drains_expired += 1
                self._free_slot(decisions, self._slots[slot_id])
            elif waiter_due is not None and waiter_due <= self._now:
                _, _, waiter = heapq.heappop(self._deadlines)
                group = waiter.group
                self._end(waiter, popped=True)
                self._reject(
                    decisions,
                    Reject(
                        waiter_id=waiter.id,
                        cause="timeout",
                        message=f"no slot for model {group.name!r} became free within "
                        f"{group.policy.queue_timeout_s:g} s",
                        retry_after=group.policy.retry_after_s,
                    ),
                )
                self._prune(group)
            else:
                return decisions
