"""The stream gate's decisions, as pure functions over typed inputs (no event loop, no clock).

The gate (:mod:`dispatcher.gate.attempts`) carries out what these return: whether a failed
attempt is
retried (:func:`after_failure`; the request deadline is the final :data:`REQUEST_TIMEOUT`), what
an admission error means once an attempt has failed, when the request falls back to the next
model group (:func:`recovery`), whether a tunnel's status fails its
attempt, how an attempt's scope ended (:func:`scope_ended`), what its usage row says
(:func:`run_outcome`, :func:`tunnel_outcome`), and what admission is told about the
candidate. Hypothesis drives them directly (``tests/edge/test_gate_rules.py``).
"""

from __future__ import annotations

from typing import Final, Literal

import attrs

from ..store.usage import Outcome

Step = Literal["retry", "give_up"]
AdmissionStep = Literal["raise", "give_up"]
Recovery = Literal["retry", "fall_back", "give_up", "raise"]
"""What the gate does when a model group's try ended without a commit: another attempt on
the same group, the next group of the fallbacks, give up with the last failure (502), or
raise the admission's refusal (the first group's: what the client would get without
fallbacks)."""
Health = Literal["success", "failure", "none"]
Terminal = Literal["completed", "failed", "cancelled"]
"""The run's terminal event as the edge received it (consumed or not)."""
Raised = Literal["nothing", "error", "cancelled"]
"""What left an attempt's scope: nothing (its block ended), an exception, a cancellation."""
Ended = Literal["quietly", "error", "cancelled", "deadline"]
"""How an attempt's scope ended, as its row sees it: ``deadline`` is the request deadline
cancelling it before the commit; ``cancelled`` any other cancellation (the client left, the
edge shut down)."""

NOT_THE_CANDIDATES_FAULT: Final = frozenset(
    {
        "request_timeout",
        "tunnel_unsupported",
        "node_draining",
        "node_lost",
        "shutting_down",
        "stale_generation",
    }
)
"""Retryable attempt failures that say nothing about the candidate's health. A node session
that ends (lost, drained, the edge shutting down, superseded: each a
``registry.LostCode``) ends every run on it at once and removes its candidates anyway:
counting each of those runs as a failure would eject the node's next session for one
event."""


@attrs.frozen(kw_only=True)
class GatePolicy:
    """A model group's gate settings (``[admission]`` / ``[models.NAME]`` in the config)."""

    max_attempts: int = 3
    request_timeout_s: float = 120.0
    first_token_timeout_s: float = 60.0
    stall_timeout_s: float = 60.0
    fallbacks: tuple[str, ...] = ()
    """The model groups tried, in order, after this one (its ``fallbacks`` with theirs,
    resolved: ``dispatcher.config.fallback_chain``)."""


@attrs.frozen
class Failure:
    """An attempt that failed before its commit point."""

    code: str
    retryable: bool


REQUEST_TIMEOUT: Final = Failure("request_timeout", retryable=False)
"""The request deadline (which covers queue waits too) ended the attempt before its commit:
the request is over, however many attempts are left."""


def after_failure(failure: Failure, *, attempt: int, max_attempts: int) -> Step:
    """Try another candidate, or give up (the client gets a 502 naming this failure)."""
    if failure.retryable and attempt < max_attempts:
        return "retry"
    return "give_up"


def after_admission_error(
    *, failed_before: bool, incapable: bool, only_excluded: bool
) -> AdmissionStep:
    """An admission refused the request. The first admission's refusal is the client's
    answer; a recovery's refusal gives up with the last failure -- except a "no capable
    candidate" for a reason other than exclusions (the request itself cannot be served: the
    same 400 as a first admission)."""
    if not failed_before:
        return "raise"
    if incapable and not only_excluded:
        return "raise"
    return "give_up"


@attrs.frozen
class NoSlot:
    """An admission found no slot for the request on the group being tried: no candidate
    could take it (``incapable``; ``only_excluded``: each already failed for it), or none
    was available (no node serves the group now, its queue is full or timed out)."""

    incapable: bool = False
    only_excluded: bool = False


def recovery(
    ended: Failure | NoSlot,
    *,
    tries: int,
    max_attempts: int,
    fallback_left: bool,
    failed_before: bool,
    first_group: bool,
) -> Recovery:
    """After a model group's attempt failed (``Failure``) or its admission refused the
    request (``NoSlot``), before anything reached the client: ``tries`` attempts were made
    on this group (of its ``max_attempts``), ``fallback_left`` says whether a fallback group
    is still to be tried, ``failed_before`` whether any attempt of the request failed.

    A retryable failure retries on the group while it has attempts left, then falls back;
    a final one (the request deadline, a failure the node calls final) gives up whatever is
    left. A refusal falls back when a group is left; else it is :func:`after_admission_error`
    for the first group, and for a fallback group the last failure stands (or, when no
    attempt ever failed, the first group's refusal is raised)."""
    if isinstance(ended, Failure):
        if after_failure(ended, attempt=tries, max_attempts=max_attempts) == "retry":
            return "retry"
        return "fall_back" if ended.retryable and fallback_left else "give_up"
    if fallback_left:
        return "fall_back"
    if first_group:
        return after_admission_error(
            failed_before=failed_before,
            incapable=ended.incapable,
            only_excluded=ended.only_excluded,
        )
    return "give_up" if failed_before else "raise"


