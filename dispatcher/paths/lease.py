"""Leases: the design's ownership rule, written once, for both paths to a node -- a normalized
run (:mod:`dispatcher.paths.runs`) and a tunnel (:mod:`dispatcher.paths.tunnel`). This module
is the rule;
those two are the path-specific handles on top (what the route holds, what the request and the
cancel say, how the node's end is told).

A *lease* is one request's hold on a node: the slot admission gave it and the route its
node's session delivers to. It is one ``async with``::

    async with leases.open_lease(slot) as lease:   # node current, id minted, route registered
        await lease.send(request)                  # through the session's writer
        ...                                        # the path's handle reads what arrives
    # however the block is left: its end reason is recorded once, derived from how it ended
    # (end_reason, a pure function); if the request reached the node and the node's end has
    # not arrived, the slot drains, the node is told to cancel (posted to the session's
    # writer: never waits, so no deadline can lose it), and admission hears when the node's
    # late end confirms it; the route is closed.

Opening checks that the slot's node is still the session admission chose (a reconnect in
between is :class:`~dispatcher.errors.StaleGeneration`, counted ``stale_generation``). The
route is registered before anything is sent, so no answer can be missed; the slot is freed
at the first of the node's end arriving (the route calls ``slot.release``) or the block
exiting. A send cancelled before the session's writer took the request withdraws it: the
node never hears of it and there is nothing to cancel (``withdrawn``).

A path subclasses :class:`Lease` (its handle: :class:`~dispatcher.paths.runs.Run`,
:class:`~dispatcher.paths.tunnel.Tunnel`) and :class:`Leases` (the opener:
:class:`~dispatcher.paths.runs.Runs`, :class:`~dispatcher.paths.tunnel.Tunnels`), filling in the
hooks
marked abstract here. Every path counts the same :class:`LeaseStatistics`.
"""

from __future__ import annotations

import abc
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager
from typing import ClassVar, Generic, Literal, TypeVar

import attrs
import trio

from .. import wire
from ..admission import (
    Admission,
    Candidate,
    Slot,
    SlotId,
)
from ..errors import NodeUnavailable, StaleGeneration
from ..link.registry import (
    LostCode,
    NodeGone,
    NodeSession,
    Registry,
)

SendFailure = Literal[
    "send_error",  # the request could not be sent (the node's session ended first)
    "withdrawn",  # cancelled before the session's writer took the request: the node never saw it
]
NodeEnd = Literal[
    "completed",  # the node ended it successfully
    "failed",  # the node ended it with an error
    LostCode,  # the node's session ended first (lost, drained, the edge's shutdown, a
    # reconnect: a synthesized end), or a draining node's grace cut it (node_draining)
    "cancelled",  # the node confirmed a cancel (run.cancelled)
]
"""How the node ended a lease (or its session's loss did)."""
EndReason = Literal[
    NodeEnd,
    SendFailure,
    # "cancelled" (in NodeEnd) also: the block was left by a cancellation (client gone, ...)
    "abandoned",  # the block was left early without an error
    "error",  # the block was left early by an exception
    "unsent",  # the block was left before the request was sent
]
"""How a lease ended, as counted in :attr:`LeaseStatistics.ended`."""


def end_reason(
    *,
    node_end: NodeEnd | None,
    sent: bool,
    send_failure: SendFailure | None,
    left_by: BaseException | None,
) -> EndReason:
    """How a lease's block ended, from what is known as it is left: a send that failed (the
    request never reached the node) first, then the node's end if it arrived (``node_end``),
    then whether anything was sent, then how the block was left (``left_by``: the exception
    that left it, None for a normal exit)."""
    if not sent and send_failure is not None:
        return send_failure
    if node_end is not None:
        return node_end
    if not sent:
        return "unsent"
    if isinstance(left_by, trio.Cancelled):
        return "cancelled"
    return "abandoned" if left_by is None else "error"


