"""Why a node session ended, as its runs' clients and the edge's log are told: a node that
was lost (its connection closed or broke, or the edge dropped it), one that left while
draining (its operator stopped it; its drain grace cut what still ran), the edge's own
shutdown, a reconnect. The naming is a pure function (``nodelink.session_end``); the rest
runs a scripted node over an in-memory connection in virtual time. The same over real
sockets and real node processes: ``test_node_lost_process.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from dispatcher import wire
from dispatcher.config import EdgeConfig, NodeSettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.link.session import (
    Parting,
    SessionEnd,
    connection_parting,
    session_end,
)
from dispatcher.paths.runs import RunSpec
from dispatcher.shared.transport import ConnectionClosed

from .fakes import ScriptedNode, connect, hello, wait_until

SPEC = RunSpec(model="m", body={"model": "m", "messages": [{"role": "user", "content": "hi"}]})


# --------------------------------------------------------------------------- pure


@pytest.mark.parametrize(
    ("parting", "detail", "draining", "edge_closing", "expected"),
    [
        (None, "", False, False, SessionEnd("node_lost", "node n1 was lost: its connection broke")),
        (
            "broken",
            "its connection broke",
            False,
            False,
            SessionEnd("node_lost", "node n1 was lost: its connection broke"),
        ),
        (
            "closed",
            "it closed its connection (code 1011: oops)",
            False,
            False,
            SessionEnd("node_lost", "node n1 was lost: it closed its connection (code 1011: oops)"),
        ),
        (
            "dropped",
            "heartbeat timeout: node silent for 15.0 s",
            False,
            False,
            SessionEnd(
                "node_lost",
                "node n1 was lost: the edge dropped it (heartbeat timeout: node silent for 15.0 s)",
            ),
        ),
        # A node that said it is draining left on purpose, however its connection ended.
        *(
            (
                parting,
                "x",
                True,
                False,
                SessionEnd(
                    "node_draining", "node n1 left while draining (its operator stopped it)"
                ),
            )
            for parting in (None, "broken", "closed", "dropped")
        ),
        # The edge's own shutdown names every end from then on.
        *(
            (parting, "x", draining, True, SessionEnd("shutting_down", "the edge is shutting down"))
            for parting in (None, "broken", "closed", "dropped", "superseded")
            for draining in (False, True)
        ),
        (
            "superseded",
            "node n1 reconnected: its session 1 was superseded",
            True,
            False,
            SessionEnd("stale_generation", "node n1 reconnected: its session 1 was superseded"),
        ),
    ],
)
def test_session_end_names_why(
    parting: Parting | None, detail: str, draining: bool, edge_closing: bool, expected: SessionEnd
) -> None:
    assert (
        session_end("n1", parting, detail, draining=draining, edge_closing=edge_closing) == expected
    )


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ConnectionClosed("connection lost", 1006), ("broken", "its connection broke")),
        (ConnectionClosed("peer gone"), ("broken", "its connection broke")),
        (
            ConnectionClosed("node shutting down", 1001),
            ("closed", "it closed its connection (code 1001: node shutting down)"),
        ),
        (ConnectionClosed("", 1000), ("closed", "it closed its connection (code 1000)")),
    ],
)
def test_connection_parting(exc: ConnectionClosed, expected: tuple[Parting, str]) -> None:
    assert connection_parting(exc) == expected


# --------------------------------------------------------------------------- in memory


@pytest.fixture
async def dispatcher(autojump_clock: trio.testing.MockClock) -> AsyncIterator[Dispatcher]:
    config = EdgeConfig(
        local_node=False, nodes=NodeSettings(heartbeat_interval=5, heartbeat_timeout=15)
    )
    async with open_dispatcher(config) as d:
        yield d


async def started_run(node: ScriptedNode) -> wire.RunRequest:
    request = await node.receive_run()
    await node.emit(request.run_id, ("run.started", {}), ("run.delta", {"text": "w0 "}))
    return request


async def test_a_node_that_closes_its_connection_mid_run_is_named_lost(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    node = await connect(dispatcher, hello("n1"))
    async with dispatcher.open_run(SPEC) as run:
        await started_run(node)
        await node.conn.aclose(1011, "the node broke down")
        events = [event async for event in run]
    failed = events[-1]
    assert isinstance(failed, wire.RunFailed)
    assert (failed.code, failed.message, failed.retryable) == (
        "node_lost",
        "node n1 was lost: it closed its connection (code 1011: the node broke down)",
        True,
    )
    assert run.end_reason == "node_lost"


async def test_a_silent_node_is_named_lost_by_its_heartbeat(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    node = await connect(dispatcher, hello("n1"))
    async with dispatcher.open_run(SPEC) as run:
        await node.receive_run()  # and never answers a ping again
        events = [event async for event in run]
    failed = events[-1]
    assert isinstance(failed, wire.RunFailed)
    assert failed.code == "node_lost"
    assert failed.message.startswith(
        "node n1 was lost: the edge dropped it (heartbeat timeout: node silent for "
    )


async def test_a_draining_nodes_grace_cutting_a_run_is_named_as_its_drain(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    """The node said it is draining, then cancelled the run itself (its grace was over):
    the client is told the node's drain cut it, not that "the node cancelled the run"; the
    usage the cancel reported still counts."""
    node = await connect(dispatcher, hello("n1"))
    usage = wire.Usage(prompt_tokens=3, completion_tokens=1)
    async with dispatcher.open_run(SPEC) as run:
        request = await started_run(node)
        await node.send(wire.NodeDraining(grace=2.5))
        await wait_until(lambda: dispatcher.registry.sessions["n1"].draining)
        await node.send(wire.RunCancelled(run_id=request.run_id, seq=2, usage=usage))
        events = [event async for event in run]
    failed = events[-1]
    assert isinstance(failed, wire.RunFailed)
    assert (failed.code, failed.message, failed.retryable) == (
        "node_draining",
        "node n1 is draining (its operator stopped it): its drain grace of 2.5 s ended "
        "before this run did",
        True,
    )
    assert run.usage == usage
    assert run.end_reason == "node_draining"
    assert node.cancels() == []  # nobody asked it to cancel


async def test_a_node_that_leaves_while_draining_is_named_leaving_not_lost(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    node = await connect(dispatcher, hello("n1"))
    async with dispatcher.open_run(SPEC) as run:
        await started_run(node)
        await node.send(wire.NodeDraining(grace=0))
        await wait_until(lambda: dispatcher.registry.sessions["n1"].draining)
        await node.conn.aclose(1000, "node drained")
        events = [event async for event in run]
    failed = events[-1]
    assert isinstance(failed, wire.RunFailed)
    assert (failed.code, failed.message) == (
        "node_draining",
        "node n1 left while draining (its operator stopped it)",
    )
    assert run.end_reason == "node_draining"


async def test_the_edges_own_shutdown_is_named_as_such(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A run still going when the dispatcher closes ends as ``shutting_down``: the node is
    not lost, the edge is going (its drain's cut-off says so too)."""
    events: list[wire.RunEvent] = []

    async def client(dispatcher: Dispatcher) -> None:
        async with dispatcher.runs.open_run(SPEC) as run:
            events.extend([event async for event in run])

    async with (
        trio.open_nursery() as outer,  # the client outlives the dispatcher
        open_dispatcher(EdgeConfig(local_node=False)) as dispatcher,
    ):
        node = await connect(dispatcher, hello("n1"))
        outer.start_soon(client, dispatcher)
        await started_run(node)
        closing_before = dispatcher.registry.closing
        await dispatcher.begin_shutdown()
        assert (closing_before, dispatcher.registry.closing) == (False, True)
    failed = events[-1]
    assert isinstance(failed, wire.RunFailed)
    assert (failed.code, failed.message) == ("shutting_down", "the edge is shutting down")


async def test_a_reconnect_is_named_as_such(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    node = await connect(dispatcher, hello("n1"))
    async with dispatcher.open_run(SPEC) as run:
        await started_run(node)
        await connect(dispatcher, hello("n1"))
        events = [event async for event in run]
    failed = events[-1]
    assert isinstance(failed, wire.RunFailed)
    assert (failed.code, failed.message) == (
        "stale_generation",
        "node n1 reconnected: its session 1 was superseded",
    )
