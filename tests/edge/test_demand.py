"""The edge's half of granted slots (protocol 2, issue #24), against a scripted node:

* a ``capacity`` is the candidate's slots from then on, and the edge confirms it with a
  ``demand`` naming its serial; a grant overtaken on the wire by a newer one is not applied;
* the edge reports the requests it has queued for the node's model when that changes, and
  the slots it holds when they go beyond its grant (a lowered one) or come back to it; within
  its grant it sends no report per request.
"""

from __future__ import annotations

import trio
import trio.testing

from dispatcher import EdgeConfig, open_dispatcher, wire
from dispatcher.edge import Dispatcher
from dispatcher.paths.runs import RunSpec

from .fakes import ScriptedNode, connect, hello, wait_until


def slots(dispatcher: Dispatcher) -> int:
    return sum(c.total for c in dispatcher.admission.statistics().candidates.values())


async def next_demand(node: ScriptedNode, count: int) -> wire.Demand:
    """The ``count``-th demand the node heard (waiting for it)."""
    while len(node.demands) < count:
        frame = await node.conn.receive()
        assert isinstance(frame, str)
        message = wire.decode(frame)
        if isinstance(message, wire.Ping):
            await node.send(wire.Pong(nonce=message.nonce))
        elif isinstance(message, wire.Demand):
            node.demands.append(message)
        else:
            node.seen.append(message)
    return node.demands[count - 1]


def capacity(slots: int, serial: int) -> wire.Capacity:
    return wire.Capacity(provider_id="p1", model="m", slots=slots, serial=serial)


async def test_a_grant_is_applied_and_confirmed_an_overtaken_one_is_not(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        open_dispatcher(EdgeConfig(local_node=False)) as dispatcher,
        trio.open_nursery() as nursery,
    ):
        node = await connect(dispatcher, hello(slots=2))
        assert slots(dispatcher) == 2
        await node.send(capacity(5, 2))
        confirmed = await next_demand(node, 1)
        assert (confirmed.serial, confirmed.waiting, confirmed.in_use) == (2, 0, 0)
        assert slots(dispatcher) == 5
        await node.send(capacity(1, 1))  # older than the one applied: overtaken
        await trio.sleep(1)
        assert slots(dispatcher) == 5
        await node.send(capacity(4, 3))
        assert (await next_demand(node, 2)).serial == 3
        assert slots(dispatcher) == 4
        assert [d.serial for d in node.demands] == [2, 3]
        nursery.cancel_scope.cancel()


async def test_demand_says_what_waits_and_what_is_held_beyond_the_grant(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        open_dispatcher(EdgeConfig(local_node=False)) as dispatcher,
        trio.open_nursery() as nursery,
    ):
        node = await connect(dispatcher, hello(slots=1))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

        async def run() -> None:
            async with dispatcher.open_run(RunSpec(model="m", body=body)) as handle:
                async for event in handle:
                    if isinstance(event, wire.TERMINAL_EVENTS):
                        return

        nursery.start_soon(run)
        first = await node.receive_run()  # the one slot: no report (within the grant)
        assert node.demands == []
        nursery.start_soon(run)
        queued = await next_demand(node, 1)  # the second waits
        assert (queued.waiting, queued.in_use, queued.serial) == (1, 1, 0)
        await node.send(capacity(0, 1))  # lowered below what the edge holds
        lowered = await next_demand(node, 2)
        assert (lowered.waiting, lowered.in_use, lowered.serial) == (1, 1, 1)
        await node.send(wire.RunCompleted(run_id=first.run_id, seq=0))
        back = await next_demand(node, 3)  # held 0: back within the grant
        assert (back.in_use, back.serial) == (0, 1)
        await node.send(capacity(1, 2))
        second = await node.receive_run()
        await node.send(wire.RunCompleted(run_id=second.run_id, seq=0))
        await wait_until(lambda: dispatcher.in_flight() == 0)
        nursery.cancel_scope.cancel()
