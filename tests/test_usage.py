"""The usage ledger: exactly-once rows, batching, flush on exit, restarts, queries."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from dispatcher.api.usage_report import parse_usage_query, usage_report_json
from dispatcher.store.ledger import RECENT_KEYS, open_usage_ledger
from dispatcher.store.seam import UsageLedger
from dispatcher.store.usage import (
    GROUP_BY,
    MAX_QUERY_LIMIT,
    DuplicateUsageRow,
    TokenTotals,
    UsageFilter,
    UsageQuery,
    UsageRow,
)
from dispatcher.store.usage_sqlite import USAGE_DB_NAME

T0 = 1_700_000_000.0


def make_row(request_id: str = "req-1", attempt: int = 1, **changes: Any) -> UsageRow:
    fields: dict[str, Any] = {
        "request_id": request_id,
        "attempt": attempt,
        "model_group": "llama",
        "served_model": "llama3:8b",
        "provider_id": "ollama",
        "node_id": "node-a",
        "path": "normalized",
        "attribution": "key-1",
        "prompt_tokens": 10,
        "completion_tokens": 20,
        "usage_source": "reported",
        "outcome": "completed",
        "billable_to": "client",
        "queue_wait_s": 0.01,
        "ttft_s": 0.1,
        "duration_s": 1.0,
        "ended_at": T0,
    }
    fields.update(changes)
    return UsageRow(**fields)


def numbered_rows(count: int, prefix: str = "req") -> Iterator[UsageRow]:
    for i in range(count):
        yield make_row(f"{prefix}-{i}", ended_at=T0 + i)


def rows_in_file(path: Path) -> list[tuple[Any, ...]]:
    """The file's rows, read by a connection of our own (not the ledger's)."""
    with closing(sqlite3.connect(path)) as conn:
        return conn.execute(
            "SELECT request_id, attempt, prompt_tokens FROM usage ORDER BY request_id, attempt"
        ).fetchall()


# ------------------------------------------------------------------ rows


def test_row_validation() -> None:
    with pytest.raises(ValueError, match="attempt"):
        make_row(attempt=0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        make_row(prompt_tokens=-1)
    with pytest.raises(ValueError, match="outcome"):
        make_row(outcome="timeout")
    with pytest.raises(ValueError, match="billable_to"):
        make_row(billable_to="nobody")
    with pytest.raises(ValueError, match="path"):
        make_row(path="carrier-pigeon")


def test_the_parts_of_a_count_are_within_it() -> None:
    """Cached and cache-written tokens are parts of the prompt's (together), reasoning
    tokens of the completion's: never negative, never beyond their total."""
    whole = make_row(prompt_tokens=10, completion_tokens=20, cached_tokens=6,
                     cache_write_tokens=4, reasoning_tokens=20)  # fmt: skip
    assert (whole.cached_tokens, whole.cache_write_tokens, whole.reasoning_tokens) == (6, 4, 20)
    assert make_row().cached_tokens == make_row().reasoning_tokens == 0
    with pytest.raises(ValueError, match=r"cached_tokens \(11\) must not exceed prompt_tokens"):
        make_row(prompt_tokens=10, cached_tokens=11)
    with pytest.raises(
        ValueError, match=r"cache_write_tokens \+ cached_tokens \(11\) must not exceed"
    ):
        make_row(prompt_tokens=10, cached_tokens=6, cache_write_tokens=5)
    with pytest.raises(ValueError, match="reasoning_tokens"):
        make_row(completion_tokens=20, reasoning_tokens=21)
    for part in ("cached_tokens", "cache_write_tokens", "reasoning_tokens"):
        negative: dict[str, Any] = {part: -1}
        with pytest.raises(ValueError, match=part):
            make_row(**negative)
        fraction: dict[str, Any] = {part: 1.5}
        with pytest.raises(TypeError, match=part):
            make_row(**fraction)


# ------------------------------------------------------------------ exactly once


