"""Counting the schedule points of the code under test, with a task beside it that runs at
each one (it checkpoints in a loop)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio


async def ticks_seen(calls: int, call: Callable[[], Awaitable[object]]) -> list[int]:
    """Await ``call()`` ``calls`` times in a row, a ticker task running beside; the ticker's
    count after each call. The count moves only where a call was a schedule point."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    seen: list[int] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.lowlevel.checkpoint()  # the ticker starts
        for _ in range(calls):
            await call()
            seen.append(ticks)
        nursery.cancel_scope.cancel()
    return seen
