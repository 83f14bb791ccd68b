"""The node's reconnect policy (``nodes.reconnect``), without an event loop: when it warns,
when it gives up, and what it says; then the words for each cause."""

from __future__ import annotations

import logging
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodes.reconnect import (
    GIVE_UP_MIN_ATTEMPTS,
    WARN_AFTER_FAILURES,
    WARN_INTERVAL,
    Backoff,
    DialCause,
    GiveUp,
    Reconnect,
    Retry,
    advice,
)


def policy(give_up_after: float | None = 60.0, *, seed: int = 1) -> Reconnect:
    return Reconnect(
        Backoff(0.5, 30.0, rng=random.Random(seed)), give_up_after=give_up_after, reset_after=30.0
    )


def fail_until_given_up(reconnect: Reconnect, limit: float) -> tuple[list[Retry], float]:
    """Attempts that fail at once, each dialled when the last decision said; the retries
    and the time of the give-up (or of the last failure once past ``limit``)."""
    now = 0.0
    retries: list[Retry] = []
    while now <= limit:
        reconnect.dialling(now)
        decision = reconnect.failed(now)
        if isinstance(decision, GiveUp):
            return retries, now
        retries.append(decision)
        now += decision.delay
    return retries, now


def test_a_node_that_never_got_in_gives_up_at_the_bound() -> None:
    retries, gave_up_at = fail_until_given_up(policy(60.0), limit=3600)
    # The last delay is cut to end exactly at the bound: no whole backoff past it.
    assert gave_up_at == pytest.approx(60.0)
    assert len(retries) >= GIVE_UP_MIN_ATTEMPTS
    assert retries[-1].gives_up_in == pytest.approx(retries[-1].delay)


def test_a_bound_of_zero_still_makes_a_few_attempts_at_the_floor() -> None:
    retries, gave_up_at = fail_until_given_up(policy(0.0), limit=3600)
    assert len(retries) + 1 == GIVE_UP_MIN_ATTEMPTS
    assert [r.delay for r in retries] == [0.5] * (GIVE_UP_MIN_ATTEMPTS - 1)
    assert gave_up_at == pytest.approx(0.5 * (GIVE_UP_MIN_ATTEMPTS - 1))


def test_keep_trying_never_gives_up_and_warns_once_a_minute() -> None:
    retries, _ = fail_until_given_up(policy(None), limit=24 * 3600)
    assert all(r.gives_up_in is None for r in retries)
    levels = [r.level for r in retries]
    assert levels[: WARN_AFTER_FAILURES - 1] == [logging.INFO] * (WARN_AFTER_FAILURES - 1)
    assert levels[WARN_AFTER_FAILURES - 1] == logging.WARNING
    warnings = levels.count(logging.WARNING)
    # A day of failures: about one warning a minute, far fewer than the attempts.
    assert 24 * 60 * 0.5 <= warnings <= 24 * 60 + 1
    assert levels.count(logging.DEBUG) > warnings


def test_a_node_that_got_in_once_reconnects_for_ever() -> None:
    reconnect = policy(60.0)
    reconnect.dialling(0.0)
    reconnect.welcomed()
    ended = reconnect.session_ended(100.0, connected_at=0.0)
    assert ended.level == logging.INFO
    assert ended.gives_up_in is None
    now = 100.0 + ended.delay
    levels = []
    for _ in range(500):  # hours of an edge that is gone
        reconnect.dialling(now)
        decision = reconnect.failed(now)
        assert isinstance(decision, Retry)
        assert decision.gives_up_in is None
        levels.append(decision.level)
        now += decision.delay
    assert levels[:3] == [logging.INFO, logging.INFO, logging.WARNING]


def test_a_welcome_starts_the_count_again() -> None:
    reconnect = policy(None)
    for now in (0.0, 1.0, 2.0):
        reconnect.dialling(now)
        reconnect.failed(now)
    reconnect.welcomed()
    levels = []
    for now in (100.0, 101.0, 102.0):
        reconnect.dialling(now)
        decision = reconnect.failed(now)
        assert isinstance(decision, Retry)
        levels.append(decision.level)
    assert levels == [logging.INFO, logging.INFO, logging.WARNING]


def test_a_long_session_resets_the_backoff() -> None:
    reconnect = policy(None)
    for now in range(8):
        reconnect.failed(float(now))
    reconnect.welcomed()
    assert reconnect.session_ended(100.0, connected_at=10.0).delay <= 1.0


