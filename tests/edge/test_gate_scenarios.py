"""The gate in virtual time over scripted in-memory nodes: deadlines, first-token timeouts,
and a Hypothesis scenario test of random failure points and client cancels."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from dispatcher import wire
from dispatcher.admission import Needs, NoCapableCandidate
from dispatcher.config import EdgeConfig, NodeSettings, QueuePolicySettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.gate.attempts import AllAttemptsFailed, Answer, GateRequest
from dispatcher.gate.pool import DispatchRequest
from dispatcher.shared.transport import ConnectionClosed
from dispatcher.store.usage import UsageRow

from .fakes import ScriptedNode, connect, hello, wait_until

BODY = {"model": "m", "messages": [{"role": "user", "content": "a b c"}]}


@asynccontextmanager
async def open_gate_dispatcher(**policy: Any) -> AsyncIterator[tuple[Dispatcher, list[UsageRow]]]:
    config = EdgeConfig(
        local_node=False,
        nodes=NodeSettings(heartbeat_interval=1000, heartbeat_timeout=3000),
        admission=QueuePolicySettings(**policy),
    )
    rows: list[UsageRow] = []
    async with open_dispatcher(config) as d:
        d.gate.record_usage = rows.append
        yield d, rows


def request(request_id: str = "r", *, stream: bool = True) -> GateRequest:
    return GateRequest(
        request_id=request_id, dispatch=DispatchRequest(model="m", body=BODY), stream=stream
    )


async def test_request_deadline_covers_queue_waits(autojump_clock: trio.testing.MockClock) -> None:
    async with open_gate_dispatcher(request_timeout_s=10, queue_timeout_s=100) as (d, rows):
        node = await connect(d, hello(slots=1))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node.answer_pings)
            async with d.open_run(d_spec()):  # holds the only slot
                start = trio.current_time()
                with pytest.raises(AllAttemptsFailed) as info:
                    async with d.gate.open(request()):
                        pytest.fail("answered while the only slot was held")
                assert trio.current_time() - start == pytest.approx(10)
            nursery.cancel_scope.cancel()
    assert info.value.code == "request_timeout"
    assert info.value.status == 502
    assert rows == []  # never dispatched


def d_spec() -> Any:
    from dispatcher.paths.runs import RunSpec

    return RunSpec(model="m", body=BODY)


async def test_first_token_timeout_moves_to_the_next_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_gate_dispatcher(first_token_timeout_s=3, max_attempts=3) as (d, rows):
        silent = await connect(d, hello("silent", slots=1))
        good = await connect(d, hello("good", slots=1))
        async with trio.open_nursery() as nursery:

            async def serve_good() -> None:
                run = await good.receive_run()
                await good.emit(run.run_id, ("run.delta", {"text": "hello"}), ("run.completed", {}))

            async def serve_silent() -> None:
                run = await silent.receive_run()
                cancel = await silent.receive()
                assert isinstance(cancel, wire.RunCancel)
                await silent.send(wire.RunCancelled(run_id=run.run_id, seq=0))

            nursery.start_soon(serve_good)
            nursery.start_soon(serve_silent)
            # Force the first attempt onto the silent node.
            first = request()
            first = attrs.evolve(
                first,
                dispatch=attrs.evolve(
                    first.dispatch, predicate=lambda c: None if c.node_id == "silent" else "busy"
                ),
            )
            start = trio.current_time()
            with pytest.raises(NoCapableCandidate) as info:
                async with d.gate.open(first):
                    pass
            # The predicate leaves only "silent": after its first-token timeout the recovery
            # admission finds no other capable candidate, the same 400 as a first admission.
            assert trio.current_time() - start == pytest.approx(3)
            assert "silent/p1: already failed for this request" in str(info.value)
            assert "good/p1: busy" in str(info.value)
            async with d.gate.open(request("second")) as answer:
                assert isinstance(answer, Answer)
                assert answer.result.node_id == "good"
                rest = [event async for event in answer]
            assert isinstance(rest[-1], wire.RunCompleted)
            nursery.cancel_scope.cancel()
    assert [(r.request_id, r.node_id, r.outcome) for r in rows] == [
        ("r", "silent", "aborted"),
        ("second", "good", "completed"),
    ]


# --------------------------------------------------------------------------- scenarios

Behaviour = tuple[str, int]
"""(kind, tokens): what a node does with one run request.

