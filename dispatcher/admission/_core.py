"""The admission core: a synchronous, sans-IO state machine.

It decides which waiter gets which slot on which candidate; it never waits, sleeps or reads
a clock. Every input carries ``now`` (seconds, any monotonic origin) and returns the list of
:data:`Decision` it produced, in order. The Trio layer (:mod:`._queue`) carries them out.

Inputs: :meth:`AdmissionCore.submit`, ``cancel``, ``release``, ``begin_drain``,
``confirm_drain``, ``node_joined``, ``node_left``, ``capacity_changed``, ``set_policy``,
``tick``. Every input first expires what is due at ``now`` (queue timeouts, drain
deadlines), so a waiter is never admitted at or after its deadline.

Data layout (what keeps an operation O(1) in the common case, whatever the queue length):

* per group, one FIFO deque per (class, requeued?, needed-capability bitmask): at most 16
  per class. A freed slot on candidate ``c`` only looks at the deques whose capabilities
  ``c`` has, and takes the oldest head among them; a waiter is skipped only when something
  rarer fails (context window, predicate, exclusion).
* ended waiters (cancelled, admitted from the middle, timed out) are marked and dropped
  lazily from deque heads; deques are compacted when the garbage outgrows the live entries.
* queue deadlines and drain deadlines live in heaps with lazy deletion (and compaction).
* invariant: no queued waiter could use a candidate that has a free slot in its class. So
  a release only has to look for waiters when it turned a full candidate free.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Literal, TypeAlias

import attrs

from ._candidates import CAPABILITIES, Candidate, CandidateKey, Needs, RequestClass
from ._policy import Policy, PolicySnapshot

WaiterId: TypeAlias = int | str
SlotId: TypeAlias = int
AdmitReason: TypeAlias = Literal["immediate", "queued", "requeued"]
RejectCause: TypeAlias = Literal["queue_full", "timeout", "no_capable_candidate", "unknown_model"]

ADMIT_REASONS: Final[tuple[AdmitReason, ...]] = ("immediate", "queued", "requeued")
REJECT_CAUSES: Final[tuple[RejectCause, ...]] = (
    "queue_full",
    "timeout",
    "no_capable_candidate",
    "unknown_model",
)
SESSION_MEMORY: Final = 10_000
"""Sessions whose last node the core remembers (least recently used ones are forgotten)."""


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


Decision: TypeAlias = Admit | Reject


@attrs.frozen(kw_only=True)
class CandidateStatistics:
    """``total``: effective slots (after ``per_candidate_cap``); ``long_total``: how many of
    them long requests may hold (0 when the group has no classes). ``in_use`` and
    ``draining`` count both classes; ``long_*`` the long ones among them."""

    total: int
    in_use: int
    draining: int
    long_total: int
    long_in_use: int
    long_draining: int


@attrs.frozen(kw_only=True)
class GroupStatistics:
    """Queue depth of one model group per class."""

    short: int
    long: int

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
    live: bool = True

    @property
    def order(self) -> tuple[int, int]:
        """Queue order: requeued waiters first, then by arrival."""
        return (0 if self.retry else 1, self.seq)

    @property
    def queue_key(self) -> tuple[int, bool, int]:
        return (self.klass, self.retry, self.capmask)


@attrs.define(eq=False)
class _CandidateState:
    candidate: Candidate
    group: _Group
    key: CandidateKey = attrs.field(init=False)
    capmask: int = attrs.field(init=False)
    limits: tuple[int, int, int] = attrs.field(init=False)
    """(total, short limit, long limit) under the group's current policy."""
    in_use: list[int] = attrs.Factory(lambda: [0, 0])
    draining: list[int] = attrs.Factory(lambda: [0, 0])
    slot_ids: set[SlotId] = attrs.Factory(set)
    last_pick: int = 0

    def __attrs_post_init__(self) -> None:
        self.key = self.candidate.key
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

    def load(self) -> float:
        total = self.limits[0]
        occupied = sum(self.in_use) + sum(self.draining)
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
    queues: dict[tuple[int, bool, int], deque[_Waiter]] = attrs.Factory(dict)
    depth: list[int] = attrs.Factory(lambda: [0, 0])
    garbage: int = 0
    """Ended waiters still sitting in ``queues``."""

    def waiters(self) -> list[_Waiter]:
        """Live waiters in queue order (O(n); for rare operations only)."""
        found = [w for queue in self.queues.values() for w in queue if w.live]
        found.sort(key=lambda w: w.order)
        return found


# --------------------------------------------------------------------------- the core