async def test_in_memory_ledger_round_trip() -> None:
    rows = [
        make_row("a", ended_at=T0),
        make_row("b", ended_at=T0 + 2, attribution=None, ttft_s=None),
        make_row("b", 2, ended_at=T0 + 1, path="tunnel", usage_source="estimated"),
    ]
    async with open_usage_ledger(":memory:") as ledger:
        for row in rows:
            ledger.record(row)
        report = await ledger.query()
    assert report.rows == (rows[1], rows[2], rows[0])  # newest first
    assert not report.truncated


async def test_in_memory_ledgers_are_separate() -> None:
    async with open_usage_ledger(None) as first, open_usage_ledger() as second:
        first.record(make_row("a"))
        second.record(make_row("b"))
        assert [row.request_id for row in (await first.query()).rows] == ["a"]
        assert [row.request_id for row in (await second.query()).rows] == ["b"]


async def test_duplicate_raises_and_the_database_keeps_one_row() -> None:
    first = make_row("r", 1, prompt_tokens=1)
    async with open_usage_ledger() as ledger:
        ledger.record(first)
        with pytest.raises(DuplicateUsageRow) as pending_dup:
            ledger.record(make_row("r", 1, prompt_tokens=2))  # while pending
        assert isinstance(pending_dup.value, ValueError)
        assert (pending_dup.value.request_id, pending_dup.value.attempt) == ("r", 1)
        await ledger.flush()
        with pytest.raises(DuplicateUsageRow):
            ledger.record(make_row("r", 1, prompt_tokens=3))  # written already
        ledger.record(make_row("r", 2))  # another attempt of the same request is fine
        report = await ledger.query()
        stats = ledger.statistics()
    assert [row for row in report.rows if row.attempt == 1] == [first]
    assert report.totals.attempts == 2
    assert stats.duplicates_refused == 2
    assert stats.duplicates_dropped == 0
    assert stats.rows_recorded == stats.rows_written == 2


async def test_old_duplicates_meet_the_primary_key_and_the_rest_of_the_batch_is_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with open_usage_ledger(recent_keys=0) as ledger:
        ledger.record(make_row("old", prompt_tokens=1))
        await ledger.flush()
        # Forgotten by `record` (recent_keys=0), so caught when written, in one batch with
        # two good rows.
        ledger.record(make_row("before"))
        ledger.record(make_row("old", prompt_tokens=2))
        ledger.record(make_row("after"))
        await ledger.flush()
        report = await ledger.query()
        stats = ledger.statistics()
    by_id = {row.request_id: row for row in report.rows}
    assert sorted(by_id) == ["after", "before", "old"]
    assert by_id["old"].prompt_tokens == 1  # the first row stays
    assert stats.duplicates_dropped == 1
    assert stats.rows_written == 3
    assert stats.batches == 2
    assert "request 'old' attempt 1 is already in the database" in caplog.text


async def test_rows_of_an_earlier_run_are_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / USAGE_DB_NAME
    async with open_usage_ledger(path) as ledger:
        ledger.record(make_row("r", prompt_tokens=1))
    async with open_usage_ledger(path) as ledger:
        ledger.record(make_row("r", prompt_tokens=99))  # a new ledger does not know the key
        await ledger.flush()
        assert ledger.statistics().duplicates_dropped == 1
    assert rows_in_file(path) == [("r", 1, 1)]


async def test_a_row_the_database_refuses_does_not_take_its_batch_with_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / USAGE_DB_NAME
    async with open_usage_ledger(path):
        pass
    with closing(sqlite3.connect(path)) as conn:
        conn.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON usage WHEN NEW.request_id = 'bad' "
            "BEGIN SELECT RAISE(ABORT, 'refused by trigger'); END"
        )
        conn.commit()
    async with open_usage_ledger(path) as ledger:
        for request_id in ("one", "bad", "two"):
            ledger.record(make_row(request_id))
        await ledger.flush()
        stats = ledger.statistics()
    assert [row[0] for row in rows_in_file(path)] == ["one", "two"]
    assert (stats.rows_written, stats.rows_lost, stats.write_errors, stats.batches) == (2, 1, 1, 1)
    assert "refused by trigger" in caplog.text


