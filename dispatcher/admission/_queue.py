"""The Trio layer of admission: parks waiters and drives the core's clock.

The core decides; this layer only carries decisions out (wakes the parked task the decision
is for) and feeds the core its inputs with ``trio.current_time()``. One driver task,
:meth:`Admission.run`, sleeps until the core's next deadline and ticks it.

Ownership is lexical: a slot exists only inside ``async with admission.open_slot(...)``, and
leaving the block (normally, by an error, or cancelled) releases it exactly once, without an
``await`` (so it works inside a cancelled scope).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType

import attrs
import trio

from ..shared.forwarding import Forwarded
from ._candidates import (
    Candidate,
    CandidateKey,
    Needs,
    RequestClass,
)
from ._core import (
    AdmissionCore,
    AdmissionStatistics,
    Admit,
    AdmitReason,
    Decision,
    SlotId,
    WaiterId,
)
from ._errors import error_for
from ._fair import DEFAULT_SHARE, Share
from ._policy import PolicySnapshot


@attrs.define(eq=False)
class _Parked:
    event: trio.Event = attrs.Factory(trio.Event)
    decision: Decision | None = None


@attrs.define(eq=False, repr=False)
class Slot:
    """An admitted request's slot, valid inside its ``open_slot`` block.

    By default the slot is released when the block exits. :meth:`drain` asks instead that it
    be handed to the core as *draining* (a cancel was sent to the node; the slot stays
    occupied until :meth:`Admission.confirm_drain` or the drain timeout). :meth:`release`
    frees it early (the run ended before the block did).
    """

    _admission: Admission
    _admit: Admit
    """The core's decision that admitted the request: what the attributes below read."""
    _drain: bool = attrs.field(default=False, init=False)
    _done: bool = attrs.field(default=False, init=False)

    slot_id = Forwarded[SlotId]("_admit.slot_id")
    candidate = Forwarded[Candidate]("_admit.candidate")
    queue_reason = Forwarded[AdmitReason]("_admit.reason")
    """``"immediate"``, ``"queued"`` or ``"requeued"``."""
    queue_wait = Forwarded[float]("_admit.queued_for")
    """Seconds spent waiting in the queue."""
    request_class = Forwarded[RequestClass]("_admit.request_class")

    @property
    def released(self) -> bool:
        """True once the slot was handed back (released or draining)."""
        return self._done

    def drain(self) -> None:
        """On exit, hand the slot to the core as draining instead of releasing it."""
        self._drain = True

    def release(self) -> None:
        """Release the slot now (idempotent; exiting the block then does nothing)."""
        self._finish(drain=False)

    def _finish(self, *, drain: bool) -> None:
        if self._done:
            return
        self._done = True
        if drain:
            self._admission._carry_out(
                self._admission._core.begin_drain(self.slot_id, trio.current_time())
            )
        else:
            admission = self._admission
            decisions = admission._core.release(self.slot_id, trio.current_time())
            # A release that admits nobody only frees a slot of this candidate: no change
            # a node is told of, unless its slots held were beyond its grant.
            admission._carry_out(
                decisions,
                reported=bool(decisions) or admission._beyond_grant(self.candidate.key, 1),
            )

    def __repr__(self) -> str:
        state = "released" if self._done else "held"
        return f"<Slot {self.slot_id} on {self.candidate.label} ({state})>"


class _SlotBlock:
    """The block of :meth:`Admission.open_slot`: entering waits for the slot, leaving gives
    it back (released, or draining). A small class rather than a generator: one per
    attempt."""

    __slots__ = ("_admission", "_args", "_slot")

    def __init__(
        self, admission: Admission, model: str, needs: Needs, requeue: bool, share: Share
    ) -> None:
        self._admission = admission
        self._args = (model, needs, requeue, share)
        self._slot: Slot | None = None

    async def __aenter__(self) -> Slot:
        if self._slot is not None:
            raise RuntimeError("open_slot's block is entered once")
        self._slot = await self._admission._admit(*self._args)
        return self._slot

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        slot = self._slot
        assert slot is not None
        slot._finish(drain=slot._drain)


