"""Normalized runs: ``open_run`` is the ownership rule of the design, in one ``async with``.

::

    async with runs.open_run(spec) as run:      # queue wait -> slot -> subscribe -> send
        async for event in run:                 # normalized events, in order, up to the
            ...                                 # terminal one
    # however the block is left, the node is told to cancel if the run is not finished
    # (shielded, bounded), the subscription is closed, and the slot is released -- once.

The slot is freed at the first of: the terminal event arriving (the node is done), or the
block exiting. A run left unfinished hands its slot to admission as *draining* until the
node confirms the cancel (``run.cancelled``) or the drain deadline passes, so the queue never
over-admits onto a node that is still generating for a client that left.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Literal

import attrs
import trio

from . import wire
from .admission import Admission, Candidate, Needs, Slot, needs_from_body
from .errors import NodeUnavailable, StaleGeneration
from .registry import NodeGone, NodeSession, Registry, Subscription

EndReason = Literal[
    "completed",  # the node sent run.completed
    "failed",  # the node sent run.failed
    "node_lost",  # the node's connection ended mid-run
    "stale_generation",  # the node reconnected mid-run (or before the send)
    "cancelled",  # the block was left before the end by a cancellation (client gone, ...)
    "abandoned",  # the block was left early without an error
    "error",  # the block was left early by an exception
    "send_error",  # the run request could not be sent
    "withdrawn",  # the block was cancelled before the session's writer took the request
]


@attrs.frozen(kw_only=True)
class RunSpec:
    """What to run: the public model group and the OpenAI chat body."""

    model: str
    body: dict[str, Any]
    needs: Needs | None = None
    """Derived from ``body`` when not given."""


@attrs.define(eq=False)
class Run:
    """The handle ``open_run`` yields. Iterate it for the run's events, terminal included."""

    run_id: str
    candidate: Candidate
    session: NodeSession
    slot: Slot
    _subscription: Subscription
    started_at: float
    _done: bool = False
    end_reason: EndReason | None = None
    """How the run ended, set once when its block is left."""
    late_terminal: wire.RunEvent | None = None
    """For a run abandoned before its end: the node's terminal event that arrived after the
    block was left (its cancel confirmation, or its own end if it ignored the cancel; a
    synthesized ``node_lost`` failure if the node went away first)."""
    late_usage: wire.Usage | None = None
    """The usage the node reported after the block was left."""
    settled: trio.Event = attrs.field(factory=trio.Event)
    """Set when an abandoned run's late terminal event arrived (or can never arrive)."""

    @property
    def node_id(self) -> str:
        return self.candidate.node_id

    @property
    def finished(self) -> bool:
        """A terminal event arrived (from the node, or synthesized when it was lost)."""
        return self._subscription.finished

    @property
    def terminal(self) -> wire.RunEvent | None:
        return self._subscription.terminal

    @property
    def usage(self) -> wire.Usage | None:
        """The node's last usage report for this run: delivered while the block was open
        (consumed or not), or after it was left (:attr:`late_usage`)."""
        return self.late_usage or self._subscription.usage

    @property
    def text_chars(self) -> int:
        """Characters of text the node sent for this run (delivered while the block was
        open), for an estimate when it reported no usage."""
        return self._subscription.text_chars

    def ready_events(self) -> list[wire.RunEvent]:
        """Events already buffered (up to and including the terminal one), without waiting:
        lets a consumer batch several tokens into one write."""
        ready: list[wire.RunEvent] = []
        while not self._done:
            event = self._subscription.receive_nowait()
            if event is None:
                break
            ready.append(event)
            if wire.is_terminal(event):
                self._done = True
        return ready

    def __aiter__(self) -> Run:
        return self

    async def __anext__(self) -> wire.RunEvent:
        if self._done:
            raise StopAsyncIteration
        event = await self._subscription.receive()
        if wire.is_terminal(event):
            self._done = True
        return event


@attrs.define(eq=False)
class RunStatistics:
    opened: int = 0
    open_runs: int = 0
    """Runs whose block is open now (subscribed, not yet left)."""
    ended: dict[str, int] = attrs.field(factory=dict)
    cancels_sent: int = 0