async def test_a_failing_transaction_is_retried_then_given_up(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / USAGE_DB_NAME
    async with open_usage_ledger(path) as ledger:
        ledger.record(make_row("first"))
        await ledger.flush()
        with closing(sqlite3.connect(path)) as conn:
            conn.execute("ALTER TABLE usage RENAME TO elsewhere")
            conn.commit()
        ledger.record(make_row("doomed"))
        await ledger.flush()  # returns: the row is given up, not retried forever
        stats = ledger.statistics()
        assert (stats.write_errors, stats.rows_lost, stats.rows_pending) == (5, 1, 0)
        assert "writing 1 rows failed 5 times; they are lost" in caplog.text
        with closing(sqlite3.connect(path)) as conn:
            conn.execute("ALTER TABLE elsewhere RENAME TO usage")
            conn.commit()
        ledger.record(make_row("later"))
        await ledger.flush()
        assert ledger.statistics().rows_written == 2
    assert [row[0] for row in rows_in_file(path)] == ["first", "later"]


# ------------------------------------------------------------------ batching


async def test_rows_recorded_together_are_written_in_few_batches() -> None:
    async with open_usage_ledger(max_batch=500) as ledger:
        for row in numbered_rows(2000):
            ledger.record(row)
        assert ledger.statistics().rows_pending == 2000
        await ledger.flush()
        stats = ledger.statistics()
    assert (stats.rows_written, stats.batches, stats.rows_pending) == (2000, 4, 0)


async def test_the_writer_gathers_rows_until_the_batch_is_full() -> None:
    # batch_interval is long, so only a full batch (or a flush) starts a write.
    async with open_usage_ledger(batch_interval=3600, max_batch=100) as ledger:
        for row in numbered_rows(100):
            ledger.record(row)
            await trio.sleep(0)  # the writer gets to run between rows
        while ledger.statistics().rows_written < 100:
            await trio.sleep(0.001)
        for row in numbered_rows(5, "more"):
            ledger.record(row)
            await trio.sleep(0)
        await trio.testing.wait_all_tasks_blocked()
        assert ledger.statistics().rows_written == 100
        await ledger.flush()
        stats = ledger.statistics()
    assert (stats.rows_written, stats.batches) == (105, 2)


async def test_a_lone_row_is_written_after_batch_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_usage_ledger(batch_interval=5) as ledger:
        start = trio.current_time()
        ledger.record(make_row())
        await trio.sleep(4.9)
        assert ledger.statistics().rows_written == 0
        while ledger.statistics().rows_written == 0:
            await trio.sleep(0.01)
        assert trio.current_time() - start >= 5


async def test_rows_beyond_max_pending_are_dropped_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with open_usage_ledger(max_pending=3) as ledger:
        for row in numbered_rows(5):
            ledger.record(row)
        await ledger.flush()
        stats = ledger.statistics()
        assert (stats.rows_recorded, stats.rows_written, stats.rows_lost) == (3, 3, 2)
        ledger.record(make_row("after"))  # room again once the writer caught up
        await ledger.flush()
        assert ledger.statistics().rows_written == 4
    assert caplog.text.count("dropping new rows") == 1


# ------------------------------------------------------------------ closing and restarts


async def test_pending_rows_are_flushed_when_the_block_is_cancelled(tmp_path: Path) -> None:
    path = tmp_path / USAGE_DB_NAME
    with trio.CancelScope() as scope:
        async with open_usage_ledger(path, batch_interval=3600, max_batch=5000) as ledger:
            for row in numbered_rows(1234):
                ledger.record(row)
            await trio.testing.wait_all_tasks_blocked()
            assert ledger.statistics().rows_pending == 1234  # the writer is still gathering
            scope.cancel(reason="test")
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert ledger.statistics().rows_written == 1234
    async with open_usage_ledger(path) as reopened:
        totals = (await reopened.query(limit=0)).totals
    assert totals.attempts == totals.requests == 1234


async def test_cancelled_while_writing_loses_and_repeats_nothing(tmp_path: Path) -> None:
    path = tmp_path / USAGE_DB_NAME
    with trio.CancelScope() as scope:
        async with open_usage_ledger(path, batch_interval=0, max_batch=50) as ledger:
            for row in numbered_rows(5000):
                ledger.record(row)
            # Let the writer get into the thread, then cancel in the middle of the batches.
            while ledger.statistics().batches < 3:
                await trio.sleep(0.0001)
            scope.cancel()
            await trio.sleep_forever()
    stats = ledger.statistics()
    assert (stats.rows_written, stats.rows_lost, stats.duplicates_dropped) == (5000, 0, 0)
    assert len(rows_in_file(path)) == 5000


async def test_an_error_in_the_block_is_raised_as_is_and_rows_are_kept(tmp_path: Path) -> None:
    path = tmp_path / USAGE_DB_NAME

    async def fail() -> None:
        async with open_usage_ledger(path, batch_interval=3600) as ledger:
            ledger.record(make_row())
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        await fail()
    assert rows_in_file(path) == [("req-1", 1, 10)]


async def test_the_ledger_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "deeper" / "data" / USAGE_DB_NAME  # the directories do not exist yet
    async with open_usage_ledger(path) as ledger:
        for row in numbered_rows(300, "first"):
            ledger.record(row)
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    async with open_usage_ledger(str(path)) as ledger:
        assert (await ledger.query(limit=0)).totals.attempts == 300
        for row in numbered_rows(200, "second"):
            ledger.record(row)
    async with open_usage_ledger(path) as ledger:
        report = await ledger.query(limit=MAX_QUERY_LIMIT)
    assert report.totals.attempts == report.totals.requests == 500
    assert report.totals.prompt_tokens == 500 * 10
    assert report.totals.client == TokenTotals(prompt_tokens=5000, completion_tokens=10000)


async def test_closed_ledger_refuses_use() -> None:
    async with open_usage_ledger() as ledger:
        pass
    with pytest.raises(trio.ClosedResourceError):
        ledger.record(make_row())
    with pytest.raises(trio.ClosedResourceError):
        await ledger.flush()


async def test_record_works_inside_a_cancelled_scope() -> None:
    async with open_usage_ledger() as ledger:
        with trio.CancelScope() as scope:
            scope.cancel()
            try:
                await trio.sleep_forever()
            finally:
                ledger.record(make_row("in-finally"))  # no await, no checkpoint
        assert scope.cancelled_caught
        report = await ledger.query()
    assert [row.request_id for row in report.rows] == ["in-finally"]


# ------------------------------------------------------------------ queries


# Three requests, seven attempts, hand-written totals below.
DATASET = [
    # r1 (key-1, llama): a failed attempt the client never saw, then the committed one.
    make_row("r1", 1, outcome="failed", billable_to="operator", prompt_tokens=100,
             completion_tokens=0, ended_at=T0 + 10),
    make_row("r1", 2, prompt_tokens=100, completion_tokens=50, ended_at=T0 + 20),
    # r2 (key-2, llama): aborted, then cancelled by the client; tokens estimated; cached
    # prompts and some reasoning.
    make_row("r2", 1, attribution="key-2", outcome="aborted", billable_to="operator",
             prompt_tokens=40, completion_tokens=5, usage_source="estimated", ended_at=T0 + 30,
             cached_tokens=30, reasoning_tokens=2),
    make_row("r2", 2, attribution="key-2", outcome="cancelled", prompt_tokens=40,
             completion_tokens=7, usage_source="estimated", ended_at=T0 + 40,
             cached_tokens=30, cache_write_tokens=4, reasoning_tokens=3),
    # r3 (key-1, qwen over a tunnel): three attempts.
    make_row("r3", 1, model_group="qwen", path="tunnel", outcome="failed",
             billable_to="operator", prompt_tokens=8, completion_tokens=0, ended_at=T0 + 50),
    make_row("r3", 2, model_group="qwen", path="tunnel", outcome="failed",
             billable_to="operator", prompt_tokens=8, completion_tokens=0, ended_at=T0 + 60),
    make_row("r3", 3, model_group="qwen", path="tunnel", prompt_tokens=8,
             completion_tokens=300, ended_at=T0 + 70),
]  # fmt: skip


@pytest.fixture
async def filled() -> AsyncIterator[UsageLedger]:
    async with open_usage_ledger() as ledger:
        for row in DATASET:
            ledger.record(row)
        yield ledger


async def test_totals_over_everything(filled: UsageLedger) -> None:
    report = await filled.query()
    totals = report.totals
    assert report.rows == tuple(reversed(DATASET))
    assert (totals.requests, totals.attempts) == (3, 7)
    assert totals.prompt_tokens == 100 + 100 + 40 + 40 + 8 + 8 + 8
    assert totals.completion_tokens == 50 + 5 + 7 + 300
    assert totals.client == TokenTotals(100 + 40 + 8, 50 + 7 + 300)
    assert totals.operator == TokenTotals(100 + 40 + 8 + 8, 5)
    assert totals.estimated == TokenTotals(80, 12)
    assert totals.outcomes == {"completed": 2, "failed": 3, "aborted": 1, "cancelled": 1}
    parts = (totals.cached_tokens, totals.cache_write_tokens, totals.reasoning_tokens)
    assert parts == (60, 4, 5)


async def test_time_window_is_since_inclusive_until_exclusive(filled: UsageLedger) -> None:
    report = await filled.query(since=T0 + 20, until=T0 + 50)
    assert [row.key for row in report.rows] == [("r2", 2), ("r2", 1), ("r1", 2)]
    assert (report.totals.requests, report.totals.attempts) == (2, 3)
    assert report.totals.client == TokenTotals(140, 57)
    assert report.totals.operator == TokenTotals(40, 5)
    assert (await filled.query(since=T0 + 70)).totals.attempts == 1
    assert (await filled.query(until=T0 + 10)).totals.attempts == 0


async def test_filter_by_attribution_and_model(filled: UsageLedger) -> None:
    key1 = await filled.query(attribution="key-1")
    assert {row.request_id for row in key1.rows} == {"r1", "r3"}
    assert (key1.totals.requests, key1.totals.attempts) == (2, 5)
    assert key1.totals.client == TokenTotals(108, 350)
    assert key1.totals.operator == TokenTotals(116, 0)

    qwen = await filled.query(model="qwen")
    assert (qwen.totals.requests, qwen.totals.attempts) == (1, 3)
    assert qwen.totals.outcomes == {"completed": 1, "failed": 2, "aborted": 0, "cancelled": 0}

    both = await filled.query(attribution="key-2", model="llama", since=T0 + 35)
    assert [row.key for row in both.rows] == [("r2", 2)]
    assert (await filled.query(attribution="key-2", model="qwen")).totals.attempts == 0
    assert (await filled.query(model="served-name-is-not-a-group")).rows == ()


async def test_limit_truncates_rows_not_totals(filled: UsageLedger) -> None:
    report = await filled.query(limit=2)
    assert [row.key for row in report.rows] == [("r3", 3), ("r3", 2)]
    assert report.truncated
    assert report.totals.attempts == 7
    only_totals = await filled.query(limit=0)
    assert only_totals.rows == ()
    assert only_totals.truncated
    assert not (await filled.query(limit=7)).truncated


async def test_query_arguments_are_checked(filled: UsageLedger) -> None:
    with pytest.raises(ValueError, match="limit"):
        await filled.query(limit=MAX_QUERY_LIMIT + 1)
    with pytest.raises(ValueError, match="since"):
        await filled.query(since=T0 + 1, until=T0)
    with pytest.raises(ValueError, match=r"^until: before since"):
        UsageFilter(since=T0 + 1, until=T0)
    # mypy refuses a misspelt filter where it can see it; one built at run time is refused too
    misspelt: dict[str, Any] = {"modle": "llama"}
    with pytest.raises(TypeError, match="modle"):
        await filled.query(**misspelt)
    with pytest.raises(TypeError, match="modle"):
        await filled.query_groups(**misspelt)


async def test_a_filter_and_filters_by_name_combine(filled: UsageLedger) -> None:
    key2 = UsageFilter(attribution="key-2")
    by_name = await filled.query(attribution="key-2", model="llama", since=T0 + 35)
    combined = await filled.query(key2, model="llama", since=T0 + 35)
    assert combined == by_name
    assert combined.filter == UsageFilter(attribution="key-2", model="llama", since=T0 + 35)
    assert combined.rows
    assert {row.attribution for row in combined.rows} == {"key-2"}
    assert (await filled.query(key2)).totals != combined.totals
    (group,) = await filled.query_groups(key2, group_by=(), model="llama", since=T0 + 35)
    assert group.attempts == combined.totals.attempts


async def test_report_json(filled: UsageLedger) -> None:
    report = await filled.query(attribution="key-2", limit=1)
    body = orjson.loads(usage_report_json(report))
    assert body["query"] == {
        "since": None,
        "until": None,
        "attribution": "key-2",
        "model": None,
        "client_request_id": None,
        "limit": 1,
    }
    assert body["truncated"] is True
    assert body["totals"] == {
        "requests": 1,
        "attempts": 2,
        "prompt_tokens": 80,
        "completion_tokens": 12,
        "total_tokens": 92,
        "cached_tokens": 60,
        "cache_write_tokens": 4,
        "reasoning_tokens": 5,
        "billable": {
            "client": {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47},
            "operator": {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45},
        },
        "estimated": {"prompt_tokens": 80, "completion_tokens": 12, "total_tokens": 92},
        "outcomes": {"completed": 0, "failed": 0, "aborted": 1, "cancelled": 1},
    }
    assert body["rows"] == [attrs.asdict(DATASET[3])]


# ------------------------------------------------------------------ the query string


@pytest.mark.parametrize(
    ("query_string", "expected"),
    [
        ("", UsageQuery()),
        ("?", UsageQuery()),
        (
            "since=1700000000&until=1700000060.5",
            UsageQuery(filter=UsageFilter(since=T0, until=T0 + 60.5)),
        ),
        ("since=2023-11-14T22:13:20Z", UsageQuery(filter=UsageFilter(since=T0))),
        ("since=2023-11-14T22:13:20", UsageQuery(filter=UsageFilter(since=T0))),  # no zone: UTC
        ("since=2023-11-15T00:13:20%2B02:00", UsageQuery(filter=UsageFilter(since=T0))),
        (
            "since=2023-11-14",
            UsageQuery(filter=UsageFilter(since=T0 - 22 * 3600 - 13 * 60 - 20)),
        ),
        (
            "attribution=key%201&model=llama",
            UsageQuery(filter=UsageFilter(attribution="key 1", model="llama")),
        ),
        ("client_request_id=mine-1", UsageQuery(filter=UsageFilter(client_request_id="mine-1"))),
        ("limit=0", UsageQuery(limit=0)),
        (f"limit={MAX_QUERY_LIMIT}", UsageQuery(limit=MAX_QUERY_LIMIT)),
        ("group_by=day,key", UsageQuery(group_by=("day", "key"))),
    ],
)
def test_parse_usage_query(query_string: str, expected: UsageQuery) -> None:
    assert parse_usage_query(query_string) == expected
    assert UsageQuery() == UsageQuery(filter=UsageFilter(), limit=1000, group_by=GROUP_BY)


@pytest.mark.parametrize(
    ("query_string", "bad"),
    [
        ("since=yesterday", "since"),
        ("until=nan", "until"),
        ("until=inf", "until"),
        ("since=", "since"),
        ("model=a&model=b", "model"),
        ("modle=llama", "modle"),
        ("limit=-1", "limit"),
        ("limit=ten", "limit"),
        ("limit=1.5", "limit"),
        (f"limit={MAX_QUERY_LIMIT + 1}", "limit"),
        ("since=1700000060&until=1700000000", "until"),
    ],
)
def test_parse_usage_query_names_the_bad_parameter(query_string: str, bad: str) -> None:
    with pytest.raises(ValueError, match=f"^{bad}: "):
        parse_usage_query(query_string)


async def test_parsed_query_feeds_the_ledger(filled: UsageLedger) -> None:
    query = parse_usage_query("model=llama&since=2023-11-14T22:13:40Z&limit=1")
    report = await filled.query(query.filter, limit=query.limit)
    assert report.filter == UsageFilter(model="llama", since=T0 + 20)
    assert report.totals.attempts == 3
    assert [row.key for row in report.rows] == [("r2", 2)]


# ------------------------------------------------------------------ Hypothesis

keys = st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.integers(1, 3))
operations = st.lists(
    st.one_of(
        st.tuples(st.just("record"), keys),
        st.tuples(st.just("flush"), st.none()),
        st.tuples(st.just("yield"), st.none()),
    ),
    max_size=40,
)


