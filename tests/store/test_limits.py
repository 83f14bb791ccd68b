"""The tenants' limits without an event loop (:class:`~dispatcher.store.limits.LimitCounters`,
the core of the embedded limit store): every input carries ``now`` (the minute windows) and
``wall`` (the UTC budget periods), every answer is a decision."""

from __future__ import annotations

import datetime
import itertools

import pytest

from dispatcher.store.limits import (
    CONCURRENCY_RETRY_AFTER,
    Held,
    LimitCounters,
    format_reset,
    month_start,
    periods,
    seconds_to_next,
)
from dispatcher.store.seam import Hold, RateHeaders, Refusal
from dispatcher.tenants import Limits, Price, PriceTable, Tenant

NOON = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC).timestamp()
"""A wall clock: noon UTC on the first of December."""
NO_PRICES = PriceTable()
PRICES = PriceTable({"m": Price(input_per_mtok=1_000_000.0, output_per_mtok=2_000_000.0)})
"""One USD per input token, two per output token: costs that are easy to count."""
_attempts = itertools.count(1)


def tenant(**limits: int | float) -> Tenant:
    return Tenant(id="t1", name="t1", limits=Limits(**limits))  # type: ignore[arg-type]


def admit(
    limiter: LimitCounters,
    who: Tenant,
    now: float,
    estimate: int = 10,
    *,
    wall: float = NOON,
    request_id: str | None = None,
    prices: PriceTable = NO_PRICES,
) -> Held | Refusal:
    rid = request_id or f"r-{now}-{estimate}-{id(object())}"
    hold = Hold(rid, who.id, who.limits, estimate, prices.cost(("m",), estimate, 0))
    return limiter.admit(hold, now=now, wall=wall)


def bill(
    limiter: LimitCounters,
    held: Held,
    prompt: int,
    completion: int,
    *,
    now: float,
    wall: float = NOON,
    prices: PriceTable = NO_PRICES,
    attempt: int | None = None,
) -> float:
    """One billable usage row of ``held``'s request (a new attempt unless ``attempt``), at
    ``prices``: what the tenants' driver settles. Returns its cost."""
    usd = prices.cost(("m",), prompt, completion)
    number = next(_attempts) if attempt is None else attempt
    limiter.settle(held, number, prompt + completion, usd, now=now, wall=wall)
    return usd


def ticket(decision: Held | Refusal) -> Held:
    assert isinstance(decision, Held), decision
    return decision


def refusal(decision: Held | Refusal) -> Refusal:
    assert isinstance(decision, Refusal), decision
    return decision


def header(headers: RateHeaders, name: str) -> str:
    return dict(headers)[name.encode()].decode()


# ------------------------------------------------------------------ requests per minute


def test_rpm_refuses_the_request_over_the_limit_until_the_oldest_leaves_the_window() -> None:
    limiter = LimitCounters()
    who = tenant(rpm=3)
    for now in (0.0, 1.0, 2.0):
        ticket(admit(limiter, who, now))
    over = refusal(admit(limiter, who, 3.0))
    assert over.limit == "rpm"
    assert not over.quota
    assert over.retry_after == pytest.approx(57.0)  # the request of t=0 leaves at t=60
    assert header(over.headers, "x-ratelimit-remaining-requests") == "0"
    assert header(over.headers, "x-ratelimit-limit-requests") == "3"
    refusal(admit(limiter, who, 59.9))
    ticket(admit(limiter, who, 60.0))
    refusal(admit(limiter, who, 60.5))  # t=1 and t=2 are still in the window


def test_a_refused_request_is_not_counted() -> None:
    limiter = LimitCounters()
    who = tenant(rpm=1)
    ticket(admit(limiter, who, 0.0))
    for now in range(1, 60):
        refusal(admit(limiter, who, float(now)))
    ticket(admit(limiter, who, 60.0))


# ------------------------------------------------------------------ tokens per minute


def test_tpm_counts_the_estimate_until_the_usage_row_corrects_it() -> None:
    limiter = LimitCounters()
    who = tenant(tpm=100)
    first = ticket(admit(limiter, who, 0.0, estimate=60))
    over = refusal(admit(limiter, who, 1.0, estimate=60))
    assert over.limit == "tpm"
    assert over.retry_after == pytest.approx(59.0)
    assert header(over.headers, "x-ratelimit-remaining-tokens") == "40"
    bill(limiter, first, 5, 5, now=2.0)  # it used 10, not 60
    second = ticket(admit(limiter, who, 2.0, estimate=60))
    assert header(second.headers, "x-ratelimit-remaining-tokens") == "30"


