"""A scripted node for edge tests: it speaks the wire protocol over an in-memory connection
and lets the test decide every event, so each exit path of a run can be forced."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import attrs
import trio

from dispatcher import wire
from dispatcher.api.app import FRONT_ENDS
from dispatcher.api.front import FrontEnd
from dispatcher.config import EdgeConfig
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server
from dispatcher.shared.transport import ConnectionClosed, MemoryConnection, memory_connection_pair
from dispatcher.store.usage import UsageRow
from nodes.config import NodeConfig


def hello(
    node_id: str = "node-a",
    *,
    model: str = "m",
    slots: int = 1,
    capabilities: Sequence[str] = (),
    token: str | None = None,
    provider_id: str = "p1",
) -> wire.Hello:
    return wire.Hello(
        protocol=wire.PROTOCOL_VERSION,
        node_id=node_id,
        label=f"{node_id} label",
        token=token,
        providers=(
            wire.ProviderInfo(
                id=provider_id,
                type="echo",
                adapter="echo",
                models=(
                    wire.ModelInfo(
                        name=model,
                        served_name=f"{model}-served",
                        slots=slots,
                        capabilities=tuple(capabilities),
                    ),
                ),
            ),
        ),
    )


@attrs.define(eq=False)
class ScriptedNode:
    """The node end of a connection; pings are answered automatically."""

    conn: MemoryConnection
    welcome: wire.Welcome | None = None
    seen: list[wire.Message] = attrs.field(factory=list)

    async def send(self, message: wire.Message) -> None:
        await self.conn.send(wire.encode(message))

    demands: list[wire.Demand] = attrs.field(factory=list)

    async def receive(self) -> wire.Message:
        """The next message from the edge but a ping (answered) or a demand (kept in
        :attr:`demands`: the scripted node grants nothing)."""
        while True:
            frame = await self.conn.receive()
            assert isinstance(frame, str)
            message = wire.decode(frame)
            if isinstance(message, wire.Ping):
                await self.send(wire.Pong(nonce=message.nonce))
                continue
            if isinstance(message, wire.Demand):
                self.demands.append(message)
                continue
            self.seen.append(message)
            return message

    async def receive_run(self) -> wire.RunRequest:
        message = await self.receive()
        assert isinstance(message, wire.RunRequest), message
        return message

    async def emit(self, run_id: str, *events: tuple[str, dict[str, object]]) -> None:
        for seq, (kind, fields) in enumerate(events):
            cls = {c.TYPE: c for c in wire.MESSAGE_TYPES}[kind]
            await self.send(cls(run_id=run_id, seq=seq, **fields))

    async def answer_pings(self) -> None:
        """Keep answering pings until the connection closes (run in a nursery)."""
        try:
            while True:
                await self.receive()
        except ConnectionClosed:
            pass

    def cancels(self) -> list[str]:
        return [m.run_id for m in self.seen if isinstance(m, wire.RunCancel)]


async def connect(dispatcher: Dispatcher, greeting: wire.Hello) -> ScriptedNode:
    """Attach a scripted node and wait for its welcome."""
    edge_end, node_end = memory_connection_pair()
    await dispatcher.attach_node(edge_end)
    node = ScriptedNode(node_end)
    await node.send(greeting)
    message = await node.receive()
    assert isinstance(message, wire.Welcome), message
    node.welcome = message
    return node


async def wait_until(predicate: object, timeout: float = 5) -> None:
    """Poll a condition at each scheduling step (for use under MockClock or real time)."""
    assert callable(predicate)
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.001)


@attrs.frozen
class ServedEdge:
    """A dispatcher serving HTTP on 127.0.0.1 (port 0), and every usage row it recorded."""

    dispatcher: Dispatcher
    server: Server
    rows: list[UsageRow]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.address.port}"


E = TypeVar("E", bound=ServedEdge)


@asynccontextmanager
async def serve_edge(
    config: EdgeConfig,
    kind: type[E],
    *,
    local_node: NodeConfig | bool = False,
    front_ends: Sequence[FrontEnd] = FRONT_ENDS,
) -> AsyncIterator[E]:
    """Open ``config``'s dispatcher, keep a copy of each usage row it records (the ledger
    still gets them), attach its in-process node (``True``: the default one; a
    ``NodeConfig``: that one), serve ``front_ends`` and yield a ``kind`` of it."""
    rows: list[UsageRow] = []
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        record = dispatcher.gate.record_usage
        assert record is not None

        def both(row: UsageRow) -> None:
            rows.append(row)
            record(row)

        dispatcher.gate.record_usage = both
        if local_node is not False:
            await dispatcher.attach_local_node(None if local_node is True else local_node)
        server: Server = await nursery.start(
            functools.partial(dispatcher.serve, front_ends=front_ends)
        )
        yield kind(dispatcher, server, rows)
        server.shutdown()
