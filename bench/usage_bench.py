"""Usage section: ledger writes/s, and how the event loop fares while they happen.

For each database (a file in a temporary directory, and ``:memory:``), with the ledger's
default settings (``batch_interval`` 0.05 s, ``max_batch`` 500):

1. :data:`ROWS` distinct rows are built first (not timed), then ``record()``-ed back to back
   and ``flush()``-ed. writes/s = rows / (record + flush time). ``record()``'s own cost per
   row is given too: it runs on the event loop, so it is what a request pays.
2. During the flush a ticker task sleeps 1 ms at a time and notes how late each wake-up
   is: the writer works in a worker thread, so the loop should stay responsive (the GIL is
   shared, so lag is not zero).
3. Then one ``query()`` over all the rows (totals and the newest 1,000), as
   ``GET /v1/usage`` would make it.

``python -m bench.usage_bench`` runs this section alone.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import trio

from bench import Table, fmt_int
from dispatcher.store.ledger import open_usage_ledger
from dispatcher.store.usage import UsageRow
from dispatcher.store.usage_sqlite import USAGE_DB_NAME

TIME_LIMIT = 20.0
"""The whole section is cut off after this many seconds."""

ROWS = 50_000
TICK = 0.001
"""The ticker's sleep, seconds."""


def _rows(count: int) -> list[UsageRow]:
    now = time.time()
    return [
        UsageRow(
            request_id=f"req-{i:08d}-0123456789abcdef",
            attempt=1 + i % 2,
            model_group="llama" if i % 3 else "qwen",
            served_model="llama3.1:8b-instruct-q4_K_M",
            provider_id="ollama",
            node_id=f"node-{i % 4}",
            path="normalized" if i % 5 else "tunnel",
            attribution=f"key-{i % 10}",
            prompt_tokens=100 + i % 900,
            completion_tokens=i % 500,
            usage_source="reported" if i % 7 else "estimated",
            outcome="completed" if i % 11 else "failed",
            billable_to="client" if i % 11 else "operator",
            queue_wait_s=0.001 * (i % 50),
            ttft_s=0.05,
            duration_s=1.5,
            ended_at=now + i * 0.001,
        )
        for i in range(count)
    ]


class _Ticker:
    """Sleeps :data:`TICK` at a time and records how late each wake-up was."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.running = False

    async def run(self) -> None:
        while True:
            start = trio.current_time()
            await trio.sleep(TICK)
            if self.running:
                self.lags.append(trio.current_time() - start - TICK)


def _percentile(values: Sequence[float], fraction: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def _measure(label: str, path: str | Path) -> list[str]:
    rows = _rows(ROWS)
    ticker = _Ticker()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker.run)
        async with open_usage_ledger(path) as ledger:
            start = time.perf_counter()
            for row in rows:
                ledger.record(row)
            recorded = time.perf_counter()
            await trio.sleep(0)  # the ticker's wake-up that waited for the loop above
            ticker.running = True
            await ledger.flush()
            flushed = time.perf_counter()
            ticker.running = False
            stats = ledger.statistics()
            if stats.rows_written != ROWS:
                raise RuntimeError(f"{label}: {stats.rows_written} of {ROWS} rows written")
            query_start = time.perf_counter()
            report = await ledger.query()
            query_s = time.perf_counter() - query_start
            if report.totals.attempts != ROWS:
                raise RuntimeError(f"{label}: query found {report.totals.attempts} rows")
        nursery.cancel_scope.cancel()
    record_s = recorded - start
    total_s = flushed - start
    return [
        label,
        fmt_int(ROWS / total_s),
        f"{record_s / ROWS * 1e6:.2f}",
        f"{(flushed - recorded) * 1e3:.0f}",
        str(stats.batches),
        f"{_percentile(ticker.lags, 0.99) * 1e3:.1f} / {max(ticker.lags, default=0) * 1e3:.1f}",
        f"{query_s * 1e3:.0f}",
    ]


async def run() -> Sequence[Table]:
    table = Table(
        title=f"usage ledger: record {ROWS:,} rows, then flush",
        columns=[
            "database",
            "writes/s",
            "record() µs/row",
            "flush ms",
            "batches",
            "loop lag p99/max ms",
            "query ms",
        ],
        notes=[
            "writes/s: rows / (record() of all + flush()), default batch_interval and "
            "max_batch (500 rows per transaction); rows built beforehand",
            "record(): synchronous, on the event loop; the writes run in a worker thread",
            f"loop lag: lateness of a {TICK * 1e3:g} ms sleep on the event loop while the "
            "writer works (during flush)",
            "query: totals over every row plus the newest 1,000 rows (GET /v1/usage)",
        ],
    )
    with tempfile.TemporaryDirectory(prefix="usage-bench-") as directory:
        table.rows.append(await _measure("file (WAL)", Path(directory) / USAGE_DB_NAME))
    table.rows.append(await _measure(":memory:", ":memory:"))
    return [table]


if __name__ == "__main__":
    from bench import render

    for result in trio.run(run):
        print(render(result))