def test_a_request_larger_than_the_whole_limit_goes_when_the_window_is_empty() -> None:
    limiter = LimitCounters()
    who = tenant(tpm=100)
    big = ticket(admit(limiter, who, 0.0, estimate=500))
    limiter.release(big, answered=False, now=1.0, wall=NOON)
    # Unanswered and unbilled: its estimate left the window with it.
    ticket(admit(limiter, who, 1.0, estimate=500))
    refusal(admit(limiter, who, 2.0, estimate=1))  # the window is over the limit now


def test_tpm_retry_after_is_when_enough_tokens_leave_the_window() -> None:
    limiter = LimitCounters()
    who = tenant(tpm=100)
    for now in (0.0, 10.0, 20.0):
        ticket(admit(limiter, who, now, estimate=30))
    # 90 used; 50 more fit when t=0's and t=10's 30 each have left: at t=70.
    assert refusal(admit(limiter, who, 25.0, estimate=50)).retry_after == pytest.approx(45.0)


def test_a_request_that_failed_before_answering_costs_no_tokens() -> None:
    limiter = LimitCounters()
    who = tenant(tpm=100)
    failed = ticket(admit(limiter, who, 0.0, estimate=90))
    limiter.release(failed, answered=False, now=1.0, wall=NOON)
    ticket(admit(limiter, who, 1.0, estimate=90))


def test_an_answered_request_keeps_its_estimate_until_its_row_comes() -> None:
    """A cancelled stream: the request is released before its row (which waits for the
    node's confirmation) arrives; until then its estimate counts, then what it used."""
    limiter = LimitCounters()
    who = tenant(tpm=100)
    streamed = ticket(admit(limiter, who, 0.0, estimate=90))
    limiter.release(streamed, answered=True, now=1.0, wall=NOON)
    refusal(admit(limiter, who, 2.0, estimate=20))
    bill(limiter, streamed, 30, 40, now=3.0)
    after = ticket(admit(limiter, who, 3.0, estimate=20))
    assert header(after.headers, "x-ratelimit-remaining-tokens") == "10"


def test_a_settle_is_counted_once_per_attempt() -> None:
    """Settling is keyed by request and attempt: a retried settle of one attempt changes
    nothing; another attempt's row adds to the tokens."""
    limiter = LimitCounters()
    who = tenant(tpm=100, budget_tokens_day=1000)
    held = ticket(admit(limiter, who, 0.0, estimate=60))
    assert limiter.settle(held, 1, 10, 0.0, now=1.0, wall=NOON)
    assert not limiter.settle(held, 1, 10, 0.0, now=1.0, wall=NOON)  # a retry: no change
    after = ticket(admit(limiter, who, 1.0, estimate=0))
    assert header(after.headers, "x-ratelimit-remaining-tokens") == "90"
    assert limiter.spent("t1", now=1.0, wall=NOON).tokens_day == 10
    assert limiter.settle(held, 2, 5, 0.0, now=2.0, wall=NOON)  # a second attempt's row
    last = ticket(admit(limiter, who, 2.0, estimate=0))
    assert header(last.headers, "x-ratelimit-remaining-tokens") == "85"
    assert limiter.spent("t1", now=2.0, wall=NOON).tokens_day == 15


# ------------------------------------------------------------------ concurrency


def test_concurrency_holds_a_place_until_the_request_is_released() -> None:
    limiter = LimitCounters()
    who = tenant(max_concurrent=2)
    first = ticket(admit(limiter, who, 0.0))
    ticket(admit(limiter, who, 0.0))
    over = refusal(admit(limiter, who, 0.0))
    assert over.limit == "max_concurrent"
    assert over.retry_after == CONCURRENCY_RETRY_AFTER
    limiter.release(first, answered=False, now=1.0, wall=NOON)
    limiter.release(first, answered=False, now=1.0, wall=NOON)  # idempotent: one place, not two
    ticket(admit(limiter, who, 1.0))
    refusal(admit(limiter, who, 1.0))
    assert limiter.in_flight("t1") == 2


def test_a_request_keeps_the_limits_it_was_admitted_under() -> None:
    """A reload lowers the limit: the counters are the tenant id's, so what is in flight
    counts against the new limit; the ticket keeps the tenant it was admitted as."""
    limiter = LimitCounters()
    before = tenant(max_concurrent=5)
    held = [ticket(admit(limiter, before, 0.0)) for _ in range(3)]
    after = tenant(max_concurrent=2)
    refusal(admit(limiter, after, 1.0))
    assert all(t.hold.limits.max_concurrent == 5 for t in held)
    for t in held[:2]:
        limiter.release(t, answered=False, now=2.0, wall=NOON)
    ticket(admit(limiter, after, 2.0))