@attrs.define(eq=False, kw_only=True)
class Lease(abc.ABC):
    """One request's hold on a node: the base of each path's handle."""

    lease_id: str
    slot: Slot
    session: NodeSession
    started_at: float = attrs.field(factory=time.monotonic)
    requested: bool = False
    """The request was handed to the session's writer (and not withdrawn)."""
    sent: bool = False
    """The request reached the node's connection (:meth:`send` returned)."""
    send_failure: SendFailure | None = None
    end_reason: EndReason | None = None
    """How the lease ended, set once when its block is left."""
    settled: trio.Event = attrs.field(factory=trio.Event)
    """Set when an abandoned lease's late end arrived (or can never arrive)."""
    _when_settled: Callable[[], None] | None = attrs.field(default=None, init=False, repr=False)

    @property
    def candidate(self) -> Candidate:
        return self.slot.candidate

    @property
    def finished(self) -> bool:
        """The node's end arrived (or was synthesized when the node was lost)."""
        return self._node_end() is not None

    def when_settled(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once when the lease is settled: at once if it is, else when an
        abandoned lease's late end arrives (or can never arrive), or when its block is left
        without abandoning it (the node's end arrived in time). Without a task waiting on
        :attr:`settled`: the accounting's rows of 10,000 clients leaving at once."""
        if self.settled.is_set():
            callback()
        else:
            self._when_settled = callback

    async def send(self, request: wire.RunRequest | wire.TunnelRequest) -> None:
        """Hand ``request`` to the session's writer (once) and wait until it is taken.
        Raises :class:`NodeUnavailable` if the session ended first; cancelled before the
        writer took it, the request is withdrawn and the node never hears of this lease."""
        if self.requested or self.sent:
            raise RuntimeError(f"{self.lease_id}: the request was already sent")
        try:
            outgoing = self.session.enqueue(request)
            self.requested = True
            await outgoing.wait_taken()
        except NodeGone as exc:
            self._send_failed("send_error")
            raise NodeUnavailable(str(exc)) from exc
        except trio.Cancelled:
            self._send_failed("withdrawn")
            raise
        self.sent = True

    def _send_failed(self, failure: SendFailure) -> None:
        self.requested = False
        self.send_failure = failure

    @abc.abstractmethod
    def _node_end(self) -> NodeEnd | None:
        """How the node ended this lease; None while it has not."""

    @abc.abstractmethod
    def _cancel_message(self) -> wire.RunCancel | wire.TunnelCancel:
        """What tells the node to stop (``end_reason`` is set by then)."""

    @abc.abstractmethod
    def _on_late_end(self, settle: Callable[[], None]) -> None:
        """Arrange for ``settle`` to be called once when the node's end arrives after the
        block was left (called while the route is still registered)."""


@attrs.define(eq=False, slots=True)
class Settle:
    """What an abandoned lease's late end calls, once: admission hears the slot's drain is
    confirmed, and the lease's ``settled`` event is set. A plain object holding neither the
    lease nor its opener, so nothing per request forms a reference cycle through it (a
    closure over both did: the lease held its route, which held the closure)."""

    admission: Admission
    slot_id: SlotId
    settled: trio.Event
    then: Callable[[], None] | None = None
    """The lease's :meth:`Lease.when_settled` callback, if any."""

    def __call__(self) -> None:
        self.admission.confirm_drain(self.slot_id)
        self.settled.set()
        then, self.then = self.then, None
        if then is not None:
            then()


@attrs.frozen
class LeaseStatistics:
    opened: int
    """Leases whose route was registered (their node was current)."""
    open: int
    """Leases whose block is open now."""
    ended: dict[EndReason, int]
    """Leases ended, by :data:`EndReason` (``stale_generation`` includes opens refused)."""
    cancels_sent: int


L = TypeVar("L", bound=Lease)


@attrs.define(eq=False)
class Leases(abc.ABC, Generic[L]):
    """Opens leases of one path on the node that admission selected."""

    registry: Registry
    admission: Admission
    _prefix: str = attrs.field(factory=lambda: secrets.token_hex(4), kw_only=True)
    _counter: Iterator[int] = attrs.field(factory=itertools.count, kw_only=True)
    _open: dict[str, L] = attrs.field(factory=dict, kw_only=True)
    _opened: int = attrs.field(default=0, kw_only=True)
    _ended: dict[EndReason, int] = attrs.field(factory=dict, kw_only=True)
    _cancels_sent: int = attrs.field(default=0, kw_only=True)

    kind: ClassVar[str]
    """The ids' prefix (``run``, ``tun``)."""

    def new_id(self) -> str:
        return f"{self.kind}-{self._prefix}-{next(self._counter)}"

    def _counts(self) -> tuple[int, int, dict[EndReason, int], int]:
        """The :class:`LeaseStatistics` fields, in order, for a path's statistics record."""
        return self._opened, len(self._open), dict(self._ended), self._cancels_sent

    @abc.abstractmethod
    def _route(self, session: NodeSession, lease_id: str, slot: Slot) -> AbstractContextManager[L]:
        """Register the route of a new lease on ``session`` and yield its handle; the route
        calls ``slot.release`` when the node's end arrives. Unregistered when left."""

    @asynccontextmanager
    async def open_lease(self, slot: Slot) -> AsyncIterator[L]:
        """A new lease on the candidate ``slot`` holds (see the module docstring)."""
        candidate = slot.candidate
        try:
            session = self.registry.require_current(candidate.node_id, candidate.generation)
        except StaleGeneration:
            self._count("stale_generation")
            raise
        lease_id = self.new_id()
        with self._route(session, lease_id, slot) as lease:
            self._open[lease_id] = lease
            self._opened += 1
            left_by: BaseException | None = None
            try:
                yield lease
            except BaseException as exc:
                left_by = exc
                raise
            finally:
                del self._open[lease_id]
                self._end(lease, left_by)
                left_by = None  # no cycle through the traceback

    def _end(self, lease: L, left_by: BaseException | None) -> None:
        lease.end_reason = reason = end_reason(
            node_end=lease._node_end(),
            sent=lease.sent,
            send_failure=lease.send_failure,
            left_by=left_by,
        )
        self._count(reason)
        if lease.sent and not lease.finished:
            self._abandon(lease)
        else:
            then, lease._when_settled = lease._when_settled, None
            if then is not None:
                then()

    def _abandon(self, lease: L) -> None:
        """The block was left after the request reached the node and before its end: drain
        the slot and tell the node (posted: never waits, so no deadline can lose it)."""
        slot = lease.slot
        slot.drain()
        then, lease._when_settled = lease._when_settled, None
        if lease.session.is_open:
            lease._on_late_end(Settle(self.admission, slot.slot_id, lease.settled, then))
            lease.session.post(lease._cancel_message())
            self._cancels_sent += 1
        else:
            lease.settled.set()  # the session is over: leaving the registry voided its slots
            if then is not None:
                then()

    def _count(self, reason: EndReason) -> None:
        self._ended[reason] = self._ended.get(reason, 0) + 1