class Admission:
    """Admission queues for every model group, over one :class:`AdmissionCore`.

    Start :meth:`run` in a long-lived nursery (or use :func:`open_admission`), then
    ``async with admission.open_slot(model, needs) as slot:``. The registry reports nodes
    with the sync methods :meth:`node_joined`, :meth:`node_left` and
    :meth:`capacity_changed`; :meth:`set_policy` swaps the configuration. The gate reports
    how each attempt went with :meth:`report_success` and :meth:`report_failure`.
    """

    def __init__(self, policy: PolicySnapshot | None = None) -> None:
        self._core = AdmissionCore(policy)
        self._parked: dict[WaiterId, _Parked] = {}
        self._ids = itertools.count()
        self._wakeup = trio.Event()
        self._armed = math.inf
        self._running = False
        self._changed = trio.Event()

    @property
    def policy(self) -> PolicySnapshot:
        return self._core.policy

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The driver: sleeps until the core's next deadline (re-armed when an input brings
        it closer) and ticks the core. Never returns; cancel it to stop."""
        if self._running:
            raise RuntimeError("Admission.run() is already running")
        self._running = True
        try:
            task_status.started()
            while True:
                deadline = self._core.next_deadline()
                self._armed = math.inf if deadline is None else deadline
                self._wakeup = trio.Event()
                with trio.move_on_at(self._armed):
                    await self._wakeup.wait()
                self._carry_out(self._core.tick(trio.current_time()))
        finally:
            self._running = False
            self._armed = math.inf

    def open_slot(
        self, model: str, needs: Needs, *, requeue: bool = False, share: Share = DEFAULT_SHARE
    ) -> AbstractAsyncContextManager[Slot]:
        """Wait for a slot of ``model`` (a group or an alias) that meets ``needs``.

        Raises an :class:`~._errors.AdmissionError` subclass when rejected. Cancelled while
        waiting, the waiter leaves the queue at once and never holds a slot. ``requeue`` is
        for a retry of a request that already held a slot, ``share`` says whose request it
        is for fair queueing (see ``AdmissionCore.submit``). The slot is given back when the
        block is left, however it is left.

        Entering is a cancel point; a schedule point only when the request waits (admitted
        at once, the caller goes on to send it to a node, which is one).
        """
        return _SlotBlock(self, model, needs, requeue, share)

    async def _admit(self, model: str, needs: Needs, requeue: bool, share: Share) -> Slot:
        """The waiting of :meth:`open_slot`'s block: the slot admitted, or the error."""
        if not self._running:
            raise RuntimeError("Admission.run() must be running to open slots")
        await trio.lowlevel.checkpoint_if_cancelled()
        waiter_id = next(self._ids)
        parked = self._parked[waiter_id] = _Parked()
        try:
            decisions = self._core.submit(
                waiter_id, model, needs, trio.current_time(), requeue=requeue, share=share
            )
            # Admitted at once (never queued) and nothing else decided: only a slot of its
            # candidate was taken -- no change a node is told of, within its grant.
            self._carry_out(
                decisions,
                reported=len(decisions) != 1
                or decisions[0].waiter_id != waiter_id
                or not isinstance(decisions[0], Admit)
                or self._beyond_grant(decisions[0].candidate.key, 0),
            )
            if parked.decision is None:
                await parked.event.wait()
        except BaseException:
            self._abandon(waiter_id, parked)
            raise
        finally:
            self._parked.pop(waiter_id, None)
        decision = parked.decision
        if not isinstance(decision, Admit):
            assert decision is not None
            raise error_for(decision)
        return Slot(self, decision)

    def confirm_drain(self, slot_id: SlotId) -> None:
        """The node confirmed the cancel of the run on this slot: it is free."""
        self._carry_out(self._core.confirm_drain(slot_id, trio.current_time()))

    def node_joined(self, candidates: Sequence[Candidate]) -> None:
        self._carry_out(self._core.node_joined(candidates, trio.current_time()))

    def node_left(self, node_id: str, generation: int) -> None:
        self._carry_out(self._core.node_left(node_id, generation, trio.current_time()))

    def capacity_changed(self, key: CandidateKey, slots: int, long_context_slots: int) -> None:
        self._carry_out(
            self._core.capacity_changed(key, slots, long_context_slots, trio.current_time())
        )

    def set_policy(self, policy: PolicySnapshot) -> None:
        self._carry_out(self._core.set_policy(policy, trio.current_time()))

    def report_success(self, key: CandidateKey) -> None:
        """An attempt on ``key`` worked (report it as soon as that is known, e.g. at the
        first token): the candidate is healthy again. See ``AdmissionCore.report_success``."""
        decisions = self._core.report_success(key, trio.current_time())
        self._carry_out(decisions, reported=bool(decisions))

    def report_failure(self, key: CandidateKey) -> None:
        """An attempt on ``key`` failed for a reason that is the candidate's (node lost,
        upstream 5xx or 429, first-token timeout, a retryable ``run.failed``), never a
        client's error. Report it before leaving the slot's block, so that a probe's
        failure is seen before another request may probe. See
        ``AdmissionCore.report_failure``."""
        decisions = self._core.report_failure(key, trio.current_time())
        self._carry_out(decisions, reported=bool(decisions))

    def statistics(self) -> AdmissionStatistics:
        return self._core.statistics()

    def demand(self, key: CandidateKey) -> tuple[int, int, int] | None:
        """``(waiting, held, slots)`` of a candidate (see ``AdmissionCore.demand``)."""
        return self._core.demand(key)

    async def wait_changed(self) -> None:
        """Until what the nodes are told of this edge's demand (``demand``: the requests
        queued, the slots held beyond a candidate's grant, its slots) may have changed after
        the call: a waiter comes or goes, a capacity changes, a node joins or leaves, a slot
        is taken or freed beyond its candidate's grant or back to it. A slot taken at once
        or freed within the grant (every request's own, on an edge that does not queue)
        wakes nobody."""
        await self._changed.wait()

    def knows_model(self, model: str) -> bool:
        """Whether a request for ``model`` (a group or an alias) would not be refused as
        unknown: a node serves it, a request waits for it, or the policy names it. See
        ``AdmissionCore.knows_model``."""
        return self._core.knows_model(model)

    # ------------------------------------------------------------------ internals

    def _abandon(self, waiter_id: int, parked: _Parked) -> None:
        """The waiting task is leaving (cancelled or failed): end the waiter in the core, or
        give back a slot it was granted but will never use."""
        self._parked.pop(waiter_id, None)
        now = trio.current_time()
        if parked.decision is None:
            self._carry_out(self._core.cancel(waiter_id, now))
        elif isinstance(parked.decision, Admit):
            self._carry_out(self._core.release(parked.decision.slot_id, now))

    def _beyond_grant(self, key: CandidateKey, freed: int) -> bool:
        """Whether ``key``'s slots held (``freed`` more, before a release) are beyond its
        slots now, or the candidate is gone: a change there is one its node is told of."""
        demand = self._core.demand(key)
        return demand is None or demand[1] + freed > demand[2]

    def _carry_out(self, decisions: Sequence[Decision], *, reported: bool = True) -> None:
        """Hand each decision to its parked task; an admission for a task that is gone is
        released at once (which may admit someone else). Wakes :meth:`wait_changed` unless
        the caller knows the change is none a node is told of (``reported`` False)."""
        if reported:
            self._changed.set()
            self._changed = trio.Event()
        pending = deque(decisions)
        while pending:
            decision = pending.popleft()
            parked = self._parked.get(decision.waiter_id)
            if parked is not None and parked.decision is None:
                parked.decision = decision
                parked.event.set()
            elif isinstance(decision, Admit):
                pending.extend(self._core.release(decision.slot_id, trio.current_time()))
        deadline = self._core.next_deadline()
        if deadline is not None and deadline < self._armed:
            self._armed = deadline
            self._wakeup.set()


@asynccontextmanager
async def open_admission(policy: PolicySnapshot | None = None) -> AsyncIterator[Admission]:
    """An :class:`Admission` with its driver running in a nursery of its own; the driver
    stops when the block exits."""
    admission = Admission(policy)
    async with trio.open_nursery() as nursery:
        await nursery.start(admission.run)
        try:
            yield admission
        finally:
            nursery.cancel_scope.cancel(reason="admission closed")
