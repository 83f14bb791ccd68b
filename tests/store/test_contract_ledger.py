"""The usage ledger's contract (:class:`~dispatcher.store.seam.UsageLedger`), run over every
backend (``tests/store/backends.py``): idempotent rows keyed by ``(request_id, attempt)``,
every filter and grouping against a reference computed here, ordering, limits and windows at
their edges, concurrent writers, and a reopened ledger keeping what was committed."""

from __future__ import annotations

import datetime
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio

from dispatcher.store.seam import UsageLedger
from dispatcher.store.usage import (
    GROUP_BY,
    MAX_QUERY_LIMIT,
    DuplicateUsageRow,
    GroupBy,
    TokenTotals,
    UsageFilter,
    UsageGroup,
    UsageRow,
)
from tests.test_usage import make_row

from .backends import LEDGERS, LedgerBackend

T0 = datetime.datetime(2026, 11, 30, 22, 0, tzinfo=datetime.UTC).timestamp()
"""Two hours before a UTC midnight: the rows below span two days."""


@pytest.fixture(params=LEDGERS, ids=lambda backend: backend.name)
def backend(request: pytest.FixtureRequest) -> LedgerBackend:
    chosen: LedgerBackend = request.param
    return chosen


def row(request_id: str, attempt: int = 1, **changes: Any) -> UsageRow:
    """The ledger tests' row (``tests/test_usage.py``), ending at this suite's ``T0``."""
    return make_row(request_id, attempt, **{"ended_at": T0, **changes})


