"""Accounting: the usage row of every dispatched attempt, built in one place for both paths.

The gate tells :class:`Accounting` how an attempt ended (:class:`Attempted`: its outcome,
whether it was committed, its times) with the handle its counts come from: a normalized run
(:meth:`Accounting.record_run`) or a tunnel (:meth:`Accounting.record_tunnel`). Each becomes
exactly one :class:`~dispatcher.store.ledger.UsageRow` (:func:`usage_row`), with the counts the node
or provider reported, or the edge's estimate (:mod:`dispatcher.shared.tokens`, the one
estimator) when it reported none -- or reported nonsense.

A run abandoned unfinished (its cancel sent, its slot draining) waits for the node's end,
which carries the usage the node knows, at most :data:`SETTLE_TIMEOUT`: the run calls back
when it settles, and the deadlines are kept by one task in the nursery the accounting is given
(the dispatcher's root nursery), never a bare task. Without a nursery, such rows are written
at once.

Recording never raises: the ledger must not break a request's exit path.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Final, Protocol

import attrs
import trio

from .. import wire
from ..shared.tokens import estimate_prompt_tokens, tokens_for_chars
from ..store.usage import BillableTo, ExecutionPath, Outcome, UsageRow, UsageSource
from .pool import DispatchRequest, DispatchResult

log = logging.getLogger("dispatcher.gate")

UsageSink = Callable[[UsageRow], None]


class UsagePricing(Protocol):
    """A row's ``cost_usd`` from its ``request_id``, ``attempt``, ``model_group``,
    ``attribution``, ``billable_to``, ``prompt_tokens`` and ``completion_tokens`` (and the
    parts of the prompt read from and written to a cache), asked before the row is built (the
    tenants' :meth:`~dispatcher.tenants.Tenants.price`, which settles the request's
    reservation too, once per attempt); never raises."""

    def __call__(
        self,
        request_id: str,
        attempt: int,
        model_group: str,
        attribution: str | None,
        billable_to: BillableTo,
        prompt_tokens: int,
        completion_tokens: int,
        /,
        *,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> float | None: ...


SETTLE_TIMEOUT: Final = 10.0
"""How long an abandoned run's usage row waits for the node's cancel confirmation."""


class Accounted(Protocol):
    """What a row says of the request (the gate's ``GateRequest``)."""

    @property
    def request_id(self) -> str: ...
    @property
    def attribution(self) -> str | None: ...
    @property
    def client_request_id(self) -> str | None: ...
    @property
    def dispatch(self) -> DispatchRequest: ...


class RunCounts(Protocol):
    """What accounting reads of a normalized run (:class:`dispatcher.paths.runs.Run`)."""

    @property
    def usage(self) -> wire.Usage | None: ...
    @property
    def text_chars(self) -> int: ...
    @property
    def finished(self) -> bool: ...
    def when_settled(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, when the run's late end arrived or can never arrive."""


class TunnelCounts(Protocol):
    """What accounting reads of a tunnel (:class:`dispatcher.paths.tunnel.Tunnel`)."""

    @property
    def usage(self) -> wire.Usage | None: ...


@attrs.frozen(kw_only=True)
class Attempted:
    """How one attempt ended, as its row says it (besides the counts)."""

    number: int
    result: DispatchResult
    path: ExecutionPath
    outcome: Outcome
    committed: bool
    """The client saw (part of) this attempt's answer: billable to the client."""
    ttft: float | None
    started_at: float
    """``trio.current_time()`` when the attempt was submitted to admission."""


@attrs.frozen
class Counts:
    """An attempt's tokens: the row's columns of the same names."""

    prompt_tokens: int
    completion_tokens: int
    usage_source: UsageSource
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0


def _counts(usage: wire.Usage) -> Counts:
    """A (non-negative) usage as the row's counts, each part within its total (a node's or
    provider's odd breakdown never makes a row the ledger refuses)."""
    prompt, completion = usage.prompt_tokens, usage.completion_tokens
    cached = min(max(0, usage.cached_tokens), prompt)
    return Counts(
        prompt,
        completion,
        "estimated" if usage.estimated else "reported",
        cached_tokens=cached,
        cache_write_tokens=min(max(0, usage.cache_write_tokens), prompt - cached),
        reasoning_tokens=min(max(0, usage.reasoning_tokens), completion),
    )


def usage_row(
    request: Accounted, attempt: Attempted, counts: Counts, price: UsagePricing | None = None
) -> UsageRow:
    """The one row builder, for both paths; ``duration_s`` and ``ended_at`` are now. Its
    ``cost_usd`` is ``price``'s (None without one): the row is built once, priced."""
    result = attempt.result
    billable_to: BillableTo = "client" if attempt.committed else "operator"
    cost = None
    if price is not None:
        cost = price(
            request.request_id,
            attempt.number,
            result.model_group,
            request.attribution,
            billable_to,
            counts.prompt_tokens,
            counts.completion_tokens,
            cached_tokens=counts.cached_tokens,
            cache_write_tokens=counts.cache_write_tokens,
        )
    return UsageRow(
        request_id=request.request_id,
        attempt=attempt.number,
        model_group=result.model_group,
        served_model=result.served_model,
        provider_id=result.provider_id,
        node_id=result.node_id,
        path=attempt.path,
        attribution=request.attribution,
        prompt_tokens=counts.prompt_tokens,
        completion_tokens=counts.completion_tokens,
        usage_source=counts.usage_source,
        outcome=attempt.outcome,
        queue_wait_s=result.queue_wait,
        ttft_s=attempt.ttft,
        duration_s=trio.current_time() - attempt.started_at,
        ended_at=time.time(),
        billable_to=billable_to,
        client_request_id=request.client_request_id,
        route=request.dispatch.route,
        cost_usd=cost,
        cached_tokens=counts.cached_tokens,
        cache_write_tokens=counts.cache_write_tokens,
        reasoning_tokens=counts.reasoning_tokens,
    )


def run_counts(request: Accounted, attempt: Attempted, run: RunCounts) -> Counts:
    """The run's usage as the node reported it (or as its adapter estimated it); the edge's
    estimate when there is none, or when the node's counts are negative (logged)."""
    usage = run.usage
    if usage is not None and _negative(usage):
        log.warning(
            "request %s attempt %d: node %s reported negative usage (%d, %d); estimating",
            request.request_id,
            attempt.number,
            attempt.result.node_id,
            usage.prompt_tokens,
            usage.completion_tokens,
        )
    return counts_so_far(request, run)


def _negative(usage: wire.Usage) -> bool:
    return usage.prompt_tokens < 0 or usage.completion_tokens < 0


def counts_so_far(request: Accounted, run: RunCounts) -> Counts:
    """:func:`run_counts` without its log line: what the run's row would say now (the
    request record reads a live run's counts with it)."""
    usage = run.usage
    if usage is not None and not _negative(usage):
        return _counts(usage)
    return Counts(
        estimate_prompt_tokens(request.dispatch.body),
        tokens_for_chars(run.text_chars),  # the subscription counts characters only
        "estimated",
    )


def tunnel_counts(request: Accounted, tunnel: TunnelCounts) -> Counts:
    """The tunnel's usage as its relay found it (reported or estimated there); the prompt's
    estimate when the tunnel reported none (it ended before its relay)."""
    usage = tunnel.usage
    if usage is not None and not _negative(usage):
        return _counts(usage)
    return Counts(estimate_prompt_tokens(request.dispatch.body), 0, "estimated")


@attrs.define(eq=False, slots=True)
class _Pending:
    """An abandoned run's row, waiting for the run to settle or its deadline."""

    accounting: Accounting
    row: tuple[Accounted, Attempted, RunCounts] | None
    """What the row is made of; None once written."""

    def __call__(self) -> None:
        """The run settled (or the deadline passed, or the accounting is closing): write
        the row now, once."""
        row, self.row = self.row, None
        if row is not None:
            request, attempt, run = row
            self.accounting._write(request, attempt, run_counts(request, attempt, run))


@attrs.define(eq=False)
class Accounting:
    """Writes the rows to ``record_usage`` (the ledger), priced by ``price``; without a
    sink, nothing is recorded."""

    record_usage: UsageSink | None = None
    nursery: trio.Nursery | None = None
    """Where the deadline of abandoned runs' rows is kept (the dispatcher's own): one task
    for them all, started with the first."""
    settle_timeout: float = SETTLE_TIMEOUT
    price: UsagePricing | None = None
    _deadlines: collections.deque[tuple[float, _Pending]] = attrs.field(
        factory=collections.deque, init=False
    )
    """Rows waiting for their run to settle, with their deadlines (in the order they were
    queued; a row written early stays until its deadline passes, a no-op then)."""
    _timer: trio.Event | None = attrs.field(default=None, init=False)
    """Set to wake the deadline task (a row queued while it sleeps with none); None while
    that task is not started."""

    @property
    def enabled(self) -> bool:
        return self.record_usage is not None

    def record_run(self, request: Accounted, attempt: Attempted, run: RunCounts) -> None:
        """The run attempt's row: at once if the run finished (or there is no nursery to
        wait in), else once the node's end arrived or :attr:`settle_timeout` passed."""
        if not self.enabled:
            return
        if not run.finished and self.nursery is not None:
            # The run is about to be abandoned (cancel sent, slot draining): its row waits
            # for the node's end (its cancel confirmation or, if it ignored the cancel, its
            # own end), which carries the usage the node knows; at once if the node is lost.
            # No task per row: the run calls back when it settles, and one task keeps the
            # deadlines (a task, a cancel scope and an event per client leaving made 10,000
            # leaving at once that much slower).
            pending = _Pending(self, (request, attempt, run))
            self._queue_deadline(pending)
            run.when_settled(pending)
            return
        self._write(request, attempt, run_counts(request, attempt, run))

    def record_tunnel(self, request: Accounted, attempt: Attempted, tunnel: TunnelCounts) -> None:
        """The tunnel attempt's row, at once (its relay has reported the usage by now)."""
        if self.enabled:
            self._write(request, attempt, tunnel_counts(request, tunnel))

    def _queue_deadline(self, pending: _Pending) -> None:
        assert self.nursery is not None
        deadlines = self._deadlines
        deadline = trio.current_time() + self.settle_timeout
        if deadlines and deadline < deadlines[-1][0]:
            # settle_timeout was shortened: keep the deque in deadline order
            deadline = deadlines[-1][0]
        deadlines.append((deadline, pending))
        if self._timer is None:
            self._timer = trio.Event()
            self.nursery.start_soon(self._expire)
        elif len(deadlines) == 1:
            self._timer.set()

    async def _expire(self) -> None:
        """Write each queued row whose run has not settled by its deadline; however this
        task ends (the dispatcher closing), every row still waiting is written, once."""
        deadlines = self._deadlines
        try:
            while True:
                if not deadlines:
                    self._timer = trio.Event()
                    await self._timer.wait()
                    continue
                deadline, pending = deadlines[0]
                if pending.row is not None:
                    await trio.sleep_until(deadline)
                deadlines.popleft()
                pending()
        finally:
            self._timer = None
            while deadlines:
                deadlines.popleft()[1]()

    def _write(self, request: Accounted, attempt: Attempted, counts: Counts) -> None:
        try:
            assert self.record_usage is not None
            self.record_usage(usage_row(request, attempt, counts, self.price))
        except Exception:  # the ledger must never break a request's exit path
            log.exception(
                "could not record usage for %s attempt %d", request.request_id, attempt.number
            )


__all__ = [
    "SETTLE_TIMEOUT",
    "Accounted",
    "Accounting",
    "Attempted",
    "Counts",
    "RunCounts",
    "TunnelCounts",
    "UsagePricing",
    "UsageSink",
    "counts_so_far",
    "run_counts",
    "tunnel_counts",
    "usage_row",
]
