"""The stream gate through a real edge and real websocket nodes running the echo adapter with
fault injection: recovery before the commit point, explicit errors after it, and exactly one
usage row per dispatched attempt."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import orjson
import pytest
import trio

from dispatcher.config import (
    EdgeConfig,
    HTTPSettings,
    NodeSettings,
    QueuePolicySettings,
)
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server
from dispatcher.store.usage import UsageRow
from nodes.agent import serve_node
from nodes.config import ModelConfig, NodeConfig, ProviderConfig

from .fakes import wait_until


@attrs.frozen
class Edge:
    dispatcher: Dispatcher
    server: Server
    nursery: trio.Nursery

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.address.port}"

    @property
    def node_url(self) -> str:
        return f"ws://127.0.0.1:{self.server.address.port}/v1/nodes/connect"

    async def add_node(self, node_id: str, slots: int = 4, **echo: Any) -> None:
        """A real node over a real websocket, serving ``echo`` with these fault options."""
        config = NodeConfig(
            node_id=node_id,
            edge_url=self.node_url,
            providers=(
                ProviderConfig(
                    id="echo",
                    type="echo",
                    options=echo,
                    models=(ModelConfig(name="echo", slots=slots),),
                ),
            ),
        )
        await self.nursery.start(functools.partial(serve_node, config))

    def stats(self) -> Any:
        return self.dispatcher.admission.statistics()


@asynccontextmanager
async def open_edge(usage_db: str = ":memory:", **policy: Any) -> AsyncIterator[Edge]:
    config = EdgeConfig(
        port=0,
        local_node=False,
        expose_node_ids=True,
        usage_db=usage_db,
        http=HTTPSettings(shutdown_grace=2),
        nodes=NodeSettings(heartbeat_interval=1, heartbeat_timeout=5),
        admission=QueuePolicySettings(**policy),
    )
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        server: Server = await nursery.start(dispatcher.serve)
        yield Edge(dispatcher, server, nursery)
        server.shutdown()
        nursery.cancel_scope.cancel()


def chat(text: str = "one two three four five six", **extra: Any) -> dict[str, Any]:
    return {"model": "echo", "messages": [{"role": "user", "content": text}], **extra}


async def rows_for(edge: Edge, request_id: str) -> list[UsageRow]:
    """The rows of the request the client sent with ``x-request-id: request_id`` (the edge
    keys rows by its own id and keeps the client's as ``client_request_id``)."""
    report = await edge.dispatcher.ledger.query()
    rows = [r for r in report.rows if r.client_request_id == request_id]
    return sorted(rows, key=lambda r: r.attempt)


def sse_events(raw: str) -> list[str]:
    return [line[len("data: ") :] for line in raw.split("\n\n") if line.startswith("data: ")]


def streamed_text(events: list[str]) -> str:
    text = ""
    for data in events:
        if data == "[DONE]":
            continue
        chunk = orjson.loads(data)
        for choice in chunk.get("choices", []):
            text += choice["delta"].get("content") or ""
    return text


async def post(edge: Edge, body: Mapping[str, Any], request_id: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        return await client.post(
            "/v1/chat/completions", json=dict(body), headers={"x-request-id": request_id}
        )


async def recovered_request(edge: Edge, body: dict[str, Any]) -> tuple[httpx.Response, str]:
    """Send requests until one lands on the failing node first (ties between idle nodes are
    broken round-robin, so one of two consecutive requests does)."""
    for i in range(2):
        response = await post(edge, body, f"req-{i}")
        assert response.status_code == 200, response.text
        if response.headers["x-dispatcher-attempts"] == "2":
            return response, f"req-{i}"
    raise AssertionError("no request was placed on the failing node first")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "fault",
    [{"fail_before_first_token": True}, {"drop_connection_after_tokens": 0}],
    ids=["fails-before-first-token", "connection-drops-before-commit"],
)
async def test_failure_before_commit_is_recovered_on_another_node(
    stream: bool, fault: dict[str, Any]
) -> None:
    async with open_edge() as edge:
        await edge.add_node("node-a", **fault)
        await edge.add_node("node-b")
        await wait_until(lambda: len(edge.dispatcher.registry.sessions) == 2)
        response, request_id = await recovered_request(edge, chat(stream=stream))
        assert response.headers["x-dispatcher-node"] == "node-b"
        if stream:
            events = sse_events(response.text)
            assert events[-1] == "[DONE]"
            assert not [e for e in events if '"error"' in e]
            assert streamed_text(events) == "one two three four five six"
        else:
            body = response.json()
            assert body["choices"][0]["message"]["content"] == "one two three four five six"
        rows = await rows_for(edge, request_id)
        assert [(r.attempt, r.node_id, r.outcome, r.billable_to) for r in rows] == [
            (1, "node-a", "aborted", "operator"),
            (2, "node-b", "completed", "client"),
        ]
        assert rows[1].usage_source == "reported"
        assert rows[1].completion_tokens == 6
        await wait_until(lambda: (edge.stats().in_use, edge.stats().draining) == (0, 0))


async def test_failure_after_commit_is_an_sse_error_without_done() -> None:
    async with open_edge() as edge:
        await edge.add_node("node-a", fail_after_tokens=3)
        await wait_until(lambda: len(edge.dispatcher.registry.sessions) == 1)
        response = await post(edge, chat(stream=True), "after-commit")
        assert response.status_code == 200
        events = sse_events(response.text)
        assert streamed_text(events[:-1]) == "one two three "
        error = orjson.loads(events[-1])["error"]
        assert error["code"] == "echo_fault"
        assert "[DONE]" not in events
        (row,) = await rows_for(edge, "after-commit")
        assert (row.outcome, row.billable_to) == ("failed", "client")
        assert row.completion_tokens >= 3
        assert edge.stats().in_use == 0


async def test_all_candidates_fail_is_a_502_naming_the_last_cause() -> None:
    async with open_edge(max_attempts=3) as edge:
        await edge.add_node("node-a", fail_before_first_token=True)
        await edge.add_node("node-b", fail_before_first_token=True)
        await wait_until(lambda: len(edge.dispatcher.registry.sessions) == 2)
        response = await post(edge, chat(), "all-fail")
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["type"] == "server_error"
        assert error["code"] == "echo_fault"
        assert "last cause" in error["message"]
        rows = await rows_for(edge, "all-fail")
        # Two candidates, both failed: the third attempt finds nobody left to try.
        assert [(r.outcome, r.billable_to) for r in rows] == [("aborted", "operator")] * 2
        assert {r.node_id for r in rows} == {"node-a", "node-b"}


async def test_attempts_never_exceed_the_maximum() -> None:
    async with open_edge(max_attempts=2) as edge:
        for name in ("a", "b", "c"):
            await edge.add_node(name, fail_before_first_token=True)
        await wait_until(lambda: len(edge.dispatcher.registry.sessions) == 3)
        response = await post(edge, chat(), "capped")
        assert response.status_code == 502
        assert len(await rows_for(edge, "capped")) == 2


async def raw_stream(edge: Edge, body: dict[str, Any], until: bytes | None) -> trio.SocketStream:
    payload = orjson.dumps(body)
    stream = await trio.open_tcp_stream("127.0.0.1", edge.server.address.port)
    await stream.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-request-id: gone\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    if until is not None:
        received = b""
        with trio.fail_after(10):
            while until not in received:
                chunk = await stream.receive_some()
                assert chunk
                received += chunk
    return stream


async def assert_nothing_left(edge: Edge) -> None:
    await wait_until(
        lambda: (edge.stats().in_use, edge.stats().draining, edge.stats().waiting) == (0, 0, 0)
    )
    # The nodes confirmed every cancel: their runs are over.
    assert edge.stats().drains_expired == 0
    for session in edge.dispatcher.registry.sessions.values():
        assert session.runs == {}


async def test_client_disconnect_after_commit() -> None:
    async with open_edge() as edge:
        await edge.add_node("node-a", token_delay=0.05)
        await wait_until(lambda: len(edge.dispatcher.registry.sessions) == 1)
        stream = await raw_stream(edge, chat(stream=True), b'"content":"one ')
        await stream.aclose()
        await assert_nothing_left(edge)
        await wait_until(lambda: edge.dispatcher.ledger.statistics().rows_recorded == 1)
        (row,) = await rows_for(edge, "gone")
        assert (row.outcome, row.billable_to) == ("cancelled", "client")
        # The node's cancel confirmation carried the partial usage it knew.
        assert row.usage_source == "reported"
        assert row.completion_tokens >= 1


async def test_client_disconnect_before_commit() -> None:
    async with open_edge() as edge:
        await edge.add_node("node-a", token_delay=30)
        await wait_until(lambda: len(edge.dispatcher.registry.sessions) == 1)
        stream = await raw_stream(edge, chat(stream=True), None)
        await wait_until(lambda: edge.stats().in_use == 1)
        await stream.aclose()
        await assert_nothing_left(edge)
        await wait_until(lambda: edge.dispatcher.ledger.statistics().rows_recorded == 1)
        (row,) = await rows_for(edge, "gone")
        assert (row.outcome, row.billable_to) == ("cancelled", "operator")


async def test_client_disconnect_while_queued_leaves_no_row() -> None:
    async with open_edge(queue_timeout_s=60) as edge:
        await edge.add_node("node-a", slots=1, token_delay=0.05)
        await wait_until(lambda: len(edge.dispatcher.registry.sessions) == 1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, edge, chat(" ".join(["w"] * 20)), "first")
            await wait_until(lambda: edge.stats().in_use == 1)
            stream = await raw_stream(edge, chat(), None)
            await wait_until(lambda: edge.stats().waiting == 1)
            await stream.aclose()
            await wait_until(lambda: edge.stats().waiting == 0)
        await assert_nothing_left(edge)
        assert await rows_for(edge, "gone") == []
        assert len(await rows_for(edge, "first")) == 1


async def test_usage_endpoint_totals_and_restart(tmp_path: Any) -> None:
    db = str(tmp_path / "usage.sqlite3")
    async with open_edge(usage_db=db) as edge:
        await edge.add_node("node-a")
        await wait_until(lambda: len(edge.dispatcher.registry.sessions) == 1)
        for i in range(3):
            response = await post(edge, chat("alpha beta gamma"), f"r{i}")
            assert response.status_code == 200
    # A new edge on the same file: every row written before the shutdown is there.
    async with open_edge(usage_db=db) as edge, httpx.AsyncClient(base_url=edge.url) as client:
        usage = (await client.get("/v1/usage", params={"model": "echo"})).json()
    assert usage["totals"]["requests"] == 3
    assert usage["totals"]["attempts"] == 3
    assert usage["totals"]["completion_tokens"] == 9
    assert {row["client_request_id"] for row in usage["rows"]} == {"r0", "r1", "r2"}


async def test_a_stall_after_commit_is_an_sse_error_without_done() -> None:
    async with open_edge(stall_timeout_s=0.5) as edge:
        await edge.add_node("node-a", stall_after_tokens=2)
        await wait_until(lambda: len(edge.dispatcher.registry.sessions) == 1)
        with trio.fail_after(20):
            response = await post(edge, chat(stream=True), "stalled")
        events = sse_events(response.text)
        assert streamed_text(events[:-1]) == "one two "
        assert orjson.loads(events[-1])["error"]["code"] == "stall_timeout"
        assert "[DONE]" not in events
        await assert_nothing_left(edge)  # the stalled run was cancelled on the node
        await wait_until(lambda: edge.dispatcher.ledger.statistics().rows_recorded == 1)
        (row,) = await rows_for(edge, "stalled")
        assert (row.outcome, row.billable_to) == ("failed", "client")