class AdmissionCore:
    """The admission state machine. See the module docstring and ``docs/admission.md``."""

    def __init__(self, policy: PolicySnapshot | None = None) -> None:
        self._policy = policy if policy is not None else PolicySnapshot()
        self._now = float("-inf")
        self._groups: dict[str, _Group] = {}
        self._ever_served: set[str] = set()
        self._nodes: dict[str, tuple[int, bool]] = {}
        """node id -> (newest generation seen, still joined?)"""
        self._by_node: dict[tuple[str, int], list[_CandidateState]] = {}
        self._waiters: dict[WaiterId, _Waiter] = {}
        self._slots: dict[SlotId, _Slot] = {}
        self._seq = itertools.count()
        self._slot_ids = itertools.count(1)
        self._picks = itertools.count(1)
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._deadlines_dead = 0
        self._drains: list[tuple[float, SlotId]] = []
        self._sessions: OrderedDict[tuple[str, str], str] = OrderedDict()
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
    ) -> list[Decision]:
        """A request for a slot of ``model`` (a group name or an alias).

        ``requeue=True`` is for a request that was admitted before and failed (recovery): it
        goes ahead of first-time waiters, is not refused for a full queue, and its admission
        reason is ``"requeued"``. Raises ``ValueError`` if ``waiter_id`` is still queued.
        """
        if waiter_id in self._waiters:
            raise ValueError(f"waiter {waiter_id!r} is already queued")
        decisions = self._advance(now)
        name = self._policy.resolve(model)
        if name not in self._ever_served and not self._policy.knows(name):
            self._reject(decisions, waiter_id, "unknown_model", f"model {model!r} does not exist")
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
        )
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
                self._reject_incapable(decisions, waiter_id, name, reasons)
                return decisions
            chosen = self._pick(waiter, (s for s in fit if s.free(klass)))
            if chosen is not None:
                self._admit(decisions, waiter, chosen, "requeued" if requeue else "immediate")
                return decisions
        depth = group.depth[_SHORT] + group.depth[_LONG]
        if not requeue and depth >= policy.max_queue:
            self._reject(
                decisions,
                waiter_id,
                "queue_full",
                f"the queue for model {name!r} is full ({depth} waiting)",
                retry_after=policy.retry_after_s,
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
        admitted at once."""
        decisions = self._advance(now)
        touched: dict[str, list[_CandidateState]] = {}
        reresolve: set[str] = set()
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
                    reresolve.update(self._remove_node(node, generation))
            self._nodes[node] = (candidate.generation, True)
            group = self._group(candidate.model)
            self._ever_served.add(group.name)
            state = group.candidates.get(candidate.key)
            if state is None:
                if not group.candidates:
                    reresolve.add(group.name)
                state = _CandidateState(candidate=candidate, group=group)
                group.candidates[candidate.key] = state
                self._by_node.setdefault((node, candidate.generation), []).append(state)
            else:
                state.update(candidate)
                reresolve.add(group.name)
            touched.setdefault(group.name, []).append(state)
        for name in reresolve:
            self._reresolve(decisions, self._groups[name])
        for name, states in touched.items():
            self._fill(decisions, self._groups[name], states)
        return decisions

    def node_left(self, node_id: str, generation: int, now: float) -> list[Decision]:
        """The node session ended: its candidates go, their in-use and draining slots become
        void (a later release or confirm is a no-op), and waiters that no remaining candidate
        can serve are rejected (those of a group left with no candidate at all keep
        waiting: a node may join)."""
        decisions = self._advance(now)
        seen = self._nodes.get(node_id)
        groups: set[str] = set()
        if seen is None or generation >= seen[0]:
            self._nodes[node_id] = (generation, False)
            if seen is not None and generation > seen[0]:  # a newer session ended: both go
                groups |= self._remove_node(node_id, seen[0])
        groups |= self._remove_node(node_id, generation)
        for name in groups:
            self._reresolve(decisions, self._groups[name])
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
        return decisions

    def set_policy(self, policy: PolicySnapshot, now: float) -> list[Decision]:
        """Replace the policy. Admitted slots are untouched (a candidate over its new limits
        just admits nobody until it is below them); queued waiters keep their deadline, are
        re-classified if the group's ``long_context_tokens`` changed, and get any capacity
        the new limits open."""
        decisions = self._advance(now)
        self._policy = policy
        for group in list(self._groups.values()):
            old = group.policy
            group.policy = policy.policy_for(group.name)
            for state in group.candidates.values():
                state.update(state.candidate)
            if group.policy.long_context_tokens != old.long_context_tokens:
                self._reclassify(group)
                self._reresolve(decisions, group)
            self._fill(decisions, group, list(group.candidates.values()))
        return decisions

    def tick(self, now: float) -> list[Decision]:
        """Expire what is due: queue timeouts (-> ``timeout`` rejections) and drain
        deadlines (the slot is freed, possibly admitting a waiter)."""
        return self._advance(now)

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do, or None."""
        waiter = self._peek_deadline()
        drain = self._peek_drain()
        times = [t for t in (waiter, drain) if t is not None]
        return min(times) if times else None

    def statistics(self) -> AdmissionStatistics:
        groups = {
            name: GroupStatistics(short=group.depth[_SHORT], long=group.depth[_LONG])
            for name, group in self._groups.items()
        }
        candidates: dict[CandidateKey, CandidateStatistics] = {}
        for group in self._groups.values():
            for key, state in group.candidates.items():
                total, _, long = state.limits
                candidates[key] = CandidateStatistics(
                    total=total,
                    in_use=state.in_use[_SHORT] + state.in_use[_LONG],
                    draining=state.draining[_SHORT] + state.draining[_LONG],
                    long_total=long,
                    long_in_use=state.in_use[_LONG],
                    long_draining=state.draining[_LONG],
                )
        return AdmissionStatistics(
            groups=groups,
            candidates=candidates,
            admissions=dict(self._admissions),
            rejections=dict(self._rejections),
            cancellations=self._cancellations,
            drains_expired=self._drains_expired,
        )

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
            group = self._groups[name] = _Group(name=name, policy=self._policy.policy_for(name))
        return group

    def _unfit(self, state: _CandidateState, waiter: _Waiter) -> str | None:
        return waiter.needs.unfit(state.candidate, _CLASSES[waiter.klass])

    def _pick(self, waiter: _Waiter, options: Iterable[_CandidateState]) -> _CandidateState | None:
        """The session's last node if free, else the least loaded, ties round-robin."""
        session = waiter.needs.session_id
        preferred = (
            self._sessions.get((waiter.group.name, session)) if session is not None else None
        )
        best: _CandidateState | None = None
        best_key: tuple[int, float, int] | None = None
        for state in options:
            key = (
                0 if state.candidate.node_id == preferred else 1,
                state.load(),
                state.last_pick,
            )
            if best_key is None or key < best_key:
                best, best_key = state, key
        return best

    def _admit(
        self,
        decisions: list[Decision],
        waiter: _Waiter,
        state: _CandidateState,
        reason: AdmitReason,
    ) -> None:
        if self._waiters.get(waiter.id) is waiter:
            self._end(waiter)
        slot = _Slot(id=next(self._slot_ids), state=state, klass=waiter.klass)
        self._slots[slot.id] = slot
        state.slot_ids.add(slot.id)
        state.in_use[waiter.klass] += 1
        state.last_pick = next(self._picks)
        session = waiter.needs.session_id
        if session is not None:
            key = (waiter.group.name, session)
            self._sessions[key] = state.candidate.node_id
            self._sessions.move_to_end(key)
            if len(self._sessions) > SESSION_MEMORY:
                self._sessions.popitem(last=False)
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

    def _reject(
        self,
        decisions: list[Decision],
        waiter_id: WaiterId,
        cause: RejectCause,
        message: str,
        *,
        retry_after: float | None = None,
        reasons: tuple[str, ...] = (),
    ) -> None:
        self._rejections[cause] += 1
        decisions.append(
            Reject(
                waiter_id=waiter_id,
                cause=cause,
                message=message,
                retry_after=retry_after,
                reasons=reasons,
            )
        )

    def _reject_incapable(
        self, decisions: list[Decision], waiter_id: WaiterId, group: str, reasons: list[str]
    ) -> None:
        self._reject(
            decisions,
            waiter_id,
            "no_capable_candidate",
            f"no candidate for model {group!r} can serve this request: " + "; ".join(reasons),
            reasons=tuple(reasons),
        )

    def _enqueue(self, waiter: _Waiter) -> None:
        group = waiter.group
        queue = group.queues.get(waiter.queue_key)
        if queue is None:
            queue = group.queues[waiter.queue_key] = deque()
        queue.append(waiter)
        group.depth[waiter.klass] += 1
        self._waiters[waiter.id] = waiter
        heapq.heappush(self._deadlines, (waiter.deadline, waiter.seq, waiter))

    def _end(self, waiter: _Waiter, *, popped: bool = False) -> None:
        """Take a queued waiter out (lazily: it stays in its deque and, unless ``popped``,
        in the deadline heap, marked as ended)."""
        waiter.live = False
        del self._waiters[waiter.id]
        group = waiter.group
        group.depth[waiter.klass] -= 1
        group.garbage += 1
        if not popped:
            self._deadlines_dead += 1
        if group.garbage > _COMPACT_MIN and group.garbage > group.depth[0] + group.depth[1]:
            self._compact(group)
        if self._deadlines_dead > _COMPACT_MIN and self._deadlines_dead > len(self._waiters):
            self._deadlines = [entry for entry in self._deadlines if entry[2].live]
            heapq.heapify(self._deadlines)
            self._deadlines_dead = 0

    def _compact(self, group: _Group) -> None:
        for key in list(group.queues):
            live = deque(w for w in group.queues[key] if w.live)
            if live:
                group.queues[key] = live
            else:
                del group.queues[key]
        group.garbage = 0

    def _reclassify(self, group: _Group) -> None:
        waiters = group.waiters()
        group.queues.clear()
        group.depth[:] = [0, 0]
        group.garbage = 0
        for waiter in waiters:
            long = waiter.needs.request_class(group.policy.long_context_tokens) == "long"
            waiter.klass = _LONG if long else _SHORT
            group.queues.setdefault(waiter.queue_key, deque()).append(waiter)
            group.depth[waiter.klass] += 1

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
        opened = [k for k in (_SHORT, _LONG) if now_free[k] and not was_free[k]]
        if opened:
            self._fill(decisions, state.group, [state], opened)

    def _oldest_for(
        self, group: _Group, klass: int, state: _CandidateState, bound: tuple[int, int] | None
    ) -> _Waiter | None:
        """The oldest queued waiter of ``klass`` that ``state`` can serve (older than
        ``bound``, if given)."""
        best: _Waiter | None = None
        empty: list[tuple[int, bool, int]] = []
        for key, queue in group.queues.items():
            if key[0] != klass or key[2] & ~state.capmask:
                continue
            while queue and not queue[0].live:
                queue.popleft()
                group.garbage -= 1
            if not queue:
                empty.append(key)
                continue
            for waiter in queue:
                if not waiter.live:
                    continue
                if bound is not None and waiter.order >= bound:
                    break
                if self._unfit(state, waiter) is None:
                    best, bound = waiter, waiter.order
                    break
        for key in empty:
            del group.queues[key]
        return best

    def _fill(
        self,
        decisions: list[Decision],
        group: _Group,
        states: Sequence[_CandidateState],
        classes: Sequence[int] = (_SHORT, _LONG),
    ) -> None:
        """Give free slots of ``states`` to the oldest waiters that can use them."""
        states = [s for s in states if group.candidates.get(s.key) is s]
        while True:
            oldest: _Waiter | None = None
            for state in states:
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
        for waiter in group.waiters():
            reasons = []
            for state in group.candidates.values():
                reason = self._unfit(state, waiter)
                if reason is None:
                    break
                reasons.append(reason)
            else:
                self._end(waiter)
                self._reject_incapable(decisions, waiter.id, group.name, reasons)

    def _remove_node(self, node_id: str, generation: int) -> set[str]:
        """Drop the candidates of (node, generation) and void their slots; returns the names
        of the groups that lost candidates."""
        states = self._by_node.pop((node_id, generation), [])
        groups: set[str] = set()
        for state in states:
            group = state.group
            if group.candidates.get(state.key) is state:
                del group.candidates[state.key]
                groups.add(group.name)
            for slot_id in state.slot_ids:
                self._slots.pop(slot_id, None)
            state.slot_ids.clear()
        return groups

    # ------------------------------------------------------------------ time

    def _peek_deadline(self) -> float | None:
        heap = self._deadlines
        while heap and not heap[0][2].live:
            heapq.heappop(heap)
            self._deadlines_dead -= 1
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
        """Expire everything due at ``now``, in time order (a waiter due at the same time as
        a drain times out first: nobody is admitted at or after its deadline)."""
        self._now = max(self._now, float(now))
        decisions: list[Decision] = []
        while True:
            waiter_due = self._peek_deadline()
            drain_due = self._peek_drain()
            if (
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
                    waiter.id,
                    "timeout",
                    f"no slot for model {group.name!r} became free within "
                    f"{group.policy.queue_timeout_s:g} s",
                    retry_after=group.policy.retry_after_s,
                )
            else:
                return decisions
