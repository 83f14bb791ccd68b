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
(:func:`dispatcher.tunnel_http.commit_tunnel`) under the request deadline and the first-token
timeout, fails the attempt on a 5xx / 429 (:func:`dispatcher.gate_rules.tunnel_status_failure`)
and yields a :class:`TunnelAnswer` with what it buffered (``head``) for the relay to send,
then the rest.

Every dispatched attempt (its run or tunnel request was sent) gets exactly one usage row when
it ends.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from . import gate_rules as rules
from . import wire
from .admission import AdmissionError, Candidate, CandidateKey, NoCapableCandidate
from .errors import AllAttemptsFailed, NodeUnavailable, RunError, TunnelFailed, UpstreamRejected
from .pool import Dispatch, DispatchRequest, DispatchResult, Pool
from .protocol.excgroups import holds
from .runs import Run, RunSpec
from .tunnel import Tunnel
from .tunnel_http import PreCommit, TunnelCall, TunnelHead, commit_tunnel
from .usage import UsageRow

log = logging.getLogger("dispatcher.gate")

Outcome = rules.Outcome
GatePolicy = rules.GatePolicy
UsageSink = Callable[[UsageRow], None]
PrepareAttempt = Callable[[int, Candidate, RunSpec], Awaitable[RunSpec]]


SETTLE_TIMEOUT = 10.0
"""How long an abandoned run's usage row waits for the node's cancel confirmation."""


@attrs.define
class RequestResult:
    """What the gate learned of a request, for the route's own accounting: the outcome of the
    row of its last dispatched attempt (None if no attempt was dispatched). The request-outcome
    metric derives from it, so the ledger and the metric agree for every request."""

    outcome: Outcome | None = None


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


class AttemptFailed(Exception):
    """An attempt failed before its commit point; ``retryable`` says if another may do."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retryable: bool,
        candidate: CandidateKey | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.candidate = candidate
        """The candidate to exclude, when no attempt was made on it."""


_AttemptFailed = AttemptFailed


def _is_content(event: wire.RunEvent) -> bool:
    return isinstance(event, wire.RunDelta) and bool(event.text or event.tool_calls)


def _estimate_tokens(chars: int) -> int:
    return (chars + 3) // 4


@attrs.define(eq=False)
class Attempt:
    """One attempt's bookkeeping, from dispatch to its usage row."""

    number: int
    result: DispatchResult
    run: Run
    started_at: float
    """``trio.current_time()`` when the attempt was submitted to admission."""
    dispatched_at: float
    first_content_at: float | None = None
    committed: bool = False
    stalled: bool = False
    """The stall timeout ended the answer after the commit (the client got an error)."""
    client_gone: bool = False
    """The API found the client gone (its connection reset): the row says ``cancelled``."""

    def observe(self, event: wire.RunEvent) -> None:
        """The consumer took ``event`` (usage is read from the run itself, consumed or
        not: see :attr:`dispatcher.runs.Run.usage`)."""
        if (
            self.first_content_at is None
            and isinstance(event, wire.RunDelta)
            and _is_content(event)
        ):
            self.first_content_at = trio.current_time()