# ------------------------------------------------------------------ budgets


def test_a_token_budget_is_spent_by_billed_usage_and_renews_at_utc_midnight() -> None:
    limiter = LimitCounters()
    who = tenant(budget_tokens_day=100)
    first = ticket(admit(limiter, who, 0.0, estimate=10))
    bill(limiter, first, 60, 40, now=1.0)
    limiter.release(first, answered=False, now=1.0, wall=NOON)
    over = refusal(admit(limiter, who, 2.0))
    assert over.limit == "budget_tokens_day"
    assert over.quota
    assert over.retry_after == pytest.approx(12 * 3600.0)
    assert "quota" in over.message
    ticket(admit(limiter, who, 3.0, wall=NOON + 12 * 3600.0))


def test_in_flight_estimates_count_against_a_budget() -> None:
    limiter = LimitCounters()
    who = tenant(budget_tokens_month=100)
    ticket(admit(limiter, who, 0.0, estimate=100))
    assert refusal(admit(limiter, who, 0.0)).limit == "budget_tokens_month"


def test_a_money_budget_is_spent_by_what_the_rows_cost() -> None:
    """The driver prices each row (at the prices of its request's admission); the store
    spends what it is told."""
    limiter = LimitCounters()
    who = tenant(budget_usd_day=10.0)
    first = ticket(admit(limiter, who, 0.0, estimate=1, prices=PRICES))
    cost = bill(limiter, first, 2, 3, now=1.0, prices=PRICES)  # 2 * 1 + 3 * 2
    assert cost == pytest.approx(8.0)
    limiter.release(first, answered=False, now=1.0, wall=NOON)
    assert limiter.spent("t1", now=1.0, wall=NOON).usd_day == pytest.approx(8.0)
    second = ticket(admit(limiter, who, 2.0, estimate=1, prices=PRICES))
    bill(limiter, second, 2, 0, now=3.0, prices=PRICES)
    limiter.release(second, answered=False, now=3.0, wall=NOON)
    over = refusal(admit(limiter, who, 4.0, prices=PRICES))
    assert over.limit == "budget_usd_day"
    assert over.quota


def test_spend_before_a_restart_counts_and_an_earlier_month_does_not() -> None:
    limiter = LimitCounters()
    who = tenant(budget_tokens_month=100)
    last_month = month_start(NOON) - 3600
    limiter.spend("t1", 1000, 0.0, now=0.0, wall=last_month)
    ticket(admit(limiter, who, 0.0))
    limiter.spend("t1", 95, 0.0, now=0.0, wall=NOON)
    assert refusal(admit(limiter, who, 0.0)).limit == "budget_tokens_month"


# ------------------------------------------------------------------ headers and times


def test_success_headers_say_what_is_left() -> None:
    limiter = LimitCounters()
    who = tenant(rpm=10, tpm=1000)
    ticket(admit(limiter, who, 0.0, estimate=100))
    second = ticket(admit(limiter, who, 15.0, estimate=100))
    assert dict(second.headers) == {
        b"x-ratelimit-limit-requests": b"10",
        b"x-ratelimit-remaining-requests": b"8",
        b"x-ratelimit-reset-requests": b"45s",
        b"x-ratelimit-limit-tokens": b"1000",
        b"x-ratelimit-remaining-tokens": b"800",
        b"x-ratelimit-reset-tokens": b"45s",
    }
    assert ticket(admit(limiter, tenant(), 0.0)).headers == ()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (-1.0, "0s"),
        (0.02, "20ms"),
        (0.0001, "1ms"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (59.9994, "59.999s"),
        (360.0, "6m0s"),
        (3723.0, "1h2m3s"),
    ],
)
def test_format_reset(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_budget_periods_are_utc_days_and_months() -> None:
    assert periods(NOON) == ("2026-12-01", "2026-12")
    assert seconds_to_next(NOON, month=False) == pytest.approx(12 * 3600)
    assert seconds_to_next(NOON, month=True) == pytest.approx(30 * 86400 + 12 * 3600)
    new_year = datetime.datetime(2027, 1, 1, tzinfo=datetime.UTC).timestamp()
    assert NOON + seconds_to_next(NOON, month=True) == pytest.approx(new_year)


def test_rpm_retry_after_when_a_reload_lowered_the_limit_below_the_window() -> None:
    limiter = LimitCounters()
    for now in range(5):
        ticket(admit(limiter, tenant(rpm=5), float(now)))
    # Limit 2 with 5 in the window: the requests of t=0..3 must leave, the last at t=63.
    assert refusal(admit(limiter, tenant(rpm=2), 5.0)).retry_after == pytest.approx(58.0)
