"""The node's tunnel runner, without an edge: what it refuses of its caller."""

from __future__ import annotations

import pytest

from dispatcher import protocol as wire
from nodes.tunnel import TunnelProvider, open_tunnels


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