@given(
    ops=operations,
    recent_keys=st.sampled_from([0, 1, 3, RECENT_KEYS]),
    max_batch=st.integers(1, 5),
)
def test_exactly_one_row_per_key(
    ops: list[tuple[str, tuple[str, int] | None]], recent_keys: int, max_batch: int
) -> None:
    """However records, flushes and writer turns interleave: the database ends with one row
    per distinct key -- the first one recorded -- and every duplicate is either refused by
    `record` or dropped at write time. With a window covering every key, `record` itself
    raises exactly for the duplicates."""

    async def scenario() -> None:
        first: dict[tuple[str, int], UsageRow] = {}
        raised: list[bool] = []
        expected_raise: list[bool] = []
        async with open_usage_ledger(
            recent_keys=recent_keys, max_batch=max_batch, batch_interval=0
        ) as ledger:
            for serial, (op, key) in enumerate(ops):
                if op == "flush":
                    await ledger.flush()
                elif op == "yield":
                    await trio.sleep(0)
                else:
                    assert key is not None
                    row = make_row(key[0], key[1], prompt_tokens=serial)
                    expected_raise.append(key in first)
                    first.setdefault(key, row)
                    try:
                        ledger.record(row)
                    except DuplicateUsageRow:
                        raised.append(True)
                    else:
                        raised.append(False)
            report = await ledger.query(limit=MAX_QUERY_LIMIT)
            stats = ledger.statistics()

        assert sorted(report.rows, key=lambda r: r.key) == sorted(
            first.values(), key=lambda r: r.key
        )
        duplicates = sum(expected_raise)
        # record() never raises for a first occurrence.
        assert not any(r and not e for r, e in zip(raised, expected_raise, strict=True))
        assert stats.duplicates_refused == sum(raised)
        assert stats.duplicates_refused + stats.duplicates_dropped == duplicates
        assert stats.rows_written == len(first)
        assert (stats.rows_pending, stats.rows_lost, stats.write_errors) == (0, 0, 0)
        if recent_keys >= len(first):
            assert raised == expected_raise
            assert stats.duplicates_dropped == 0

    trio.run(scenario)


