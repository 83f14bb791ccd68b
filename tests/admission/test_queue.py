"""The Trio layer: parking, cancellation, timeouts and slot ownership, in virtual time."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from dispatcher.admission import (
    MODEL_LINGER_S,
    Admission,
    AdmissionError,
    ModelUnavailable,
    Needs,
    NoCapableCandidate,
    Policy,
    PolicySnapshot,
    QueueFull,
    QueueTimeout,
    Slot,
    UnknownModel,
    open_admission,
)

from .helpers import cand


@pytest.fixture
async def admission() -> AsyncIterator[Admission]:
    policy = PolicySnapshot(
        default=Policy(queue_timeout_s=30, max_queue=2, retry_after_s=3, drain_timeout_s=5),
        groups={"later": Policy()},
    )
    async with open_admission(policy) as admission:
        admission.node_joined([cand(slots=1)])
        yield admission


def depth(admission: Admission, group: str = "m") -> int:
    groups = admission.statistics().groups
    return groups[group].depth if group in groups else 0


async def hold(
    admission: Admission,
    task_status: trio.TaskStatus[Slot] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with admission.open_slot("m", Needs()) as slot:
        task_status.started(slot)
        await trio.sleep_forever()


async def test_immediate_admission(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    async with admission.open_slot("m", Needs()) as slot:
        assert slot.queue_reason == "immediate"
        assert slot.queue_wait == 0
        assert slot.candidate.node_id == "node-a"
        assert admission.statistics().in_use == 1
    assert slot.released
    assert admission.statistics().in_use == 0


async def test_parked_waiter_gets_the_released_slot(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        holder = await nursery.start(hold, admission)
        result: list[Slot] = []

        async def wait() -> None:
            async with admission.open_slot("m", Needs()) as slot:
                result.append(slot)

        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert depth(admission) == 1
        await trio.sleep(7)
        assert isinstance(holder, Slot)
        holder.release()
        nursery.cancel_scope.cancel()
    [slot] = result
    assert (slot.queue_reason, slot.queue_wait) == ("queued", 7)
    assert admission.statistics().in_use == 0


async def test_cancel_while_parked_leaves_the_queue_at_once(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, admission)
        with trio.CancelScope() as scope:
            nursery.start_soon(lambda: scope_cancel_soon(admission, scope))
            async with admission.open_slot("m", Needs()):
                pytest.fail("admitted while the slot is held")
        assert scope.cancelled_caught
        assert depth(admission) == 0
        stats = admission.statistics()
        assert (stats.in_use, stats.cancellations) == (1, 1)
        nursery.cancel_scope.cancel()
    assert admission.statistics().in_use == 0


async def scope_cancel_soon(admission: Admission, scope: trio.CancelScope) -> None:
    await trio.testing.wait_all_tasks_blocked()
    assert depth(admission) == 1
    scope.cancel(reason="client went away")


async def test_timeout_at_exactly_queue_timeout(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, admission)
        start = trio.current_time()
        with pytest.raises(QueueTimeout) as info:
            async with admission.open_slot("m", Needs()):
                pytest.fail("admitted while the slot is held")
        assert trio.current_time() - start == 30
        assert (info.value.status, info.value.retry_after, info.value.code) == (
            503,
            3,
            "queue_timeout",
        )
        assert depth(admission) == 0
        nursery.cancel_scope.cancel()


async def test_queue_full_is_immediate(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, admission)
        for _ in range(2):
            nursery.start_soon(hold, admission)
        await trio.testing.wait_all_tasks_blocked()
        assert depth(admission) == 2
        start = trio.current_time()
        with pytest.raises(QueueFull) as info:
            async with admission.open_slot("m", Needs()):
                pass
        assert trio.current_time() == start
        assert (info.value.status, info.value.retry_after) == (429, 3)
        nursery.cancel_scope.cancel()


async def test_unknown_model_and_incapable_requests_raise(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    with pytest.raises(UnknownModel) as unknown:
        async with admission.open_slot("nope", Needs()):
            pass
    assert unknown.value.status == 404
    with pytest.raises(NoCapableCandidate) as incapable:
        async with admission.open_slot("m", Needs(tools=True)):
            pass
    assert incapable.value.status == 400
    assert incapable.value.reasons == ("node-a/ollama-1: lacks capability 'tools'",)
    assert isinstance(incapable.value, AdmissionError)
    stats = admission.statistics()
    assert (stats.in_use, stats.waiting) == (0, 0)


async def test_a_model_whose_node_left_raises_model_unavailable_for_the_linger(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    """In virtual time: the model's only node leaves; 59 s later a request is refused with
    a retryable 503 (``Retry-After``) at once, without queueing; 60 s after, a 404."""
    admission.node_left("node-a", 1)
    await trio.sleep(MODEL_LINGER_S - 1)
    start = trio.current_time()
    with pytest.raises(ModelUnavailable) as unavailable:
        async with admission.open_slot("m", Needs()):
            pass
    assert trio.current_time() == start
    error = unavailable.value
    assert (error.status, error.code, error.retry_after) == (503, "model_unavailable", 2.0)
    assert "a node served it until 59 s ago" in error.message
    await trio.sleep(1)
    with pytest.raises(UnknownModel):
        async with admission.open_slot("m", Needs()):
            pass
    assert admission.statistics().rejections["model_unavailable"] == 1


async def test_node_joining_admits_a_parked_waiter(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, admission)
        got: list[Slot] = []

        async def wait() -> None:
            async with admission.open_slot("later", Needs()) as slot:
                got.append(slot)

        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert depth(admission, "later") == 1
        await trio.sleep(2)
        admission.node_joined([cand("node-b", model="later")])
        await trio.testing.wait_all_tasks_blocked()
        assert [s.candidate.node_id for s in got] == ["node-b"]
        assert got[0].queue_wait == 2
        nursery.cancel_scope.cancel()


async def test_slot_is_released_when_the_block_raises(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    with pytest.raises(ZeroDivisionError):
        async with admission.open_slot("m", Needs()):
            1 / 0  # noqa: B018
    assert admission.statistics().in_use == 0


async def test_slot_is_released_when_the_block_is_cancelled(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.move_on_after(1):
        async with admission.open_slot("m", Needs()):
            await trio.sleep_forever()
    assert admission.statistics().in_use == 0


async def test_drained_slot_stays_occupied_until_confirmed(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    async with admission.open_slot("m", Needs()) as slot:
        slot.drain()
    assert admission.statistics().draining == 1
    async with trio.open_nursery() as nursery:
        got: list[Slot] = []

        async def wait() -> None:
            async with admission.open_slot("m", Needs()) as slot:
                got.append(slot)

        nursery.start_soon(wait)
        await trio.sleep(1)
        assert got == []
        admission.confirm_drain(slot.slot_id)
    assert [s.queue_wait for s in got] == [1]
    assert admission.statistics().draining == 0


async def test_drain_timeout_frees_the_slot(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    async with admission.open_slot("m", Needs()) as slot:
        slot.drain()
    start = trio.current_time()
    async with admission.open_slot("m", Needs()) as second:
        assert trio.current_time() - start == 5
        assert second.queue_reason == "queued"
    assert admission.statistics().drains_expired == 1
    admission.confirm_drain(slot.slot_id)  # late confirmation: a no-op


async def test_early_release_makes_exit_a_no_op(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    async with admission.open_slot("m", Needs()) as slot:
        slot.release()
        assert slot.released
        slot.drain()  # too late: already released
        async with admission.open_slot("m", Needs()) as other:
            assert other.queue_reason == "immediate"
    stats = admission.statistics()
    assert (stats.in_use, stats.draining) == (0, 0)


async def test_admission_racing_a_cancel_does_not_leak_the_slot(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        holder = await nursery.start(hold, admission)
        assert isinstance(holder, Slot)
        entered: list[Slot] = []
        scope = trio.CancelScope()

        async def wait() -> None:
            with scope:
                async with admission.open_slot("m", Needs()) as slot:
                    entered.append(slot)
                    await trio.sleep_forever()

        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        # The slot is granted and the waiter cancelled in the same scheduling step.
        holder.release()
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        stats = admission.statistics()
        assert (stats.in_use, stats.waiting) == (0, 0)
        assert all(s.released for s in entered)
        nursery.cancel_scope.cancel()


async def test_policy_and_capacity_changes_reach_parked_waiters(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, admission)
        nursery.start_soon(hold, admission)
        await trio.testing.wait_all_tasks_blocked()
        assert depth(admission) == 1
        admission.capacity_changed(cand().key, 2, 0)
        await trio.testing.wait_all_tasks_blocked()
        assert (depth(admission), admission.statistics().in_use) == (0, 2)
        admission.set_policy(PolicySnapshot(default=Policy(per_candidate_cap=1)))
        assert admission.statistics().in_use == 2  # admitted requests are untouched
        admission.node_left("node-a", 1)
        assert admission.statistics().in_use == 0  # void: the node is gone
        nursery.cancel_scope.cancel()


async def test_open_slot_needs_the_driver(autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission()
    with pytest.raises(RuntimeError, match="must be running"):
        async with admission.open_slot("m", Needs()):
            pass


async def test_driver_runs_once(autojump_clock: trio.testing.MockClock) -> None:
    async with open_admission() as admission:
        with pytest.raises(RuntimeError, match="already running"):
            await admission.run()


async def test_a_failing_candidate_is_ejected_and_probed_when_its_cool_down_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b = cand("node-a"), cand("node-b")
    async with open_admission(PolicySnapshot(default=Policy(queue_timeout_s=30))) as admission:
        admission.node_joined([a, b])
        admission.report_failure(a.key)
        admission.report_failure(a.key)
        stats = admission.statistics().candidates[a.key]
        assert (stats.health, stats.consecutive_failures, stats.ejected_until) == (
            "ejected",
            2,
            5.0,
        )
        async with trio.open_nursery() as nursery:
            held = await nursery.start(hold, admission)
            assert isinstance(held, Slot)
            assert held.candidate.node_id == "node-b"  # node-a is idle but ejected
            async with admission.open_slot("m", Needs()) as probe:  # parks until 5 s
                assert trio.current_time() == 5
                assert (probe.candidate.node_id, probe.queue_wait) == ("node-a", 5)
                stats = admission.statistics().candidates[a.key]
                assert (stats.health, stats.probe_in_flight) == ("probing", True)
                admission.report_success(probe.candidate.key)
            nursery.cancel_scope.cancel()
        stats = admission.statistics().candidates[a.key]
        assert (stats.health, stats.consecutive_failures, stats.ejections) == ("healthy", 0, 0)
        assert admission.statistics().ejections == 1


async def test_a_failed_probe_ejects_again_for_twice_as_long(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_admission() as admission:
        admission.node_joined([cand()])
        admission.report_failure(cand().key)
        admission.report_failure(cand().key)
        await trio.sleep(5)  # the cool-down ends (open_slot sees it, driver tick or not)
        async with admission.open_slot("m", Needs()) as slot:
            stats = admission.statistics().candidates[cand().key]
            assert (stats.health, stats.probe_in_flight) == ("probing", True)
            admission.report_failure(slot.candidate.key)
        stats = admission.statistics().candidates[cand().key]
        assert (stats.health, stats.ejected_until, stats.ejections) == ("ejected", 15, 2)
        async with admission.open_slot("m", Needs()) as slot:  # the only one: fallback
            assert slot.queue_reason == "immediate"


async def test_wait_changed_wakes_for_what_a_node_is_told_not_for_a_slot_within_its_grant(
    admission: Admission, autojump_clock: trio.testing.MockClock
) -> None:
    """``wait_changed`` (what drives the ``demand`` reports) wakes when a request queues or
    a slot beyond the grant is freed, not when a slot is taken at once or freed within it."""
    wakes = 0

    async def count_wakes() -> None:
        nonlocal wakes
        while True:
            await admission.wait_changed()
            wakes += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(count_wakes)
        await trio.testing.wait_all_tasks_blocked()
        async with admission.open_slot("m", Needs()):
            await trio.testing.wait_all_tasks_blocked()
            assert wakes == 0  # taken at once, within the grant of 1
        await trio.testing.wait_all_tasks_blocked()
        assert wakes == 0  # freed within the grant
        holder = await nursery.start(hold, admission)
        nursery.start_soon(hold, admission)  # queues behind it
        await trio.testing.wait_all_tasks_blocked()
        assert depth(admission) == 1
        assert wakes >= 1  # (the driver's tick for the new queue deadline may wake it too)
        before = wakes
        admission.capacity_changed(cand().key, 0, 0)  # the grant drops below the slot held
        await trio.testing.wait_all_tasks_blocked()
        assert wakes > before
        assert holder.candidate.node_id == "node-a"
        nursery.cancel_scope.cancel()
