"""The stream gate on the tunnel path, end to end: a client over real HTTP -> the edge
(127.0.0.1 port 0) -> real websockets -> two real nodes, each relaying to its own fake
OpenAI-compatible provider on a real HTTP server. Recovery before the commit point (upstream
5xx / 429, a body broken off, a first token that never comes), relaying after it, and exactly
one usage row per dispatched tunnel attempt."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
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
from dispatcher.http import MalformedBody, Responder, Server
from dispatcher.store.usage import UsageRow
from nodes.agent import serve_node
from nodes.config import ModelConfig, NodeConfig, ProviderConfig

from ..nodes.fake_providers import SeenRequest, serve_fake_openai
from .fakes import wait_until
from .test_tunnel import (
    KEY_ENV,
    MODEL,
    PROVIDER_KEY,
    SERVED,
    TunnelFake,
    chat_body,
    raw_post,
    renamed,
    sse_events,
    without_usage_chunk,
)


@attrs.define(eq=False, kw_only=True)
class BreakingFake(TunnelFake):
    """A fake whose non-streamed chat answer can break off half-way (``break_body``)."""

    break_body: bool = False

    def route(self, seen: SeenRequest) -> Any:
        handler = super().route(seen)
        if handler is None or not self.break_body or seen.path != "/v1/chat/completions":
            return handler

        async def broken(seen: SeenRequest, responder: Responder) -> None:
            stream = await responder.start_stream(200, [(b"content-type", b"application/json")])
            await stream.send(b'{"id":"chatcmpl-broken","object":"chat.completion","choi')
            # Raising after answering makes serve_http cut the connection.
            raise MalformedBody("fake provider: body broken off")

        return broken


@attrs.define(eq=False)
class Edge:
    dispatcher: Dispatcher
    server: Server
    fakes: dict[str, BreakingFake]
    """By node id: ``node-a`` and ``node-b``."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.address.port}"

    @property
    def a(self) -> BreakingFake:
        return self.fakes["node-a"]

    @property
    def b(self) -> BreakingFake:
        return self.fakes["node-b"]

    def requests(self) -> int:
        return sum(len(fake.requests) for fake in self.fakes.values())

    async def post(
        self, body: dict[str, Any], request_id: str, path: str = "/v1/chat/completions"
    ) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            return await client.post(path, json=body, headers={"x-request-id": request_id})

    async def rows(self, request_id: str, count: int) -> list[UsageRow]:
        """The usage rows of the request sent with ``x-request-id: request_id`` (its
        ``client_request_id``; the key is the edge's), once there are ``count`` (rows are
        recorded when the gate's block ends, which may be just after the client got its
        answer)."""
        ledger = self.dispatcher.ledger
        rows: list[UsageRow] = []
        with trio.fail_after(5):
            while True:
                report = await ledger.query()
                rows = sorted(
                    (r for r in report.rows if r.client_request_id == request_id),
                    key=lambda r: r.attempt,
                )
                if len(rows) >= count:
                    break
                await trio.sleep(0.01)
        await trio.sleep(0.05)
        report = await ledger.query()
        assert len([r for r in report.rows if r.client_request_id == request_id]) == count
        return rows

    async def nothing_left(self) -> None:
        admission = self.dispatcher.admission
        await wait_until(
            lambda: (admission.statistics().in_use, admission.statistics().draining) == (0, 0)
        )
        assert admission.statistics().drains_expired == 0
        assert self.dispatcher.tunnels.statistics().open_tunnels == 0


def node_config(node_id: str, edge_port: int, base_url: str) -> NodeConfig:
    return NodeConfig(
        node_id=node_id,
        edge_url=f"ws://127.0.0.1:{edge_port}/v1/nodes/connect",
        providers=(
            ProviderConfig(
                id=f"vllm-{node_id}",
                type="openai",
                path="tunnel",
                base_url=base_url,
                api_key_env=KEY_ENV,
                models=(ModelConfig(name=MODEL, served_name=SERVED, slots=2),),
            ),
        ),
    )


