"""The gate's decisions as pure functions, driven by Hypothesis with no event loop:
failure kind x committed x attempts x deadline -> retry / error / row outcome / health."""

from __future__ import annotations

from typing import get_args

from hypothesis import given
from hypothesis import strategies as st

from dispatcher.gate import rules
from dispatcher.gate.attempts import MAX_STATISTICS, Gate
from dispatcher.link.registry import LostCode

CODES = st.sampled_from(
    [
        "upstream_5xx",
        "upstream_rate_limited",
        "first_token_timeout",
        "node_lost",
        "stale_generation",
        "node_draining",
        "shutting_down",
        "request_timeout",
        "tunnel_unsupported",
        "cancelled_by_node",
        "internal",
    ]
)
FAILURES = st.builds(rules.Failure, CODES, st.booleans())
TERMINALS = st.sampled_from([None, "completed", "failed", "cancelled"])
ENDED = st.sampled_from(["quietly", "error", "cancelled", "deadline"])
RAISED = st.sampled_from(["nothing", "error", "cancelled"])


@given(
    failures=st.lists(FAILURES, min_size=1, max_size=8),
    max_attempts=st.integers(min_value=1, max_value=6),
)
def test_a_request_makes_at_most_max_attempts_and_stops_at_a_final_failure(
    failures: list[rules.Failure], max_attempts: int
) -> None:
    """Replay the gate's loop over a run of failing attempts."""
    made = 0
    for number, failure in enumerate(failures, start=1):
        made = number
        if rules.after_failure(failure, attempt=number, max_attempts=max_attempts) == "give_up":
            break
    assert made <= max_attempts
    stopped_at = failures[made - 1]
    if made < len(failures) and made < max_attempts:
        assert not stopped_at.retryable  # it stopped early only for a final failure
    for earlier in failures[: made - 1]:
        assert earlier.retryable  # every failure before the last was retried


@given(failure=FAILURES, attempt=st.integers(1, 10), max_attempts=st.integers(1, 10))
def test_after_failure(failure: rules.Failure, attempt: int, max_attempts: int) -> None:
    step = rules.after_failure(failure, attempt=attempt, max_attempts=max_attempts)
    assert (step == "retry") == (failure.retryable and attempt < max_attempts)


@given(attempt=st.integers(1, 10), max_attempts=st.integers(1, 10))
def test_the_request_deadline_ends_the_request_whatever_attempts_are_left(
    attempt: int, max_attempts: int
) -> None:
    step = rules.after_failure(rules.REQUEST_TIMEOUT, attempt=attempt, max_attempts=max_attempts)
    assert step == "give_up"
    assert rules.health(rules.REQUEST_TIMEOUT) == "none"  # not the candidate's fault


@given(
    failed_before=st.booleans(),
    incapable=st.booleans(),
    only_excluded=st.booleans(),
)
def test_after_admission_error(failed_before: bool, incapable: bool, only_excluded: bool) -> None:
    step = rules.after_admission_error(
        failed_before=failed_before,
        incapable=incapable,
        only_excluded=only_excluded,
    )
    if not failed_before:
        assert step == "raise"  # the first admission's answer
    elif incapable and not only_excluded:
        assert step == "raise"  # the request itself cannot be served: its 400
    else:
        assert step == "give_up"  # the last failure stands: a 502


@given(failure=st.none() | FAILURES, client_error=st.booleans())
def test_health_never_blames_a_candidate_for_the_client_or_the_request(
    failure: rules.Failure | None, client_error: bool
) -> None:
    verdict = rules.health(failure, client_error=client_error)
    if failure is None or client_error:
        assert verdict == "success"
    elif not failure.retryable or failure.code in rules.NOT_THE_CANDIDATES_FAULT:
        assert verdict == "none"
    else:
        assert verdict == "failure"


def test_a_node_sessions_end_never_counts_against_its_candidates() -> None:
    """However a node's session ended (``registry.LostCode``: lost, drained, the edge
    shutting down, superseded), the runs it ended say nothing about the candidate."""
    for code in get_args(LostCode):
        assert rules.health(rules.Failure(code, retryable=True)) == "none", code
    assert set(get_args(LostCode)) == {
        "node_lost",
        "node_draining",
        "shutting_down",
        "stale_generation",
    }


@given(status=st.none() | st.integers(100, 599), retryable=st.booleans())
def test_is_client_error(status: int | None, retryable: bool) -> None:
    expected = status is not None and 400 <= status < 500 and status != 429 and not retryable
    assert rules.is_client_error(status, retryable) is expected


@given(status=st.integers(0, 999))
def test_a_tunnel_status_fails_its_attempt_only_for_5xx_429_or_no_http_status(status: int) -> None:
    failure = rules.tunnel_status_failure(status)
    if 200 <= status < 500 and status != 429:
        assert failure is None  # the client's answer: read to its commit, or relayed as it is
    else:
        assert failure is not None
        assert failure.retryable  # another candidate may answer
        assert rules.health(failure) == "failure"  # and this one is to blame