# ------------------------------------------------------------------ logging hygiene


@pytest.fixture(autouse=True)
def _usage_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="dispatcher.usage")


_ADDED_BY_VERSION = {
    2: ("client_request_id", "route"),
    3: ("cost_usd",),
    4: ("cached_tokens", "cache_write_tokens", "reasoning_tokens"),
}
_TYPES = {"cost_usd": "REAL"}


def write_old_ledger(path: Path, version: int, row: UsageRow) -> None:
    """A ledger file of schema ``version`` (1 to 3) holding ``row``."""
    later = {c for added in _ADDED_BY_VERSION.values() for c in added}
    added = [c for v, names in _ADDED_BY_VERSION.items() if v <= version for c in names]
    columns = [c for c in attrs.fields_dict(UsageRow) if c not in later or c in added]
    with closing(sqlite3.connect(path)) as conn:
        conn.executescript(
            "CREATE TABLE usage (request_id TEXT NOT NULL, attempt INTEGER NOT NULL, "
            "model_group TEXT NOT NULL, served_model TEXT NOT NULL, provider_id TEXT NOT NULL, "
            "node_id TEXT NOT NULL, path TEXT NOT NULL, attribution TEXT, "
            "prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, "
            "usage_source TEXT NOT NULL, outcome TEXT NOT NULL, billable_to TEXT NOT NULL, "
            "queue_wait_s REAL NOT NULL, ttft_s REAL, duration_s REAL NOT NULL, "
            "ended_at REAL NOT NULL, "
            + "".join(f"{column} {_TYPES.get(column, 'TEXT')}, " for column in added)
            + f"PRIMARY KEY (request_id, attempt)); PRAGMA user_version={version};"
        )
        marks = ", ".join("?" * len(columns))
        conn.execute(
            f"INSERT INTO usage ({', '.join(columns)}) VALUES ({marks})",
            [getattr(row, c) for c in columns],
        )
        conn.commit()