@attrs.define(eq=False)
class Answer:
    """The committed attempt, as the API consumes it."""

    attempt: Attempt
    attempts: int
    """How many attempts the request took (the committed one included)."""
    head: list[wire.RunEvent]
    _stall_timeout: float
    _done: bool = False

    @property
    def result(self) -> DispatchResult:
        return self.attempt.result

    @property
    def run(self) -> Run:
        return self.attempt.run

    @property
    def terminal(self) -> wire.RunEvent | None:
        return self.attempt.run.terminal

    def client_gone(self) -> None:
        """The API found the client gone (a reset connection, not a cancellation): the row
        says ``cancelled``, as it would for a client that left by closing."""
        self.attempt.client_gone = True

    def __aiter__(self) -> Answer:
        return self

    async def __anext__(self) -> wire.RunEvent:
        """The next event after the head; a stall becomes a synthesized ``run.failed``."""
        if self._done:
            raise StopAsyncIteration
        with trio.move_on_after(self._stall_timeout) as stall:
            event = await self.attempt.run.__anext__()
        if stall.cancelled_caught:
            self._done = True
            self.attempt.stalled = True
            return wire.RunFailed(
                run_id=self.attempt.run.run_id,
                seq=-1,
                code="stall_timeout",
                message=f"no output from the model for {self._stall_timeout:g} s",
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


@attrs.define(eq=False)
class TunnelAttempt:
    """One tunnel attempt's bookkeeping, from dispatch to its usage row."""

    number: int
    result: DispatchResult
    tunnel: Tunnel
    started_at: float
    """``trio.current_time()`` when the attempt was submitted to admission."""
    dispatched_at: float
    committed_at: float | None = None
    committed: bool = False
    failed: bool = False
    """The relay ended the answer with an error after the commit (broken off, stalled)."""
    client_gone: bool = False
    """The relay found the client gone."""
    delivered: bool = False
    """The client got the whole answer (the relayed ``data: [DONE]``): however the request
    ends from here, its row says ``completed``."""


@attrs.define(eq=False)
class TunnelAnswer:
    """The committed tunnel attempt: the relay sends ``head`` (what the pre-commit phase
    buffered), then the rest of the tunnel's response."""

    attempt: TunnelAttempt
    attempts: int
    """How many attempts the request took (the committed one included)."""
    head: TunnelHead
    """What the pre-commit phase read (:func:`~dispatcher.tunnel_http.commit_tunnel`)."""
    stall_timeout: float
    """The longest silence of the tunnel between two pieces after the commit."""

    @property
    def result(self) -> DispatchResult:
        return self.attempt.result

    @property
    def tunnel(self) -> Tunnel:
        return self.attempt.tunnel

    def failed(self) -> None:
        """The relay ended the answer with an error (its usage row says ``failed``)."""
        self.attempt.failed = True

    def client_gone(self) -> None:
        """The relay found the client gone (its usage row says ``cancelled``)."""
        self.attempt.client_gone = True

    def delivered(self) -> None:
        """The client got the whole answer (its usage row says ``completed``, even if the
        client leaves before the provider's end of body)."""
        self.attempt.delivered = True


@attrs.define(eq=False)
class Gate:
    pool: Pool
    policy_for: Callable[[str], GatePolicy]
    record_usage: UsageSink | None = None
    nursery: trio.Nursery | None = None
    """Where an abandoned run's row waits for the node's cancel confirmation (the
    dispatcher's own nursery). Without one, such rows are written at once, estimated."""
    settle_timeout: float = SETTLE_TIMEOUT
    statistics: dict[str, int] = attrs.field(factory=dict)

    @asynccontextmanager
    async def open(self, request: GateRequest) -> AsyncIterator[Answer | TunnelAnswer]:
        policy = self.policy_for(request.dispatch.model)
        excluded: set[CandidateKey] = set()
        last_failure: _AttemptFailed | None = None
        deadline = trio.current_time() + policy.request_timeout_s
        for number in range(1, policy.max_attempts + 1):
            dispatch_request = attrs.evolve(
                request.dispatch, exclude=frozenset(excluded), requeue=number > 1
            )
            attempt: Attempt | TunnelAttempt | None = None
            yielded = False  # once the caller has the answer, its errors are its own
            started = trio.current_time()
            try:
                with trio.CancelScope(deadline=deadline) as before_commit:
                    async with self.pool.open(
                        dispatch_request, prepare_run=self._prepare(request, number)
                    ) as dispatch:
                        attempt = self._new_attempt(request, number, dispatch, started)
                        ended_by: BaseException | None = None
                        try:
                            try:
                                answer = await self._commit(request, attempt, number, policy)
                            except (_AttemptFailed, UpstreamRejected) as exc:
                                # Before the slot is released, so that a probe's failure
                                # is seen before another request may probe.
                                self._report_health(attempt, exc)
                                raise
                            self._report_health(attempt, None)
                            before_commit.deadline = math.inf
                            yielded = True
                            yield answer
                        except BaseException as exc:
                            ended_by = exc
                            raise
                        finally:
                            timed_out = not attempt.committed and before_commit.cancel_called
                            if isinstance(attempt, TunnelAttempt):
                                self._record_tunnel(request, attempt, ended_by, timed_out)
                            else:
                                self._record(request, attempt, ended_by, timed_out)
                if before_commit.cancelled_caught:
                    raise _AttemptFailed(
                        "request_timeout",
                        f"no answer within the request deadline of {policy.request_timeout_s:g} s",
                        retryable=False,
                    )
                return
            except _AttemptFailed as failure:
                last_failure = failure
                self._count(f"attempt_failed:{failure.code}")
                if attempt is not None:
                    excluded.add(attempt.result.candidate)
                elif failure.candidate is not None:
                    excluded.add(failure.candidate)
                step = rules.after_failure(
                    rules.Failure(failure.code, failure.retryable),
                    attempt=number,
                    max_attempts=policy.max_attempts,
                )
                log.info(
                    "request %s attempt %d failed before commit: %s (%s)",
                    request.request_id,
                    number,
                    failure.message,
                    "retrying" if step == "retry" else "giving up",
                )
                if step == "give_up":
                    break
            except AdmissionError as exc:
                incapable = isinstance(exc, NoCapableCandidate)
                decided = rules.after_admission_error(
                    committed=yielded,
                    failed_before=last_failure is not None,
                    incapable=incapable,
                    only_excluded=incapable and exc.only_excluded,
                )
                if decided == "raise":
                    raise
                break  # a recovery could not be admitted: the last cause stands
            except RunError as exc:
                if yielded:
                    raise  # the caller's own error after the commit: not ours to retry
                # Admitted but never dispatched (stale generation, node gone at send).
                last_failure = _AttemptFailed(exc.code, exc.message, retryable=exc.retryable)
                self._count(f"attempt_failed:{exc.code}")
                step = rules.after_failure(
                    rules.Failure(exc.code, exc.retryable),
                    attempt=number,
                    max_attempts=policy.max_attempts,
                )
                if step == "give_up":
                    break
        assert last_failure is not None
        raise AllAttemptsFailed(
            f"every attempt failed before the answer started; last cause: {last_failure.message}",
            code=last_failure.code,
        )

    def _report_health(
        self, attempt: Attempt | TunnelAttempt, failure: _AttemptFailed | UpstreamRejected | None
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
    ) -> Attempt | TunnelAttempt:
        """The bookkeeping of an attempt that was just admitted and opened."""
        now = trio.current_time()
        if dispatch.run is not None:
            return Attempt(number, dispatch.result, dispatch.run, started, now)
        if request.tunnel_call is None:
            result = dispatch.result
            raise _AttemptFailed(
                "tunnel_unsupported",
                f"{result.node_id}/{result.provider_id} serves this model through a tunnel, "
                "which this request cannot use",
                retryable=True,
                candidate=result.candidate,
            )
        return TunnelAttempt(number, dispatch.result, dispatch.tunnel, started, now)

    async def _commit(
        self,
        request: GateRequest,
        attempt: Attempt | TunnelAttempt,
        number: int,
        policy: GatePolicy,
    ) -> Answer | TunnelAnswer:
        """Read the attempt up to its commit point (raising :class:`AttemptFailed` before
        it) and mark it committed."""
        if isinstance(attempt, TunnelAttempt):
            assert request.tunnel_call is not None
            tunnel_head = await self._until_tunnel_commit(attempt, request.tunnel_call, policy)
            attempt.committed = True
            attempt.committed_at = trio.current_time()
            return TunnelAnswer(attempt, number, tunnel_head, policy.stall_timeout_s)
        head = await self._until_commit(attempt, request.stream, policy)
        attempt.committed = True
        return Answer(attempt, number, head, policy.stall_timeout_s)

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
        self, attempt: Attempt, stream: bool, policy: GatePolicy
    ) -> list[wire.RunEvent]:
        """Read the attempt's events up to its commit point (the first content for a stream,
        the successful end otherwise). Raises :class:`_AttemptFailed` before that."""
        head: list[wire.RunEvent] = []
        run = attempt.run
        first_token_deadline = attempt.dispatched_at + policy.first_token_timeout_s
        while True:
            timeout = (
                first_token_deadline
                if attempt.first_content_at is None
                else trio.current_time() + policy.stall_timeout_s
            )
            with trio.move_on_at(timeout) as waited:
                event = await run.__anext__()
            if waited.cancelled_caught:
                if attempt.first_content_at is None:
                    raise _AttemptFailed(
                        "first_token_timeout",
                        f"{attempt.result.node_id}/{attempt.result.provider_id}: no first "
                        f"token within {policy.first_token_timeout_s:g} s",
                        retryable=True,
                    )
                raise _AttemptFailed(
                    "stall_timeout",
                    f"{attempt.result.node_id}/{attempt.result.provider_id}: no output for "
                    f"{policy.stall_timeout_s:g} s",
                    retryable=True,
                )
            attempt.observe(event)
            if isinstance(event, wire.RunFailed) and rules.is_client_error(
                event.status, event.retryable
            ):
                # The upstream refused the request itself: the client's answer, relayed as
                # the upstream's status (committed: this attempt answered the client).
                attempt.committed = True
                raise UpstreamRejected(event.message, code=event.code, status=event.status)
            if isinstance(event, wire.RunFailed):
                raise _AttemptFailed(
                    event.code,
                    f"{attempt.result.node_id}/{attempt.result.provider_id}: {event.message}",
                    retryable=event.retryable,
                )
            if isinstance(event, wire.RunCancelled):
                raise _AttemptFailed(
                    "cancelled_by_node",
                    f"{attempt.result.node_id}: the node cancelled the run",
                    retryable=True,
                )
            head.append(event)
            if isinstance(event, wire.RunCompleted) or (stream and _is_content(event)):
                return head

    async def _until_tunnel_commit(
        self, attempt: TunnelAttempt, call: TunnelCall, policy: GatePolicy
    ) -> TunnelHead:
        """Run the tunnel's pre-commit phase (:func:`commit_tunnel`) under the first-token
        timeout (the stall timeout once it reported output), and judge the response's status
        (:func:`rules.tunnel_status_failure`). Raises :class:`_AttemptFailed` when the
        attempt failed before its commit point."""
        result = attempt.result
        where = f"{result.node_id}/{result.provider_id}"
        first_token_deadline = attempt.dispatched_at + policy.first_token_timeout_s
        with trio.CancelScope(deadline=first_token_deadline) as waited:
            pre_commit = PreCommit(waited, policy.stall_timeout_s)
            try:
                head = await commit_tunnel(attempt.tunnel, call, result.served_model, pre_commit)
            except TunnelFailed as exc:
                raise _AttemptFailed(exc.code, exc.message, retryable=exc.retryable) from exc
            except NodeUnavailable as exc:
                raise _AttemptFailed(exc.code, f"{where}: {exc.message}", retryable=True) from exc
            status = head.start.status
            failure = rules.tunnel_status_failure(status)
            if failure is not None:
                raise _AttemptFailed(
                    failure.code,
                    f"{where}: the provider answered status {status}",
                    retryable=failure.retryable,
                )
            return head
        if pre_commit.output_at is None:
            raise _AttemptFailed(
                "first_token_timeout",
                f"{where}: no first token within {policy.first_token_timeout_s:g} s",
                retryable=True,
            )
        raise _AttemptFailed(
            "stall_timeout", f"{where}: no output for {policy.stall_timeout_s:g} s", retryable=True
        )

    def _record_tunnel(
        self,
        request: GateRequest,
        attempt: TunnelAttempt,
        ended_by: BaseException | None,
        timed_out: bool,
    ) -> None:
        """The tunnel attempt's usage row, exactly once, when its scope ends -- if its
        request reached the node. ``timed_out``: the request deadline ended it before the
        commit."""
        tunnel = attempt.tunnel
        if self.record_usage is None or not tunnel.sent:
            return
        cancelled = _is_cancellation(ended_by)
        outcome = rules.tunnel_outcome(
            rules.TunnelEnd(
                committed=attempt.committed,
                cancelled=cancelled,
                timed_out=timed_out,
                client_gone=attempt.client_gone,
                errored=ended_by is not None and not cancelled,
                relay_failed=attempt.failed,
                delivered=attempt.delivered,
                finished=tunnel.finished,
                completed=tunnel.completed,
                status=tunnel.status,
            )
        )
        request.result.outcome = outcome
        usage = tunnel.usage
        if usage is not None:
            prompt, completion, reported = usage
            source = "reported" if reported else "estimated"
        else:
            prompt, completion, source = _estimate_prompt(request.dispatch.body), 0, "estimated"
        ttft = (
            None if attempt.committed_at is None else attempt.committed_at - attempt.dispatched_at
        )
        self._emit(
            request,
            attempt.number,
            attempt.result,
            prompt=prompt,
            completion=completion,
            source=source,
            outcome=outcome,
            committed=attempt.committed,
            ttft=ttft,
            started_at=attempt.started_at,
        )

    def _record(
        self,
        request: GateRequest,
        attempt: Attempt,
        ended_by: BaseException | None,
        timed_out: bool,
    ) -> None:
        """The attempt's usage row, exactly once, when its scope ends. ``timed_out``: the
        request deadline ended it before the commit."""
        if self.record_usage is None:
            return
        cancelled = _is_cancellation(ended_by)
        outcome = rules.run_outcome(
            rules.RunEnd(
                terminal=_terminal_kind(attempt.run.terminal),
                committed=attempt.committed,
                cancelled=cancelled,
                timed_out=timed_out,
                client_gone=attempt.client_gone,
                errored=ended_by is not None and not cancelled,
                stalled=attempt.stalled,
            )
        )
        request.result.outcome = outcome
        if not attempt.run.finished and self.nursery is not None:
            # The run is about to be abandoned (cancel sent, slot draining): its row waits
            # for the node's end (its cancel confirmation or, if it ignored the cancel, its
            # own end), which carries the usage the node knows; at once if the node is lost.
            self.nursery.start_soon(self._record_when_settled, request, attempt, outcome)
            return
        self._write(request, attempt, outcome)

    async def _record_when_settled(
        self, request: GateRequest, attempt: Attempt, outcome: Outcome
    ) -> None:
        try:
            with trio.move_on_after(self.settle_timeout):
                await attempt.run.settled.wait()
        finally:
            # However this ends (confirmed, timed out, the dispatcher closing), once.
            self._write(request, attempt, outcome)

    def _write(self, request: GateRequest, attempt: Attempt, outcome: Outcome) -> None:
        usage = attempt.run.usage
        if usage is not None and (usage.prompt_tokens < 0 or usage.completion_tokens < 0):
            log.warning(
                "request %s attempt %d: node %s reported negative usage (%d, %d); estimating",
                request.request_id,
                attempt.number,
                attempt.result.node_id,
                usage.prompt_tokens,
                usage.completion_tokens,
            )
            usage = None
        if usage is not None:
            prompt, completion = usage.prompt_tokens, usage.completion_tokens
            source = "estimated" if usage.estimated else "reported"
        else:
            prompt = _estimate_prompt(request.dispatch.body)
            completion = _estimate_tokens(attempt.run.text_chars)
            source = "estimated"
        self._emit(
            request,
            attempt.number,
            attempt.result,
            prompt=prompt,
            completion=completion,
            source=source,
            outcome=outcome,
            committed=attempt.committed,
            ttft=(
                None
                if attempt.first_content_at is None
                else attempt.first_content_at - attempt.dispatched_at
            ),
            started_at=attempt.started_at,
        )

    def _emit(
        self,
        request: GateRequest,
        number: int,
        result: DispatchResult,
        *,
        prompt: int,
        completion: int,
        source: str,
        outcome: Outcome,
        committed: bool,
        ttft: float | None,
        started_at: float,
    ) -> None:
        assert self.record_usage is not None
        try:
            row = UsageRow(
                request_id=request.request_id,
                attempt=number,
                model_group=result.model_group,
                served_model=result.served_model,
                provider_id=result.provider_id,
                node_id=result.node_id,
                path=result.path,  # type: ignore[arg-type]
                attribution=request.attribution,
                prompt_tokens=prompt,
                completion_tokens=completion,
                usage_source=source,  # type: ignore[arg-type]
                outcome=outcome,
                billable_to="client" if committed else "operator",
                queue_wait_s=result.queue_wait,
                ttft_s=ttft,
                duration_s=trio.current_time() - started_at,
                ended_at=time.time(),
                client_request_id=request.client_request_id,
                route=request.dispatch.route,
            )
            self.record_usage(row)
        except Exception:  # the ledger must never break a request's exit path
            log.exception("could not record usage for %s attempt %d", request.request_id, number)

    def _count(self, key: str) -> None:
        self.statistics[key] = self.statistics.get(key, 0) + 1


def _terminal_kind(event: wire.RunEvent | None) -> rules.Terminal | None:
    if isinstance(event, wire.RunCompleted):
        return "completed"
    if isinstance(event, wire.RunFailed):
        return "failed"
    if isinstance(event, wire.RunCancelled):
        return "cancelled"
    return None


def _is_cancellation(exc: BaseException | None) -> bool:
    return holds(exc, trio.Cancelled)


def _estimate_prompt(body: dict[str, Any]) -> int:
    """Characters of the request's messages (and, for the tunnel-only routes, its ``prompt``
    or ``input``) / 4, rounded up."""
    chars = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        chars += len(part["text"])
    for key in ("prompt", "input"):
        value = body.get(key)
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, list):
            chars += sum(len(item) for item in value if isinstance(item, str))
    return _estimate_tokens(chars)


__all__: Sequence[str] = (
    "AllAttemptsFailed",
    "Answer",
    "Attempt",
    "AttemptFailed",
    "Gate",
    "GatePolicy",
    "GateRequest",
    "PreCommit",
    "RequestResult",
    "TunnelAnswer",
    "TunnelAttempt",
    "TunnelCall",
    "TunnelHead",
)