@attrs.define(eq=False)
class Runs:
    """Opens normalized runs on the node that admission selects."""

    registry: Registry
    admission: Admission
    _prefix: str = attrs.field(factory=lambda: secrets.token_hex(4))
    _counter: Iterator[int] = attrs.field(factory=itertools.count)
    stats: RunStatistics = attrs.field(factory=RunStatistics)

    def new_run_id(self) -> str:
        return f"run-{self._prefix}-{next(self._counter)}"

    @asynccontextmanager
    async def open_run(self, spec: RunSpec) -> AsyncIterator[Run]:
        needs = spec.needs if spec.needs is not None else needs_from_body(spec.body)
        async with (
            self.admission.open_slot(spec.model, needs) as slot,
            self.open_on_slot(spec, slot) as run,
        ):
            yield run

    @asynccontextmanager
    async def open_on_slot(self, spec: RunSpec, slot: Slot) -> AsyncIterator[Run]:
        """Subscribe and send the run on the candidate ``slot`` holds (the rest of
        ``open_run`` after admission; ``dispatcher.pool`` uses it after its hooks)."""
        candidate = slot.candidate
        try:
            session = self.registry.require_current(candidate.node_id, candidate.generation)
        except StaleGeneration:
            self._count("stale_generation")
            raise
        run_id = self.new_run_id()
        with session.subscribe(run_id) as subscription, self._counted_open():
            subscription.on_terminal = lambda _event: slot.release()
            run = Run(run_id, candidate, session, slot, subscription, time.monotonic())
            body = {**spec.body, "model": candidate.served_model}
            request = wire.RunRequest(
                run_id=run_id,
                provider_id=candidate.provider_id,
                model=spec.model,
                served_model=candidate.served_model,
                body=body,
            )
            # The session's writer sends it; this block only waits until it is taken, so a
            # client leaving now withdraws the request instead of interrupting a write.
            try:
                outgoing = session.enqueue(request)
            except NodeGone as exc:
                self._count("send_error")
                raise NodeUnavailable(str(exc)) from exc
            try:
                await outgoing.wait_taken()
            except NodeGone as exc:
                self._count("send_error")
                raise NodeUnavailable(str(exc)) from exc
            except trio.Cancelled:
                self._count("withdrawn")  # the node never heard of it: nothing to cancel
                raise
            self.stats.opened += 1
            try:
                yield run
            except BaseException as exc:
                run.end_reason = self._reason(run, exc)
                raise
            else:
                run.end_reason = self._reason(run, None)
            finally:
                self._count(run.end_reason or "error")
                if not run.finished:
                    self._abandon(run)

    def _abandon(self, run: Run) -> None:
        """The block was left before the terminal event: drain the slot and tell the node
        (posted to the session's writer: never waits, so no deadline can lose it). The
        node's late events (its last usage, its cancel confirmation) are kept on ``run``."""
        run.slot.drain()
        slot_id = run.slot.slot_id

        def late_event(event: wire.RunEvent) -> None:
            if isinstance(event, wire.RunUsage):
                run.late_usage = event.usage
                return
            run.late_terminal = event
            if isinstance(event, wire.RunCancelled) and event.usage is not None:
                run.late_usage = event.usage
            self.admission.confirm_drain(slot_id)
            run.settled.set()

        run._subscription.on_late_event = late_event
        reason = "client went away" if run.end_reason == "cancelled" else "run abandoned"
        if run.session.is_open:
            run.session.post(wire.RunCancel(run_id=run.run_id, reason=reason))
            self.stats.cancels_sent += 1
        else:
            run.settled.set()  # the session is over: leaving the registry voided its slots

    @staticmethod
    def _reason(run: Run, exc: BaseException | None) -> EndReason:
        terminal = run.terminal
        if isinstance(terminal, wire.RunCompleted):
            return "completed"
        if isinstance(terminal, wire.RunFailed):
            if terminal.code in ("node_lost", "stale_generation"):
                return terminal.code  # type: ignore[return-value]
            return "failed"
        if isinstance(terminal, wire.RunCancelled):
            return "cancelled"
        if isinstance(exc, trio.Cancelled):
            return "cancelled"
        return "abandoned" if exc is None else "error"

    @contextmanager
    def _counted_open(self) -> Iterator[None]:
        self.stats.open_runs += 1
        try:
            yield
        finally:
            self.stats.open_runs -= 1

    def _count(self, reason: str) -> None:
        self.stats.ended[reason] = self.stats.ended.get(reason, 0) + 1
