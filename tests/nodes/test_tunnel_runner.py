"""The node's tunnel runner, without an edge: what it refuses of its caller."""

from __future__ import annotations

import attrs
import orjson
import pytest
import trio

from dispatcher import wire
from nodes.tunnel import TunnelProvider, open_tunnel_pools, open_tunnels, tunnel_providers
from nodes.upstream.pools import pool_size
from tests.nodes.test_connection_reuse import TIMEOUT, provider, start_upstream


async def test_a_second_start_for_a_running_tunnel_is_a_local_protocol_error() -> None:
    """The session's machine refuses the edge's second ``tunnel.request`` for a running
    tunnel; the runner does not paper over a caller that skipped it."""
    sent: list[wire.NodeMessage] = []

    async def send(message: wire.NodeMessage) -> None:
        sent.append(message)

    async def send_data(tunnel_id: str, data: bytes) -> None:
        raise AssertionError("no body is relayed here")

    request = wire.TunnelRequest(tunnel_id="t1", provider_id="p", method="GET", path="/v1/models")
    provider = TunnelProvider(id="p", base_url="http://127.0.0.1:9")
    async with open_tunnels(send, send_data, {"p": provider}) as tunnels:
        tunnels.start(request)
        with pytest.raises(wire.LocalProtocolError, match="tunnel 't1' is already running"):
            tunnels.start(request)
        assert tunnels.statistics().active_tunnels == 1


async def test_tunnels_share_one_pool_per_provider_sized_to_its_slots(
    nursery: trio.Nursery,
) -> None:
    """A provider from the config gets a pool of its slots: more tunnels at once than that
    (the edge never sends so many) wait for a connection instead of opening more, and every
    tunnel is answered on the pool's connections, kept alive between tunnels."""
    up = await start_upstream(nursery, "openai")
    up.fake.chunk_delay = 0.01  # each tunnel holds its connection a while
    config = attrs.evolve(provider(up, slots=2), path="tunnel")
    providers = tunnel_providers([config])
    assert providers["up"].connections == pool_size(config) == 2
    ends: list[wire.TunnelEnd] = []
    all_ended = trio.Event()

    async def send(message: wire.NodeMessage) -> None:
        await trio.lowlevel.checkpoint()
        if isinstance(message, wire.TunnelEnd):
            ends.append(message)
            if len(ends) == 8:
                all_ended.set()

    async def send_data(tunnel_id: str, data: bytes) -> None:
        await trio.lowlevel.checkpoint()

    body = orjson.dumps({"model": "m", "messages": [], "stream": True}).decode()
    with trio.fail_after(TIMEOUT):
        async with open_tunnel_pools(providers) as pooled:
            async with open_tunnels(send, send_data, pooled) as tunnels:
                for n in range(8):
                    tunnels.start(
                        wire.TunnelRequest(
                            tunnel_id=f"t{n}",
                            provider_id="up",
                            method="POST",
                            path="/v1/chat/completions",
                            body=body,
                        )
                    )
                await all_ended.wait()
            # The pools are the outer block's: still open after the tunnels' block.
            assert up.relay.open == up.relay.accepted == 2
            async with open_tunnel_pools(pooled) as again:
                assert again == pooled  # already open: as they are
        await up.relay.wait_for(lambda: up.relay.open == 0)
    assert [end.error for end in ends] == [None] * 8
    assert up.relay.peak_open == up.relay.accepted == 2


async def test_a_whole_answer_leaves_at_once_with_its_end(nursery: trio.Nursery) -> None:
    """A non-streamed answer that came whole with its head: ``tunnel.start``, its body and
    ``tunnel.end`` are handed over together (one socket write over the websocket); a window
    smaller than the body sends it as credit allows, as before."""
    up = await start_upstream(nursery, "openai")
    providers = tunnel_providers([attrs.evolve(provider(up, slots=2), path="tunnel")])
    batches: list[list[object]] = []
    singles: list[object] = []
    ended = trio.Event()

    async def send(message: wire.NodeMessage) -> None:
        await trio.lowlevel.checkpoint()
        singles.append(message)
        if isinstance(message, wire.TunnelEnd):
            ended.set()

    async def send_data(tunnel_id: str, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        singles.append(wire.TunnelData(tunnel_id, data))

    async def send_many(messages: object) -> None:
        await trio.lowlevel.checkpoint()
        assert isinstance(messages, list)
        batches.append(messages)
        if isinstance(messages[-1], wire.TunnelEnd):
            ended.set()

    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).decode()
    request = wire.TunnelRequest(
        tunnel_id="t1", provider_id="up", method="POST", path="/v1/chat/completions", body=body
    )
    with trio.fail_after(TIMEOUT):
        async with open_tunnels(send, send_data, providers, send_many=send_many) as tunnels:
            tunnels.start(request)
            await ended.wait()
    assert singles == []
    (batch,) = batches
    start, *data, end = batch
    assert isinstance(start, wire.TunnelStart)
    assert start.status == 200
    assert data
    assert all(isinstance(piece, wire.TunnelData) for piece in data)
    answer = orjson.loads(b"".join(piece.data for piece in data))  # type: ignore[attr-defined]
    assert answer["object"] == "chat.completion"
    assert end == wire.TunnelEnd(tunnel_id="t1")

    # A window smaller than the body: tunnel.start alone, the body as credit comes.
    ended = trio.Event()
    batches.clear()
    small = attrs.evolve(request, tunnel_id="t2", window=10)
    with trio.fail_after(TIMEOUT):
        async with open_tunnels(send, send_data, providers, send_many=send_many) as tunnels:
            tunnels.start(small)
            while not any(isinstance(m, wire.TunnelData) for m in singles):
                await trio.sleep(0.01)
            tunnels.credit("t2", 1 << 20)
            await ended.wait()
    assert batches == []
    assert isinstance(singles[0], wire.TunnelStart)
    assert len(singles[1].data) == 10  # type: ignore[attr-defined]
    assert isinstance(singles[-1], wire.TunnelEnd)
    assert singles[-1].error is None