@given(raised=RAISED, committed=st.booleans(), deadline_fired=st.booleans())
def test_a_cancellation_is_the_deadlines_only_before_the_commit(
    raised: rules.Raised, committed: bool, deadline_fired: bool
) -> None:
    ended = rules.scope_ended(raised, committed=committed, deadline_fired=deadline_fired)
    if raised == "cancelled":
        expected = "deadline" if deadline_fired and not committed else "cancelled"
        assert ended == expected
    else:
        assert ended == ("quietly" if raised == "nothing" else "error")


def _run_end(
    terminal: rules.Terminal | None,
    committed: bool,
    raised: rules.Raised,
    deadline_fired: bool,
    client_gone: bool,
    stalled: bool,
    delivered: bool = False,
) -> rules.RunEnd:
    return rules.RunEnd(
        terminal=terminal,
        committed=committed,
        ended=rules.scope_ended(raised, committed=committed, deadline_fired=deadline_fired),
        client_gone=client_gone,
        stalled=stalled,
        delivered=delivered and terminal is not None and committed,
    )


RUN_ENDS = st.builds(
    _run_end,
    terminal=TERMINALS,
    committed=st.booleans(),
    raised=RAISED,
    deadline_fired=st.booleans(),
    client_gone=st.booleans(),
    stalled=st.booleans(),
    delivered=st.booleans(),
)


@given(end=RUN_ENDS)
def test_a_run_rows_outcome_is_what_its_client_saw(end: rules.RunEnd) -> None:
    outcome = rules.run_outcome(end)
    left = end.client_gone or end.ended == "cancelled"
    if end.terminal == "completed":
        assert outcome == "completed"  # the node's whole answer arrived
    elif end.delivered and end.terminal == "failed":
        assert outcome == "failed"  # the client was sent the error event, then left
    elif left:
        assert outcome == "cancelled"
    else:
        assert outcome in ("failed", "aborted")
        # "failed" only for an answer the client saw part of; else the gate aborted it
        assert (outcome == "failed") == (
            end.committed and (end.terminal is not None or end.ended != "quietly" or end.stalled)
        )
    if end.ended == "deadline" and not end.client_gone and end.terminal != "completed":
        assert outcome == "aborted"  # the request deadline cut it before the client saw any
    if outcome == "failed":
        assert end.committed


TUNNEL_ENDS = st.builds(
    rules.TunnelAttemptEnd,
    committed=st.booleans(),
    ended=ENDED,
    client_gone=st.booleans(),
    relay_failed=st.booleans(),
    delivered=st.booleans(),
    finished=st.booleans(),
    completed=st.booleans(),
    status=st.none() | st.sampled_from([200, 204, 400, 404, 429, 500, 503]),
)


@given(end=TUNNEL_ENDS)
def test_a_tunnel_rows_outcome_is_what_its_client_saw(end: rules.TunnelAttemptEnd) -> None:
    outcome = rules.tunnel_outcome(end)
    left = end.client_gone or end.ended == "cancelled"
    if end.delivered and not end.relay_failed:
        assert outcome == "completed"  # the client has the whole answer, [DONE] included
    elif left:
        assert outcome == "cancelled"
    elif not end.committed:
        assert outcome == "aborted"
    if outcome == "completed" and not end.delivered:
        assert end.completed
        assert end.status is not None
        assert 200 <= end.status < 300
        assert end.ended == "quietly"
        assert not end.relay_failed
    if outcome == "failed":
        assert end.committed


@given(
    failure=FAILURES,
    deadline=st.booleans(),
    committed=st.booleans(),
    attempt=st.integers(1, 10),
    max_attempts=st.integers(1, 10),
)
def test_failure_kind_x_committed_x_attempts_x_deadline(
    failure: rules.Failure, deadline: bool, committed: bool, attempt: int, max_attempts: int
) -> None:
    """An attempt's scope ended by a failure (an error, or the request deadline's
    cancellation): before the commit the gate decides retry or give up and the row says
    ``aborted`` (the operator's); after it the failure is the client's error and the row says
    ``failed`` (the client's) -- the gate's loop never sees it to retry."""
    ended = rules.scope_ended(
        "cancelled" if deadline else "error", committed=committed, deadline_fired=deadline
    )
    run_end = rules.RunEnd(
        terminal=None, committed=committed, ended=ended, client_gone=False, stalled=False
    )
    outcome = rules.run_outcome(run_end)
    if committed:
        assert outcome == ("cancelled" if deadline else "failed")  # no deadline after commit
        return
    assert outcome == "aborted"
    why = rules.REQUEST_TIMEOUT if deadline else failure
    step = rules.after_failure(why, attempt=attempt, max_attempts=max_attempts)
    retried = failure.retryable and not deadline and attempt < max_attempts
    assert step == ("retry" if retried else "give_up")


def test_gate_statistics_hold_a_bounded_number_of_failure_codes() -> None:
    """The codes are a node's words: a node sending a new one each time does not grow the
    table past MAX_STATISTICS keys; the rest are counted as "other"."""
    gate = Gate.__new__(Gate)  # only its statistics table is used
    gate.statistics = {}
    for n in range(MAX_STATISTICS + 50):
        gate._count(f"attempt_failed:code-{n}")
    assert len(gate.statistics) == MAX_STATISTICS + 1
    assert gate.statistics["attempt_failed:other"] == 50
    gate._count("attempt_failed:code-0")  # a known key still counts as itself
    assert gate.statistics["attempt_failed:code-0"] == 2
