"""The limit store's contract (:class:`~dispatcher.store.seam.LimitStore`), run over every
backend (``tests/store/backends.py``): each limit at its edge and its window's, the
reservation / settle / release arithmetic (a settle keyed by request and attempt, so a retried
one counts once), budgets by UTC day and month, seeding from a ledger, concurrent admissions.

The store runs on clocks the test moves (``clock`` monotonic, ``wall`` Unix time)."""

from __future__ import annotations

import datetime
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from dispatcher.config import Limits
from dispatcher.store.ledger import open_usage_ledger
from dispatcher.store.seam import Hold, LimitStore, Refusal
from dispatcher.store.usage import UsageRow

from .backends import LIMITS, LimitBackend

WALL = datetime.datetime(2026, 12, 15, 12, 0, tzinfo=datetime.UTC).timestamp()
"""Noon UTC, mid-month."""
_ids = itertools.count()


class Clocks:
    def __init__(self) -> None:
        self.now = 1000.0
        self.wall = WALL

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.wall += seconds


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


@pytest.fixture(params=LIMITS, ids=lambda backend: backend.name)
async def store(request: pytest.FixtureRequest, clocks: Clocks) -> AsyncIterator[LimitStore[Any]]:
    backend: LimitBackend = request.param
    async with backend.open(lambda: clocks.now, lambda: clocks.wall) as opened:
        yield opened


def hold(tokens: int = 10, usd: float = 0.0, tenant: str = "t1", **limits: Any) -> Hold:
    return Hold(f"r{next(_ids)}", tenant, Limits(**limits), tokens, usd)


async def admitted(store: LimitStore[Any], asked: Hold) -> Any:
    decision = await store.admit(asked)
    assert not isinstance(decision, Refusal), decision
    return decision


async def refused(store: LimitStore[Any], asked: Hold) -> Refusal:
    decision = await store.admit(asked)
    assert isinstance(decision, Refusal), decision
    return decision


def remaining(decision: Any, kind: str) -> int:
    return int(dict(decision.headers)[f"x-ratelimit-remaining-{kind}".encode()])


# ------------------------------------------------------------------ rates at their edges


async def test_rpm_at_its_edge_and_its_window(store: LimitStore[Any], clocks: Clocks) -> None:
    for _ in range(3):
        await admitted(store, hold(rpm=3))
    over = await refused(store, hold(rpm=3))
    assert over.limit == "rpm"
    assert over.retry_after == pytest.approx(60.0)
    clocks.advance(59.999)
    await refused(store, hold(rpm=3))
    clocks.advance(0.001)  # the first three leave the window at exactly 60 s
    await admitted(store, hold(rpm=3))


async def test_max_concurrent_at_its_edge(store: LimitStore[Any]) -> None:
    first = await admitted(store, hold(max_concurrent=2))
    await admitted(store, hold(max_concurrent=2))
    assert (await refused(store, hold(max_concurrent=2))).limit == "max_concurrent"
    store.release(first, answered=False)
    store.release(first, answered=False)  # idempotent: one place, not two
    assert store.in_flight("t1") == 1
    await admitted(store, hold(max_concurrent=2))
    await refused(store, hold(max_concurrent=2))


async def test_tpm_at_its_edge(store: LimitStore[Any], clocks: Clocks) -> None:
    await admitted(store, hold(60, tpm=100))
    exact = await admitted(store, hold(40, tpm=100))  # 60 + 40 == 100: fits
    assert remaining(exact, "tokens") == 0
    over = await refused(store, hold(1, tpm=100))
    assert over.limit == "tpm"
    clocks.advance(60.0)
    await admitted(store, hold(100, tpm=100))


async def test_limits_of_one_tenant_leave_another_alone(store: LimitStore[Any]) -> None:
    await admitted(store, hold(rpm=1, tenant="a"))
    await refused(store, hold(rpm=1, tenant="a"))
    await admitted(store, hold(rpm=1, tenant="b"))


# ------------------------------------------------------------------ reserve, settle, release


async def test_settle_replaces_the_estimate_once_per_attempt(store: LimitStore[Any]) -> None:
    held = await admitted(store, hold(60, tpm=100))
    store.settle(held, 1, 10, 0.0)
    store.settle(held, 1, 10, 0.0)  # retried: counted once
    probe = await admitted(store, hold(0, tpm=100))
    assert remaining(probe, "tokens") == 90
    store.settle(held, 2, 5, 0.0)  # another attempt's row adds
    probe = await admitted(store, hold(0, tpm=100))
    assert remaining(probe, "tokens") == 85
    assert store.spent("t1").tokens_day == 15


