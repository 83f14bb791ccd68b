"""The stream gate: attempts, the commit point, recovery before it, explicit errors after it.

A client request becomes a sequence of *attempts*. Each attempt is its own owned scope -- an
admission, a slot, a subscription, a transport (``pool.open``) -- and ends either by *close*
(its run ended: nothing to tell the node) or by *abort* (the node is told to cancel), each at
most once, by leaving that scope.

Nothing reaches the client before the **commit point**: the first content-bearing delta of a
streamed run, or the complete successful answer of a non-streamed one; for a tunnel, a 2xx
status followed by the first SSE event that carries content (a non-streamed body: complete),
or any other status that is not 5xx / 429 (relayed as it is). Until then a failure
(node lost, retryable ``run.failed``, upstream 5xx / 429, stale generation, first-token
timeout) is recovered:
the attempt is aborted and the request admitted again with the failed candidates excluded,
up to ``max_attempts`` and within one deadline that covers queue waits too. After the commit,
a failure is delivered to the client as an explicit error (an SSE error event), never a
silent clean end.

::

    async with gate.open(request) as answer:      # attempts until one commits, or raises
        answer.head                               # events up to the commit point
        async for event in answer:                # the rest, with the stall timeout
            ...

A tunnel attempt runs its pre-commit phase inside the attempt loop: the API puts a
:class:`TunnelCall` (what to relay of the client's HTTP request) on the request; the gate
sends it and reads the response up to its commit point
(:func:`dispatcher.paths.tunnel_http.commit_tunnel`) under the request deadline and the first-token
timeout, fails the attempt on a 5xx / 429 (:func:`dispatcher.gate.rules.tunnel_status_failure`)
and yields a :class:`TunnelAnswer` with what it buffered (``head``) for the relay to send,
then the rest.

The loop (:meth:`Gate.open`) enters each attempt as one block (``Gate._attempt``: its
request deadline, its ``pool.open``, its usage row, nested) on the request's ``_Committed``
(the block ``Gate.open`` returns: an exit stack of one block, no generator); an attempt
that fails before its commit point leaves its block as it raises, so it holds only the one
that committed, and the gate's block enters with its answer once, after the loop, so the
caller's block runs inside its scopes. Every dispatched
attempt (its run or tunnel request was sent) gets exactly one usage row when its scopes end,
however they end (:mod:`dispatcher.gate.accounting`). The decisions -- retry or not, how a scope
ended, the row's outcome, the candidate's health -- are pure functions in
:mod:`dispatcher.gate.rules`.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Final, Generic, TypedDict, TypeVar

import attrs
import trio

from .. import wire
from ..admission import (
    AdmissionError,
    Candidate,
    CandidateKey,
    NoCapableCandidate,
)
from ..errors import (
    AllAttemptsFailed,
    NodeUnavailable,
    RunError,
    TunnelFailed,
    UpstreamRejected,
)
from ..paths.runs import Run, RunSpec
from ..paths.tunnel import Tunnel
from ..paths.tunnel_http import (
    PreCommit,
    TunnelCall,
    TunnelHead,
    commit_tunnel,
)
from ..shared.excgroups import holds
from ..store.usage import ExecutionPath
from . import rules
from .accounting import (
    SETTLE_TIMEOUT,
    Accounting,
    Attempted,
    UsagePricing,
    UsageSink,
)
from .pool import (
    Dispatch,
    DispatchRequest,
    DispatchResult,
    Pool,
)
from .rules import GatePolicy, Outcome

log = logging.getLogger("dispatcher.gate")

MAX_STATISTICS: Final = 256
"""Distinct keys :attr:`Gate.statistics` holds (failure codes are the node's words)."""

PrepareAttempt = Callable[[int, Candidate, RunSpec], Awaitable[RunSpec]]


@attrs.define
class RequestResult:
    """What the gate learned of a request, for the route's own accounting: the outcome of the
    row of its last dispatched attempt (None if no attempt was dispatched). The request-outcome
    metric derives from it, so the ledger and the metric agree for every request."""

    outcome: Outcome | None = None
    attempts: int = 0
    """Attempts admitted so far (the committed one included)."""
    attempt: RunAttempt | TunnelAttempt | None = None
    """The latest admitted attempt: the one answering once the request committed (its node,
    queue wait, first output and counts so far are what the request record reports)."""
    waiting_since: float | None = None
    """``trio.current_time()`` when the request began waiting for admission, while it waits
    (its first attempt's or a recovery's); None once admitted."""


@attrs.frozen(kw_only=True)
class GateRequest:
    request_id: str
    """The edge's own id of the request: the ledger's key."""
    dispatch: DispatchRequest
    stream: bool
    attribution: str | None = None
    client_request_id: str | None = None
    """The client's own ``x-request-id``, stored beside the edge's id (never the key)."""
    prepare: PrepareAttempt | None = attrs.field(default=None, eq=False)
    """Called fresh for every attempt (attempt number, chosen candidate, spec) before the run
    is sent: per-attempt credentials, headers, options."""
    tunnel_call: TunnelCall | None = attrs.field(default=None, eq=False)
    """How to relay the request when admission picks a tunnel candidate; without it, tunnel
    candidates fail (and are excluded) without a request sent."""
    result: RequestResult = attrs.field(factory=RequestResult, eq=False)
    """Filled in by the gate (see :class:`RequestResult`)."""
    may_use: Callable[[str], bool] | None = attrs.field(default=None, eq=False)
    """Whether the client may be served by a model group (its key's ``models``): a fallback
    it may not use is skipped. None: any."""


class AttemptFailed(Exception):
    """An attempt failed before its commit point; ``retryable`` says if another may do."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retryable: bool,
        candidate: CandidateKey | None = None,
        sent: bool = True,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.candidate = candidate
        """The candidate the next attempts exclude (None: no attempt was made on one)."""
        self.sent = sent
        """The attempt's request reached the node's connection, so it has a usage row;
        False: the node was lost before it went out (a tunnel's), and it has none."""


def _is_content(event: wire.RunEvent) -> bool:
    return isinstance(event, wire.RunDelta) and bool(event.text or event.tool_calls)


class _Ending(TypedDict):
    committed: bool
    ended: rules.Ended
    client_gone: bool


@attrs.define(eq=False)
class Attempt:
    """One attempt's bookkeeping, from dispatch to its usage row: what both paths share."""

    number: int
    result: DispatchResult
    started_at: float
    """``trio.current_time()`` when the attempt was submitted to admission."""
    dispatched_at: float
    output_at: float | None = None
    """When the answer began: a run's first content, a tunnel's commit (the row's ttft)."""
    committed: bool = False
    client_gone: bool = False
    """The API found the client gone (its connection reset): the row says ``cancelled``."""

    @property
    def where(self) -> str:
        return f"{self.result.node_id}/{self.result.provider_id}"

    def failure(
        self, code: str, message: str, *, retryable: bool, sent: bool = True
    ) -> AttemptFailed:
        """This attempt failed before its commit: its candidate is excluded from the next."""
        return AttemptFailed(
            code, message, retryable=retryable, candidate=self.result.candidate, sent=sent
        )

    def ending(self, ended: rules.Ended) -> _Ending:
        """What both paths' end records (:class:`~dispatcher.gate.rules.RunEnd`,
        :class:`~dispatcher.gate.rules.TunnelAttemptEnd`) take of the attempt, its scope ended
        so."""
        return {"committed": self.committed, "ended": ended, "client_gone": self.client_gone}

    def attempted(self, path: ExecutionPath, outcome: Outcome) -> Attempted:
        ttft = None if self.output_at is None else self.output_at - self.dispatched_at
        return Attempted(
            number=self.number,
            result=self.result,
            path=path,
            outcome=outcome,
            committed=self.committed,
            ttft=ttft,
            started_at=self.started_at,
        )


@attrs.define(eq=False)
class RunAttempt(Attempt):
    """A normalized attempt: its run."""

    run: Run = attrs.field(kw_only=True)
    stalled: bool = False
    """The stall timeout ended the answer after the commit (the client got an error)."""
    delivered: bool = False
    """The client was sent the answer's end (:meth:`Answer.delivered`)."""

    def observe(self, event: wire.RunEvent) -> None:
        """The consumer took ``event`` (usage is read from the run itself, consumed or
        not: see :attr:`dispatcher.paths.runs.Run.usage`)."""
        if self.output_at is None and _is_content(event):
            self.output_at = trio.current_time()

    def record(self, accounting: Accounting, request: GateRequest, ended: rules.Ended) -> Outcome:
        outcome = rules.run_outcome(
            rules.RunEnd(
                terminal=_terminal_kind(self.run.terminal),
                stalled=self.stalled,
                delivered=self.delivered,
                **self.ending(ended),
            )
        )
        accounting.record_run(request, self.attempted("normalized", outcome), self.run)
        return outcome


@attrs.define(eq=False)
class TunnelAttempt(Attempt):
    """A tunnel attempt: its tunnel, and what its relay reported."""

    tunnel: Tunnel = attrs.field(kw_only=True)
    failed: bool = False
    """The relay ended the answer with an error after the commit (broken off, stalled)."""
    delivered: bool = False
    """The client got the whole answer (the relayed ``data: [DONE]``): however the request
    ends from here, its row says ``completed``."""

    def record(self, accounting: Accounting, request: GateRequest, ended: rules.Ended) -> Outcome:
        tunnel = self.tunnel
        outcome = rules.tunnel_outcome(
            rules.TunnelAttemptEnd(
                **self.ending(ended),
                relay_failed=self.failed,
                delivered=self.delivered,
                finished=tunnel.finished,
                completed=tunnel.completed,
                status=tunnel.status,
            )
        )
        accounting.record_tunnel(request, self.attempted("tunnel", outcome), tunnel)
        return outcome


A = TypeVar("A", RunAttempt, TunnelAttempt)


@attrs.define(eq=False, kw_only=True)
class _Answer(Generic[A]):
    """The committed attempt, as the API consumes it (both paths)."""

    attempt: A
    attempts: int
    """How many attempts the request took (the committed one included)."""
    stall_timeout: float
    """The longest silence between two pieces of the answer after the commit."""

    @property
    def result(self) -> DispatchResult:
        return self.attempt.result

    def client_gone(self) -> None:
        """The API found the client gone (a reset connection, not a cancellation): the row
        says ``cancelled``, as it would for a client that left by closing."""
        self.attempt.client_gone = True


@attrs.define(eq=False, kw_only=True)
class Answer(_Answer[RunAttempt]):
    """A committed normalized attempt: ``head`` (the events up to the commit point), then
    the rest by iteration."""

    head: list[wire.RunEvent]
    _done: bool = False

    @property
    def run(self) -> Run:
        return self.attempt.run

    @property
    def terminal(self) -> wire.RunEvent | None:
        return self.attempt.run.terminal

    def delivered(self) -> None:
        """The client was sent the answer's end (the terminal event, rendered): a failed
        run's row says ``failed`` even if the client leaves before the request's block ends."""
        self.attempt.delivered = True

    def __aiter__(self) -> Answer:
        return self

    async def __anext__(self) -> wire.RunEvent:
        """The next event after the head; a stall becomes a synthesized ``run.failed``."""
        if self._done:
            raise StopAsyncIteration
        with trio.move_on_after(self.stall_timeout) as stall:
            event = await self.attempt.run.__anext__()
        if stall.cancelled_caught:
            self._done = True
            self.attempt.stalled = True
            return wire.RunFailed(
                run_id=self.attempt.run.run_id,
                seq=-1,
                code="stall_timeout",
                message=f"no output from the model for {self.stall_timeout:g} s",
                retryable=False,
            )
        self.attempt.observe(event)
        if wire.is_terminal(event):
            self._done = True
        return event

    def ready_events(self) -> list[wire.RunEvent]:
        events = self.attempt.run.ready_events()
        for event in events:
            self.attempt.observe(event)
            if wire.is_terminal(event):
                self._done = True
        return events


@attrs.define(eq=False, kw_only=True)
class TunnelAnswer(_Answer[TunnelAttempt]):
    """A committed tunnel attempt: the relay sends ``head`` (what the pre-commit phase
    buffered), then the rest of the tunnel's response."""

    head: TunnelHead

    @property
    def tunnel(self) -> Tunnel:
        return self.attempt.tunnel

    def failed(self) -> None:
        """The relay ended the answer with an error (its usage row says ``failed``)."""
        self.attempt.failed = True

    def delivered(self) -> None:
        """The client got the whole answer (its usage row says ``completed``, even if the
        client leaves before the provider's end of body)."""
        self.attempt.delivered = True


class _Committed:
    """The block of :meth:`Gate.open`: entering it makes the attempts (the gate's loop), and
    it holds the committed attempt's block for the rest of the request -- what an
    :class:`~contextlib.AsyncExitStack` is for one block, without its deque of callbacks,
    and without a generator around it (a held stream keeps one of these, not a suspended
    frame). ``enter`` keeps a block only once it entered: one that raises from its
    ``__aenter__`` has left already; when no attempt commits, nothing is held and the
    request's error is raised from ``__aenter__``."""

    __slots__ = ("_block", "_gate", "_request")

    def __init__(self, gate: Gate, request: GateRequest) -> None:
        self._gate = gate
        self._request = request
        self._block: AbstractAsyncContextManager[Answer | TunnelAnswer] | None = None

    async def enter(
        self, block: AbstractAsyncContextManager[Answer | TunnelAnswer]
    ) -> Answer | TunnelAnswer:
        if self._block is not None:
            raise RuntimeError("an attempt is held already")
        answer = await block.__aenter__()
        self._block = block
        return answer

    async def __aenter__(self) -> Answer | TunnelAnswer:
        return await self._gate._until_committed(self._request, self)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        block, self._block = self._block, None
        if block is None:
            return None
        # The block's own exit, as an exit stack calls it: its scopes shield what they must.
        return await block.__aexit__(exc_type, exc, tb)  # noqa: ASYNC102


@attrs.define(eq=False)
class _RowWhenEnded:
    """An attempt's usage row, recorded exactly once when the block this wraps ends (however
    it ends) -- if its request reached the node."""

    accounting: Accounting
    request: GateRequest
    attempt: RunAttempt | TunnelAttempt
    deadline: trio.CancelScope
    """The attempt's deadline scope: whether it fired says how the attempt ended."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, _type: object, exc: BaseException | None, _tb: object) -> None:
        attempt = self.attempt
        if not self.accounting.enabled:
            return
        if isinstance(attempt, TunnelAttempt) and not attempt.tunnel.sent:
            return
        raised: rules.Raised = (
            "nothing" if exc is None else "cancelled" if holds(exc, trio.Cancelled) else "error"
        )
        how = rules.scope_ended(
            raised, committed=attempt.committed, deadline_fired=self.deadline.cancel_called
        )
        self.request.result.outcome = attempt.record(self.accounting, self.request, how)


class Gate:
    """The stream gate (see the module docstring). ``record_usage`` is the ledger's sink;
    ``nursery`` is where an abandoned run's row waits for the node's cancel confirmation
    (the dispatcher's own nursery; without one, such rows are written at once, estimated);
    ``price_usage`` prices each row as it is built (the tenants')."""

    def __init__(
        self,
        pool: Pool,
        policy_for: Callable[[str], GatePolicy],
        record_usage: UsageSink | None = None,
        nursery: trio.Nursery | None = None,
        settle_timeout: float = SETTLE_TIMEOUT,
        price_usage: UsagePricing | None = None,
    ) -> None:
        self.pool = pool
        self.policy_for = policy_for
        self.accounting = Accounting(record_usage, nursery, settle_timeout, price_usage)
        self.statistics: dict[str, int] = {}

    @property
    def record_usage(self) -> UsageSink | None:
        return self.accounting.record_usage

    @record_usage.setter
    def record_usage(self, sink: UsageSink | None) -> None:
        self.accounting.record_usage = sink

    @property
    def settle_timeout(self) -> float:
        return self.accounting.settle_timeout

    @settle_timeout.setter
    def settle_timeout(self, seconds: float) -> None:
        self.accounting.settle_timeout = seconds

    def open(self, request: GateRequest) -> AbstractAsyncContextManager[Answer | TunnelAnswer]:
        """Make attempts until one commits and yield its answer, inside that attempt's
        scopes; raise the request's error when none does."""
        return _Committed(self, request)

    async def _until_committed(
        self, request: GateRequest, committed: _Committed
    ) -> Answer | TunnelAnswer:
        """The loop: each attempt a block (:meth:`_attempt`) entered on ``committed``; one
        that fails leaves its block (aborting it) as it raises, so only the committed one's
        stays, and its answer is returned. The model's group first, then its fallbacks
        (``GatePolicy.fallbacks``, those the client's key may use), each while
        :func:`rules.recovery` says so, all within the first group's one deadline."""
        first = self.policy_for(request.dispatch.model)
        may_use = request.may_use
        groups = (
            request.dispatch.model,
            *(group for group in first.fallbacks if may_use is None or may_use(group)),
        )
        excluded: set[CandidateKey] = set()
        last_failure: AttemptFailed | None = None
        first_refusal: AdmissionError | None = None
        deadline = trio.current_time() + first.request_timeout_s
        number = 0
        for position, group in enumerate(groups):
            policy = first
            if position:
                policy = attrs.evolve(
                    self.policy_for(group), request_timeout_s=first.request_timeout_s
                )
            recover = functools.partial(
                rules.recovery,
                max_attempts=policy.max_attempts,
                fallback_left=position + 1 < len(groups),
                first_group=position == 0,
            )
            tries = 0
            step: rules.Recovery = "retry"
            while step == "retry":
                try:
                    return await committed.enter(
                        self._attempt(request, group, policy, number + 1, excluded, deadline)
                    )
                except AttemptFailed as failure:
                    number, tries, last_failure = number + 1, tries + 1, failure
                    if failure.candidate is not None:
                        excluded.add(failure.candidate)
                    self._count(f"attempt_failed:{failure.code}")
                    step = recover(
                        rules.Failure(failure.code, failure.retryable),
                        tries=tries,
                        failed_before=True,
                    )
                    log.info(
                        "request %s attempt %d %s: %s (%s)",
                        request.request_id,
                        number,
                        "failed before commit" if failure.sent else "was not sent",
                        failure.message,
                        _STEP_WORDS[step],
                    )
                except AdmissionError as exc:
                    if first_refusal is None and position == 0:
                        first_refusal = exc
                    incapable = isinstance(exc, NoCapableCandidate)
                    step = recover(
                        rules.NoSlot(incapable, incapable and exc.only_excluded),
                        tries=tries,
                        failed_before=last_failure is not None,
                    )
                    if step == "raise":
                        if position == 0:
                            raise
                        assert first_refusal is not None  # only a refused first group fell back
                        raise first_refusal from None
                except RunError as exc:
                    # Admitted but never dispatched (stale generation, node gone at send).
                    number, tries = number + 1, tries + 1
                    last_failure = AttemptFailed(exc.code, exc.message, retryable=exc.retryable)
                    self._count(f"attempt_failed:{exc.code}")
                    step = recover(
                        rules.Failure(exc.code, exc.retryable), tries=tries, failed_before=True
                    )
                    log.info(
                        "request %s attempt %d was not sent: %s (%s)",
                        request.request_id,
                        number,
                        exc.message,
                        _STEP_WORDS[step],
                    )
            if step == "give_up":
                break
            log.info(
                "request %s: model group %s served no answer; falling back to %s",
                request.request_id,
                group,
                groups[position + 1],
            )
        assert last_failure is not None
        raise AllAttemptsFailed(
            f"every attempt failed before the answer started; last cause: {last_failure.message}",
            code=last_failure.code,
        )

    @asynccontextmanager
    async def _attempt(
        self,
        request: GateRequest,
        group: str,
        policy: GatePolicy,
        number: int,
        excluded: set[CandidateKey],
        deadline: float,
    ) -> AsyncIterator[Answer | TunnelAnswer]:
        """One attempt on ``group`` (the model asked for, or a fallback) as a block: under
        the request's ``deadline``, admitted and opened, read up to its commit point (raising
        :class:`AttemptFailed` before it, a timeout of the deadline too), its answer yielded
        inside its scopes -- the deadline, its ``pool.open``, its usage row
        (:class:`_RowWhenEnded`)."""
        dispatch_request, requeue = request.dispatch, number > 1
        # a recovery is requeued, the candidates that failed excluded (a first attempt as it
        # came, unless that said otherwise: no copy)
        if (
            dispatch_request.requeue != requeue
            or dispatch_request.exclude != excluded
            or dispatch_request.model != group
        ):
            dispatch_request = attrs.evolve(
                dispatch_request, model=group, exclude=frozenset(excluded), requeue=requeue
            )
        with trio.CancelScope(deadline=deadline) as deadline_scope:
            started = request.result.waiting_since = trio.current_time()
            async with self.pool.open(
                dispatch_request, prepare_run=self._prepare(request, number)
            ) as dispatch:
                request.result.waiting_since = None
                attempt = self._new_attempt(request, number, dispatch, started)
                request.result.attempts, request.result.attempt = number, attempt
                with _RowWhenEnded(self.accounting, request, attempt, deadline_scope):
                    try:
                        answer = await self._commit(request, attempt, number, policy)
                    except (AttemptFailed, UpstreamRejected) as exc:
                        # Before the slot is released, so that a probe's failure is seen
                        # before another request may probe.
                        self._report_health(attempt, exc)
                        raise
                    self._report_health(attempt, None)
                    deadline_scope.deadline = math.inf  # committed: no deadline from here
                    yield answer
                    return
        # Only the deadline scope, having caught its cancellation, gets here.
        raise AttemptFailed(
            rules.REQUEST_TIMEOUT.code,
            f"no answer within the request deadline of {policy.request_timeout_s:g} s",
            retryable=rules.REQUEST_TIMEOUT.retryable,
        )

    def _report_health(
        self, attempt: Attempt, failure: AttemptFailed | UpstreamRejected | None
    ) -> None:
        """Tell admission how the candidate did: it answered (committed, or refused the
        request as the client's mistake), or it failed for a reason of its own. A client's
        error, a timeout of the whole request or a cancellation say nothing about it."""
        key = attempt.result.candidate
        if isinstance(failure, UpstreamRejected):
            verdict = rules.health(None, client_error=True)
        else:
            verdict = rules.health(
                None if failure is None else rules.Failure(failure.code, failure.retryable)
            )
        if verdict == "success":
            self.pool.admission.report_success(key)
        elif verdict == "failure":
            self.pool.admission.report_failure(key)

    def _new_attempt(
        self, request: GateRequest, number: int, dispatch: Dispatch, started: float
    ) -> RunAttempt | TunnelAttempt:
        """The bookkeeping of an attempt that was just admitted and opened."""
        now = trio.current_time()
        result = dispatch.result
        if dispatch.run is not None:
            return RunAttempt(number, result, started, now, run=dispatch.run)
        assert dispatch.tunnel is not None  # a dispatch holds exactly one of the two
        if request.tunnel_call is None:
            raise AttemptFailed(
                "tunnel_unsupported",
                f"{result.node_id}/{result.provider_id} serves this model through a tunnel, "
                "which this request cannot use",
                retryable=True,
                candidate=result.candidate,
            )
        return TunnelAttempt(number, result, started, now, tunnel=dispatch.tunnel)

    async def _commit(
        self,
        request: GateRequest,
        attempt: RunAttempt | TunnelAttempt,
        number: int,
        policy: GatePolicy,
    ) -> Answer | TunnelAnswer:
        """Read the attempt up to its commit point (raising :class:`AttemptFailed` before
        it) and mark it committed."""
        if isinstance(attempt, TunnelAttempt):
            assert request.tunnel_call is not None  # _new_attempt refused it otherwise
            tunnel_head = await self._until_tunnel_commit(attempt, request.tunnel_call, policy)
            attempt.committed = True
            attempt.output_at = trio.current_time()
            return TunnelAnswer(
                attempt=attempt,
                attempts=number,
                stall_timeout=policy.stall_timeout_s,
                head=tunnel_head,
            )
        head = await self._until_commit(attempt, request.stream, policy)
        attempt.committed = True
        return Answer(
            attempt=attempt, attempts=number, stall_timeout=policy.stall_timeout_s, head=head
        )

    def _prepare(
        self, request: GateRequest, number: int
    ) -> Callable[[Candidate, RunSpec], Awaitable[RunSpec]] | None:
        prepare = request.prepare
        if prepare is None:
            return None

        async def for_this_attempt(candidate: Candidate, spec: RunSpec) -> RunSpec:
            return await prepare(number, candidate, spec)

        return for_this_attempt

    async def _until_commit(
        self, attempt: RunAttempt, stream: bool, policy: GatePolicy
    ) -> list[wire.RunEvent]:
        """Read the attempt's events up to its commit point (the first content for a stream,
        the successful end otherwise). Raises :class:`AttemptFailed` before that."""
        head: list[wire.RunEvent] = []
        run = attempt.run
        first_token_deadline = attempt.dispatched_at + policy.first_token_timeout_s
        # One scope for the whole read, its deadline moved before each event is awaited
        # once output was seen (the first-token deadline until then, the stall timeout from
        # the last event after).
        with trio.CancelScope(deadline=first_token_deadline) as waited:
            while True:
                if attempt.output_at is not None:
                    waited.deadline = trio.current_time() + policy.stall_timeout_s
                event = await run.__anext__()
                attempt.observe(event)
                if isinstance(event, wire.RunFailed) and rules.is_client_error(
                    event.status, event.retryable
                ):
                    # The upstream refused the request itself: the client's answer, relayed
                    # as the upstream's status (committed: this attempt answered the client).
                    attempt.committed = True
                    raise UpstreamRejected(event.message, code=event.code, status=event.status)
                if isinstance(event, wire.RunFailed):
                    raise attempt.failure(
                        event.code, f"{attempt.where}: {event.message}", retryable=event.retryable
                    )
                if isinstance(event, wire.RunCancelled):
                    raise attempt.failure(
                        "cancelled_by_node",
                        f"{attempt.result.node_id}: the node cancelled the run",
                        retryable=True,
                    )
                head.append(event)
                if isinstance(event, wire.RunCompleted) or (stream and _is_content(event)):
                    return head
        raise _timed_out(attempt, policy, output_seen=attempt.output_at is not None)

    async def _until_tunnel_commit(
        self, attempt: TunnelAttempt, call: TunnelCall, policy: GatePolicy
    ) -> TunnelHead:
        """Run the tunnel's pre-commit phase (:func:`commit_tunnel`) under the first-token
        timeout (the stall timeout once it reported output), and judge the response's status
        (:func:`rules.tunnel_status_failure`). Raises :class:`AttemptFailed` when the
        attempt failed before its commit point."""
        where = attempt.where
        first_token_deadline = attempt.dispatched_at + policy.first_token_timeout_s
        with trio.CancelScope(deadline=first_token_deadline) as waited:
            pre_commit = PreCommit(waited, policy.stall_timeout_s)
            try:
                head = await commit_tunnel(
                    attempt.tunnel, call, attempt.result.served_model, pre_commit
                )
            except TunnelFailed as exc:
                raise attempt.failure(exc.code, exc.message, retryable=exc.retryable) from exc
            except NodeUnavailable as exc:
                # lost before the request went out: no row (see _RowWhenEnded); lost while
                # its body was going out: the node may have begun it, the row is kept
                raise attempt.failure(
                    exc.code,
                    f"{where}: {exc.message}",
                    retryable=True,
                    sent=attempt.tunnel.sent,
                ) from exc
            status = head.start.status
            failure = rules.tunnel_status_failure(status)
            if failure is not None:
                raise attempt.failure(
                    failure.code,
                    f"{where}: the provider answered status {status}",
                    retryable=failure.retryable,
                )
            return head
        raise _timed_out(attempt, policy, output_seen=pre_commit.output_at is not None)

    def _count(self, key: str) -> None:
        # The failure codes come from nodes and providers: past MAX_STATISTICS distinct keys,
        # a new one is counted as "other" (a hostile node cannot grow this without bound).
        statistics = self.statistics
        if key not in statistics and len(statistics) >= MAX_STATISTICS:
            key = "attempt_failed:other"
        statistics[key] = statistics.get(key, 0) + 1


_STEP_WORDS: Final[dict[rules.Recovery, str]] = {
    "retry": "retrying",
    "fall_back": "falling back",
    "give_up": "giving up",
    "raise": "giving up",
}


def _timed_out(attempt: Attempt, policy: GatePolicy, *, output_seen: bool) -> AttemptFailed:
    """The first-token timeout (nothing came yet) or the stall timeout (output stopped)
    ended the attempt before its commit."""
    if not output_seen:
        return attempt.failure(
            "first_token_timeout",
            f"{attempt.where}: no first token within {policy.first_token_timeout_s:g} s",
            retryable=True,
        )
    return attempt.failure(
        "stall_timeout",
        f"{attempt.where}: no output for {policy.stall_timeout_s:g} s",
        retryable=True,
    )


def _terminal_kind(event: wire.RunEvent | None) -> rules.Terminal | None:
    if isinstance(event, wire.RunCompleted):
        return "completed"
    if isinstance(event, wire.RunFailed):
        return "failed"
    if isinstance(event, wire.RunCancelled):
        return "cancelled"
    return None


__all__: Sequence[str] = (
    "AllAttemptsFailed",
    "Answer",
    "Attempt",
    "AttemptFailed",
    "Gate",
    "GatePolicy",
    "GateRequest",
    "Outcome",
    "PreCommit",
    "RequestResult",
    "RunAttempt",
    "TunnelAnswer",
    "TunnelAttempt",
    "TunnelCall",
    "TunnelHead",
)
