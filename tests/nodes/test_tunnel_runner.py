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