def varied_rows() -> list[UsageRow]:
    """48 rows over every dimension: keys (one None), models, routes (one None), both
    sides of a UTC midnight, billable to either side, estimated or reported, priced or not,
    one to three attempts per request, some client request ids, cached, cache-written and
    reasoning tokens or none."""
    rows = []
    keys = ("key-1", "key-2", None)
    models = ("llama", "qwen")
    routes = ("/v1/chat/completions", "/v1/messages", None)
    for i in range(24):
        attempts = 1 + i % 3
        for attempt in range(1, attempts + 1):
            last = attempt == attempts
            rows.append(
                row(
                    f"req-{i:02d}",
                    attempt,
                    attribution=keys[i % 3],
                    model_group=models[i % 2],
                    route=routes[(i // 2) % 3],
                    client_request_id=f"client-{i % 5}" if i % 4 else None,
                    ended_at=T0 + i * 600 + attempt,  # 24 * 10 min: across midnight
                    prompt_tokens=i + attempt,
                    completion_tokens=2 * i,
                    usage_source="estimated" if i % 7 == 0 else "reported",
                    outcome="completed" if last else "failed",
                    billable_to="client" if last else "operator",
                    cost_usd=None if i % 5 == 0 else 0.25 * i,
                    cached_tokens=i // 2 if i % 3 else 0,
                    cache_write_tokens=attempt if i % 4 == 1 else 0,
                    reasoning_tokens=i if i % 2 else 0,
                )
            )
    return rows[:48]


def matching(rows: Iterable[UsageRow], where: UsageFilter) -> list[UsageRow]:
    return [
        r
        for r in rows
        if (where.since is None or r.ended_at >= where.since)
        and (where.until is None or r.ended_at < where.until)
        and (where.attribution is None or r.attribution == where.attribution)
        and (where.model is None or r.model_group == where.model)
        and (where.client_request_id is None or r.client_request_id == where.client_request_id)
    ]


def newest_first(rows: Iterable[UsageRow]) -> list[UsageRow]:
    return sorted(rows, key=lambda r: (r.ended_at, r.request_id, r.attempt), reverse=True)


def day(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.UTC).strftime("%Y-%m-%d")


def dimension(r: UsageRow, name: GroupBy) -> str | None:
    return {"key": r.attribution, "model": r.model_group, "route": r.route, "day": day(r.ended_at)}[
        name
    ]


def reference_groups(
    rows: Sequence[UsageRow], group_by: Sequence[GroupBy], *, billable: bool
) -> list[UsageGroup]:
    grouped: dict[tuple[str | None, ...], list[UsageRow]] = defaultdict(list)
    for r in rows:
        if billable and r.billable_to != "client":
            continue
        grouped[tuple(dimension(r, name) for name in group_by)].append(r)
    found = []
    for values in sorted(grouped, key=lambda v: [(x is not None, x or "") for x in v]):
        members = grouped[values]
        client = [r for r in members if r.billable_to == "client"]
        found.append(
            UsageGroup(
                **dict(zip(group_by, values, strict=True)),
                requests=len({r.request_id for r in members}),
                attempts=len(members),
                prompt_tokens=sum(r.prompt_tokens for r in members),
                completion_tokens=sum(r.completion_tokens for r in members),
                client=TokenTotals(
                    sum(r.prompt_tokens for r in client), sum(r.completion_tokens for r in client)
                ),
                cost_usd=pytest.approx(sum(r.cost_usd or 0.0 for r in client)),  # type: ignore[arg-type]
                cached_tokens=sum(r.cached_tokens for r in members),
                cache_write_tokens=sum(r.cache_write_tokens for r in members),
                reasoning_tokens=sum(r.reasoning_tokens for r in members),
            )
        )
    return found


async def filled(ledger: UsageLedger, rows: Iterable[UsageRow]) -> None:
    for r in rows:
        ledger.record(r)
    await ledger.flush()


# ------------------------------------------------------------------ exactly once


async def test_a_key_is_recorded_once(backend: LedgerBackend, tmp_path: Path) -> None:
    async with backend.open(tmp_path) as ledger:
        ledger.record(row("r", 1))
        ledger.record(row("r", 2))  # another attempt of the same request: its own row
        with pytest.raises(DuplicateUsageRow):
            ledger.record(row("r", 1, prompt_tokens=999))
        await ledger.flush()
        with pytest.raises(DuplicateUsageRow):
            ledger.record(row("r", 2))  # written, still refused
        report = await ledger.query()
        assert sorted((r.request_id, r.attempt, r.prompt_tokens) for r in report.rows) == [
            ("r", 1, 10),
            ("r", 2, 10),
        ]
        stats = ledger.statistics()
        assert (stats.rows_written, stats.duplicates_refused, stats.rows_lost) == (2, 2, 0)


@pytest.mark.parametrize(
    "backend", [b for b in LEDGERS if b.persistent], ids=lambda backend: backend.name
)
async def test_a_reopened_ledger_keeps_its_rows_and_refuses_their_keys(
    backend: LedgerBackend, tmp_path: Path
) -> None:
    rows = varied_rows()
    async with backend.open(tmp_path) as ledger:
        for r in rows:
            ledger.record(r)  # not flushed: leaving the block writes them
    async with backend.open(tmp_path) as ledger:
        ledger.record(row("req-00", 1, prompt_tokens=999))  # a key written before the restart
        ledger.record(row("new", 1))
        await ledger.flush()
        report = await ledger.query(limit=MAX_QUERY_LIMIT)
        assert report.totals.attempts == len(rows) + 1
        assert [r for r in report.rows if r.key == ("req-00", 1)] == [
            next(r for r in rows if r.key == ("req-00", 1))
        ]
        stats = ledger.statistics()
        assert (stats.rows_written, stats.duplicates_dropped) == (1, 1)


async def test_concurrent_writers_lose_nothing(backend: LedgerBackend, tmp_path: Path) -> None:
    async with backend.open(tmp_path) as ledger:

        async def writer(name: str) -> None:
            for i in range(50):
                ledger.record(row(f"{name}-{i}", ended_at=T0 + i))
                if i % 7 == 0:
                    await trio.sleep(0)
                if i % 20 == 0:
                    await ledger.query(limit=1)  # a reader among the writers

        async with trio.open_nursery() as nursery:
            for name in "abcdefgh":
                nursery.start_soon(writer, name)
        report = await ledger.query(limit=MAX_QUERY_LIMIT)
        assert report.totals.attempts == len(report.rows) == 400
        assert len({r.key for r in report.rows}) == 400
        assert ledger.statistics().rows_lost == 0


# ------------------------------------------------------------------ queries


async def test_every_filter_selects_what_it_names(backend: LedgerBackend, tmp_path: Path) -> None:
    rows = varied_rows()
    filters = [
        UsageFilter(),
        UsageFilter(attribution="key-2"),
        UsageFilter(model="qwen"),
        UsageFilter(client_request_id="client-3"),
        UsageFilter(since=T0 + 3000),
        UsageFilter(until=T0 + 3000),
        UsageFilter(since=T0 + 600, until=T0 + 6000, attribution="key-1", model="llama"),
        UsageFilter(attribution="nobody"),
    ]
    async with backend.open(tmp_path) as ledger:
        await filled(ledger, rows)
        for where in filters:
            expected = newest_first(matching(rows, where))
            report = await ledger.query(where, limit=MAX_QUERY_LIMIT)
            assert list(report.rows) == expected, where
            totals = report.totals
            assert totals.attempts == len(expected)
            assert totals.requests == len({r.request_id for r in expected})
            assert totals.prompt_tokens == sum(r.prompt_tokens for r in expected)
            assert totals.completion_tokens == sum(r.completion_tokens for r in expected)
            assert totals.cached_tokens == sum(r.cached_tokens for r in expected)
            assert totals.cache_write_tokens == sum(r.cache_write_tokens for r in expected)
            assert totals.reasoning_tokens == sum(r.reasoning_tokens for r in expected)
            client = [r for r in expected if r.billable_to == "client"]
            assert totals.client == TokenTotals(
                sum(r.prompt_tokens for r in client), sum(r.completion_tokens for r in client)
            )
            assert totals.cost_usd == pytest.approx(sum(r.cost_usd or 0.0 for r in client))
            estimated = [r for r in expected if r.usage_source == "estimated"]
            assert totals.estimated.prompt_tokens == sum(r.prompt_tokens for r in estimated)
            assert sum(totals.outcomes.values()) == len(expected)
            assert totals.outcomes["failed"] == sum(r.outcome == "failed" for r in expected)


async def test_windows_at_their_edges(backend: LedgerBackend, tmp_path: Path) -> None:
    """``since`` is inclusive and ``until`` exclusive: adjacent windows split the rows."""
    rows = [row(f"r{i}", ended_at=T0 + i) for i in range(10)]
    async with backend.open(tmp_path) as ledger:
        await filled(ledger, rows)
        at = await ledger.query(since=T0 + 3, until=T0 + 4)
        assert [r.request_id for r in at.rows] == ["r3"]
        before = await ledger.query(until=T0 + 5)
        after = await ledger.query(since=T0 + 5)
        assert before.totals.attempts + after.totals.attempts == 10
        assert min(r.ended_at for r in after.rows) == T0 + 5
        empty = await ledger.query(since=T0 + 5, until=T0 + 5)
        assert empty.rows == ()
        assert empty.totals.attempts == 0


async def test_newest_first_and_limits_at_their_edges(
    backend: LedgerBackend, tmp_path: Path
) -> None:
    same_time = [row(f"r{i}", attempt, ended_at=T0) for i in range(3) for attempt in (1, 2)]
    async with backend.open(tmp_path) as ledger:
        await filled(ledger, [*same_time, row("later", ended_at=T0 + 1)])
        ordered = await ledger.query()
        assert [r.key for r in ordered.rows] == [
            ("later", 1),
            ("r2", 2),
            ("r2", 1),
            ("r1", 2),
            ("r1", 1),
            ("r0", 2),
            ("r0", 1),
        ]
        none = await ledger.query(limit=0)
        assert none.rows == ()
        assert none.totals.attempts == 7
        assert none.truncated
        one = await ledger.query(limit=1)
        assert [r.key for r in one.rows] == [("later", 1)]
        assert one.truncated
        exact = await ledger.query(limit=7)
        assert len(exact.rows) == 7
        assert not exact.truncated
        for bad in (-1, MAX_QUERY_LIMIT + 1):
            with pytest.raises(ValueError, match="limit"):
                await ledger.query(limit=bad)


async def test_text_is_ordered_by_its_characters_not_a_locale(
    backend: LedgerBackend, tmp_path: Path
) -> None:
    """Ties are broken by ``request_id`` in code point order (Python's, SQLite's), and groups
    ordered so, whatever the database's locale would say (case, punctuation, accents)."""
    names = ["B", "_c", "a", "a-b", "ab", "\u00e9", "Z"]
    async with backend.open(tmp_path) as ledger:
        await filled(ledger, [row(name, attribution=name, ended_at=T0) for name in names])
        report = await ledger.query()
        assert [r.request_id for r in report.rows] == sorted(names, reverse=True)
        groups = await ledger.query_groups(group_by=("key",))
        assert [g.key for g in groups] == sorted(names)


@pytest.mark.parametrize(
    "group_by",
    [(), *((name,) for name in GROUP_BY), ("key", "day"), ("model", "route"), GROUP_BY],
    ids=lambda names: "+".join(names) or "none",
)
async def test_groups_are_the_sums_of_their_rows(
    backend: LedgerBackend, tmp_path: Path, group_by: tuple[GroupBy, ...]
) -> None:
    rows = varied_rows()
    async with backend.open(tmp_path) as ledger:
        await filled(ledger, rows)
        for billable in (False, True):
            found = await ledger.query_groups(group_by=group_by, billable=billable)
            assert found == reference_groups(rows, group_by, billable=billable)
        where = UsageFilter(since=T0 + 1200, attribution="key-1")
        found = await ledger.query_groups(where, group_by=group_by)
        assert found == reference_groups(matching(rows, where), group_by, billable=False)


async def test_bad_groupings_are_refused(backend: LedgerBackend, tmp_path: Path) -> None:
    async with backend.open(tmp_path) as ledger:
        for bad in (["key", "key"], ["tenant"]):
            with pytest.raises(ValueError, match="group_by"):
                await ledger.query_groups(group_by=bad)  # type: ignore[arg-type]


async def test_billable_spend_is_per_key_and_day_billed_to_clients(
    backend: LedgerBackend, tmp_path: Path
) -> None:
    rows = varied_rows()
    since = T0 + 1800
    async with backend.open(tmp_path) as ledger:
        await filled(ledger, rows)
        spend = await ledger.billable_spend(since)
    expected = reference_groups(
        matching(rows, UsageFilter(since=since)), ("key", "day"), billable=True
    )
    assert spend == expected
    assert {g.day for g in spend} == {day(T0), day(T0 + 86400)}  # both sides of midnight


def test_the_varied_rows_cover_every_dimension() -> None:
    """The reference data above means something: each dimension has several values."""
    rows = varied_rows()
    for name in GROUP_BY:
        assert len({dimension(r, name) for r in rows}) >= 2, name
    assert {r.billable_to for r in rows} == {"client", "operator"}
    assert any(r.cost_usd is None for r in rows)
    assert any(r.attempt == 3 for r in rows)
    for part in ("cached_tokens", "cache_write_tokens", "reasoning_tokens"):
        assert len({getattr(r, part) for r in rows}) >= 3, part
    assert len(rows) == 48
