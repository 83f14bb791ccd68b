"""The node link's send lock (``nodes.agent._SendTurn``): a free turn is taken without a
schedule point (the send under it has its own), a cancelled task never takes one, and turns
that meet are served one at a time, in order."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from nodes.agent import _SendTurn


async def test_a_free_turn_is_taken_without_a_schedule_point() -> None:
    turn = _SendTurn()
    ran: list[str] = []

    async def other() -> None:
        ran.append("other")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)  # runs at this task's next schedule point
        async with turn:
            assert ran == []  # trio.Lock would have let the other task run here
        await trio.testing.wait_all_tasks_blocked()
        assert ran == ["other"]


async def test_a_cancelled_task_does_not_take_its_turn() -> None:
    turn = _SendTurn()
    reached = False
    with trio.CancelScope() as scope:
        scope.cancel()
        async with turn:
            reached = True
    assert not reached
    assert scope.cancelled_caught
    async with turn:  # still free
        pass


async def test_turns_that_meet_are_served_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    turn = _SendTurn()
    log: list[str] = []

    async def send(name: str, hold: float) -> None:
        async with turn:
            log.append(f"{name} in")
            await trio.sleep(hold)
            log.append(f"{name} out")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send, "a", 1.0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(send, "b", 0.0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(send, "c", 0.0)
    assert log == ["a in", "a out", "b in", "b out", "c in", "c out"]


async def test_a_turn_is_given_back_when_its_block_raises() -> None:
    turn = _SendTurn()
    with pytest.raises(ValueError, match="boom"):
        async with turn:
            raise ValueError("boom")
    with trio.fail_after(1):
        async with turn:
            pass
