"""A node serves several edges and holds its own slots (issue #24), in one process: two
dispatchers (edges) over in-memory connections, one node (``serve_node``) dialling both,
its ``echo`` provider with :data:`SLOTS` slots counting how many of its runs are going at
once. Virtual time.

* the edges see the node's slots shared, never more than it has between them: each idle
  edge starts with half;
* loaded from both edges at once, the provider never runs more than its slots, and every
  request completes;
* all the load on one edge: it is granted every slot; a first request on the other gets a
  slot when one of the first edge's runs ends (the first edge confirms its smaller grant);
* an edge that leaves frees its grants: the other is granted every slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs
import trio
import trio.testing

from dispatcher import EdgeConfig, open_dispatcher, wire
from dispatcher.edge import Dispatcher
from dispatcher.paths.runs import RunSpec
from dispatcher.shared.transport import Connection, memory_connection_pair
from nodes.agent import serve_node
from nodes.config import ModelConfig, NodeConfig, ProviderConfig
from tests.edge.fakes import wait_until

SLOTS = 4
URLS = ("ws://edge-a/v1/nodes/connect", "ws://edge-b/v1/nodes/connect")


def node_config() -> NodeConfig:
    return NodeConfig(
        node_id="shared-node",
        edges=URLS,
        providers=(
            ProviderConfig(id="echo", type="echo", models=(ModelConfig(name="echo", slots=SLOTS),)),
        ),
        reconnect_min_backoff=0.1,
        reconnect_max_backoff=0.2,
    )


def dial_to(dispatcher: Dispatcher) -> Callable[[], AbstractAsyncContextManager[Connection]]:
    @asynccontextmanager
    async def dial() -> AsyncIterator[Connection]:
        edge_end, node_end = memory_connection_pair()
        await dispatcher.attach_node(edge_end)
        yield node_end

    return dial


def slots(dispatcher: Dispatcher) -> int:
    """The slots the edge believes it has on the node (0 before it joined)."""
    return sum(c.total for c in dispatcher.admission.statistics().candidates.values())


def body(tokens: int, delay: float) -> dict[str, Any]:
    return {
        "model": "echo",
        "messages": [{"role": "user", "content": " ".join(["w"] * tokens)}],
        "max_tokens": tokens,
        "echo": {"token_delay": delay},
    }


@attrs.define
class Running:
    """How many runs the node's provider has going, as the edges' runs see them start and
    end (each edge counts its own; their sum is the node's)."""

    now: int = 0
    most: int = 0
    completed: int = 0

    async def run(self, dispatcher: Dispatcher, tokens: int = 3, delay: float = 1.0) -> None:
        async with dispatcher.open_run(RunSpec(model="echo", body=body(tokens, delay))) as run:
            started = False
            async for event in run:
                if isinstance(event, wire.RunStarted):
                    started = True
                    self.now += 1
                    self.most = max(self.most, self.now)
                if isinstance(event, wire.TERMINAL_EVENTS):
                    if started:
                        self.now -= 1
                    assert isinstance(event, wire.RunCompleted), event
                    self.completed += 1


@asynccontextmanager
async def two_edges_one_node() -> AsyncIterator[tuple[Dispatcher, Dispatcher, trio.CancelScope]]:
    async with (
        open_dispatcher(EdgeConfig(local_node=False)) as a,
        open_dispatcher(EdgeConfig(local_node=False)) as b,
        trio.open_nursery() as nursery,
    ):
        dials = {URLS[0]: dial_to(a), URLS[1]: dial_to(b)}
        scope = trio.CancelScope()

        async def node() -> None:
            with scope:
                await serve_node(node_config(), dials=dials)

        nursery.start_soon(node)
        await wait_until(lambda: slots(a) > 0 and slots(b) > 0, timeout=30)
        yield a, b, scope
        scope.cancel()


async def test_idle_edges_share_the_slots(autojump_clock: trio.testing.MockClock) -> None:
    async with two_edges_one_node() as (a, b, _):
        await wait_until(lambda: slots(a) + slots(b) == SLOTS, timeout=30)
        assert (slots(a), slots(b)) == (SLOTS // 2, SLOTS // 2)


async def test_load_on_both_edges_never_runs_more_than_the_slots(
    autojump_clock: trio.testing.MockClock,
) -> None:
    running = Running()
    async with two_edges_one_node() as (a, b, _):
        async with trio.open_nursery() as nursery:
            for i in range(24):
                nursery.start_soon(running.run, a if i % 3 else b, 2, 0.5 + (i % 5) / 10)
        assert running.completed == 24
        assert 0 < running.most <= SLOTS
        assert slots(a) + slots(b) <= SLOTS


async def test_a_first_request_on_the_idle_edge_gets_a_slot_at_the_first_run_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    running = Running()
    async with two_edges_one_node() as (a, b, _):
        async with trio.open_nursery() as nursery:
            for _ in range(12):  # three rounds of the node's slots, all on edge a
                nursery.start_soon(running.run, a, 5, 1.0)
            await wait_until(lambda: slots(a) == SLOTS and running.now == SLOTS, timeout=30)
            assert slots(b) == 0
            asked = trio.current_time()
            first_end = asked + 5.0  # the first runs on a end about 5 s in (5 tokens, 1 s)
            await running.run(b, 1, 0.0)
            served = trio.current_time()
            assert served <= first_end + 1.0  # at the first run end, not after a's queue
            assert running.most <= SLOTS
        assert running.completed == 13


async def test_an_edge_that_leaves_frees_its_slots(autojump_clock: trio.testing.MockClock) -> None:
    async with (
        open_dispatcher(EdgeConfig(local_node=False)) as a,
        open_dispatcher(EdgeConfig(local_node=False)) as b,
        trio.open_nursery() as nursery,
    ):
        b_connections: list[Connection] = []
        b_down = False

        @asynccontextmanager
        async def dial_b() -> AsyncIterator[Connection]:
            if b_down:  # edge b is gone: dialling it hangs until the attempt times out
                await trio.sleep_forever()
            edge_end, node_end = memory_connection_pair()
            b_connections.append(edge_end)
            await b.attach_node(edge_end)
            yield node_end

        dials = {URLS[0]: dial_to(a), URLS[1]: dial_b}
        node_scope = trio.CancelScope()

        async def node() -> None:
            with node_scope:
                await serve_node(node_config(), dials=dials)

        nursery.start_soon(node)
        await wait_until(lambda: (slots(a), slots(b)) == (SLOTS // 2, SLOTS // 2), timeout=30)
        b_down = True
        await b_connections[0].aclose()  # edge b is gone: its half comes back to a
        await wait_until(lambda: slots(a) == SLOTS, timeout=30)
        node_scope.cancel()


async def test_a_node_given_one_edge_serves_the_edges_its_welcome_names(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The node's config names edge a alone; a's welcome names edge b (a live edge sharing
    its stores): the node dials b too and shares its slots between them. When b is gone and
    a no longer lists it, the node stops dialling it and a gets every slot back."""
    from dispatcher.config import StoreSettings

    async with (
        open_dispatcher(EdgeConfig(local_node=False, store=StoreSettings(edge_id="a"))) as a,
        open_dispatcher(EdgeConfig(local_node=False, store=StoreSettings(edge_id="b"))) as b,
        trio.open_nursery() as nursery,
    ):
        a._peers = (wire.EdgePeer(id="b", node_url=URLS[1]),)  # as a Redis cluster lists it
        b._peers = (wire.EdgePeer(id="a", node_url=URLS[0]),)
        b_connections: list[Connection] = []
        b_dials = 0
        b_down = False

        @asynccontextmanager
        async def dial_b() -> AsyncIterator[Connection]:
            nonlocal b_dials
            b_dials += 1
            if b_down:
                raise OSError("connection refused")
            edge_end, node_end = memory_connection_pair()
            b_connections.append(edge_end)
            await b.attach_node(edge_end)
            yield node_end

        a_connections: list[Connection] = []

        @asynccontextmanager
        async def dial_a() -> AsyncIterator[Connection]:
            edge_end, node_end = memory_connection_pair()
            a_connections.append(edge_end)
            await a.attach_node(edge_end)
            yield node_end

        config = attrs.evolve(node_config(), edges=(), edge_url=URLS[0])
        node_scope = trio.CancelScope()

        async def node() -> None:
            with node_scope:
                await serve_node(config, dials={URLS[0]: dial_a, URLS[1]: dial_b})

        nursery.start_soon(node)
        await wait_until(lambda: (slots(a), slots(b)) == (SLOTS // 2, SLOTS // 2), timeout=30)
        assert len(a.registry.sessions) == len(b.registry.sessions) == 1
        # b is gone for good: a stops listing it; the node's next welcome from a forgets it.
        b_down = True
        a._peers = ()
        await b_connections[0].aclose()
        await wait_until(lambda: slots(a) == SLOTS, timeout=30)
        await a_connections[-1].aclose()  # the node reconnects to a: a new welcome
        await wait_until(lambda: len(a_connections) == 2, timeout=30)
        await wait_until(lambda: slots(a) == SLOTS, timeout=30)
        dials_then = b_dials
        await trio.sleep(120)  # the node's backoff is at most 0.2 s: it would have dialled
        assert b_dials == dials_then
        node_scope.cancel()


async def test_a_drained_node_drains_on_every_edge(autojump_clock: trio.testing.MockClock) -> None:
    """The node's drain (its SIGTERM) is told to every edge: each stops routing to it, the
    runs going on either finish, then the node leaves both."""
    from nodes.agent import Drain

    running = Running()
    async with (
        open_dispatcher(EdgeConfig(local_node=False)) as a,
        open_dispatcher(EdgeConfig(local_node=False)) as b,
        trio.open_nursery() as nursery,
    ):
        drain = Drain()
        left = trio.Event()

        async def node() -> None:
            await serve_node(
                node_config(), dials={URLS[0]: dial_to(a), URLS[1]: dial_to(b)}, drain=drain
            )
            left.set()

        nursery.start_soon(node)
        await wait_until(lambda: slots(a) > 0 and slots(b) > 0, timeout=30)
        nursery.start_soon(running.run, a, 3, 1.0)
        nursery.start_soon(running.run, b, 3, 1.0)
        await wait_until(lambda: running.now == 2, timeout=30)
        drain.request()
        await wait_until(
            lambda: all(s.draining for d in (a, b) for s in d.registry.sessions.values()),
            timeout=30,
        )
        with trio.fail_after(60):
            await left.wait()
        assert running.completed == 2
        await wait_until(lambda: not a.registry.sessions and not b.registry.sessions)
