"""A scripted node for edge tests: it speaks the wire protocol over an in-memory connection
and lets the test decide every event, so each exit path of a run can be forced."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from dispatcher import wire
from dispatcher.edge import Dispatcher
from dispatcher.transport import ConnectionClosed, MemoryConnection, memory_connection_pair


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

    async def receive(self) -> wire.Message:
        """The next non-ping message from the edge."""
        while True:
            frame = await self.conn.receive()
            assert isinstance(frame, str)
            message = wire.decode(frame)
            if isinstance(message, wire.Ping):
                await self.send(wire.Pong(nonce=message.nonce))
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