@given(
    give_up_after=st.one_of(st.none(), st.floats(0.0, 600.0)),
    durations=st.lists(st.floats(0.0, 15.0), min_size=1, max_size=200),
    welcome_at=st.one_of(st.none(), st.integers(0, 199)),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_policy_invariants(
    give_up_after: float | None, durations: list[float], welcome_at: int | None, seed: int
) -> None:
    """Attempts taking ``durations`` (a dial that hangs up to its timeouts), all failing
    except that the ``welcome_at``-th gets in and ends at once. Whatever happens: warnings
    are WARN_INTERVAL apart; a node that got in never gives up; one that never did gives up
    only past its bound and after GIVE_UP_MIN_ATTEMPTS, and never waits past the bound (but
    for the floor) before its last attempt."""
    reconnect = policy(give_up_after, seed=seed)
    now = 0.0
    warned: list[float] = []
    for index, duration in enumerate(durations):
        reconnect.dialling(now)
        started = now
        now += duration
        if index == welcome_at:
            reconnect.welcomed()
            decision: Retry | GiveUp = reconnect.session_ended(now, connected_at=started)
        else:
            decision = reconnect.failed(now)
        if isinstance(decision, GiveUp):
            assert give_up_after is not None
            assert not reconnect.welcomed_once
            assert now >= give_up_after
            assert decision.failures >= GIVE_UP_MIN_ATTEMPTS
            assert decision.failing_for == pytest.approx(now)
            return
        assert decision.delay >= 0.5
        if give_up_after is not None and not reconnect.welcomed_once:
            assert now + decision.delay <= max(give_up_after, now + 0.5) + 1e-9
        else:
            assert decision.gives_up_in is None
        if decision.level == logging.WARNING:
            assert not warned or now - warned[-1] >= WARN_INTERVAL or reconnect.failures == 3
            warned.append(now)
        now += decision.delay


# --------------------------------------------------------------------------- the words

URL = "ws://edge.example:8700/v1/nodes/connect"


@pytest.mark.parametrize(
    ("cause", "url", "expected"),
    [
        (
            DialCause(kind="refused", host="127.0.0.1", port=9),
            URL,
            "connection refused at 127.0.0.1:9: is the edge running, and is the port right?",
        ),
        (
            DialCause(
                kind="dns", host="edge.exmaple", port=8700, detail="Name or service not known"
            ),
            URL,
            "the host name 'edge.exmaple' does not resolve (Name or service not known): check "
            "the host in the edge URL",
        ),
        (
            DialCause(kind="tls", host="edge.example", port=8700, detail="WRONG_VERSION_NUMBER"),
            "wss://edge.example:8700/v1/nodes/connect",
            "the TLS handshake with edge.example:8700 failed (WRONG_VERSION_NUMBER): is the "
            "edge serving TLS? If not, use ws:// (ws://edge.example:8700/v1/nodes/connect)",
        ),
        (
            DialCause(kind="timeout", host="edge.example", port=8700, stage="websocket upgrade"),
            URL,
            "edge.example:8700 took the connection but did not answer the websocket upgrade in "
            "time: if the edge serves TLS, use wss:// (wss://edge.example:8700/v1/nodes/connect)",
        ),
        (
            DialCause(kind="http", host="edge.example", port=443, status=404),
            "wss://edge.example/llm/v1/nodes/connect",
            "/llm/v1/nodes/connect is not a node endpoint at edge.example:443 (HTTP 404): is "
            "the path right? The edge itself serves nodes at "
            "wss://edge.example/v1/nodes/connect",
        ),
        (
            DialCause(kind="http", host="edge.example", port=8700, status=401),
            URL,
            "the edge refused the node (HTTP 401 to the websocket upgrade): check the node's "
            "token (--token, token_env) against the edge's nodes.tokens, or what a proxy in "
            "front of it asks for",
        ),
        (
            DialCause(
                kind="certificate",
                host="edge.example",
                port=8700,
                detail="unable to get local issuer certificate",
            ),
            URL,
            "the edge's TLS certificate did not verify (unable to get local issuer "
            "certificate): give the node its CA (edge_ca_file), or the name it carries "
            "(edge_tls_server_name)",
        ),
        (DialCause.other("the edge ended the session"), URL, "the edge ended the session"),
    ],
    ids=["refused", "dns", "tls", "upgrade-timeout", "404", "401", "certificate", "other"],
)
def test_advice_says_what_to_do(cause: DialCause, url: str, expected: str) -> None:
    assert advice(cause, url) == expected
