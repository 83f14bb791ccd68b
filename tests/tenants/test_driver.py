"""The driver of the tenant limits in virtual time (``MockClock(autojump_threshold=0)``, no
sockets): the refusal's ``Retry-After`` is honest, the ticket is released however its block
is left, usage rows bill their request, and a restart seeds the budgets from the ledger."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import trio
import trio.testing

from dispatcher.admission import UnknownModel
from dispatcher.errors import QuotaExceeded, RateLimited, StoreUnavailable, TokenRateLimited
from dispatcher.store.ledger import open_usage_ledger
from dispatcher.store.limits import MemoryLimits
from dispatcher.store.usage import UsageRow
from dispatcher.tenants import (
    SEED_RETRY,
    TICKET_MEMORY,
    KeyDirectory,
    Limits,
    Price,
    PriceTable,
    Tenant,
    TenantPolicy,
    Tenants,
    expected_output_tokens,
    request_estimate,
)

NOON = datetime.datetime(2026, 12, 15, 12, 0, tzinfo=datetime.UTC).timestamp()
BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def tenant(**limits: Any) -> Tenant:
    return Tenant(id="t1", name="t1", models=("m", "n*"), limits=Limits(**limits))


def tenants(prices: PriceTable | None = None) -> Tenants:
    return Tenants(TenantPolicy(prices=prices or PriceTable()), MemoryLimits(wall=lambda: NOON))


def row(
    request_id: str, *, billable: bool = True, prompt: int = 10, completion: int = 5, **extra: Any
) -> UsageRow:
    fields: dict[str, Any] = {
        "request_id": request_id,
        "attempt": 1,
        "model_group": "m",
        "served_model": "m-served",
        "provider_id": "p",
        "node_id": "n",
        "path": "normalized",
        "attribution": "t1",
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "usage_source": "reported",
        "outcome": "completed",
        "billable_to": "client" if billable else "operator",
        "queue_wait_s": 0.0,
        "ttft_s": 0.1,
        "duration_s": 0.2,
        "ended_at": NOON,
    }
    fields.update(extra)
    return UsageRow(**fields)


async def test_retry_after_is_honest_in_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    driver = tenants()
    who = tenant(rpm=2)
    admitted = 0
    refusals: list[RateLimited] = []
    start = trio.current_time()
    while admitted < 5:
        try:
            async with driver.admitted(f"r{admitted}", who, "m", BODY):
                admitted += 1
        except RateLimited as exc:
            refusals.append(exc)
            assert exc.retry_after is not None
            await trio.sleep(exc.retry_after)
    # 2 at once, 2 a minute later, 1 a minute after that: each wait was exactly enough.
    assert len(refusals) == 2
    assert trio.current_time() - start == pytest.approx(120.0)
    assert dict(refusals[0].headers)[b"x-ratelimit-limit-requests"] == b"2"


async def test_the_ticket_is_released_however_the_block_is_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    driver = tenants()
    who = tenant(max_concurrent=1)
    with trio.move_on_after(5):
        async with driver.admitted("r1", who, "m", BODY):
            await trio.sleep_forever()
    with pytest.raises(ValueError, match="boom"):
        async with driver.admitted("r2", who, "m", BODY):
            raise ValueError("boom")
    async with driver.admitted("r3", who, "m", BODY):
        with pytest.raises(RateLimited):
            async with driver.admitted("r4", who, "m", BODY):
                pass
    assert driver.limits.in_flight("t1") == 0


async def test_a_model_outside_the_patterns_is_unknown() -> None:
    driver = tenants()
    with pytest.raises(UnknownModel, match=r"^model 'other' does not exist$"):
        async with driver.admitted("r1", tenant(), "other", BODY):
            pass
    async with driver.admitted("r2", tenant(), "n-7b", BODY) as ticket:
        assert ticket is not None
    async with driver.admitted("r3", None, "anything", BODY) as none:
        assert none is None  # client auth off: nothing is limited


async def test_billable_rows_bill_their_request_at_its_admitted_prices(
    autojump_clock: trio.testing.MockClock,
) -> None:
    driver = tenants(PriceTable({"m": Price(1e6, 2e6)}))
    who = tenant(tpm=1000, budget_usd_day=100.0)
    recorded: list[UsageRow] = []
    record = driver.recorder(recorded.append)
    async with driver.admitted("r1", who, "m", BODY):
        driver.swap(TenantPolicy(prices=PriceTable({"m": Price(9e6, 9e6)})))
        record(row("r1", billable=False, prompt=3, completion=0))
        record(row("r1", attempt=2, prompt=10, completion=5))
    failed, billed = recorded
    assert failed.cost_usd == pytest.approx(3.0)
    assert billed.cost_usd == pytest.approx(20.0)  # the prices of admission, not 9 USD
    spent = driver.limits.spent("t1")
    assert (spent.tokens_day, spent.usd_day) == (15, 20.0)
    # A row of a request this edge has no ticket of (another edge's, an old one) is spent
    # at the prices in force.
    record(row("elsewhere", prompt=1, completion=0))
    assert recorded[-1].cost_usd == pytest.approx(9.0)
    assert driver.limits.spent("t1").usd_day == 29.0


async def test_a_restart_keeps_the_month_spent(tmp_path: Any) -> None:
    path = tmp_path / "usage.sqlite3"
    earlier = NOON - 3 * 86400
    last_month = NOON - 20 * 86400
    async with open_usage_ledger(path) as ledger:
        ledger.record(row("a", ended_at=NOON - 60, cost_usd=1.0))
        ledger.record(row("b", ended_at=earlier, cost_usd=2.0))
        ledger.record(row("c", ended_at=last_month, cost_usd=4.0))
        ledger.record(row("d", ended_at=NOON - 60, billable=False, cost_usd=8.0))
    driver = tenants()
    async with open_usage_ledger(path) as ledger:
        await driver.seed(ledger)
    spent = driver.limits.spent("t1")
    assert (spent.tokens_day, spent.usd_day) == (15, 1.0)
    assert (spent.tokens_month, spent.usd_month) == (30, 3.0)
    with pytest.raises(QuotaExceeded) as info:
        async with driver.admitted("r", tenant(budget_usd_month=3.0), "m", BODY):
            pass
    assert info.value.code == "insufficient_quota"


async def test_only_a_ticket_whose_row_may_still_come_is_remembered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    driver = tenants()
    who = tenant()
    async with driver.admitted("waiting", who, "m", BODY) as waiting:
        assert waiting is not None
        waiting.answered = True  # and not billed yet: its row is on its way
    async with driver.admitted("failed", who, "m", BODY):
        pass  # nothing committed: no row is to come
    async with driver.admitted("billed", who, "m", BODY) as billed:
        assert billed is not None
        billed.answered = True
        driver.price("billed", 1, "m", "t1", "client", 1, 1)
    assert driver.tickets() == 1
    await trio.sleep(TICKET_MEMORY - 0.5)
    assert driver.ticket("waiting") is waiting
    await trio.sleep(0.5)
    assert driver.ticket("waiting") is None
    async with driver.admitted("late", who, "m", BODY) as late:
        assert late is not None
        late.answered = True
    driver.price("late", 1, "m", "t1", "client", 1, 1)  # its row came: forgotten
    assert driver.ticket("late") is None


async def test_a_row_priced_twice_settles_its_attempt_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The settle is keyed by request and attempt: pricing one attempt's row again (a
    retried settle) spends nothing more; another attempt's row does."""
    driver = tenants(PriceTable({"m": Price(1e6, 1e6)}))
    async with driver.admitted("r1", tenant(), "m", BODY):
        assert driver.price("r1", 1, "m", "t1", "client", 2, 3) == pytest.approx(5.0)
        assert driver.price("r1", 1, "m", "t1", "client", 2, 3) == pytest.approx(5.0)
        assert driver.limits.spent("t1").usd_day == pytest.approx(5.0)
        driver.price("r1", 2, "m", "t1", "client", 1, 0)
        assert driver.limits.spent("t1").usd_day == pytest.approx(6.0)