@asynccontextmanager
async def open_edge(monkeypatch: pytest.MonkeyPatch, **policy: Any) -> AsyncIterator[Edge]:
    monkeypatch.setenv(KEY_ENV, PROVIDER_KEY)
    config = EdgeConfig(
        port=0,
        local_node=False,
        expose_node_ids=True,
        usage_db=":memory:",
        http=HTTPSettings(shutdown_grace=2),
        nodes=NodeSettings(heartbeat_interval=1, heartbeat_timeout=5),
        admission=QueuePolicySettings(**policy),
    )
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        server: Server = await nursery.start(dispatcher.serve)
        fakes: dict[str, BreakingFake] = {}
        node_scopes: list[trio.CancelScope] = []
        for node_id in ("node-a", "node-b"):
            fake: BreakingFake = await nursery.start(serve_fake_openai, BreakingFake())
            fake.api_key = PROVIDER_KEY
            fakes[node_id] = fake
            cfg = node_config(node_id, server.address.port, fake.base_url + "/v1")

            async def run_node(cfg: NodeConfig, task_status: trio.TaskStatus[None]) -> None:
                with trio.CancelScope() as scope:
                    node_scopes.append(scope)
                    await serve_node(cfg, task_status=task_status)

            await nursery.start(functools.partial(run_node, cfg))
        await wait_until(lambda: len(dispatcher.registry.sessions) == 2)
        try:
            yield Edge(dispatcher, server, fakes)
        finally:
            # The nodes first, so that the edge sees their close frames.
            for scope in node_scopes:
                scope.cancel()
            with trio.move_on_after(5):
                while dispatcher.registry.sessions:
                    await dispatcher.registry.wait_changed()
            server.shutdown()
            nursery.cancel_scope.cancel()


async def recovered(
    edge: Edge, body: dict[str, Any], path: str = "/v1/chat/completions", prefix: str = "req"
) -> tuple[httpx.Response, str]:
    """Send requests until one is placed on node-a first (ties between idle nodes are broken
    round-robin, so one of two consecutive requests is)."""
    for i in range(2):
        before = len(edge.a.requests)
        response = await edge.post(body, f"{prefix}-{i}", path)
        if len(edge.a.requests) > before:
            return response, f"{prefix}-{i}"
        assert response.headers["x-dispatcher-attempts"] == "1"
    raise AssertionError("no request was placed on node-a")


# --------------------------------------------------------------------------- recovery


@pytest.mark.parametrize(
    ("status", "code"), [(503, "upstream_5xx"), (429, "upstream_rate_limited")]
)
async def test_upstream_error_before_commit_is_recovered_on_another_node(
    monkeypatch: pytest.MonkeyPatch, status: int, code: str
) -> None:
    async with open_edge(monkeypatch) as edge:
        edge.a.status = status
        edge.b.chunk_count = 8
        body = chat_body(stream=True, stream_options={"include_usage": True})
        response, request_id = await recovered(edge, body)
        assert response.status_code == 200
        assert response.headers["x-dispatcher-attempts"] == "2"
        assert response.headers["x-dispatcher-node"] == "node-b"
        assert response.content == renamed(edge.b.sent().body)  # byte for byte what B sent
        assert response.content.endswith(b"data: [DONE]\n\n")
        rows = await edge.rows(request_id, 2)
        assert [(r.attempt, r.node_id, r.path, r.outcome, r.billable_to) for r in rows] == [
            (1, "node-a", "tunnel", "aborted", "operator"),
            (2, "node-b", "tunnel", "completed", "client"),
        ]
        assert rows[0].usage_source == "estimated"
        assert rows[0].ttft_s is None
        assert (rows[1].usage_source, rows[1].prompt_tokens, rows[1].completion_tokens) == (
            "reported",
            7,
            8,
        )
        assert rows[1].ttft_s is not None
        assert rows[1].ttft_s >= 0
        await edge.nothing_left()
        assert edge.dispatcher.gate.statistics[f"attempt_failed:{code}"] >= 1


async def test_stripped_usage_chunk_after_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_edge(monkeypatch) as edge:
        edge.a.status = 500
        response, request_id = await recovered(edge, chat_body(stream=True))
        assert response.status_code == 200
        assert response.content == renamed(without_usage_chunk(edge.b.sent().body))
        rows = await edge.rows(request_id, 2)
        assert rows[1].usage_source == "reported"


async def test_all_tunnel_candidates_fail_is_a_502_naming_the_last_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_edge(monkeypatch, max_attempts=3) as edge:
        edge.a.status = edge.b.status = 503
        response = await edge.post(chat_body(stream=True), "all-fail")
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == "upstream_5xx"
        assert "last cause" in error["message"]
        assert "answered status 503" in error["message"]
        assert edge.requests() == 2  # each candidate once; the third attempt finds nobody
        rows = await edge.rows("all-fail", 2)
        assert [(r.outcome, r.billable_to, r.path) for r in rows] == [
            ("aborted", "operator", "tunnel")
        ] * 2
        assert {r.node_id for r in rows} == {"node-a", "node-b"}
        await edge.nothing_left()


