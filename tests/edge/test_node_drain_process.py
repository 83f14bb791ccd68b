"""A node's SIGTERM with real processes: an edge on 127.0.0.1 (in this process, so the test can
see its sessions) and ``dispatcher node`` processes. SIGTERM node A mid-stream: the stream
completes intact, A exits 0 after a clean leave, and what comes meanwhile goes to node B -- or,
with no B, waits in the queue and times out there (503 ``queue_timeout``) rather than reaching
A. Bounds are generous; the drain's timing is tested in virtual time (tests/nodes/test_drain.py).
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio

from dispatcher.config import EdgeConfig, QueuePolicySettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server
from tests.edge.test_drain_process import (
    _draining,
    _gone,
    _has_session,
    chat,
    data_lines,
    node_process,
    quiet,
    wait_for,
)

WORDS = 40


@asynccontextmanager
async def edge(queue_timeout_s: float = 10.0) -> AsyncIterator[tuple[Dispatcher, int]]:
    config = EdgeConfig(
        port=0,
        local_node=False,
        expose_node_ids=True,
        admission=QueuePolicySettings(queue_timeout_s=queue_timeout_s),
    )
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        server: Server = await nursery.start(dispatcher.serve)
        yield dispatcher, server.address.port
        nursery.cancel_scope.cancel()


def streamed_text(lines: list[str]) -> str:
    text = []
    for line in data_lines(lines):
        if line == "data: [DONE]":
            continue
        chunk: dict[str, Any] = orjson.loads(line.removeprefix("data: "))
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text.append(choice["delta"].get("content") or "")
    return "".join(text)


async def test_sigterm_mid_stream_completes_it_and_new_requests_go_to_the_other_node(
    tmp_path: Path,
) -> None:
    async with (
        edge() as (dispatcher, port),
        node_process(tmp_path, port, "node-a") as node_a,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client,
    ):
        await wait_for(lambda: _has_session(dispatcher, "node-a"))
        lines: list[str] = []
        elsewhere: list[httpx.Response] = []
        # 40 tokens x 0.1 s: about 4 s, well inside the node's 30 s grace.
        async with (
            node_process(tmp_path, port, "node-b") as node_b,
            client.stream("POST", "/v1/chat/completions", json=chat(WORDS, 0.1)) as stream,
        ):
            assert stream.headers["x-dispatcher-node"] == "node-a"  # the only node yet
            await wait_for(lambda: _has_session(dispatcher, "node-b"))
            async for line in stream.aiter_lines():
                lines.append(line)
                if line.startswith("data: ") and len(data_lines(lines)) == 3:
                    node_a.signal(signal.SIGTERM)
                    await wait_for(lambda: _draining(dispatcher, "node-a"))
                    for _ in range(4):
                        elsewhere.append(
                            await client.post("/v1/chat/completions", json=chat(2, 0, stream=False))
                        )
            assert await node_a.wait_exit() == 0
            await wait_for(lambda: _gone(dispatcher, "node-a"))
            assert "node-b" in dispatcher.registry.sessions  # B serves on
            after = await client.post("/v1/chat/completions", json=chat(2, 0, stream=False))
            node_b.signal(signal.SIGTERM)
            assert await node_b.wait_exit() == 0
    assert data_lines(lines)[-1] == "data: [DONE]"
    assert streamed_text(lines).split() == [f"w{i}" for i in range(WORDS)]  # intact
    assert [r.status_code for r in elsewhere] == [200] * 4
    assert {r.headers["x-dispatcher-node"] for r in elsewhere} == {"node-b"}
    assert (after.status_code, after.headers["x-dispatcher-node"]) == (200, "node-b")
    assert quiet(node_a.stderr), node_a.stderr
    assert "drained: leaving the edge" in node_a.stderr
    assert "refused, this node is draining" not in node_a.stderr  # nothing new reached A
    assert quiet(node_b.stderr), node_b.stderr


async def test_with_only_the_draining_node_new_requests_wait_and_never_reach_it(
    tmp_path: Path,
) -> None:
    async with (
        edge(queue_timeout_s=1.0) as (dispatcher, port),
        node_process(tmp_path, port, "node-a") as node_a,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client,
    ):
        await wait_for(lambda: _has_session(dispatcher, "node-a"))
        lines: list[str] = []
        # 40 tokens x 0.15 s: about 6 s, longer than the 1 s queue wait below.
        async with client.stream("POST", "/v1/chat/completions", json=chat(WORDS, 0.15)) as stream:
            async for line in stream.aiter_lines():
                lines.append(line)
                if line.startswith("data: ") and len(data_lines(lines)) == 3:
                    node_a.signal(signal.SIGTERM)
                    await wait_for(lambda: _draining(dispatcher, "node-a"))
                    waited = await client.post(
                        "/v1/chat/completions", json=chat(2, 0, stream=False)
                    )
                    ready = await client.get("/readyz")
        assert await node_a.wait_exit() == 0
        await wait_for(lambda: _gone(dispatcher, "node-a"))
    assert data_lines(lines)[-1] == "data: [DONE]"
    assert streamed_text(lines).split() == [f"w{i}" for i in range(WORDS)]
    assert waited.status_code == 503
    assert waited.json()["error"]["code"] == "queue_timeout"
    assert "x-dispatcher-node" not in waited.headers
    assert (ready.status_code, ready.json()["reason"]) == (
        503,
        "no node serves a model (1 node(s) draining)",
    )
    assert "refused, this node is draining" not in node_a.stderr
    assert quiet(node_a.stderr), node_a.stderr
