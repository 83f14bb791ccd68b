"""Issue #23's acceptance over HTTP: an edge opened by ``open_dispatcher`` with its tenants'
limits on a real ``redis-server`` (``[store] redis_url``), which stops mid-load. With
``on_store_error = "refuse"`` a stream admitted before finishes; new requests of a key with
limits get 503 in each front end's shape, naming the limit store, counted in ``/metrics``;
a key without limits is served; within seconds of Redis' return, service is normal. With
``"local"`` the key's limits divided by ``edge_count`` hold on the edge."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
import trio

from dispatcher.config import EdgeConfig, KeySettings, StoreSettings
from tests.store.redis_server import BINARY, RedisServer, own_server

from .fakes import ServedEdge, serve_edge

pytestmark = pytest.mark.skipif(BINARY is None, reason="no redis-server")

ADMIN = "sk-admin"
ALICE = "sk-alice"
FREE = "sk-free"
MESSAGES: list[Any] = [{"role": "user", "content": "one two three four"}]
CHAT = {"model": "echo", "messages": MESSAGES}


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with own_server() as server:
        yield server


@asynccontextmanager
async def open_edge(server: RedisServer, **store: Any) -> AsyncIterator[httpx.AsyncClient]:
    config = EdgeConfig(
        port=0,
        local_node=False,
        admin_keys=(ADMIN,),
        keys=(
            KeySettings(id="alice", key=ALICE, rpm=4),
            KeySettings(id="free", key=FREE),
        ),
        store=StoreSettings(redis_url=server.url, timeout_s=0.3, **store),
    )
    async with (
        serve_edge(config, ServedEdge, local_node=True) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=10) as client,
    ):
        yield client


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def back(client: httpx.AsyncClient) -> None:
    """Ask until a chat of ALICE's is served again (at most 5 s after Redis' return; it
    is refused or decided on the edge until then)."""
    with trio.fail_after(5):
        while True:
            answer = await client.post("/v1/chat/completions", json=CHAT, headers=auth(ALICE))
            if answer.status_code == 200:
                return
            assert answer.status_code in (429, 503), answer.text
            await trio.sleep(0.05)


def metric(text: str, name: str) -> float:
    [line] = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[-1])


async def test_refuse_while_redis_is_down_and_serve_within_seconds_of_its_return(
    server: RedisServer,
) -> None:
    async with open_edge(server) as client:
        first = await client.post("/v1/chat/completions", json=CHAT, headers=auth(ALICE))
        assert first.is_success

        # A stream admitted before Redis stops finishes, with no error event.
        body = {**CHAT, "stream": True, "echo": {"token_delay": 0.1}}
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=auth(ALICE)
        ) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            received = [await anext(lines)]
            server.stop()
            async for line in lines:
                received.append(line)
        text = "\n".join(received)
        assert "data: [DONE]" in text
        assert '"error"' not in text
        content = "".join(
            choice["delta"].get("content") or ""
            for line in received
            if line.startswith("data: {")
            for choice in orjson.loads(line[6:])["choices"]
        )
        assert content == "one two three four"

        # New requests of a key with limits: 503 naming the limit store, in every shape.
        chat = await client.post("/v1/chat/completions", json=CHAT, headers=auth(ALICE))
        responses = await client.post(
            "/v1/responses", json={"model": "echo", "input": "hi"}, headers=auth(ALICE)
        )
        messages = await client.post(
            "/v1/messages",
            json={"model": "echo", "max_tokens": 16, "messages": MESSAGES},
            headers={"x-api-key": ALICE, "anthropic-version": "2023-06-01"},
        )
        for answer in chat, responses:
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            assert error["code"] == "limit_store_unavailable"
            assert "limit store" in error["message"]
            assert int(answer.headers["retry-after"]) >= 1
        assert messages.status_code == 529, messages.text
        assert messages.json()["type"] == "error"
        assert messages.json()["error"]["type"] == "overloaded_error"
        assert "limit store" in messages.json()["error"]["message"]
        assert "retry-after" in messages.headers
        # A key without limits has nothing to check: it is served.
        free = await client.post("/v1/chat/completions", json=CHAT, headers=auth(FREE))
        assert free.is_success, free.text

        scraped = (await client.get("/metrics", headers=auth(ADMIN))).text
        assert metric(scraped, "dispatcher_limit_store_up") == 0
        assert metric(scraped, 'dispatcher_limit_store_errors_total{mode="refuse"}') == 3
        assert metric(scraped, 'dispatcher_limit_store_errors_total{mode="local"}') == 1
        assert metric(scraped, "dispatcher_limit_store_outages_total") == 1
        assert metric(scraped, 'dispatcher_requests_total{model="echo",outcome="rejected"}') == 3

        server.start()
        await back(client)
        scraped = (await client.get("/metrics", headers=auth(ADMIN))).text
        assert metric(scraped, "dispatcher_limit_store_up") == 1


async def test_local_holds_each_edges_share_of_the_limits(server: RedisServer) -> None:
    """rpm = 4 over edge_count = 2: this edge serves 2 while Redis is down, then 429s."""
    async with open_edge(server, on_store_error="local", edge_count=2) as client:
        server.stop()
        statuses = [
            (await client.post("/v1/chat/completions", json=CHAT, headers=auth(ALICE))).status_code
            for _ in range(3)
        ]
        assert statuses == [200, 200, 429]
        refused = await client.post("/v1/chat/completions", json=CHAT, headers=auth(ALICE))
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.headers["x-ratelimit-limit-requests"] == "2"
        scraped = (await client.get("/metrics", headers=auth(ADMIN))).text
        assert metric(scraped, 'dispatcher_limit_store_errors_total{mode="local"}') == 4
        assert metric(scraped, 'dispatcher_limit_store_errors_total{mode="refuse"}') == 0
        server.start()
        await back(client)
        scraped = (await client.get("/metrics", headers=auth(ADMIN))).text
        assert metric(scraped, "dispatcher_limit_store_up") == 1
