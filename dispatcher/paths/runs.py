"""Normalized runs: the run path's handle on the ownership rule of :mod:`dispatcher.paths.lease`
(the rule itself is written there, once, for runs and tunnels; :mod:`dispatcher.paths.tunnel` is
the other path).

::

    async with runs.open_run(spec) as run:      # queue wait -> slot -> subscribe -> send
        async for event in run:                 # normalized events, in order, up to the
            ...                                 # terminal one
    # however the block is left, the node is told to cancel if the run is not finished
    # (posted, never waits), the subscription is closed, and the slot is released -- once.

What is the run path's: the route is the run's :class:`~dispatcher.link.registry.Subscription`,
the request (``run.request``) is sent on entry, the node's end is its terminal event, the
cancel is ``run.cancel``. A run left unfinished hands its slot to admission as *draining*
until the node confirms the cancel (``run.cancelled``) or the drain deadline passes, so the
queue never over-admits onto a node that is still generating for a client that left; the
node's late events (its last usage, its confirmation) are kept on the :class:`Run`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final, get_args

import attrs

from .. import wire
from ..admission import Needs, Slot, needs_from_body
from ..link.registry import LostCode, NodeSession, Subscription
from .lease import (
    EndReason,
    Lease,
    Leases,
    LeaseStatistics,
    NodeEnd,
)

__all__ = ["EndReason", "Run", "RunSpec", "RunStatistics", "Runs"]

_LOST_CODES: Final[dict[str, LostCode]] = {code: code for code in get_args(LostCode)}
"""The ``run.failed`` codes of the end the registry synthesizes when a session ends (or a
draining node's grace cut the run)."""


@attrs.frozen(kw_only=True)
class RunSpec:
    """What to run: the public model group and the OpenAI body of its ``route``."""

    model: str
    body: dict[str, Any]
    needs: Needs | None = None
    """Derived from ``body`` when not given."""
    route: wire.RouteName = "chat"
    """What ``body`` is (``wire.RunRequest.route``): a chat-completions body, or an
    embeddings body."""


@attrs.frozen
class RunStatistics(LeaseStatistics):
    """What :meth:`Runs.statistics` counts: the lease counts of runs."""

    @property
    def open_runs(self) -> int:
        """Runs whose block is open now (subscribed, not yet left): :attr:`open`."""
        return self.open


@attrs.define(eq=False, kw_only=True)
class Run(Lease):
    """The handle ``open_run`` yields. Iterate it for the run's events, terminal included."""

    _subscription: Subscription
    _done: bool = False
    late_terminal: wire.RunEvent | None = None
    """For a run abandoned before its end: the node's terminal event that arrived after the
    block was left (its cancel confirmation, or its own end if it ignored the cancel; a
    synthesized ``node_lost`` failure if the node went away first)."""
    late_usage: wire.Usage | None = None
    """The usage the node reported after the block was left."""
    _settle: Callable[[], None] | None = attrs.field(default=None, init=False, repr=False)

    @property
    def run_id(self) -> str:
        return self.lease_id

    @property
    def node_id(self) -> str:
        return self.candidate.node_id

    @property
    def terminal(self) -> wire.RunEvent | None:
        """The terminal event, once delivered (by the node, or synthesized when it was
        lost)."""
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

    def _node_end(self) -> NodeEnd | None:
        terminal = self._subscription.terminal
        if isinstance(terminal, wire.RunCompleted):
            return "completed"
        if isinstance(terminal, wire.RunFailed):
            return _LOST_CODES.get(terminal.code, "failed")
        if isinstance(terminal, wire.RunCancelled):
            return "cancelled"
        return None

    def _cancel_message(self) -> wire.RunCancel:
        reason = "client went away" if self.end_reason == "cancelled" else "run abandoned"
        return wire.RunCancel(run_id=self.run_id, reason=reason)

    def _on_late_end(self, settle: Callable[[], None]) -> None:
        self._settle = settle
        # The subscription hands this bound method to the session as it closes, then
        # forgets it (registry.NodeSession.subscribe): no cycle run -> subscription -> run.
        self._subscription.on_late_event = self._late_event

    def _late_event(self, event: wire.RunEvent) -> None:
        if isinstance(event, wire.RunUsage):
            self.late_usage = event.usage
            return
        self.late_terminal = event
        if isinstance(event, wire.RunCancelled) and event.usage is not None:
            self.late_usage = event.usage
        settle, self._settle = self._settle, None
        if settle is not None:
            settle()


@attrs.define(eq=False, slots=True)
class _Release:
    """A subscription's ``on_terminal``: the node's end frees the slot at once."""

    slot: Slot

    def __call__(self, _event: wire.RunEvent) -> None:
        self.slot.release()


@attrs.define(eq=False)
class Runs(Leases[Run]):
    """Opens normalized runs on the node that admission selects."""

    kind = "run"

    @property
    def stats(self) -> RunStatistics:
        """:meth:`statistics`, as an attribute (its older name)."""
        return self.statistics()

    def statistics(self) -> RunStatistics:
        return RunStatistics(*self._counts())

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
        ``open_run`` after admission; ``dispatcher.gate.pool`` uses it after its hooks)."""
        async with self.open_lease(slot) as run:
            candidate = slot.candidate
            # The session's writer sends it; this block only waits until it is taken, so a
            # client leaving now withdraws the request instead of interrupting a write.
            await run.send(
                wire.RunRequest(
                    run_id=run.run_id,
                    provider_id=candidate.provider_id,
                    model=spec.model,
                    served_model=candidate.served_model,
                    body={**spec.body, "model": candidate.served_model},
                    route=spec.route,
                )
            )
            yield run

    @contextmanager
    def _route(self, session: NodeSession, lease_id: str, slot: Slot) -> Iterator[Run]:
        with session.subscribe(lease_id) as subscription:
            subscription.on_terminal = _Release(slot)
            yield Run(lease_id=lease_id, slot=slot, session=session, subscription=subscription)
