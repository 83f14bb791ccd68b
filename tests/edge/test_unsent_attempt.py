"""An attempt whose node was lost before its request went out: the edge says so in its log
and writes no usage row for it, while the attempts whose requests did go out each have theirs.

Found by the cluster soak: a tunnel request still queued for the node's connection when the
node was SIGKILLed was logged as "failed before commit", the line that promises a row, and had
none. Here a scripted node on an unbuffered in-memory connection reads its first request and
nothing more: the edge's writer takes the second and waits on it, the third stays queued; then
the node's connection closes."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio

from dispatcher import wire
from dispatcher.config import EdgeConfig, NodeSettings
from dispatcher.shared.transport import memory_connection_pair

from .fakes import ScriptedNode, ServedEdge, serve_edge, wait_until
from .test_tunnel import tunnel_hello


async def test_an_attempt_never_sent_has_no_row_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dispatcher.gate")
    config = EdgeConfig(port=0, local_node=False, nodes=NodeSettings(heartbeat_interval=100))
    async with serve_edge(config, ServedEdge) as edge:
        tunnels = edge.dispatcher.tunnels
        edge_end, node_end = memory_connection_pair(buffer=0)
        await edge.dispatcher.attach_node(edge_end)
        node = ScriptedNode(node_end)
        await node.send(tunnel_hello(slots=3))
        assert isinstance(await node.receive(), wire.Welcome)

        def sent() -> list[bool]:
            return [lease.sent for lease in tunnels._open.values()]

        answers: dict[str, httpx.Response] = {}
        async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:

            async def post(request_id: str) -> None:
                answers[request_id] = await client.post(
                    "/v1/embeddings",
                    json={"model": "t", "input": "hello"},
                    headers={"x-request-id": request_id},
                )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, "read")
                assert isinstance(await node.receive(), wire.TunnelRequest)
                # from here the node reads nothing: the next request is taken by the
                # edge's writer, which then waits on the connection with it
                nursery.start_soon(post, "taken")
                await wait_until(lambda: sent() == [True, True])
                nursery.start_soon(post, "queued")
                await wait_until(lambda: sorted(sent()) == [False, True, True])
                await node_end.aclose()
        await wait_until(lambda: tunnels.statistics().open == 0)

    assert set(answers) == {"read", "taken", "queued"}
    assert all(answer.status_code >= 500 for answer in answers.values()), answers
    rows = {str(row.client_request_id): row for row in edge.rows}
    assert sorted(rows) == ["read", "taken"], edge.rows
    assert all(row.attempt == 1 and row.node_id == "scripted" for row in rows.values())
    by_request = {row.client_request_id: row.request_id for row in edge.rows}
    lines = [r.getMessage() for r in caplog.records if r.name == "dispatcher.gate"]
    for request_id in ("read", "taken"):
        assert any(
            f"request {by_request[request_id]} attempt 1 failed before commit: " in line
            for line in lines
        ), lines
    not_sent = [line for line in lines if " attempt 1 was not sent: " in line]
    assert len(not_sent) == 1, lines
    assert " was not sent: scripted/p: " in not_sent[0]
    assert not any(
        line.startswith(not_sent[0].split(" attempt ")[0] + " attempt 1 failed") for line in lines
    )