def test_the_estimate_counts_the_declared_output() -> None:
    assert expected_output_tokens({}) == 0
    assert expected_output_tokens({"max_tokens": 50}) == 50
    assert expected_output_tokens({"max_completion_tokens": 20, "max_tokens": 50}) == 20
    assert expected_output_tokens({"max_output_tokens": 7}) == 7
    assert expected_output_tokens({"max_tokens": True}) == 0
    assert request_estimate({**BODY, "max_tokens": 50}) == request_estimate(BODY) + 50


async def test_tpm_refusal_is_the_tokens_error(autojump_clock: trio.testing.MockClock) -> None:
    driver = tenants()
    who = tenant(tpm=60)
    async with driver.admitted("r1", who, "m", {**BODY, "max_tokens": 50}):
        with pytest.raises(TokenRateLimited) as info:
            async with driver.admitted("r2", who, "m", {**BODY, "max_tokens": 50}):
                pass
    assert info.value.error_type == "tokens"
    assert info.value.status == 429


async def test_a_request_authenticated_before_a_reload_is_admitted_as_the_reload_made_it() -> None:
    """The tenant and the prices of one config, never the old limits with the new prices:
    the key was looked up before the reload (its body was still arriving), the request is
    admitted after it."""
    old = Tenant(id="t1", name="t1", limits=Limits(rpm=10))
    new = Tenant(id="t1", name="t1", limits=Limits(rpm=5))
    driver = Tenants(
        TenantPolicy(KeyDirectory({"digest": old}), PriceTable({"m": Price(1, 1)})), MemoryLimits()
    )
    driver.swap(TenantPolicy(KeyDirectory({"digest": new}), PriceTable({"m": Price(3, 3)})))
    async with driver.admitted("r1", old, "m", BODY) as ticket:
        assert ticket is not None
        assert ticket.tenant is new
        assert ticket.prices.price("m") == Price(3, 3)
    gone = Tenant(id="removed", name="removed")
    async with driver.admitted("r2", gone, "m", BODY) as ticket:
        assert ticket is not None
        assert ticket.tenant is gone  # removed meanwhile: it keeps what it was


class _Unreadable:
    """A ledger whose database is down for the first ``failures`` reads, then answers what
    the real one answered (read beforehand: no worker thread under the virtual clock)."""

    def __init__(self, groups: Any, failures: int) -> None:
        self.groups = groups
        self.failures = failures

    async def billable_spend(self, since: float) -> Any:
        await trio.lowlevel.checkpoint()
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("the usage ledger's database cannot be reached")
        return self.groups


async def test_budgets_are_seeded_once_the_ledger_can_be_read(
    autojump_clock: trio.testing.MockClock, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "usage.sqlite3"
    async with open_usage_ledger(path) as ledger:
        ledger.record(row("a", ended_at=NOON - 60, cost_usd=1.0))
        groups = await ledger.billable_spend(NOON - 40 * 86400)
    driver = tenants()
    async with trio.open_nursery() as nursery:
        unreadable: Any = _Unreadable(groups, failures=3)
        await nursery.start(driver.seed_when_readable, unreadable)
        assert driver.limits.spent("t1").tokens_day == 0  # started: not seeded yet
        await trio.sleep(3 * SEED_RETRY - 0.5)
        assert driver.limits.spent("t1").tokens_day == 0
        await trio.sleep(1)
        assert driver.limits.spent("t1").tokens_day == 15
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "budgets not seeded" in warnings[0].getMessage()