def health(failure: Failure | None, *, client_error: bool = False) -> Health:
    """What admission hears of the candidate: ``success`` when the attempt committed or the
    upstream refused the request as the client's mistake (the candidate works), ``failure``
    for a retryable failure of its own, nothing otherwise."""
    if failure is None or client_error:
        return "success"
    if failure.retryable and failure.code not in NOT_THE_CANDIDATES_FAULT:
        return "failure"
    return "none"


def is_client_error(status: int | None, retryable: bool) -> bool:
    """An upstream's answer that is the client's mistake (a 4xx other than 429, final)."""
    return status is not None and 400 <= status < 500 and status != 429 and not retryable


def tunnel_status_failure(status: int) -> Failure | None:
    """A tunnel's response status, before anything of it is relayed: a 5xx or a 429 (or no
    HTTP status at all) fails the attempt, retryably -- another candidate may answer; any
    other status is the client's answer (a 2xx read to its commit point, others relayed as
    they are)."""
    if not 200 <= status <= 599:
        return Failure("tunnel_failed", retryable=True)
    if status == 429:
        return Failure("upstream_rate_limited", retryable=True)
    if status >= 500:
        return Failure("upstream_5xx", retryable=True)
    return None


def scope_ended(raised: Raised, *, committed: bool, deadline_fired: bool) -> Ended:
    """How an attempt's scope ended: a cancellation is the request deadline's when that
    deadline fired before the commit (after it, the deadline no longer applies)."""
    if raised == "cancelled":
        return "deadline" if deadline_fired and not committed else "cancelled"
    return "error" if raised == "error" else "quietly"


@attrs.frozen(kw_only=True)
class RunEnd:
    """How a normalized attempt's scope ended, as its usage row sees it."""

    terminal: Terminal | None
    """The run's terminal event, if it arrived before the scope ended."""
    committed: bool
    ended: Ended
    client_gone: bool
    """The API found the client gone by a broken connection."""
    stalled: bool
    delivered: bool = False
    """The client was sent the answer's end (its front end rendered and sent the terminal
    event: the stream's end, or its error event)."""


def run_outcome(end: RunEnd) -> Outcome:
    """The row outcome of a normalized attempt: what its client saw when the request ended."""
    if end.terminal == "completed":
        return "completed"  # the run ended whole, whether or not the API relayed it all
    if end.delivered and end.committed and end.terminal == "failed":
        return "failed"  # the client got the error event: leaving after it changes nothing
    if end.client_gone or end.ended == "cancelled":
        return "cancelled"
    if end.committed and (end.terminal is not None or end.ended != "quietly" or end.stalled):
        return "failed"  # failed (or stalled) after the client saw part of it
    return "aborted"  # failed before the commit, or left unfinished by its consumer


@attrs.frozen(kw_only=True)
class TunnelAttemptEnd:
    """How a tunnel attempt's scope ended, as its usage row sees it."""

    committed: bool
    ended: Ended
    client_gone: bool
    relay_failed: bool
    """The relay ended the answer with an error after the commit."""
    delivered: bool
    """The client was sent the stream's ``data: [DONE]``."""
    finished: bool
    """The tunnel's end arrived (from the node, or synthesized)."""
    completed: bool
    """... without an error."""
    status: int | None


def tunnel_outcome(end: TunnelAttemptEnd) -> Outcome:
    """The row outcome of a tunnel attempt."""
    if end.delivered and not end.relay_failed:
        return "completed"
    if end.client_gone or end.ended == "cancelled":
        return "cancelled"
    if not end.committed:
        return "aborted"
    ok = end.status is not None and 200 <= end.status < 300
    quiet = end.ended == "quietly" and not end.relay_failed
    if quiet and end.completed and ok:
        return "completed"
    if quiet and not end.finished:
        return "aborted"  # left unfinished by a consumer that stopped reading
    return "failed"  # broke off, stalled, or the provider's error status relayed


__all__ = [
    "NOT_THE_CANDIDATES_FAULT",
    "REQUEST_TIMEOUT",
    "AdmissionStep",
    "Ended",
    "Failure",
    "GatePolicy",
    "Health",
    "NoSlot",
    "Outcome",
    "Raised",
    "Recovery",
    "RunEnd",
    "Step",
    "Terminal",
    "TunnelAttemptEnd",
    "after_admission_error",
    "after_failure",
    "health",
    "is_client_error",
    "recovery",
    "run_outcome",
    "scope_ended",
    "tunnel_outcome",
    "tunnel_status_failure",
]
