"""A Hypothesis state machine over the admission core, checked against a small model.

The model does not re-implement selection; it keeps the facts (live candidates and
generations, slots and their class, queued waiters with their order and deadline) and checks
every decision the core returns against the rules of ``docs/admission.md``:

* capacity: in use + draining never exceeds a candidate's limits (total and per class),
  except right after the limits were lowered below the occupancy; and no admission happens
  unless the candidate had room in the waiter's class;
* FIFO: an admitted waiter never overtakes an older queued waiter of its group and class
  that could have used the same candidate;
* never a stale generation, never a candidate that fails the waiter's needs;
* work-conserving: no queued waiter could use a candidate with room in its class;
* every waiter ends exactly once; timeouts, drain deadlines and cool-down ends fire in
  time order;
* health (failure-aware selection): the model keeps each identity's state (healthy, ejected
  until when, probing with or without its probe) from the reports and the clock, and checks
  that an ejected candidate is only ever admitted onto by a waiter that no healthy or
  probing candidate can serve (so never while a healthy capable one has a free slot), that
  a probing candidate has at most one probe in flight, and that work-conserving and FIFO
  hold with health taken into account;
* affinity (groups whose policy turns it on, requests with an affinity key): the model
  ranks the fit, not ejected candidates with slots of the request's class by
  ``rendezvous_rank`` and checks every admission against the rule of ``docs/admission.md``:
  the first in the ranking with room within the bounded load (else the least loaded with
  room), never another while the request's hold lasts and its first-ranked one has no
  room; a request never waits while another fit candidate has room for longer than its
  ``affinity_wait_s`` (checked on the machine's clock); the hold's end is a deadline; the
  affinity counters (hits, spills by reason) agree; FIFO and work-conserving hold with the
  hold taken into account (a held waiter does not block those behind it);
* the core's statistics (health included) and next deadline agree with the model;
* bounded memory: a group exists exactly while it has a candidate or a queued waiter, or
  the policy names it (so one with none of them is gone after the input that emptied it),
  and ``knows_model`` says so; an identity's health is forgotten when it has no joined
  candidate and nothing to remember (its ``ejections_total`` starts again from 0);
* a request for a group that does not exist is ``model_unavailable`` while its last
  candidate left less than the linger ago or the requesting tenant's allowed models name
  it (``tenant_models``), else ``unknown_model``;
* teardown: after releasing everything and letting time pass, nothing is in use, draining
  or queued.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import attrs
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from dispatcher.admission import (
    AdmissionCore,
    Admit,
    Candidate,
    CandidateIdentity,
    CandidateKey,
    Decision,
    Needs,
    Policy,
    PolicySnapshot,
    Reject,
    RequestClass,
    WaiterId,
    rendezvous_rank,
)

NODES = ("n1", "n2", "n3")
PROVIDERS = ("p1", "p2")
GROUPS = ("g1", "g2")
MODELS = ("g1", "g2", "alias1", "g3", "nope")  # g3: known to the policy only; nope: unknown
CAPABILITIES = ("tools", "json", "vision")


def _not_p2(candidate: Candidate) -> str | None:
    return "p2 is excluded by the caller" if candidate.provider_id == "p2" else None


def _only_n1(candidate: Candidate) -> str | None:
    return None if candidate.node_id == "n1" else "not n1"


PREDICATES: tuple[Callable[[Candidate], str | None] | None, ...] = (None, _not_p2, _only_n1)


def _policy(
    max_queue: int = 3,
    timeout: float = 10.0,
    cap: int | None = None,
    long_tokens: int | None = 3000,
    drain: float = 3.0,
    eject_after: int = 2,
    eject_base: float = 2.0,
    eject_max: float = 8.0,
    affinity: bool = False,
    wait: float = 0.5,
    load: float = 1.25,
) -> Policy:
    return Policy(
        max_queue=max_queue,
        queue_timeout_s=timeout,
        per_candidate_cap=cap,
        long_context_tokens=long_tokens,
        drain_timeout_s=drain,
        retry_after_s=1.0,
        eject_after_failures=eject_after,
        eject_base_s=eject_base,
        eject_max_s=eject_max,
        affinity=affinity,
        affinity_wait_s=wait,
        affinity_load_factor=load,
    )


LINGER = 5.0
"""Every policy's ``model_linger_s`` (the unit tests change it; one value here keeps the
model of what the core remembers exact)."""

POLICIES = (
    PolicySnapshot(
        default=_policy(affinity=True),
        groups={"g3": _policy(timeout=4.0)},
        aliases={"alias1": "g1"},
        model_linger_s=LINGER,
    ),
    PolicySnapshot(
        default=_policy(
            max_queue=6,
            timeout=5.0,
            cap=1,
            long_tokens=None,
            drain=1.0,
            eject_after=1,
            affinity=True,
            wait=2.0,
            load=1.0,
        ),
        groups={
            "g2": _policy(max_queue=1, timeout=0.0, eject_after=0, affinity=True, wait=0.0),
            "g3": _policy(),
        },
        aliases={"alias1": "g2"},
        model_linger_s=LINGER,
    ),
    PolicySnapshot(
        default=_policy(max_queue=0, cap=2, long_tokens=5000, eject_base=1.0, eject_max=3.0),
        groups={
            "g1": _policy(
                max_queue=4, timeout=2.0, long_tokens=1000, eject_after=3, affinity=True, wait=3.0
            ),
        },
        model_linger_s=LINGER,
        tenant_models={"": {"nope"}, "someone-else": {"g3"}},
    ),
    PolicySnapshot(
        default=_policy(max_queue=5, long_tokens=None, affinity=True, wait=1.0, load=3.0),
        groups={"g2": _policy(max_queue=2, timeout=3.0, affinity=True, wait=0.5, load=1.0)},
        model_linger_s=LINGER,
    ),
)

# Mostly plain needs, so that requests compete for the same slots and queues form.
rarely = st.sampled_from([False, False, False, True])
needs_strategy = st.builds(
    Needs,
    tools=rarely,
    json=rarely,
    vision=rarely,
    estimated_tokens=st.sampled_from([0, 0, 500, 1500, 4000, 6000]),
    predicate=st.sampled_from((None, None, None, *PREDICATES[1:])),
    session_id=st.sampled_from([None, "s1", "s2"]),
    affinity_key=st.sampled_from([None, "k1", "k2", "k3", "k4"]),
)


@attrs.define
class MWaiter:
    id: WaiterId
    group: str
    needs: Needs
    retry: bool
    seq: int
    deadline: float
    submitted: float = 0.0
    hold_until: float | None = None
    """Affinity: the end of its hold (set at submit as the core's rule says)."""
    hold_pending: bool = False
    """Its hold's end has not been expired yet (a deadline of the core)."""
    placed: CandidateIdentity | None = None
    """Affinity: where its key was last served when it was submitted (its own)."""

    @property
    def order(self) -> tuple[int, int]:
        return (0 if self.retry else 1, self.seq)


@attrs.define
class MSlot:
    key: CandidateKey
    klass: RequestClass
    draining: bool = False
    deadline: float = 0.0


@attrs.define
class MHealth:
    """One identity's health, as the rules of ``docs/admission.md`` say it must be."""

    state: str = "healthy"
    failures: int = 0
    ejections: int = 0
    until: float | None = None
    seq: int = -1
    probe: int | None = None
    total: int = 0

    @property
    def pristine(self) -> bool:
        return (self.state, self.failures, self.ejections) == ("healthy", 0, 0)


class AdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = POLICIES[0]
        self.core = AdmissionCore(self.policy)
        self.now = 0.0
        self.expired_now = True
        self.candidates: dict[CandidateKey, Candidate] = {}
        self.nodes: dict[str, tuple[int, bool]] = {}
        self.queued: dict[WaiterId, MWaiter] = {}
        self.slots: dict[int, MSlot] = {}
        self.slot_ids_seen: set[int] = set()
        self.over: set[CandidateKey] = set()
        self.submitted: set[WaiterId] = set()
        self.ended: set[WaiterId] = set()
        self.ids = itertools.count()
        self.health: dict[CandidateIdentity, MHealth] = {}
        self.cool_seq = itertools.count()
        self.ejections = 0
        self.left_at: dict[str, float] = {}
        """group -> when its last candidate left (the latest time it lost its last one)."""
        self.affinity: dict[str, dict[str, int]] = {}
        self.placed: dict[tuple[str, str], CandidateIdentity] = {}
        """(group, affinity key) -> the identity that last served the key (its placement)."""
        """group -> its affinity counters (reset when the core drops the group)."""

    # ------------------------------------------------------------------ model helpers

    def group_policy(self, group: str) -> Policy:
        return self.policy.policy_for(group)

    def klass(self, waiter: MWaiter) -> RequestClass:
        return waiter.needs.request_class(self.group_policy(waiter.group).long_context_tokens)

    def group_candidates(self, group: str) -> list[Candidate]:
        return [c for c in self.candidates.values() if c.model == group]

    def group_exists(self, group: str) -> bool:
        """Whether the core must hold ``group``: a candidate or a queued waiter keeps it."""
        return bool(self.group_candidates(group)) or any(
            w.group == group for w in self.queued.values()
        )

    def forget_departed(self) -> None:
        """The core keeps no health for an identity with no joined candidate and nothing to
        remember."""
        joined = {c.identity for c in self.candidates.values()}
        for identity in [i for i, h in self.health.items() if h.pristine and i not in joined]:
            del self.health[identity]

    def limits(self, key: CandidateKey) -> tuple[int, int, int]:
        candidate = self.candidates[key]
        policy = self.group_policy(candidate.model)
        total = candidate.slots
        if policy.per_candidate_cap is not None:
            total = min(total, policy.per_candidate_cap)
        if policy.long_context_tokens is None:
            return total, total, 0
        long = min(candidate.long_context_slots, total)
        return total, total - long, long

    def occupancy(self, key: CandidateKey) -> tuple[int, int]:
        short = sum(1 for s in self.slots.values() if s.key == key and s.klass == "short")
        long = sum(1 for s in self.slots.values() if s.key == key and s.klass == "long")
        return short, long

    def within(self, key: CandidateKey) -> bool:
        total, short_limit, long_limit = self.limits(key)
        short, long = self.occupancy(key)
        return short + long <= total and short <= short_limit and long <= long_limit

    def has_room(self, key: CandidateKey, klass: RequestClass) -> bool:
        total, short_limit, long_limit = self.limits(key)
        short, long = self.occupancy(key)
        limit, used = (short_limit, short) if klass == "short" else (long_limit, long)
        return short + long < total and used < limit

    def fits(self, waiter: MWaiter, candidate: Candidate) -> bool:
        return waiter.needs.unfit(candidate, self.klass(waiter)) is None

    def h(self, identity: CandidateIdentity) -> MHealth:
        return self.health.get(identity, MHealth())

    def health_allows(self, waiter: MWaiter, candidate: Candidate) -> bool:
        """Whether health lets ``waiter`` onto ``candidate`` (room and needs aside)."""
        health = self.h(candidate.identity)
        if health.state == "healthy":
            return True
        if health.state == "probing":
            return health.probe is None
        return not any(
            self.fits(waiter, c) and self.h(c.identity).state != "ejected"
            for c in self.group_candidates(waiter.group)
        )

    def usable(self, waiter: MWaiter, candidate: Candidate) -> bool:
        return (
            self.fits(waiter, candidate)
            and self.has_room(candidate.key, self.klass(waiter))
            and self.health_allows(waiter, candidate)
            and self.holding(waiter) is None
        )

    # affinity: the rule of docs/admission.md, written from the words (not the core's code)

    def affine(self, waiter: MWaiter) -> bool:
        return waiter.needs.affinity_key is not None and self.group_policy(waiter.group).affinity

    def class_limit(self, key: CandidateKey, klass: RequestClass) -> int:
        return self.limits(key)[1 if klass == "short" else 2]

    def ranked(self, waiter: MWaiter) -> list[Candidate]:
        """The candidates an affine waiter may prefer, in its key's order: fit, not ejected,
        with slots of its class."""
        key = waiter.needs.affinity_key
        assert key is not None
        klass = self.klass(waiter)
        fit = {
            c.identity: c
            for c in self.group_candidates(waiter.group)
            if self.fits(waiter, c)
            and self.class_limit(c.key, klass) > 0
            and self.h(c.identity).state != "ejected"
        }
        return [fit[identity] for identity in self.preference(waiter, key, fit)]

    def preference(
        self, waiter: MWaiter, key: str, identities: Iterable[CandidateIdentity]
    ) -> list[CandidateIdentity]:
        """``identities`` in ``key``'s order: where the key was last served (when ``waiter``
        was submitted) first, then by rendezvous ranking."""
        ranked = rendezvous_rank(key, identities)
        placed = waiter.placed
        if placed in ranked:
            ranked.remove(placed)
            ranked.insert(0, placed)
        return ranked

    def room_for(self, waiter: MWaiter, candidate: Candidate) -> bool:
        """Room in its class and health lets it in (a probing one: no probe in flight)."""
        health = self.h(candidate.identity)
        return self.has_room(candidate.key, self.klass(waiter)) and not (
            health.state == "probing" and health.probe is not None
        )

    def holding(self, waiter: MWaiter) -> Candidate | None:
        """The candidate an affine waiter waits for while its hold lasts (its first-ranked,
        with no room for it), else None."""
        if waiter.hold_until is None or self.now >= waiter.hold_until or not self.affine(waiter):
            return None
        ranked = self.ranked(waiter)
        if not ranked or self.room_for(waiter, ranked[0]):
            return None
        return ranked[0]

    def occupied(self, key: CandidateKey) -> int:
        return sum(self.occupancy(key))

    def affinity_choice(self, waiter: MWaiter, admitted: Candidate) -> None:
        """Check an affine waiter's admission against the rule."""
        ranked = self.ranked(waiter)
        if not ranked:
            event("affinity: every candidate ejected (usual selection)")
            return
        assert self.holding(waiter) is None, (
            f"{waiter.id!r} admitted onto {admitted.key} while holding for its preferred one"
        )
        roomy = [c for c in ranked if self.room_for(waiter, c)]
        assert admitted in roomy, (admitted.key, [c.key for c in roomy])
        occupied = sum(self.occupied(c.key) for c in ranked) + 1
        total = sum(self.limits(c.key)[0] for c in ranked)
        factor = self.group_policy(waiter.group).affinity_load_factor
        within = [
            c
            for c in roomy
            if self.occupied(c.key) + 1
            <= math.ceil(factor * occupied * self.limits(c.key)[0] / total)
        ]
        if within:
            assert admitted == within[0], (
                f"{waiter.id!r} on {admitted.key}, not the first within the load bound "
                f"{within[0].key}"
            )
            event("affinity: first ranked" if admitted == ranked[0] else "affinity: spilled")
        else:

            def load(c: Candidate) -> float:
                return self.occupied(c.key) / self.limits(c.key)[0]

            assert load(admitted) == min(load(c) for c in roomy)
            event("affinity: none within the bound")

    def affinity_result(self, waiter: MWaiter, admitted: Candidate) -> str:
        key = waiter.needs.affinity_key
        if key is None:
            return "unkeyed"
        candidates = {c.identity: c for c in self.group_candidates(waiter.group)}
        home = candidates[self.preference(waiter, key, candidates)[0]]
        if home == admitted:
            return "hit"
        if self.class_limit(home.key, self.klass(waiter)) == 0 or not self.fits(waiter, home):
            return "ineligible"
        if self.h(home.identity).state == "ejected":
            return "ejected"
        return "over_load" if self.room_for(waiter, home) else "busy"

    def drop_slot(self, slot_id: int) -> MSlot | None:
        slot = self.slots.pop(slot_id, None)
        if slot is not None:
            health = self.health.get(slot.key.identity)
            if health is not None and health.probe == slot_id:
                health.probe = None
        return slot

    def eject(self, health: MHealth, policy: Policy) -> None:
        health.ejections += 1
        health.state = "ejected"
        health.probe = None
        cool_down = min(policy.eject_max_s, policy.eject_base_s * 2 ** (health.ejections - 1))
        health.until = self.now + cool_down
        health.seq = next(self.cool_seq)
        health.total += 1
        self.ejections += 1

    def reset(self, health: MHealth) -> None:
        health.state = "healthy"
        health.failures = health.ejections = 0
        health.until = health.probe = None

    def note_limits_changed(self) -> None:
        for key in self.candidates:
            if not self.within(key):
                self.over.add(key)

    def end(self, waiter_id: WaiterId) -> None:
        assert waiter_id in self.submitted, waiter_id
        assert waiter_id not in self.ended, f"waiter {waiter_id!r} ended twice"
        self.ended.add(waiter_id)
        self.queued.pop(waiter_id, None)

    def void_node(self, node: str, generation: int) -> None:
        for key in [k for k in self.candidates if (k.node_id, k.generation) == (node, generation)]:
            del self.candidates[key]
            self.over.discard(key)
            if not self.group_candidates(key.model):
                self.left_at[key.model] = self.now
        for slot_id in [i for i, s in self.slots.items() if s.key.node_id == node]:
            if self.slots[slot_id].key.generation == generation:
                self.drop_slot(slot_id)

    # ------------------------------------------------------------------ decision checks

    def check_admit(self, admit: Admit, waiter: MWaiter) -> None:
        key = admit.candidate.key
        assert key in self.candidates, f"admitted to a candidate that is gone: {key}"
        assert self.candidates[key] == admit.candidate
        generation, joined = self.nodes[key.node_id]
        assert joined, "admitted to a node that left"
        assert generation == key.generation, "admitted to a stale generation"
        klass = self.klass(waiter)
        assert admit.request_class == klass
        assert self.fits(waiter, admit.candidate), "admitted to a candidate failing the needs"
        assert self.has_room(key, klass), f"admitted beyond the limits of {key}"
        health = self.h(key.identity)
        if health.state == "ejected":
            for healthy in self.group_candidates(waiter.group):
                assert not (
                    self.fits(waiter, healthy)
                    and self.h(healthy.identity).state == "healthy"
                    and self.has_room(healthy.key, klass)
                ), f"admitted onto ejected {key} while healthy {healthy.key} had room"
        assert self.health_allows(waiter, admit.candidate), (
            f"health forbids {waiter.id!r} on {key} ({health})"
        )
        for other in self.queued.values():
            if (
                other.id != waiter.id
                and other.group == waiter.group
                and self.klass(other) == klass
                and other.order < waiter.order
                and self.fits(other, admit.candidate)
                and self.health_allows(other, admit.candidate)
                and self.holding(other) is None
            ):
                raise AssertionError(f"{waiter.id!r} overtook older waiter {other.id!r}")
        if health.state != "healthy":
            event(f"admitted onto a candidate that is {health.state}")
        if self.group_policy(waiter.group).affinity:
            if self.affine(waiter):
                self.affinity_choice(waiter, admit.candidate)
            result = self.affinity_result(waiter, admit.candidate)
            counts = self.affinity.setdefault(waiter.group, {})
            counts[result] = counts.get(result, 0) + 1
            event(f"affinity result {result}")
            if waiter.needs.affinity_key is not None:
                placement = (waiter.group, waiter.needs.affinity_key)
                if placement in self.placed and self.placed[placement] != key.identity:
                    event("affinity: a key placed elsewhere")
                self.placed[placement] = key.identity
        if health.state == "probing":
            assert health.probe is None, "a second probe in flight"
            self.health[key.identity].probe = admit.slot_id
        if waiter.id in self.queued:
            assert admit.reason == ("requeued" if waiter.retry else "queued"), admit
            assert admit.queued_for >= 0
        self.end(waiter.id)
        assert admit.slot_id not in self.slot_ids_seen, "slot id reused"
        self.slot_ids_seen.add(admit.slot_id)
        self.slots[admit.slot_id] = MSlot(key=key, klass=klass)

    def check_reresolve_reject(self, reject: Reject) -> None:
        waiter = self.queued[reject.waiter_id]
        assert reject.cause == "no_capable_candidate", reject
        candidates = self.group_candidates(waiter.group)
        assert candidates, "rejected for capability with no candidate at all"
        assert not any(self.fits(waiter, c) for c in candidates)
        assert len(reject.reasons) == len(candidates)
        self.end(waiter.id)

    def check_queued_decision(self, decision: Decision) -> None:
        assert decision.waiter_id in self.queued, f"decision for a waiter not queued: {decision}"
        event(f"queued waiter -> {decision.__class__.__name__}")
        waiter = self.queued[decision.waiter_id]
        if isinstance(decision, Admit):
            self.check_admit(decision, waiter)
        else:
            self.check_reresolve_reject(decision)

    def expire(self, decisions: deque[Decision]) -> None:
        """Replay what the core expires at ``now``, in time order, consuming the decisions
        each expiry produced."""
        events: list[tuple[float, int, int, WaiterId]] = [
            (w.deadline, 0, w.seq, w.id) for w in self.queued.values() if w.deadline <= self.now
        ]
        events += [
            (s.deadline, 1, slot_id, slot_id)
            for slot_id, s in self.slots.items()
            if s.draining and s.deadline <= self.now
        ]
        cool_downs = {h.seq: identity for identity, h in self.health.items()}
        events += [
            (h.until, 2, h.seq, h.seq)
            for h in self.health.values()
            if h.state == "ejected" and h.until is not None and h.until <= self.now
        ]
        events += [
            (w.hold_until, 3, w.seq, w.id)
            for w in self.queued.values()
            if w.hold_pending and w.hold_until is not None and w.hold_until <= self.now
        ]
        events.sort(key=lambda e: e[:3])
        for _, kind, _, ident in events:
            if kind == 3:
                held = self.queued.get(ident)
                if held is None:
                    continue
                held.hold_pending = False
                # the end of a hold: it (and any other whose hold is over) may take any
                # candidate with room now
                self.admit_usable(decisions)
            elif kind == 2:
                assert isinstance(ident, int)
                identity = cool_downs[ident]
                health = self.health[identity]
                health.state, health.until = "probing", None
                # the probe, if a waiter can take it (now, not after a later drain expiry
                # freed a slot for it); an affine waiter it frees may go elsewhere
                self.admit_usable(decisions)
            elif kind == 0:
                if ident not in self.queued:
                    continue
                assert decisions, f"waiter {ident!r} past its deadline was not rejected"
                reject = decisions.popleft()
                assert isinstance(reject, Reject), reject
                assert (reject.waiter_id, reject.cause) == (ident, "timeout"), reject
                assert reject.retry_after is not None
                self.end(ident)
            else:
                assert isinstance(ident, int)
                slot = self.slots.get(ident)
                if slot is None or not slot.draining:
                    continue
                self.drop_slot(ident)
                self.admit_usable(decisions)
        self.expired_now = True

    def admit_usable(self, decisions: deque[Decision]) -> None:
        """Consume the admissions an expiry caused: those at the head of ``decisions`` of
        queued waiters onto candidates the model says they may use now."""
        while decisions:
            head = decisions[0]
            if not (
                isinstance(head, Admit)
                and head.waiter_id in self.queued
                and self.candidates.get(head.candidate.key) == head.candidate
                and self.usable(self.queued[head.waiter_id], head.candidate)
            ):
                break
            self.check_queued_decision(decisions.popleft())

    def run(self, decisions: Sequence[Decision]) -> deque[Decision]:
        pending = deque(decisions)
        self.expire(pending)
        return pending

    def finish(self, pending: Iterable[Decision]) -> None:
        for decision in pending:
            self.check_queued_decision(decision)
        for key in list(self.over):
            if key not in self.candidates or self.within(key):
                self.over.discard(key)
        self.forget_departed()

    # ------------------------------------------------------------------ rules

    @rule(
        model=st.sampled_from(MODELS),
        needs=needs_strategy,
        requeue=st.booleans(),
        data=st.data(),
    )
    def submit(self, model: str, needs: Needs, requeue: bool, data: st.DataObject) -> None:
        exclude_some: bool = data.draw(rarely, label="exclude some")
        if self.candidates and exclude_some:
            keys = sorted(self.candidates)
            needs = attrs.evolve(
                needs, exclude=frozenset(data.draw(st.sets(st.sampled_from(keys), max_size=2)))
            )
        self.do_submit(model, needs, requeue)

    @rule(
        model=st.sampled_from(GROUPS),
        needs=st.sampled_from(
            [
                Needs(),
                Needs(estimated_tokens=4000),
                Needs(session_id="s1"),
                Needs(affinity_key="k1"),
                Needs(affinity_key="k2", session_id="s2"),
                Needs(affinity_key="k3", estimated_tokens=4000),
            ]
        ),
    )
    def submit_plain(self, model: str, needs: Needs) -> None:
        """The common request, more often: it makes requests compete and queues form."""
        self.do_submit(model, needs, False)

    def do_submit(self, model: str, needs: Needs, requeue: bool) -> None:
        n = next(self.ids)
        waiter_id: WaiterId = n if n % 2 else f"w{n}"
        self.submitted.add(waiter_id)
        pending = self.run(self.core.submit(waiter_id, model, needs, self.now, requeue=requeue))
        group = self.policy.resolve(model)
        # after what the submit expired first (self.run), before the waiter itself
        known_before = self.group_exists(group) or self.policy.knows(group)
        policy = self.group_policy(group)
        waiter = MWaiter(
            id=waiter_id,
            group=group,
            needs=needs,
            retry=requeue,
            seq=n,
            deadline=self.now + policy.queue_timeout_s,
            submitted=self.now,
            placed=(
                None if needs.affinity_key is None else self.placed.get((group, needs.affinity_key))
            ),
        )
        hold_until = self.now + policy.affinity_wait_s
        depth = sum(w.group == group for w in self.queued.values())
        if (
            needs.affinity_key is not None
            and policy.affinity
            and self.now < hold_until < waiter.deadline
            and (requeue or depth < policy.max_queue)
        ):
            waiter.hold_until = hold_until
        own = [d for d in pending if d.waiter_id == waiter_id]
        rest = [d for d in pending if d.waiter_id != waiter_id]
        candidates = self.group_candidates(group)
        klass = self.klass(waiter)
        if not known_before:
            [reject] = own
            assert isinstance(reject, Reject), reject
            left_at = self.left_at.get(group)
            lingering = left_at is not None and self.now < left_at + LINGER
            if lingering or group in self.policy.tenant_models.get("", ()):
                assert reject.cause == "model_unavailable", reject
                assert reject.retry_after == self.policy.unavailable_retry_after_s
                event("submit -> model_unavailable" + (" (named)" if not lingering else ""))
            else:
                assert reject.cause == "unknown_model", reject
                assert reject.retry_after is None
            self.end(waiter_id)
        elif candidates and not any(self.fits(waiter, c) for c in candidates):
            [reject] = own
            assert isinstance(reject, Reject), reject
            assert reject.cause == "no_capable_candidate", reject
            expected = [needs.unfit(c, klass) for c in candidates]
            assert sorted(reject.reasons) == sorted(r for r in expected if r is not None)
            self.end(waiter_id)
        elif any(self.usable(waiter, c) for c in candidates):
            [admit] = own
            assert isinstance(admit, Admit), admit
            assert admit.reason == ("requeued" if requeue else "immediate")
            assert admit.queued_for == 0
            self.check_admit(admit, waiter)
        elif not requeue and sum(w.group == group for w in self.queued.values()) >= (
            policy.max_queue
        ):
            [reject] = own
            assert isinstance(reject, Reject), reject
            assert reject.cause == "queue_full", reject
            assert reject.retry_after == policy.retry_after_s
            self.end(waiter_id)
        elif waiter.deadline <= self.now:
            [reject] = own
            assert isinstance(reject, Reject), reject
            assert reject.cause == "timeout", reject
            self.end(waiter_id)
        else:
            assert own == [], own
            self.queued[waiter_id] = waiter
            waiter.hold_pending = waiter.hold_until is not None
            if self.holding(waiter) is not None:
                event("submit -> held for its preferred candidate")
        assert rest == [], rest
        event(f"submit -> {own[0].__class__.__name__ if own else 'queued'}")

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        waiter_id = data.draw(st.sampled_from(sorted(self.queued, key=str)))
        pending = self.run(self.core.cancel(waiter_id, self.now))
        if waiter_id in self.queued:
            self.end(waiter_id)
        assert not pending, pending
        assert not self.core.is_queued(waiter_id)

    @rule(waiter=st.integers(0, 50))
    def cancel_unknown(self, waiter: int) -> None:
        if waiter in self.queued:
            return
        assert not self.run(self.core.cancel(waiter, self.now))

    @precondition(lambda self: self.slot_ids_seen)
    @rule(data=st.data(), confirm=st.booleans())
    def release(self, data: st.DataObject, confirm: bool) -> None:
        # Any slot id ever issued: released or void ones must be no-ops.
        slot_id = data.draw(st.sampled_from(sorted(self.slot_ids_seen)))
        if data.draw(st.booleans(), label="prefer a live slot") and self.slots:
            slot_id = data.draw(st.sampled_from(sorted(self.slots)))
        method = self.core.confirm_drain if confirm else self.core.release
        pending = self.run(method(slot_id, self.now))
        if slot_id in self.slots:
            self.drop_slot(slot_id)
        else:
            assert not pending, pending
        self.finish(pending)

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def begin_drain(self, data: st.DataObject) -> None:
        slot_id = data.draw(st.sampled_from(sorted(self.slots)))
        pending = self.run(self.core.begin_drain(slot_id, self.now))
        slot = self.slots.get(slot_id)
        if slot is not None and not slot.draining:
            slot.draining = True
            group = self.candidates[slot.key].model
            slot.deadline = self.now + self.group_policy(group).drain_timeout_s
        assert not pending, pending

    def announce(self, node: str, generation: int, data: st.DataObject) -> list[Candidate]:
        providers = data.draw(st.sets(st.sampled_from(PROVIDERS), min_size=1), label="providers")
        candidates = []
        for provider in sorted(providers):
            for group in sorted(data.draw(st.sets(st.sampled_from(GROUPS), min_size=1))):
                candidates.append(
                    Candidate(
                        node_id=node,
                        generation=generation,
                        provider_id=provider,
                        provider_type="t",
                        adapter="a",
                        model=group,
                        served_model=group + "-served",
                        capabilities=data.draw(
                            st.just(CAPABILITIES) | st.sets(st.sampled_from(CAPABILITIES))
                        ),
                        slots=data.draw(st.sampled_from([1, 1, 2, 2, 3, 0])),
                        long_context_slots=data.draw(st.sampled_from([1, 1, 0, 2])),
                        context_window=data.draw(st.sampled_from([None, None, 5000, 1000])),
                    )
                )
        return candidates

    def joined(self, candidates: list[Candidate], superseded: tuple[str, int] | None) -> None:
        if superseded is not None:
            self.void_node(*superseded)
        for candidate in candidates:
            self.nodes[candidate.node_id] = (candidate.generation, True)
            self.candidates[candidate.key] = candidate
        self.note_limits_changed()

    @rule(node=st.sampled_from(NODES), data=st.data())
    def node_joined(self, node: str, data: st.DataObject) -> None:
        """A node joins (new generation) or re-announces in its current session."""
        generation, joined = self.nodes.get(node, (0, False))
        if not joined:
            generation += 1
        candidates = self.announce(node, generation, data)
        decisions = self.core.node_joined(candidates, self.now)
        pending = self.run(decisions)
        self.joined(candidates, None)
        self.finish(pending)

    @precondition(lambda self: any(joined for _, joined in self.nodes.values()))
    @rule(data=st.data())
    def rejoin(self, data: st.DataObject) -> None:
        """A joined node reconnects with a new generation before its old session ended."""
        node = data.draw(st.sampled_from(sorted(n for n, (_, j) in self.nodes.items() if j)))
        generation = self.nodes[node][0]
        candidates = self.announce(node, generation + 1, data)
        pending = self.run(self.core.node_joined(candidates, self.now))
        self.joined(candidates, (node, generation))
        self.finish(pending)

    @precondition(lambda self: self.nodes)
    @rule(data=st.data())
    def stale_join(self, data: st.DataObject) -> None:
        """An announcement of a generation that is older, or that already left."""
        node = data.draw(st.sampled_from(sorted(self.nodes)))
        generation, joined = self.nodes[node]
        stale = generation - 1 if joined else generation
        if stale < 1:
            return
        before = dict(self.candidates)
        candidates = self.announce(node, stale, data)
        assert not self.run(self.core.node_joined(candidates, self.now))
        assert self.candidates == before

    @precondition(lambda self: self.nodes)
    @rule(data=st.data(), stale=st.booleans())
    def node_left(self, data: st.DataObject, stale: bool) -> None:
        node = data.draw(st.sampled_from(sorted(self.nodes)))
        generation = self.nodes[node][0]
        if stale:
            generation -= 1
        pending = self.run(self.core.node_left(node, generation, self.now))
        if not stale:
            self.nodes[node] = (generation, False)
        self.void_node(node, generation)
        self.finish(pending)

    @precondition(lambda self: self.candidates)
    @rule(data=st.data(), slots=st.integers(0, 3), long=st.integers(0, 2), stale=st.booleans())
    def capacity_changed(self, data: st.DataObject, slots: int, long: int, stale: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.candidates)))
        if stale:
            key = attrs.evolve(key, generation=key.generation - 1)
        pending = self.run(self.core.capacity_changed(key, slots, long, self.now))
        if key in self.candidates:
            self.candidates[key] = attrs.evolve(
                self.candidates[key], slots=slots, long_context_slots=long
            )
            self.note_limits_changed()
        else:
            assert not pending
        self.finish(pending)

    @rule(index=st.integers(0, len(POLICIES) - 1))
    def set_policy(self, index: int) -> None:
        pending = self.run(self.core.set_policy(POLICIES[index], self.now))
        self.policy = POLICIES[index]
        for identity, health in self.health.items():
            if self.group_policy(identity.model).eject_after_failures == 0:
                self.reset(health)
        self.note_limits_changed()
        self.finish(pending)

    def report_keys(self, data: st.DataObject) -> CandidateKey:
        """A candidate to report on: a live one, one a slot is on (maybe a session that is
        gone), an older generation of a live one, or one the core never saw."""
        keys = set(self.candidates) | {s.key for s in self.slots.values()}
        keys |= {attrs.evolve(k, generation=k.generation - 1) for k in self.candidates}
        keys |= {CandidateKey("n9", 1, "p1", "g1"), CandidateKey("n1", 1, "p1", "g3")}
        return data.draw(st.sampled_from(sorted(keys)), label="reported key")

    def do_report(self, key: CandidateKey, success: bool) -> None:
        """Report on ``key`` to the core and apply the same rule to the model."""
        if success:
            pending = self.run(self.core.report_success(key, self.now))
            health = self.health.get(key.identity)
            if health is not None:
                event(f"success while {health.state}")
                self.reset(health)
            self.finish(pending)
            return
        pending = self.run(self.core.report_failure(key, self.now))
        policy = self.group_policy(key.model)
        identity = key.identity
        known = identity in self.health or (
            key.node_id in self.nodes and bool(self.group_candidates(key.model))
        )
        if policy.eject_after_failures and known:
            health = self.health.setdefault(identity, MHealth())
            health.failures += 1
            if health.state == "probing" or (
                health.state == "healthy" and health.failures >= policy.eject_after_failures
            ):
                self.eject(health, policy)
                event(f"ejected (level {health.ejections})")
        self.finish(pending)

    @rule(data=st.data(), times=st.integers(1, 3))
    def report_failure(self, data: st.DataObject, times: int) -> None:
        key = self.report_keys(data)
        for _ in range(times):
            self.do_report(key, success=False)

    @rule(data=st.data())
    def report_success(self, data: st.DataObject) -> None:
        self.do_report(self.report_keys(data), success=True)

    @precondition(lambda self: self.slots)
    @rule(data=st.data(), failed=st.booleans(), retry=st.booleans())
    def attempt_ends(self, data: st.DataObject, failed: bool, retry: bool) -> None:
        """What the gate does: report an attempt's outcome, then leave its slot; a failed
        attempt may be retried with its candidate excluded."""
        slot_id = data.draw(st.sampled_from(sorted(self.slots)))
        key = self.slots[slot_id].key
        self.do_report(key, success=not failed)
        if slot_id in self.slots:  # a drain that expired just now took it already
            pending = self.run(self.core.release(slot_id, self.now))
            self.drop_slot(slot_id)
            self.finish(pending)
        if failed and retry:
            self.do_submit(key.model, Needs(exclude=frozenset({key})), True)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 5.0, 11.0]), tick=st.booleans())
    def advance(self, dt: float, tick: bool) -> None:
        """Time passes, with a tick (what the Trio driver does at a deadline) or without one
        (the next input expires what is due)."""
        self.now += dt
        if tick:
            pending = self.run(self.core.tick(self.now))
            assert not pending, pending
            self.finish(pending)
        else:
            self.expired_now = dt == 0 and self.expired_now

    @precondition(lambda self: any(h.state == "ejected" for h in self.health.values()))
    @rule()
    def cool_down_ends(self) -> None:
        """Jump to the end of the next cool-down and tick (probes, more often)."""
        self.now = max(self.now, min(h.until for h in self.health.values() if h.until is not None))
        pending = self.run(self.core.tick(self.now))
        assert not pending, pending

    # ------------------------------------------------------------------ invariants

    @invariant()
    def capacity(self) -> None:
        for key in self.candidates:
            assert self.within(key) or key in self.over, f"{key} over its limits"

    @invariant()
    def work_conserving(self) -> None:
        if not self.expired_now:
            return  # a timeout is due but no input has happened yet
        for waiter in self.queued.values():
            candidates = self.group_candidates(waiter.group)
            assert not candidates or any(self.fits(waiter, c) for c in candidates), (
                f"{waiter.id!r} queued with no capable candidate"
            )
            for candidate in candidates:
                assert not self.usable(waiter, candidate), (
                    f"{waiter.id!r} waits while {candidate.key} has room for it"
                )
            assert waiter.deadline > self.now

    @invariant()
    def affinity_wait_is_bounded(self) -> None:
        """A waiter never waits while another fit candidate has room for it, except its hold:
        an affine waiter, within ``affinity_wait_s`` of its arrival, whose preferred
        candidate has no room."""
        if not self.expired_now:
            return
        for waiter in self.queued.values():
            elsewhere = [
                c
                for c in self.group_candidates(waiter.group)
                if self.fits(waiter, c)
                and self.has_room(c.key, self.klass(waiter))
                and self.health_allows(waiter, c)
            ]
            if not elsewhere:
                continue
            preferred = self.holding(waiter)
            assert preferred is not None, f"{waiter.id!r} waits while {elsewhere[0].key} has room"
            assert preferred not in elsewhere or not self.room_for(waiter, preferred)
            assert waiter.hold_until is not None
            assert (
                self.now - waiter.submitted
                < waiter.hold_until - waiter.submitted
                <= max(p.policy_for(waiter.group).affinity_wait_s for p in POLICIES)
            )
            event("a waiter holds for its preferred candidate while another has room")

    @invariant()
    def one_probe_at_most(self) -> None:
        for identity, health in self.health.items():
            probes = [i for i, s in self.slots.items() if i == health.probe]
            assert len(probes) <= 1
            if health.probe is not None:
                assert health.state == "probing", (identity, health)
                assert self.slots[health.probe].key.identity == identity

    @invariant()
    def statistics_agree(self) -> None:
        stats = self.core.statistics()
        for group in ("g1", "g2", "g3"):
            short = sum(
                1 for w in self.queued.values() if w.group == group and self.klass(w) == "short"
            )
            long = sum(
                1 for w in self.queued.values() if w.group == group and self.klass(w) == "long"
            )
            found = stats.groups.get(group)
            assert ((found.short, found.long) if found else (0, 0)) == (short, long)
            if found is None:
                self.affinity.pop(group, None)  # dropped: its counters start again
                continue
            assert found.affinity_on == self.group_policy(group).affinity
            counts = self.affinity.get(group, {})
            assert {r: n for r, n in found.affinity.items() if n} == counts, (group, counts)
        assert set(stats.candidates) == set(self.candidates)
        for key, candidate_stats in stats.candidates.items():
            in_use = [s for s in self.slots.values() if s.key == key and not s.draining]
            draining = [s for s in self.slots.values() if s.key == key and s.draining]
            assert candidate_stats.in_use == len(in_use)
            assert candidate_stats.draining == len(draining)
            assert candidate_stats.long_in_use == sum(s.klass == "long" for s in in_use)
            assert candidate_stats.long_draining == sum(s.klass == "long" for s in draining)
            assert (candidate_stats.total, candidate_stats.long_total) == (
                self.limits(key)[0],
                self.limits(key)[2],
            )
            health = self.h(key.identity)
            assert (
                candidate_stats.health,
                candidate_stats.consecutive_failures,
                candidate_stats.ejections,
                candidate_stats.ejected_until,
                candidate_stats.probe_in_flight,
                candidate_stats.ejections_total,
            ) == (
                health.state,
                health.failures,
                health.ejections,
                health.until,
                health.probe is not None,
                health.total,
            ), (key, health)
        assert stats.ejections == self.ejections
        for waiter_id in self.queued:
            assert self.core.is_queued(waiter_id)
        for slot_id in self.slot_ids_seen:
            slot = self.slots.get(slot_id)
            expected = None if slot is None else ("draining" if slot.draining else "in_use")
            assert self.core.slot_state(slot_id) == expected

    @invariant()
    def groups_are_bounded(self) -> None:
        """A group with no candidate, no waiter and no policy naming it does not exist after
        the input that emptied it; one with any of them does (or, named by the policy only,
        may); ``knows_model`` agrees."""
        if not self.expired_now:
            return  # a timeout is due but no input has happened yet
        groups = set(self.core.statistics().groups)
        for group in groups:
            assert self.group_exists(group) or self.policy.knows(group), (
                f"group {group!r} has no candidate, no waiter and no policy, but exists"
            )
        for group in {*GROUPS, "g3"}:
            if self.group_exists(group):
                assert group in groups, f"group {group!r} is missing"
        for model in MODELS:
            group = self.policy.resolve(model)
            known = self.group_exists(group) or self.policy.knows(group)
            assert self.core.knows_model(model) == known, model

    @invariant()
    def next_deadline_agrees(self) -> None:
        times = [w.deadline for w in self.queued.values()]
        times += [s.deadline for s in self.slots.values() if s.draining]
        times += [h.until for h in self.health.values() if h.until is not None]
        times += [w.hold_until for w in self.queued.values() if w.hold_pending and w.hold_until]
        assert self.core.next_deadline() == (min(times) if times else None)

    def teardown(self) -> None:
        for _ in range(100):
            if not self.slots and not self.queued:
                break
            for slot_id in sorted(self.slots):
                if slot_id in self.slots:
                    pending = self.run(self.core.release(slot_id, self.now))
                    self.drop_slot(slot_id)  # unless its drain just expired
                    self.finish(pending)
            if not self.slots:
                self.now += 100.0
                assert not self.run(self.core.tick(self.now))
        self.now += 100.0  # past every cool-down, also with nothing held or queued
        assert not self.run(self.core.tick(self.now))
        assert all(h.state != "ejected" for h in self.health.values())
        stats = self.core.statistics()
        assert (stats.in_use, stats.draining, stats.waiting) == (0, 0, 0)
        assert self.core.next_deadline() is None
        assert not self.queued
        assert self.ended == self.submitted


TestAdmissionCore = AdmissionMachine.TestCase
TestAdmissionCore.settings = settings(settings(), stateful_step_count=50)
