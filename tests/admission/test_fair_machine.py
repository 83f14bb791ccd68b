"""A Hypothesis state machine over the admission core's fair queueing.

One group, arbitrary arrivals (tenant, priority band; each tenant has its own weight),
requeued arrivals, cancels, releases, capacity changes and time passing (queue timeouts).
Two worlds, drawn at the start:

* *homogeneous*: every waiter can use every candidate. Then the rules of "Fairness" in
  ``docs/admission.md`` are checked exactly: band order, FIFO within a tenant, and the
  fairness bound: for any two tenants of a band that have both been backlogged since some
  admission, their admissions since then, each divided by its weight, differ by at most
  one round (``1 / w_a + 1 / w_b``: start-time fair queueing's bound for unit requests);
* *constrained*: some waiters need vision, which one candidate lacks. Fairness between
  tenants is then not promised, but band order and FIFO within a tenant still hold among
  the waiters that could have used the chosen candidate.

In both: requeued waiters first (FIFO among them), work-conserving (no queued waiter could
use a candidate with a free slot), every waiter ends exactly once, and teardown leaves
nothing behind.

Affinity (``docs/admission.md``, "Affinity": it chooses the candidate, never the waiter),
also drawn at the start: *off*; *pick* (on, with no hold: it only chooses which candidate a
keyed waiter takes, so every rule above, the fairness bound included, must hold exactly);
*hold* (on, with 1 s holds: a keyed waiter whose preferred candidate is full can use only
that one for its first second, so it counts as a waiter that cannot use the others, as a
constrained one; band order, FIFO within a tenant and work-conserving hold with that, and
the fairness bound is not promised).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dispatcher.admission import (
    AdmissionCore,
    Admit,
    CandidateIdentity,
    CandidateKey,
    Needs,
    Policy,
    PolicySnapshot,
    Reject,
    Share,
    rendezvous_rank,
)

from .helpers import cand

TENANTS = ("a", "b", "c", "d")
WEIGHTS = (0.5, 1.0, 1.0, 2.0, 3.0)
TIMEOUT = 10.0
EPSILON = 1e-9
HOLD = 1.0
MAX_QUEUE = 40


@attrs.define
class MWaiter:
    id: int
    share: Share
    retry: bool
    seq: int
    needs: Needs
    hold_until: float | None = None
    placed: CandidateIdentity | None = None
    """Where its affinity key was last served when it was submitted (its own)."""

    def ahead_of(self, other: MWaiter) -> bool:
        """Whether the rules put ``self`` before ``other`` whatever the virtual times."""
        if self.retry != other.retry:
            return self.retry
        if self.retry:
            return self.seq < other.seq
        if self.share.priority != other.share.priority:
            return self.share.priority > other.share.priority
        return self.share.tenant == other.share.tenant and self.seq < other.seq


class FairMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core = AdmissionCore(self.policy("off"))
        self.affinity = "off"
        self.now = 0.0
        self.ids = itertools.count()
        self.seqs = itertools.count()
        self.weights: dict[str, float] = {}
        self.homogeneous = True
        self.candidates: dict[CandidateKey, int] = {}
        """Each candidate's slots (n1 has vision; n2 too, in the homogeneous world)."""
        self.queued: dict[int, MWaiter] = {}
        self.slots: dict[int, CandidateKey] = {}
        self.ended: set[int] = set()
        self.placed: dict[str, CandidateIdentity] = {}
        """Affinity key -> the candidate that last served it (preferred while it can)."""
        self.log: dict[int, list[str]] = {}
        """Per band, the tenant of each first-time waiter admitted from the queue."""
        self.since: dict[tuple[int, str], int] = {}
        """(band, tenant) backlogged -> the length of its band's log when it became so."""

    # ------------------------------------------------------------------ model helpers

    @staticmethod
    def policy(affinity: str) -> PolicySnapshot:
        return PolicySnapshot(
            default=Policy(
                max_queue=MAX_QUEUE,
                queue_timeout_s=TIMEOUT,
                affinity=affinity != "off",
                affinity_wait_s=HOLD if affinity == "hold" else 0.0,
            )
        )

    def can_serve(self, waiter: MWaiter, key: CandidateKey) -> bool:
        return not waiter.needs.vision or key.node_id == "n1" or self.homogeneous

    def fits(self, waiter: MWaiter, key: CandidateKey) -> bool:
        """Whether ``waiter`` may take a slot of ``key`` (room aside): it can serve it, and
        the waiter is not holding for another candidate."""
        return self.can_serve(waiter, key) and self.held_for(waiter) in (None, key)

    def held_for(self, waiter: MWaiter) -> CandidateKey | None:
        """The candidate a keyed waiter holds for: its preferred one, while full, within its
        hold."""
        affinity_key = waiter.needs.affinity_key
        if waiter.hold_until is None or affinity_key is None or self.now >= waiter.hold_until:
            return None
        able = {
            CandidateIdentity(k.node_id, k.provider_id, k.model): k
            for k, slots in self.candidates.items()
            if slots > 0 and self.can_serve(waiter, k)
        }
        if not able:
            return None
        placed = waiter.placed
        first = placed if placed in able else rendezvous_rank(affinity_key, able)[0]
        preferred = able[first]
        return None if self.free(preferred) > 0 else preferred

    def free(self, key: CandidateKey) -> int:
        return self.candidates[key] - sum(1 for k in self.slots.values() if k == key)

    def backlogged(self, band: int, tenant: str) -> bool:
        return any(
            not w.retry and w.share.priority == band and w.share.tenant == tenant
            for w in self.queued.values()
        )

    def leave_queue(self, waiter: MWaiter) -> None:
        del self.queued[waiter.id]
        band, tenant = waiter.share.priority, waiter.share.tenant
        if not waiter.retry and not self.backlogged(band, tenant):
            del self.since[(band, tenant)]

    def check_fair(self, band: int) -> None:
        """The fairness bound between every two tenants backlogged in ``band`` (plus the one
        just admitted, whose backlog may have ended with it)."""
        log = self.log[band]
        tenants = [t for (b, t) in self.since if b == band]
        for a, b in itertools.combinations(tenants, 2):
            start = max(self.since[(band, a)], self.since[(band, b)])
            tail = log[start:]
            wa, wb = self.weights[a], self.weights[b]
            lag = tail.count(a) / wa - tail.count(b) / wb
            assert abs(lag) <= 1 / wa + 1 / wb + EPSILON, (band, a, b, tail)
            if tail and abs(lag) > max(1 / wa, 1 / wb) - EPSILON:
                event("fair: a pair at its full lag")

    def apply(self, decisions: Sequence[Admit | Reject], new: MWaiter | None = None) -> None:
        for decision in decisions:
            assert isinstance(decision.waiter_id, int)
            waiter = self.queued.get(decision.waiter_id)
            if waiter is None:
                assert new is not None, decision
                assert decision.waiter_id == new.id, decision
                waiter = new
            assert waiter.id not in self.ended, f"waiter {waiter.id} ended twice"
            self.ended.add(waiter.id)
            if isinstance(decision, Reject):
                assert decision.cause in ("timeout", "queue_full"), decision
                if decision.cause == "timeout":
                    assert waiter is not new
                    self.leave_queue(waiter)
                continue
            self.admitted(decision, waiter, queued=waiter is not new)

    def admitted(self, admit: Admit, waiter: MWaiter, *, queued: bool) -> None:
        key = admit.candidate.key
        assert self.free(key) > 0, f"admitted beyond the slots of {key}"
        assert self.fits(waiter, key)
        for other in self.queued.values():
            if other is not waiter and self.fits(other, key):
                assert not other.ahead_of(waiter), f"{waiter} overtook {other}"
            elif other is not waiter and other.ahead_of(waiter) and self.can_serve(other, key):
                event("affinity: passed a waiter holding for another candidate")
        self.slots[admit.slot_id] = key
        if self.affinity != "off" and waiter.needs.affinity_key is not None:
            self.placed[waiter.needs.affinity_key] = key.identity
        if not queued:
            assert admit.reason == ("requeued" if waiter.retry else "immediate")
            return
        assert admit.reason == ("requeued" if waiter.retry else "queued")
        if not waiter.retry:
            band = waiter.share.priority
            self.log.setdefault(band, []).append(waiter.share.tenant)
            if self.homogeneous and self.affinity != "hold":
                self.check_fair(band)
        self.leave_queue(waiter)

    # ------------------------------------------------------------------ rules

    @initialize(
        affinity=st.sampled_from(["off", "pick", "hold"]),
        homogeneous=st.booleans(),
        weights=st.lists(st.sampled_from(WEIGHTS), min_size=len(TENANTS), max_size=len(TENANTS)),
        slots=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    )
    def setup(
        self, affinity: str, homogeneous: bool, weights: list[float], slots: tuple[int, int]
    ) -> None:
        self.affinity = affinity
        assert self.core.set_policy(self.policy(affinity), self.now) == []
        self.homogeneous = homogeneous
        self.weights = dict(zip(TENANTS, weights, strict=True))
        joined = [
            cand("n1", slots=slots[0], caps=("vision",)),
            cand("n2", slots=slots[1], caps=() if not homogeneous else ("vision",)),
        ]
        self.candidates = {c.key: c.slots for c in joined}
        assert self.core.node_joined(joined, self.now) == []

    @rule(
        tenant=st.sampled_from(TENANTS),
        band=st.sampled_from([0, 0, 1, 2]),
        retry=st.sampled_from([False, False, False, False, True]),
        vision=st.booleans(),
        count=st.integers(1, 4),
        affinity_key=st.sampled_from([None, "k1", "k2", "k3"]),
    )
    def submit(
        self,
        tenant: str,
        band: int,
        retry: bool,
        vision: bool,
        count: int,
        affinity_key: str | None,
    ) -> None:
        """``count`` arrivals of one share (bursts build backlogs)."""
        share = Share(tenant=tenant, priority=band, weight=self.weights[tenant])
        for _ in range(count):
            waiter = MWaiter(
                id=next(self.ids),
                share=share,
                retry=retry,
                seq=next(self.seqs),
                needs=Needs(vision=vision and not self.homogeneous, affinity_key=affinity_key),
                placed=None if affinity_key is None else self.placed.get(affinity_key),
            )
            if (
                self.affinity == "hold"
                and affinity_key is not None
                and (retry or len(self.queued) < MAX_QUEUE)
            ):
                waiter.hold_until = self.now + HOLD
            decisions = self.core.submit(
                waiter.id, "m", waiter.needs, self.now, requeue=retry, share=share
            )
            self.apply(decisions, waiter)
            if waiter.id not in self.ended:
                self.queued[waiter.id] = waiter
                if not retry:
                    self.since.setdefault((band, tenant), len(self.log.setdefault(band, [])))

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        waiter = self.queued[data.draw(st.sampled_from(sorted(self.queued)))]
        assert self.core.cancel(waiter.id, self.now) == []
        self.ended.add(waiter.id)
        self.leave_queue(waiter)

    @precondition(lambda self: self.slots)
    @rule(data=st.data(), count=st.integers(1, 4))
    def release(self, data: st.DataObject, count: int) -> None:
        """``count`` slots end, one after the other (each may admit a waiter)."""
        for _ in range(count):
            if not self.slots:
                return
            slot_id = data.draw(st.sampled_from(sorted(self.slots)))
            del self.slots[slot_id]
            self.apply(self.core.release(slot_id, self.now))

    @rule(node=st.sampled_from(["n1", "n2"]), slots=st.integers(0, 3))
    def capacity(self, node: str, slots: int) -> None:
        [key] = [k for k in self.candidates if k.node_id == node]
        self.candidates[key] = slots
        self.apply(self.core.capacity_changed(key, slots, 0, self.now))

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self.apply(self.core.tick(self.now))

    # ------------------------------------------------------------------ invariants

    @invariant()
    def work_conserving(self) -> None:
        for key in self.candidates:
            if self.free(key) > 0:
                assert not any(self.fits(w, key) for w in self.queued.values()), key

    @invariant()
    def depth_agrees(self) -> None:
        groups = self.core.statistics().groups
        assert (groups["m"].depth if "m" in groups else 0) == len(self.queued)
        assert all(self.core.is_queued(w) for w in self.queued)

    def teardown(self) -> None:
        while self.slots:  # a release may admit a queued waiter onto the freed slot
            slot_id = min(self.slots)
            del self.slots[slot_id]
            self.apply(self.core.release(slot_id, self.now))
        self.now += TIMEOUT
        self.apply(self.core.tick(self.now))
        assert not self.queued
        statistics = self.core.statistics()
        assert statistics.waiting == 0
        assert statistics.in_use == 0


TestFairQueueing = FairMachine.TestCase
TestFairQueueing.settings = settings(settings(), stateful_step_count=60)