async def test_an_unanswered_request_is_refunded(store: LimitStore[Any]) -> None:
    held = await admitted(store, hold(90, tpm=100, budget_tokens_day=100))
    await refused(store, hold(20, tpm=100, budget_tokens_day=100))
    store.release(held, answered=False)
    await admitted(store, hold(90, tpm=100, budget_tokens_day=100))
    assert store.spent("t1").tokens_day == 0


async def test_an_answered_request_keeps_its_estimate_until_settled(
    store: LimitStore[Any],
) -> None:
    held = await admitted(store, hold(90, tpm=100))
    store.release(held, answered=True)  # a cancelled stream: its row is still to come
    await refused(store, hold(20, tpm=100))
    store.settle(held, 1, 70, 0.0)
    probe = await admitted(store, hold(20, tpm=100))
    assert remaining(probe, "tokens") == 10


async def test_a_budget_counts_reservations_then_spend(store: LimitStore[Any]) -> None:
    """A budget is exhausted when what was spent and what is reserved reach it."""
    limits: dict[str, Any] = {"budget_tokens_day": 100, "budget_usd_month": 5.0}
    held = await admitted(store, hold(60, 2.0, **limits))
    second = await admitted(store, hold(40, 0.0, **limits))  # 60 reserved: under 100
    over = await refused(store, hold(1, 0.0, **limits))  # 100 reserved: exhausted
    assert over.limit == "budget_tokens_day"
    assert over.quota
    store.release(second, answered=False)  # its reservation goes
    store.settle(held, 1, 30, 4.0)  # it used 30 tokens, cost 4 USD
    store.release(held, answered=True)
    spent = store.spent("t1")
    assert (spent.tokens_day, spent.usd_day) == (30, 4.0)
    assert (spent.tokens_month, spent.usd_month) == (30, 4.0)
    await admitted(store, hold(60, 0.5, **limits))  # 30 + 60 < 100 tokens, 4 + 0.5 < 5 USD
    await admitted(store, hold(1, 0.5, **limits))  # 4 + 1 USD: now exhausted
    assert (await refused(store, hold(1, 0.0, **limits))).limit == "budget_usd_month"


async def test_budgets_renew_at_utc_midnight_and_month(
    store: LimitStore[Any], clocks: Clocks
) -> None:
    store.spend("t1", 100, 1.0)
    await refused(store, hold(1, budget_tokens_day=100))
    clocks.advance(12 * 3600.0)  # midnight UTC: a new day, the same month
    await admitted(store, hold(1, budget_tokens_day=100))
    assert (await refused(store, hold(1, budget_tokens_month=100))).limit == "budget_tokens_month"
    assert store.spent("t1").tokens_day == 0
    assert store.spent("t1").tokens_month == 100


async def test_concurrent_admissions_never_exceed_a_limit(store: LimitStore[Any]) -> None:
    outcomes: list[bool] = []

    async def ask() -> None:
        decision = await store.admit(hold(max_concurrent=3, rpm=5))
        outcomes.append(not isinstance(decision, Refusal))

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(ask)
    assert outcomes.count(True) == 3
    assert store.in_flight("t1") == 3


def ledger_row(request_id: str, ended_at: float, billable: bool = True) -> UsageRow:
    """A row of 15 tokens and 1 USD, attributed to ``t1``: what seeding reads."""
    return UsageRow(
        request_id=request_id,
        attempt=1,
        model_group="m",
        served_model="m",
        provider_id="p",
        node_id="n",
        path="normalized",
        attribution="t1",
        prompt_tokens=10,
        completion_tokens=5,
        usage_source="reported",
        outcome="completed",
        billable_to="client" if billable else "operator",
        queue_wait_s=0.0,
        ttft_s=None,
        duration_s=1.0,
        ended_at=ended_at,
        cost_usd=1.0,
    )


async def test_seeding_from_a_ledger_counts_this_month_only(
    store: LimitStore[Any], tmp_path: Path
) -> None:
    async with open_usage_ledger(tmp_path / "usage.sqlite3") as ledger:
        ledger.record(ledger_row("today", WALL - 60))
        ledger.record(ledger_row("earlier", WALL - 3 * 86400))
        ledger.record(ledger_row("last-month", WALL - 20 * 86400))
        ledger.record(ledger_row("operator", WALL - 60, billable=False))
        await store.seed(ledger)
    spent = store.spent("t1")
    assert (spent.tokens_day, spent.usd_day) == (15, 1.0)
    assert (spent.tokens_month, spent.usd_month) == (30, 2.0)