async def test_a_provider_400_is_relayed_as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_edge(monkeypatch) as edge:
        edge.a.status = edge.b.status = 400
        edge.a.error_message = edge.b.error_message = "bad temperature"
        # A value the edge accepts (0..2) and this provider refuses.
        response = await edge.post(chat_body(temperature=1.9), "bad")
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "bad temperature"
        assert response.headers["x-dispatcher-attempts"] == "1"
        assert edge.requests() == 1  # no retry
        (row,) = await edge.rows("bad", 1)
        assert (row.outcome, row.billable_to, row.path) == ("failed", "client", "tunnel")
        assert (row.prompt_tokens, row.completion_tokens, row.usage_source) == (0, 0, "estimated")
        await edge.nothing_left()


async def test_a_body_broken_off_before_commit_is_recovered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_edge(monkeypatch) as edge:
        edge.a.break_body = True
        response, request_id = await recovered(edge, chat_body())
        assert response.status_code == 200
        assert response.headers["x-dispatcher-attempts"] == "2"
        assert response.content == renamed(edge.b.sent().body)
        assert int(response.headers["content-length"]) == len(response.content)
        rows = await edge.rows(request_id, 2)
        assert [(r.node_id, r.outcome, r.billable_to) for r in rows] == [
            ("node-a", "aborted", "operator"),
            ("node-b", "completed", "client"),
        ]
        assert (rows[1].usage_source, rows[1].completion_tokens) == ("reported", 5)
        await edge.nothing_left()


async def test_first_token_timeout_moves_the_tunnel_to_the_next_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_edge(monkeypatch, first_token_timeout_s=0.5) as edge:
        edge.a.stall_after_chunks = 0  # the role preamble, then nothing
        response, request_id = await recovered(edge, chat_body(stream=True))
        assert response.status_code == 200
        assert response.headers["x-dispatcher-attempts"] == "2"
        assert response.content == renamed(without_usage_chunk(edge.b.sent().body))
        await edge.a.requests[-1].disconnected.wait()  # the node closed A's request
        rows = await edge.rows(request_id, 2)
        assert [(r.node_id, r.outcome) for r in rows] == [
            ("node-a", "aborted"),
            ("node-b", "completed"),
        ]
        await edge.nothing_left()
        assert edge.dispatcher.gate.statistics["attempt_failed:first_token_timeout"] == 1


async def test_completions_and_embeddings_are_recovered_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_edge(monkeypatch) as edge:
        edge.a.status = 502
        calls: list[tuple[str, dict[str, Any]]] = [
            ("/v1/completions", {"model": MODEL, "prompt": "once upon", "stream": True}),
            ("/v1/embeddings", {"model": MODEL, "input": ["a b", "c"]}),
        ]
        for path, body in calls:
            response, request_id = await recovered(edge, body, path, prefix=path)
            assert response.status_code == 200
            assert response.headers["x-dispatcher-attempts"] == "2"
            sent = renamed(edge.b.sent().body)
            expected = without_usage_chunk(sent) if body.get("stream") else sent
            assert response.content == expected
            rows = await edge.rows(request_id, 2)
            assert [(r.outcome, r.path) for r in rows] == [
                ("aborted", "tunnel"),
                ("completed", "tunnel"),
            ]
            assert rows[1].usage_source == "reported"
        await edge.nothing_left()


# --------------------------------------------------------------------------- after the commit


async def test_failure_after_commit_is_an_sse_error_without_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_edge(monkeypatch) as edge:
        for fake in edge.fakes.values():
            fake.chunk_count = 10
            fake.fail_after_chunks = 4
        response = await edge.post(chat_body(stream=True), "broken")
        assert response.status_code == 200
        assert edge.requests() == 1  # no retry after the commit
        (fake,) = [f for f in edge.fakes.values() if f.requests]
        events = sse_events(response.content)
        assert events[:5] == sse_events(renamed(fake.sent().body))[:5]
        last = orjson.loads(events[-1].removeprefix(b"data: "))
        assert last["error"]["code"] == "tunnel_failed"
        assert b"[DONE]" not in response.content
        (row,) = await edge.rows("broken", 1)
        assert (row.outcome, row.billable_to, row.path) == ("failed", "client", "tunnel")
        assert row.usage_source == "estimated"
        await edge.nothing_left()