kinds: ``complete`` after ``tokens`` deltas; ``fail`` (retryable) after ``tokens`` deltas;
``stall`` after ``tokens`` deltas (until cancelled); ``drop`` the connection after ``tokens``
deltas."""

behaviours = st.tuples(
    st.sampled_from(["complete", "fail", "stall", "drop"]), st.integers(min_value=0, max_value=3)
)


@attrs.define
class NodeScript:
    node: ScriptedNode
    plan: list[Behaviour]
    cancels: dict[str, int] = attrs.field(factory=dict)
    requests: list[str] = attrs.field(factory=list)


async def play(script: NodeScript) -> None:
    """Answer run requests by the plan; confirm cancels; count what the edge sent."""
    node = script.node
    running: dict[str, trio.CancelScope] = {}

    async def run(request: wire.RunRequest, behaviour: Behaviour, scope: trio.CancelScope) -> None:
        kind, tokens = behaviour
        with scope, contextlib.suppress(ConnectionClosed):
            seq = 0
            for i in range(tokens):
                await trio.sleep(0.5)
                await node.send(wire.RunDelta(run_id=request.run_id, seq=seq, text=f"t{i} "))
                seq += 1
            await trio.sleep(0.5)
            if kind == "complete":
                await node.send(wire.RunCompleted(run_id=request.run_id, seq=seq))
            elif kind == "fail":
                await node.send(
                    wire.RunFailed(
                        run_id=request.run_id, seq=seq, code="x", message="boom", retryable=True
                    )
                )
            elif kind == "drop":
                await node.conn.aclose()
            else:
                await trio.sleep_forever()
        running.pop(request.run_id, None)

    async with trio.open_nursery() as nursery:
        while True:
            try:
                message = await node.receive()
                if isinstance(message, wire.RunRequest):
                    script.requests.append(message.run_id)
                    behaviour = script.plan.pop(0) if script.plan else ("complete", 1)
                    scope = running[message.run_id] = trio.CancelScope()
                    nursery.start_soon(run, message, behaviour, scope)
                elif isinstance(message, wire.RunCancel):
                    script.cancels[message.run_id] = script.cancels.get(message.run_id, 0) + 1
                    to_cancel = running.pop(message.run_id, None)
                    if to_cancel is not None:
                        to_cancel.cancel()
                    await node.send(wire.RunCancelled(run_id=message.run_id, seq=99))
            except ConnectionClosed:
                break
        nursery.cancel_scope.cancel()


@given(
    plans=st.lists(st.lists(behaviours, max_size=4), min_size=2, max_size=3),
    stream=st.booleans(),
    cancel_at=st.none() | st.floats(min_value=0, max_value=6),
    max_attempts=st.integers(min_value=1, max_value=4),
)
def test_gate_scenarios(
    plans: list[list[Behaviour]], stream: bool, cancel_at: float | None, max_attempts: int
) -> None:
    trio.run(
        _scenario,
        plans,
        stream,
        cancel_at,
        max_attempts,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )


async def _scenario(
    plans: list[list[Behaviour]], stream: bool, cancel_at: float | None, max_attempts: int
) -> None:
    policy = {
        "max_attempts": max_attempts,
        "first_token_timeout_s": 4.0,
        "stall_timeout_s": 4.0,
        "request_timeout_s": 60.0,
        "queue_timeout_s": 30.0,
        "drain_timeout_s": 5.0,
    }
    async with open_gate_dispatcher(**policy) as (d, rows):
        scripts = []
        for i, plan in enumerate(plans):
            node = await connect(d, hello(f"n{i}", slots=1))
            scripts.append(NodeScript(node, list(plan)))
        commits: list[Answer] = []
        received: list[wire.RunEvent] = []
        outcome: list[str] = []
        async with trio.open_nursery() as nursery:
            for script in scripts:
                nursery.start_soon(play, script)

            async def client() -> None:
                with trio.move_on_after(math.inf if cancel_at is None else cancel_at):
                    try:
                        async with d.gate.open(request(stream=stream)) as answer:
                            assert isinstance(answer, Answer)
                            commits.append(answer)
                            received.extend(answer.head)
                            async for event in answer:
                                received.append(event)
                        outcome.append("answered")
                    except AllAttemptsFailed:
                        outcome.append("failed")
                    return
                outcome.append("cancelled")

            await client()
            # Let drains settle (cancel confirmations or the drain deadline).
            await wait_until(
                lambda: (
                    (d.admission.statistics().in_use, d.admission.statistics().draining) == (0, 0)
                ),
                timeout=60,
            )
            nursery.cancel_scope.cancel()

        stats = d.admission.statistics()
        assert (stats.in_use, stats.draining, stats.waiting) == (0, 0, 0)
        for session in d.registry.sessions.values():
            assert session.runs == {}
        assert len(outcome) == 1
        # At most one commit, and what the client got came from that attempt only.
        assert len(commits) <= 1
        if commits:
            answer = commits[0]
            assert all(event.run_id == answer.run.run_id for event in received)
            head = answer.head
            if stream:
                # The first content, or the end of a run that produced none.
                last = head[-1]
                assert isinstance(last, wire.RunCompleted) or (
                    isinstance(last, wire.RunDelta) and last.text
                )
            else:
                assert isinstance(head[-1], wire.RunCompleted)
            assert answer.attempts <= max_attempts
        # Abort at most once per attempt; never after a clean end.
        dispatched = [run_id for s in scripts for run_id in s.requests]
        for script in scripts:
            assert all(count == 1 for count in script.cancels.values())
        assert len(dispatched) <= max_attempts
        # Exactly one usage row per dispatched attempt (an abandoned run's row is written
        # when its node confirms the cancel, so give those a moment).
        await wait_until(lambda: len(rows) >= len(dispatched), timeout=30)
        assert len(rows) == len(dispatched)
        assert len({(r.request_id, r.attempt) for r in rows}) == len(rows)
        assert sum(r.billable_to == "client" for r in rows) == len(commits)


async def test_client_leaving_between_admission_and_dispatch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Cancelled while admitted (a slot held, the per-attempt hook running, nothing sent):
    the slot is released, the node never hears of the run, and there is no usage row."""
    async with open_gate_dispatcher() as (d, rows):
        node = await connect(d, hello(slots=1))
        in_hook = trio.Event()

        async def slow_hook(number: int, candidate: Any, spec: Any) -> Any:
            in_hook.set()
            await trio.sleep_forever()

        gated = attrs.evolve(request(), prepare=slow_hook)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node.answer_pings)
            with trio.move_on_after(5) as client:
                async with d.gate.open(gated):
                    pytest.fail("dispatched despite the hook never returning")
            assert client.cancelled_caught
            assert in_hook.is_set()
            nursery.cancel_scope.cancel()
        stats = d.admission.statistics()
        assert (stats.in_use, stats.draining, stats.waiting) == (0, 0, 0)
        assert sum(stats.admissions.values()) == 1
    assert not [m for m in node.seen if isinstance(m, wire.RunRequest)]
    assert rows == []


