"""Hypothesis-generated scenarios for the Trio layer, each run under ``trio.run`` in virtual
time: requests that open a slot and hold it for a while (and may drain it, release it early,
or be cancelled at any point), nodes that join, leave, rejoin and change capacity.

Some requests report how their attempt went (success or a candidate-caused failure) before
leaving the block, as the gate does, so candidates get ejected, probed and restored.

Afterwards nothing may be in use, draining or queued, no probe is left in flight, every
task has finished, and each request ended exactly one way. Along the way, every admission
must be to the node's current session and within the candidate's slots.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Literal

import attrs
import trio
import trio.testing
from hypothesis import event, given
from hypothesis import strategies as st

from dispatcher.admission import (
    AdmissionError,
    CandidateKey,
    Needs,
    Policy,
    PolicySnapshot,
    open_admission,
)

from .helpers import cand

NODES = ("n1", "n2")
POLICY = PolicySnapshot(
    default=Policy(max_queue=4, queue_timeout_s=6, drain_timeout_s=2, retry_after_s=1),
    groups={
        "m": Policy(
            max_queue=4, queue_timeout_s=6, drain_timeout_s=2, eject_base_s=2, eject_max_s=4
        )
    },
)
times = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 5.0, 8.0])


@attrs.frozen
class Request:
    at: float
    model: str
    needs: Needs
    hold: float
    cancel_after: float | None
    drain: bool
    confirm_after: float | None
    release_early: bool
    report: Literal["success", "failure"] | None = None


@attrs.frozen
class Join:
    at: float
    node: str
    slots: int
    tools: bool


@attrs.frozen
class Leave:
    at: float
    node: str


@attrs.frozen
class Capacity:
    at: float
    node: str
    slots: int


requests = st.builds(
    Request,
    at=times,
    model=st.sampled_from(["m"] * 7 + ["nope"]),
    needs=st.sampled_from([Needs(), Needs(), Needs(tools=True), Needs(session_id="s")]),
    hold=times,
    cancel_after=st.one_of(st.none(), st.none(), times),
    drain=st.booleans(),
    confirm_after=st.none() | times,
    release_early=st.booleans(),
    report=st.sampled_from([None, "success", "failure", "failure"]),
)
joins = st.builds(
    Join, at=times, node=st.sampled_from(NODES), slots=st.integers(0, 2), tools=st.booleans()
)
leaves = st.builds(Leave, at=times, node=st.sampled_from(NODES))
capacities = st.builds(Capacity, at=times, node=st.sampled_from(NODES), slots=st.integers(0, 3))
first_join = st.builds(
    Join, at=st.just(0.0), node=st.just("n1"), slots=st.integers(1, 2), tools=st.booleans()
)
scenarios = st.builds(
    lambda first, rest: [first, *rest],
    first_join,
    st.lists(st.one_of(requests, requests, requests, joins, leaves, capacities), max_size=25),
)


def run_scenario(steps: list[Request | Join | Leave | Capacity]) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    ended: list[int] = []
    sessions: dict[str, int] = {}  # node -> current generation (absent: not joined)
    generations: dict[str, int] = {}
    slots_of: dict[CandidateKey, int] = {}
    exact_capacity = not any(isinstance(step, Capacity) for step in steps)

    async def main() -> None:
        async with open_admission(POLICY) as admission:

            async def confirm_later(slot_id: int, delay: float) -> None:
                await trio.sleep(delay)
                admission.confirm_drain(slot_id)

            async def request(index: int, step: Request, nursery: trio.Nursery) -> None:
                await trio.sleep(step.at)
                outcome = "cancelled"
                deadline = math.inf if step.cancel_after is None else step.cancel_after
                with trio.move_on_after(deadline):
                    try:
                        async with admission.open_slot(step.model, step.needs) as slot:
                            outcome = f"admitted ({slot.queue_reason})"
                            key = slot.candidate.key
                            assert not step.needs.tools or "tools" in slot.candidate.capabilities
                            candidates = admission.statistics().candidates
                            if sessions.get(key.node_id) != key.generation:
                                # The session ended since (same instant): the slot is void.
                                assert key not in candidates, "admitted to a stale session"
                            elif exact_capacity:
                                stats = candidates[key]
                                assert stats.in_use + stats.draining <= slots_of[key]
                            await trio.sleep(step.hold)
                            if step.report == "success":
                                admission.report_success(key)
                            elif step.report == "failure":
                                admission.report_failure(key)
                            if step.release_early:
                                slot.release()
                                await trio.sleep(step.hold)
                            if step.drain:
                                slot.drain()
                                if step.confirm_after is not None:
                                    nursery.start_soon(
                                        confirm_later, slot.slot_id, step.confirm_after
                                    )
                    except AdmissionError as exc:
                        outcome = type(exc).__name__
                outcomes[outcome] += 1
                ended.append(index)

            async def node_event(step: Join | Leave | Capacity) -> None:
                await trio.sleep(step.at)
                if isinstance(step, Join):
                    generation = generations[step.node] = generations.get(step.node, 0) + 1
                    candidate = cand(
                        step.node,
                        generation=generation,
                        slots=step.slots,
                        caps={"tools"} if step.tools else (),
                    )
                    sessions[step.node] = generation
                    slots_of[candidate.key] = step.slots
                    admission.node_joined([candidate])
                elif isinstance(step, Leave):
                    if step.node in sessions:
                        admission.node_left(step.node, sessions.pop(step.node))
                elif step.node in sessions:
                    key = cand(step.node, generation=sessions[step.node]).key
                    slots_of[key] = step.slots
                    admission.capacity_changed(key, step.slots, 0)

            async with trio.open_nursery() as nursery:
                for index, step in enumerate(steps):
                    if isinstance(step, Request):
                        nursery.start_soon(request, index, step, nursery)
                    else:
                        nursery.start_soon(node_event, step)
            await trio.sleep(POLICY.default.drain_timeout_s + 1)  # unconfirmed drains expire
            stats = admission.statistics()
            assert (stats.in_use, stats.draining, stats.waiting) == (0, 0, 0), stats
            assert not any(c.probe_in_flight for c in stats.candidates.values()), stats

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    request_indexes = [i for i, step in enumerate(steps) if isinstance(step, Request)]
    assert sorted(ended) == request_indexes  # every request ended exactly once
    assert sum(outcomes.values()) == len(request_indexes)
    return outcomes


@given(scenarios)
def test_trio_layer_scenarios(steps: list[Request | Join | Leave | Capacity]) -> None:
    for outcome in run_scenario(steps):
        event(outcome)


def test_a_busy_scenario() -> None:
    steps: list[Request | Join | Leave | Capacity] = [Join(0.0, "n1", 1, True)]
    steps += [Request(0.0, "m", Needs(), 1.0, None, False, None, False) for _ in range(3)]
    steps += [Request(0.5, "m", Needs(), 1.0, 0.5, True, 0.5, False)]
    steps += [Leave(1.5, "n1"), Join(2.0, "n1", 2, False), Capacity(3.0, "n1", 1)]
    run_scenario(steps)