async def test_client_disconnect_after_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_edge(monkeypatch) as edge:
        for fake in edge.fakes.values():
            fake.chunk_count = 100_000
            fake.chunk_delay = 0.005
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", edge.server.address.port)
            async with stream:
                request = raw_post("/v1/chat/completions", chat_body(stream=True))
                request = request.replace(
                    b"host: edge\r\n", b"host: edge\r\nx-request-id: gone\r\n"
                )
                await stream.send_all(request)
                received = b""
                while received.count(b"\n\n") < 6:  # the head, then five events
                    received += await stream.receive_some(65536)
                assert received.startswith(b"HTTP/1.1 200 ")
            (fake,) = [f for f in edge.fakes.values() if f.requests]
            (seen,) = fake.requests
            await seen.disconnected.wait()  # the node closed the provider's request
            assert seen.chunks_sent < 100_000
            await edge.nothing_left()
        (row,) = await edge.rows("gone", 1)
        assert (row.outcome, row.billable_to, row.path) == ("cancelled", "client", "tunnel")
        assert row.ttft_s is not None
        assert edge.dispatcher.tunnels.statistics().ended == {"cancelled": 1}


async def test_client_disconnect_before_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_edge(monkeypatch) as edge:
        for fake in edge.fakes.values():
            fake.stall_after_chunks = 0
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", edge.server.address.port)
            async with stream:
                request = raw_post("/v1/chat/completions", chat_body(stream=True))
                request = request.replace(
                    b"host: edge\r\n", b"host: edge\r\nx-request-id: early\r\n"
                )
                await stream.send_all(request)
                await wait_until(lambda: edge.requests() == 1)
            (fake,) = [f for f in edge.fakes.values() if f.requests]
            await fake.requests[0].disconnected.wait()
            await edge.nothing_left()
        (row,) = await edge.rows("early", 1)
        assert (row.outcome, row.billable_to, row.path) == ("cancelled", "operator", "tunnel")
        assert row.ttft_s is None


async def test_a_stall_after_commit_is_an_sse_error_and_aborts_the_tunnel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_edge(monkeypatch, stall_timeout_s=0.5) as edge:
        for fake in edge.fakes.values():
            fake.chunk_count = 10
            fake.stall_after_chunks = 4
        with trio.fail_after(20):
            response = await edge.post(chat_body(stream=True), "stalled")
        assert response.status_code == 200
        assert edge.requests() == 1  # no retry after the commit
        (fake,) = [f for f in edge.fakes.values() if f.requests]
        events = sse_events(response.content)
        last = orjson.loads(events[-1].removeprefix(b"data: "))
        assert last["error"]["code"] == "stall_timeout"
        assert b"[DONE]" not in response.content
        # The stalled upstream request was closed, not left hanging on the node.
        (seen,) = fake.requests
        with trio.fail_after(10):
            await seen.disconnected.wait()
        (row,) = await edge.rows("stalled", 1)
        assert (row.outcome, row.billable_to, row.path) == ("failed", "client", "tunnel")
        await edge.nothing_left()


async def test_a_client_leaving_after_the_relayed_done_is_completed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The official SDK closes the connection as soon as it reads ``data: [DONE]``; the
    provider may keep its connection a while longer. The client has the whole answer: the row
    is ``completed`` with the provider's usage, and the metric agrees."""
    async with open_edge(monkeypatch) as edge:
        for fake in edge.fakes.values():
            fake.linger_after_end = 30
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", edge.server.address.port)
            async with stream:
                request = raw_post("/v1/chat/completions", chat_body(stream=True))
                request = request.replace(
                    b"host: edge\r\n", b"host: edge\r\nx-request-id: done-then-gone\r\n"
                )
                await stream.send_all(request)
                received = b""
                while b"data: [DONE]\n\n" not in received:
                    received += await stream.receive_some(65536)
            await edge.nothing_left()
        (row,) = await edge.rows("done-then-gone", 1)
        assert (row.outcome, row.usage_source, row.path) == ("completed", "reported", "tunnel")
        text = edge.dispatcher.metrics.render().decode()
        assert 'dispatcher_requests_total{model="' in text
        assert 'outcome="completed"} 1.0' in text
        assert 'outcome="client_gone"} 1.0' not in text


async def test_no_client_facing_message_names_the_providers_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_edge(monkeypatch, max_attempts=2) as edge:
        edge.a.break_body = edge.b.break_body = True
        response = await edge.post(chat_body(), "no-address")
        assert response.status_code == 502
        message = response.json()["error"]["message"]
        assert "broke off" in message
        for fake in edge.fakes.values():
            address = fake.base_url.removeprefix("http://")
            assert address not in message
        assert "127.0.0.1" not in message
        await edge.nothing_left()