async def test_per_attempt_hook_is_called_fresh_for_every_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_gate_dispatcher(max_attempts=3) as (d, rows):
        bad = await connect(d, hello("bad", slots=1))
        good = await connect(d, hello("good", slots=1))
        calls: list[tuple[int, str]] = []

        async def hook(number: int, candidate: Any, spec: Any) -> Any:
            calls.append((number, candidate.node_id))
            return attrs.evolve(spec, body={**spec.body, "x-attempt": number})

        async def serve(node: ScriptedNode, fail: bool) -> None:
            run = await node.receive_run()
            assert run.body["x-attempt"] == (1 if fail else 2)
            if fail:
                await node.emit(
                    run.run_id, ("run.failed", {"code": "x", "message": "no", "retryable": True})
                )
            else:
                await node.emit(run.run_id, ("run.delta", {"text": "ok"}), ("run.completed", {}))

        first = attrs.evolve(
            request(),
            prepare=hook,
            dispatch=attrs.evolve(
                request().dispatch,
                predicate=lambda c: None if c.node_id == "bad" or calls else "not yet",
            ),
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, bad, True)
            nursery.start_soon(serve, good, False)
            async with d.gate.open(first) as answer:
                assert isinstance(answer, Answer)
                assert answer.attempts == 2
                _ = [event async for event in answer]
    assert calls == [(1, "bad"), (2, "good")]
    assert [(r.attempt, r.outcome) for r in rows] == [(1, "aborted"), (2, "completed")]


async def test_a_tunnel_candidate_is_skipped_by_a_request_that_cannot_use_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request without a tunnel call (an embedded normalized run) that admission places on
    a tunnel candidate moves on to another candidate; nothing was dispatched there."""
    async with open_gate_dispatcher(max_attempts=2) as (d, rows):
        tunnel_only = attrs.evolve(
            hello("tunnel-node"),
            providers=(
                wire.ProviderInfo(
                    id="vllm",
                    type="openai",
                    adapter="openai",
                    path="tunnel",
                    models=(wire.ModelInfo(name="m", served_name="m", slots=1),),
                ),
            ),
        )
        tunnel_node = await connect(d, tunnel_only)
        runner = await connect(d, hello("runner", slots=2))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tunnel_node.answer_pings)
            # Load the normalized node to 1 of 2 slots: the idle tunnel candidate is the
            # least loaded, so the first attempt lands there.
            pinned = attrs.evolve(
                d_spec(),
                needs=Needs(predicate=lambda c: None if c.node_id == "runner" else "pinned"),
            )
            async with d.open_run(pinned):
                held = await runner.receive_run()

                async def serve() -> None:
                    run = await runner.receive_run()
                    await runner.emit(
                        run.run_id, ("run.delta", {"text": "hi"}), ("run.completed", {})
                    )

                nursery.start_soon(serve)
                async with d.gate.open(request(stream=False)) as answer:
                    assert isinstance(answer, Answer)
                    assert answer.attempts == 2
                    assert answer.result.node_id == "runner"
                await runner.emit(held.run_id, ("run.completed", {}))
            nursery.cancel_scope.cancel()
    assert d.gate.statistics.get("attempt_failed:tunnel_unsupported") == 1
    assert [(r.node_id, r.attempt) for r in rows] == [("runner", 2)]