async def test_a_version_1_ledger_is_migrated_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / USAGE_DB_NAME
    write_old_ledger(path, 1, make_row("old-1"))
    async with open_usage_ledger(path) as ledger:
        ledger.record(make_row("new-1", client_request_id="mine", route="/v1/chat/completions"))
        report = await ledger.query()
    assert {r.request_id for r in report.rows} == {"old-1", "new-1"}
    (new,) = [r for r in report.rows if r.request_id == "new-1"]
    assert (new.client_request_id, new.route) == ("mine", "/v1/chat/completions")
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (4,)


async def test_a_version_2_ledger_gains_the_cost_column(tmp_path: Path) -> None:
    path = tmp_path / USAGE_DB_NAME
    old = make_row("old-1")
    write_old_ledger(path, 2, old)
    async with open_usage_ledger(path) as ledger:
        ledger.record(attrs.evolve(make_row("new-1"), cost_usd=0.25))
        report = await ledger.query()
    costs = {row.request_id: row.cost_usd for row in report.rows}
    assert costs == {"old-1": None, "new-1": 0.25}
    assert report.totals.cost_usd == pytest.approx(0.25 if old.billable_to == "client" else 0.0)
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (4,)


async def test_a_version_3_ledger_gains_the_parts_of_its_counts(tmp_path: Path) -> None:
    """Schema 4 added the cached, cache-write and reasoning tokens: the rows of a file of
    schema 3 have 0 of each, the new rows what they say, and the sums count both."""
    path = tmp_path / USAGE_DB_NAME
    old = make_row("old-1", cost_usd=0.5)
    write_old_ledger(path, 3, old)
    new = make_row(
        "new-1", cost_usd=0.25, cached_tokens=6, cache_write_tokens=2, reasoning_tokens=15
    )
    async with open_usage_ledger(path) as ledger:
        ledger.record(new)
        report = await ledger.query()
        (group,) = await ledger.query_groups(group_by=())
    assert sorted(report.rows, key=lambda row: row.request_id) == [new, old]
    parts = (report.totals.cached_tokens, report.totals.cache_write_tokens)
    assert (*parts, report.totals.reasoning_tokens) == (6, 2, 15)
    assert (group.cached_tokens, group.cache_write_tokens, group.reasoning_tokens) == (6, 2, 15)
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (4,)
        assert conn.execute(
            "SELECT request_id, cached_tokens, cache_write_tokens, reasoning_tokens FROM usage "
            "ORDER BY request_id"
        ).fetchall() == [("new-1", 6, 2, 15), ("old-1", 0, 0, 0)]
    async with open_usage_ledger(path) as ledger:  # opened again: nothing more to migrate
        assert (await ledger.query()).rows == report.rows


async def test_rows_are_searchable_by_the_clients_request_id() -> None:
    async with open_usage_ledger(":memory:") as ledger:
        ledger.record(make_row("edge-1", client_request_id="reused"))
        ledger.record(make_row("edge-2", client_request_id="reused"))
        ledger.record(make_row("edge-3", client_request_id="other"))
        report = await ledger.query(parse_usage_query("client_request_id=reused").filter)
    assert sorted(r.request_id for r in report.rows) == ["edge-1", "edge-2"]
    assert report.totals.requests == 2
