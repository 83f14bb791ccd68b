"""Model fallbacks in the gate's recovery: the decision as a pure function driven by
Hypothesis (``rules.recovery``), then the gate in virtual time over scripted in-memory nodes
-- a fallback group serves when every candidate of the first failed or none had a slot within
its queue timeout, never after the commit, never after a final failure, never one the key may
not use; one usage row per dispatched attempt, each naming the group that ran it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
import trio.testing
from hypothesis import event, given
from hypothesis import strategies as st

from dispatcher import wire
from dispatcher.admission import QueueTimeout, UnknownModel
from dispatcher.config import EdgeConfig, NodeSettings, QueuePolicySettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.gate import rules
from dispatcher.gate.attempts import AllAttemptsFailed, Answer, GateRequest
from dispatcher.gate.pool import DispatchRequest
from dispatcher.store.usage import UsageRow

from .fakes import ScriptedNode, connect, hello, wait_until
from .test_gate_scenarios import Behaviour, NodeScript, behaviours, play

# --------------------------------------------------------------------------- the decision

FAILURES = st.builds(
    rules.Failure, st.sampled_from(["upstream_5xx", "node_lost", "request_timeout"]), st.booleans()
)
NO_SLOTS = st.builds(rules.NoSlot, st.booleans(), st.booleans()).map(
    lambda refusal: attrs.evolve(refusal, only_excluded=refusal.incapable and refusal.only_excluded)
)
ENDS = st.one_of(FAILURES, NO_SLOTS)


@given(
    ended=ENDS,
    tries=st.integers(0, 6),
    max_attempts=st.integers(1, 6),
    failed_before=st.booleans(),
)
def test_without_fallbacks_recovery_is_what_the_gate_did_before(
    ended: rules.Failure | rules.NoSlot, tries: int, max_attempts: int, failed_before: bool
) -> None:
    """No fallback left on the first group: exactly the retry rule and the admission rule."""
    step = rules.recovery(
        ended,
        tries=tries,
        max_attempts=max_attempts,
        fallback_left=False,
        failed_before=failed_before or isinstance(ended, rules.Failure),
        first_group=True,
    )
    if isinstance(ended, rules.Failure):
        assert step == rules.after_failure(ended, attempt=tries, max_attempts=max_attempts)
    else:
        assert step == rules.after_admission_error(
            failed_before=failed_before,
            incapable=ended.incapable,
            only_excluded=ended.only_excluded,
        )


@given(
    groups=st.lists(
        st.tuples(st.integers(1, 4), st.lists(ENDS, min_size=1, max_size=6)),
        min_size=1,
        max_size=4,
    )
)
def test_the_gate_loop_over_groups(
    groups: list[tuple[int, list[rules.Failure | rules.NoSlot]]],
) -> None:
    """Replay the gate's loop (one ``rules.recovery`` per end, each group its own script of
    ends and its own ``max_attempts``) and check what it may never do: retry a group past its
    attempts or after a final failure, fall back after a final failure or past the last
    group, raise an admission's refusal once an attempt failed (unless the first group itself
    cannot serve the request), or try a group twice."""
    failed_before = False
    tried: list[int] = []
    final: rules.Recovery | None = None
    for position, (max_attempts, ends) in enumerate(groups):
        tried.append(position)
        tries = 0
        for ended in ends:
            if isinstance(ended, rules.Failure):
                tries += 1
                failed_before = True
            step = rules.recovery(
                ended,
                tries=tries,
                max_attempts=max_attempts,
                fallback_left=position + 1 < len(groups),
                failed_before=failed_before,
                first_group=position == 0,
            )
            if step == "retry":
                assert isinstance(ended, rules.Failure)
                assert ended.retryable
                assert tries < max_attempts
                continue
            if step == "fall_back":
                assert position + 1 < len(groups)
                assert not isinstance(ended, rules.Failure) or ended.retryable
            if step == "raise":
                first_cannot = (
                    position == 0 and isinstance(ended, rules.NoSlot) and ended.incapable
                ) and not ended.only_excluded
                assert not failed_before or first_cannot
            if step in ("give_up", "raise"):
                final_failure = isinstance(ended, rules.Failure) and not ended.retryable
                assert final_failure or position + 1 == len(groups)
            final = step
            break
        else:
            final = "retry"  # the script ran out while retrying: the request goes on
        if final != "fall_back":
            break
    assert tried == list(range(len(tried)))  # in order, each once
    assert final is not None


# --------------------------------------------------------------------------- the gate

BODY = {"model": "a", "messages": [{"role": "user", "content": "a b c"}]}


@asynccontextmanager
async def open_fallback_dispatcher(
    **models: QueuePolicySettings,
) -> AsyncIterator[tuple[Dispatcher, list[UsageRow]]]:
    config = EdgeConfig(
        local_node=False,
        nodes=NodeSettings(heartbeat_interval=1000, heartbeat_timeout=3000),
        admission=QueuePolicySettings(queue_timeout_s=30, first_token_timeout_s=10),
        models=models,
    )
    rows: list[UsageRow] = []
    async with open_dispatcher(config) as d:
        d.gate.record_usage = rows.append
        yield d, rows


def request(
    model: str = "a",
    *,
    stream: bool = True,
    may_use: Callable[[str], bool] | None = None,
) -> GateRequest:
    return GateRequest(
        request_id="r",
        dispatch=DispatchRequest(model=model, body={**BODY, "model": model}),
        stream=stream,
        may_use=may_use,
    )


async def fail(node: ScriptedNode, *, retryable: bool = True) -> None:
    """Fail the next run the node gets before anything of it was sent."""
    run = await node.receive_run()
    await node.send(
        wire.RunFailed(
            run_id=run.run_id,
            seq=0,
            code="upstream_5xx",
            message="the provider answered HTTP 500",
            retryable=retryable,
        )
    )


async def answer(node: ScriptedNode, text: str = "served") -> None:
    run = await node.receive_run()
    await node.emit(run.run_id, ("run.delta", {"text": text}), ("run.completed", {}))


def groups_of(rows: list[UsageRow]) -> list[tuple[int, str, str, str]]:
    return sorted((r.attempt, r.model_group, r.outcome, r.billable_to) for r in rows)


async def test_a_fallback_serves_when_every_candidate_of_the_group_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    models = {"a": QueuePolicySettings(fallbacks=("b",)), "b": QueuePolicySettings()}
    async with open_fallback_dispatcher(**models) as (d, rows):
        first = await connect(d, hello("node-a", model="a"))
        backup = await connect(d, hello("node-b", model="b"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail, first)
            nursery.start_soon(answer, backup)
            async with d.gate.open(request()) as got:
                assert isinstance(got, Answer)
                assert got.result.model_group == "b"
                assert got.result.node_id == "node-b"
                assert got.attempts == 2
                events = [*got.head, *[event async for event in got]]
            nursery.cancel_scope.cancel()
        assert isinstance(events[-1], wire.RunCompleted)
        await wait_until(lambda: len(rows) == 2)
    assert groups_of(rows) == [(1, "a", "aborted", "operator"), (2, "b", "completed", "client")]


async def test_a_fallback_serves_when_no_candidate_had_a_slot_within_the_queue_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``a`` is configured and served by no node: its request waits out ``a``'s queue
    timeout, then ``b`` serves it as the first attempt (nothing was dispatched on ``a``)."""
    models = {
        "a": QueuePolicySettings(fallbacks=("b",), queue_timeout_s=5),
        "b": QueuePolicySettings(),
    }
    async with open_fallback_dispatcher(**models) as (d, rows):
        backup = await connect(d, hello("node-b", model="b"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer, backup)
            start = trio.current_time()
            async with d.gate.open(request()) as got:
                assert got.result.model_group == "b"
                assert got.attempts == 1
                assert trio.current_time() - start == pytest.approx(5)
                assert isinstance(got, Answer)
                assert [event async for event in got]
            nursery.cancel_scope.cancel()
        await wait_until(lambda: len(rows) == 1)
    assert groups_of(rows) == [(1, "b", "completed", "client")]


async def test_fallbacks_follow_their_own_fallbacks_and_each_group_has_its_attempts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``a`` (one attempt) falls back to ``b``, whose fallback ``c`` comes next: ``a``'s
    second node is never tried, ``b``'s candidates are, and ``c`` serves."""
    models = {
        "a": QueuePolicySettings(fallbacks=("b",), max_attempts=1),
        "b": QueuePolicySettings(fallbacks=("c",), max_attempts=3),
        "c": QueuePolicySettings(),
    }
    async with open_fallback_dispatcher(**models) as (d, rows):
        a1 = await connect(d, hello("a1", model="a"))
        a2 = await connect(d, hello("a2", model="a"))
        b1 = await connect(d, hello("b1", model="b"))
        c1 = await connect(d, hello("c1", model="c"))
        assert d.gate.policy_for("a").fallbacks == ("b", "c")
        async with trio.open_nursery() as nursery:
            # a1 or a2 gets the first attempt (whichever admission picks); the other is idle
            nursery.start_soon(fail, a1)
            nursery.start_soon(fail, a2)
            nursery.start_soon(fail, b1)
            nursery.start_soon(answer, c1)
            async with d.gate.open(request()) as got:
                assert got.result.model_group == "c"
                assert got.attempts == 3
                assert isinstance(got, Answer)
                assert [event async for event in got]
            nursery.cancel_scope.cancel()
        await wait_until(lambda: len(rows) == 3)
    assert groups_of(rows) == [
        (1, "a", "aborted", "operator"),
        (2, "b", "aborted", "operator"),
        (3, "c", "completed", "client"),
    ]


async def test_no_fallback_after_the_commit(autojump_clock: trio.testing.MockClock) -> None:
    """The stream started on ``a``, then failed: the client gets the explicit error event,
    ``b`` is never asked."""
    models = {"a": QueuePolicySettings(fallbacks=("b",)), "b": QueuePolicySettings()}
    async with open_fallback_dispatcher(**models) as (d, rows):
        first = await connect(d, hello("node-a", model="a"))
        backup = await connect(d, hello("node-b", model="b"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(backup.answer_pings)

            async def fail_midway() -> None:
                run = await first.receive_run()
                await first.emit(
                    run.run_id,
                    ("run.delta", {"text": "half "}),
                    ("run.failed", {"code": "upstream_disconnected", "message": "cut"}),
                )

            nursery.start_soon(fail_midway)
            async with d.gate.open(request()) as got:
                assert isinstance(got, Answer)
                assert got.result.model_group == "a"
                events = [*got.head, *[event async for event in got]]
            nursery.cancel_scope.cancel()
        await wait_until(lambda: len(rows) == 1)
    assert isinstance(events[0], wire.RunDelta)
    assert isinstance(events[-1], wire.RunFailed)
    assert not any(isinstance(m, wire.RunRequest) for m in backup.seen)
    assert groups_of(rows) == [(1, "a", "failed", "client")]


@pytest.mark.parametrize("why", ["final failure", "the key may not use it"])
async def test_no_fallback_after_a_final_failure_nor_to_a_group_the_key_may_not_use(
    autojump_clock: trio.testing.MockClock, why: str
) -> None:
    models = {"a": QueuePolicySettings(fallbacks=("b",)), "b": QueuePolicySettings()}
    async with open_fallback_dispatcher(**models) as (d, rows):
        first = await connect(d, hello("node-a", model="a"))
        backup = await connect(d, hello("node-b", model="b"))
        final = why == "final failure"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(backup.answer_pings)
            nursery.start_soon(lambda: fail(first, retryable=not final))
            with pytest.raises(AllAttemptsFailed) as failed:
                async with d.gate.open(request(may_use=None if final else "a".__eq__)):
                    pytest.fail("answered")
            nursery.cancel_scope.cancel()
        await wait_until(lambda: len(rows) == 1)
    assert failed.value.code == "upstream_5xx"
    assert not any(isinstance(m, wire.RunRequest) for m in backup.seen)
    assert groups_of(rows) == [(1, "a", "aborted", "operator")]


async def test_when_no_group_had_a_slot_the_first_groups_refusal_stands(
    autojump_clock: trio.testing.MockClock,
) -> None:
    models = {
        "a": QueuePolicySettings(fallbacks=("b",), queue_timeout_s=5),
        "b": QueuePolicySettings(queue_timeout_s=7),
    }
    async with open_fallback_dispatcher(**models) as (d, rows):
        start = trio.current_time()
        with pytest.raises(QueueTimeout) as refused:
            async with d.gate.open(request()):
                pytest.fail("answered")
        assert trio.current_time() - start == pytest.approx(12)  # a's wait, then b's
    assert "'a'" in str(refused.value)
    assert rows == []


# --------------------------------------------------------------------------- random scenarios

GROUP_NAMES = ("a", "b", "c")


@given(
    plans=st.lists(
        st.lists(st.lists(behaviours, max_size=3), min_size=1, max_size=2),
        min_size=2,
        max_size=3,
    ),
    max_attempts=st.lists(st.integers(1, 3), min_size=3, max_size=3),
    stream=st.booleans(),
)
def test_fallback_scenarios(
    plans: list[list[list[Behaviour]]], max_attempts: list[int], stream: bool
) -> None:
    """Groups ``a -> b (-> c)``, each served by one or two scripted nodes that complete,
    fail, stall or drop their connection at random points: at most one commit; one row per
    dispatched attempt, numbered from 1; the groups' rows in fallback order, none past a
    group's ``max_attempts``, none after the committed one; every slot released."""
    trio.run(
        _fallback_scenario,
        plans,
        max_attempts,
        stream,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )


async def _fallback_scenario(
    plans: list[list[list[Behaviour]]], max_attempts: list[int], stream: bool
) -> None:
    names = GROUP_NAMES[: len(plans)]
    models = {
        name: QueuePolicySettings(
            fallbacks=names[index + 1 : index + 2],
            max_attempts=max_attempts[index],
            queue_timeout_s=5,
            first_token_timeout_s=4,
            stall_timeout_s=4,
            drain_timeout_s=5,
        )
        for index, name in enumerate(names)
    }
    async with open_fallback_dispatcher(**models) as (d, rows):
        scripts = [
            NodeScript(await connect(d, hello(f"{name}{i}", model=name)), list(plan))
            for name, group_plans in zip(names, plans, strict=True)
            for i, plan in enumerate(group_plans)
        ]
        commits: list[Answer] = []
        async with trio.open_nursery() as nursery:
            for script in scripts:
                nursery.start_soon(play, script)
            try:
                async with d.gate.open(request(stream=stream)) as got:
                    assert isinstance(got, Answer)
                    commits.append(got)
                    async for _ in got:
                        pass
            except (AllAttemptsFailed, QueueTimeout, UnknownModel):
                pass
            await wait_until(
                lambda: (
                    (d.admission.statistics().in_use, d.admission.statistics().draining) == (0, 0)
                ),
                timeout=120,
            )
            dispatched = sum(len(script.requests) for script in scripts)
            await wait_until(lambda: len(rows) >= dispatched, timeout=60)
            nursery.cancel_scope.cancel()
    assert len(commits) <= 1
    event(f"served by {commits[0].result.model_group if commits else 'none'}")
    assert len(rows) == dispatched
    ordered = sorted(rows, key=lambda row: row.attempt)
    assert [row.attempt for row in ordered] == list(range(1, len(rows) + 1))
    positions = [names.index(row.model_group) for row in ordered]
    assert positions == sorted(positions)  # a's attempts, then b's, then c's
    for index in range(len(names)):
        assert positions.count(index) <= max_attempts[index]
    assert sum(row.billable_to == "client" for row in rows) == len(commits)
    if commits:
        (answer,) = commits
        assert ordered[-1].model_group == answer.result.model_group  # nothing after it
        assert ordered[-1].attempt == answer.attempts
