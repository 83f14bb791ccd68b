"""The stream gate: attempts, the commit point, recovery before it, explicit errors after it.

A client request becomes a sequence of *attempts*. Each attempt is its own owned scope -- an
admission, a slot, a subscription, a transport (``pool.open``) -- and ends either by *close*
(its run ended: nothing to tell the node) or by *abort* (the node is told to cancel), each at
most once, by leaving that scope.

Nothing reaches the client before the **commit point**: the first content-bearing delta of a
streamed run, or the complete successful answer of a non-streamed one. Until then a failure
(node lost, retryable ``run.failed``, stale generation, first-token timeout) is recovered:
the attempt is aborted and the request admitted again with the failed candidates excluded,
up to ``max_attempts`` and within one deadline that covers queue waits too. After the commit,
a failure is delivered to the client as an explicit error (an SSE error event), never a
silent clean end.

::

    async with gate.open(request) as answer:      # attempts until one commits, or raises
        answer.head                               # events up to the commit point
        async for event in answer:                # the rest, with the stall timeout
            ...

Every dispatched attempt (its run request was sent) gets exactly one usage row when it ends.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import attrs
import trio

from . import wire
from .admission import AdmissionError, Candidate, CandidateKey, NoCapableCandidate
from .errors import RunError
from .pool import DispatchRequest, DispatchResult, Pool
from .runs import Run, RunSpec
from .usage import UsageRow

log = logging.getLogger("dispatcher.gate")

Outcome = Literal["completed", "failed", "aborted", "cancelled"]
UsageSink = Callable[[UsageRow], None]
PrepareAttempt = Callable[[int, Candidate, RunSpec], Awaitable[RunSpec]]


@attrs.frozen(kw_only=True)
class GatePolicy:
    max_attempts: int = 3
    request_timeout_s: float = 120.0
    first_token_timeout_s: float = 60.0
    stall_timeout_s: float = 60.0


@attrs.frozen(kw_only=True)
class GateRequest:
    request_id: str
    dispatch: DispatchRequest
    stream: bool
    attribution: str | None = None
    prepare: PrepareAttempt | None = attrs.field(default=None, eq=False)
    """Called fresh for every attempt (attempt number, chosen candidate, spec) before the run
    is sent: per-attempt credentials, headers, options."""


class AllAttemptsFailed(RunError):
    """Every attempt failed before anything was streamed (502, with the last cause)."""


class _AttemptFailed(Exception):
    """An attempt failed before its commit point; ``retryable`` says if another may do."""

    def __init__(self, code: str, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable


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
    usage: wire.Usage | None = None
    completion_chars: int = 0
    committed: bool = False

    def observe(self, event: wire.RunEvent) -> None:
        if isinstance(event, wire.RunDelta):
            self.completion_chars += len(event.text)
            if self.first_content_at is None and _is_content(event):
                self.first_content_at = trio.current_time()
        elif isinstance(event, wire.RunUsage) or (
            isinstance(event, wire.RunCancelled) and event.usage is not None
        ):
            self.usage = event.usage


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


@attrs.frozen
class TunnelAnswer:
    """The request was placed on a tunnel candidate: the relay answers it."""

    result: DispatchResult
    tunnel: Any
    attempts: int


@attrs.define(eq=False)
class Gate:
    pool: Pool
    policy_for: Callable[[str], GatePolicy]
    record_usage: UsageSink | None = None
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
            attempt: Attempt | None = None
            yielded = False  # once the caller has the answer, its errors are its own
            started = trio.current_time()
            try:
                with trio.CancelScope(deadline=deadline) as before_commit:
                    async with self.pool.open(
                        dispatch_request, prepare_run=self._prepare(request, number)
                    ) as dispatch:
                        if dispatch.run is None:
                            # A tunnel: relayed as is (recovery of tunnels is future work).
                            before_commit.deadline = math.inf
                            yielded = True
                            yield TunnelAnswer(dispatch.result, dispatch.tunnel, number)
                            return
                        attempt = Attempt(
                            number,
                            dispatch.result,
                            dispatch.run,
                            started_at=started,
                            dispatched_at=trio.current_time(),
                        )
                        ended_by: BaseException | None = None
                        try:
                            head = await self._until_commit(attempt, request.stream, policy)
                            attempt.committed = True
                            before_commit.deadline = math.inf
                            yielded = True
                            yield Answer(attempt, number, head, policy.stall_timeout_s)
                        except BaseException as exc:
                            ended_by = exc
                            raise
                        finally:
                            self._record(request, attempt, ended_by, deadline)
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
                log.info(
                    "request %s attempt %d failed before commit: %s (%s)",
                    request.request_id,
                    number,
                    failure.message,
                    "retrying" if failure.retryable else "not retryable",
                )
                if not failure.retryable:
                    break
            except NoCapableCandidate as exc:
                if yielded or last_failure is None or not _only_exclusions(exc):
                    raise
                break  # every capable candidate already failed for this request
            except AdmissionError:
                if yielded or last_failure is None:
                    raise
                break  # a recovery could not be admitted: the last cause stands
            except RunError as exc:
                if yielded:
                    raise  # the caller's own error after the commit: not ours to retry
                # Admitted but never dispatched (stale generation, node gone at send).
                last_failure = _AttemptFailed(exc.code, exc.message, retryable=exc.retryable)
                self._count(f"attempt_failed:{exc.code}")
                if not exc.retryable:
                    break
        assert last_failure is not None
        raise AllAttemptsFailed(
            f"every attempt failed before the answer started; last cause: {last_failure.message}",
            code=last_failure.code,
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

    def _record(
        self,
        request: GateRequest,
        attempt: Attempt,
        ended_by: BaseException | None,
        deadline: float,
    ) -> None:
        """The attempt's usage row, exactly once, when its scope ends."""
        if self.record_usage is None:
            return
        terminal = attempt.run.terminal
        outcome: Outcome
        if isinstance(terminal, wire.RunCompleted):
            outcome = "completed"
        elif _is_cancellation(ended_by) and not (
            not attempt.committed and trio.current_time() >= deadline
        ):
            outcome = "cancelled"  # the client (or the edge's shutdown) ended the request
        elif attempt.committed and (terminal is not None or ended_by is not None):
            outcome = "failed"  # failed (or stalled) after the client saw part of it
        else:
            # Failed before the commit (the client never saw it), or left unfinished by a
            # consumer that stopped reading: the gate aborted it.
            outcome = "aborted"
        usage = attempt.usage
        if usage is not None:
            prompt, completion, source = usage.prompt_tokens, usage.completion_tokens, "reported"
        else:
            prompt = _estimate_prompt(request.dispatch.body)
            completion = _estimate_tokens(attempt.completion_chars)
            source = "estimated"
        now = trio.current_time()
        result = attempt.result
        row = UsageRow(
            request_id=request.request_id,
            attempt=attempt.number,
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
            billable_to="client" if attempt.committed else "operator",
            queue_wait_s=result.queue_wait,
            ttft_s=(
                None
                if attempt.first_content_at is None
                else attempt.first_content_at - attempt.dispatched_at
            ),
            duration_s=now - attempt.started_at,
            ended_at=time.time(),
        )
        try:
            self.record_usage(row)
        except Exception:  # the ledger must never break a request's exit path
            log.exception("could not record usage for %s attempt %d", row.request_id, row.attempt)

    def _count(self, key: str) -> None:
        self.statistics[key] = self.statistics.get(key, 0) + 1


def _is_cancellation(exc: BaseException | None) -> bool:
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(_is_cancellation(inner) for inner in exc.exceptions)
    return False


def _only_exclusions(exc: NoCapableCandidate) -> bool:
    reasons = exc.reasons
    return bool(reasons) and all("already failed for this request" in r for r in reasons)


def _estimate_prompt(body: dict[str, Any]) -> int:
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
    return _estimate_tokens(chars)


__all__: Sequence[str] = (
    "AllAttemptsFailed",
    "Answer",
    "Attempt",
    "Gate",
    "GatePolicy",
    "GateRequest",
    "TunnelAnswer",
)
