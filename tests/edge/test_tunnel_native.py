"""Native tunnels: ``/v1/messages`` relayed to an Anthropic-API provider and ``/v1/responses``
to an OpenAI Responses provider, end to end: the official ``anthropic`` and ``openai`` SDKs ->
a real edge (127.0.0.1 port 0) -> a real ``dispatcher node`` process -> a fake of the two APIs
on 127.0.0.1 (``native_fakes.py``), and back.

The node serves ``claude-native`` with two ``anthropic`` tunnel providers declaring
``routes = ["messages"]`` and ``gpt-native`` with two ``openai`` ones declaring
``["responses"]``, and both models with an ``openai`` tunnel provider declaring no routes (the
default chat, completions, embeddings): that one is never chosen for either route.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import attrs
import httpx
import openai
import orjson
import pytest
import trio

from dispatcher import wire
from dispatcher.config import EdgeConfig, NodeSettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server
from dispatcher.paths.tunnel import Tunnel
from dispatcher.paths.tunnel_http import (
    ModelRewrite,
    SSEFilter,
    body_usage,
    dialect_of,
    dialect_usage,
    tail_usage,
    upstream_headers,
)
from dispatcher.store.usage import UsageRow
from nodes.tunnel import request_headers

from ..nodes.fake_providers import _serve
from .fakes import wait_until
from .native_fakes import (
    CACHE_READ,
    CACHE_WRITE,
    CACHED_TOKENS,
    INPUT_TOKENS,
    REASONING_TOKENS,
    NativeFake,
    anthropic_event,
    anthropic_usage_object,
    responses_event,
    responses_usage_object,
)

CLIENT_KEY = "client-key-for-the-edge-5b1e"
ANTHROPIC_KEY = "sk-ant-node-secret-8d2f"
OPENAI_KEY = "sk-openai-node-secret-93ac"
CLAUDE = "claude-native"
CLAUDE_SERVED = "claude-served-4"
GPT = "gpt-native"
GPT_SERVED = "gpt-served-5"
NODE_ID = "native-node"

NODE_TOML = """\
[node]
id = "{node_id}"
edge_url = "ws://127.0.0.1:{port}/v1/nodes/connect"
reconnect_min_backoff = 0.2
reconnect_max_backoff = 1

[[providers]]
id = "anth-a"
type = "anthropic"
path = "tunnel"
base_url = "{fake}"
api_key_env = "NATIVE_TEST_ANTHROPIC_KEY"
routes = ["messages"]
  [[providers.models]]
  name = "{claude}"
  served_name = "{claude_served}"
  slots = 2

[[providers]]
id = "anth-b"
type = "anthropic"
path = "tunnel"
base_url = "{fake}"
api_key_env = "NATIVE_TEST_ANTHROPIC_KEY"
routes = ["messages"]
  [[providers.models]]
  name = "{claude}"
  served_name = "{claude_served}"
  slots = 2

[[providers]]
id = "resp-a"
type = "openai"
path = "tunnel"
base_url = "{fake}/v1"
api_key_env = "NATIVE_TEST_OPENAI_KEY"
routes = ["responses"]
  [[providers.models]]
  name = "{gpt}"
  served_name = "{gpt_served}"
  slots = 2

[[providers]]
id = "resp-b"
type = "openai"
path = "tunnel"
base_url = "{fake}/v1"
api_key_env = "NATIVE_TEST_OPENAI_KEY"
routes = ["responses"]
  [[providers.models]]
  name = "{gpt}"
  served_name = "{gpt_served}"
  slots = 2

[[providers]]
id = "plain"
type = "openai"
path = "tunnel"
base_url = "{fake}/v1"
api_key_env = "NATIVE_TEST_OPENAI_KEY"
  [[providers.models]]
  name = "{claude}"
  slots = 2
  [[providers.models]]
  name = "{gpt}"
  slots = 2
"""


@attrs.define(eq=False)
class NativeEnv:
    dispatcher: Dispatcher
    server: Server
    fake: NativeFake
    usages: list[wire.Usage]
    """Every usage a tunnel's relay reported (``Tunnel.on_usage``), in order."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.address.port}"

    def anthropic(self) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.url, api_key=CLIENT_KEY, max_retries=0)

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=CLIENT_KEY, max_retries=0)

    def raw(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers={"x-api-key": CLIENT_KEY}, timeout=30)

    async def rows(self, request_id: str, count: int) -> list[UsageRow]:
        """The usage rows of the request sent with ``x-request-id: request_id``, once there
        are ``count`` (and still ``count`` a moment later)."""
        rows: list[UsageRow] = []
        with trio.fail_after(10):
            while len(rows) < count:
                await trio.sleep(0.01)
                report = await self.dispatcher.ledger.query()
                rows = [r for r in report.rows if r.client_request_id == request_id]
        await trio.sleep(0.05)
        report = await self.dispatcher.ledger.query()
        rows = [r for r in report.rows if r.client_request_id == request_id]
        assert len(rows) == count, rows
        return sorted(rows, key=lambda r: r.attempt)

    async def idle(self) -> None:
        admission = self.dispatcher.admission
        await wait_until(
            lambda: (admission.statistics().in_use, admission.statistics().draining) == (0, 0),
            timeout=10,
        )
        assert self.dispatcher.tunnels.statistics().open_tunnels == 0

    async def leave_after(self, request: bytes, marker: bytes, count: int) -> None:
        """Send ``request`` over a plain TCP connection and close it once the answer holds
        ``marker`` ``count`` times (a client leaving mid-stream)."""
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", self.server.address.port)
            async with stream:
                await stream.send_all(request)
                received = b""
                while received.count(marker) < count:
                    received += await stream.receive_some(65536)
                assert received.startswith(b"HTTP/1.1 200 ")

    def assert_keys_stayed_home(self) -> None:
        """The provider saw the node's key, the way its API takes it, and never the client's."""
        for seen in self.fake.requests:
            assert all(CLIENT_KEY not in value for _, value in seen.headers)
            if seen.path == "/v1/messages":
                assert seen.header("x-api-key") == ANTHROPIC_KEY
                assert seen.authorization is None
            else:
                assert seen.authorization == f"Bearer {OPENAI_KEY}"
                assert seen.header("x-api-key") is None


@asynccontextmanager
async def open_native(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[NativeEnv]:
    usages: list[wire.Usage] = []
    on_usage = Tunnel.on_usage

    def watched(self: Tunnel, usage: wire.Usage) -> None:
        usages.append(usage)
        on_usage(self, usage)

    monkeypatch.setattr(Tunnel, "on_usage", watched)
    config = EdgeConfig(
        port=0,
        local_node=False,
        expose_node_ids=True,
        api_keys=(CLIENT_KEY,),
        nodes=NodeSettings(heartbeat_interval=1, heartbeat_timeout=5),
    )
    fake = NativeFake(anthropic_key=ANTHROPIC_KEY, openai_key=OPENAI_KEY)
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        await nursery.start(_serve, fake)
        server: Server = await nursery.start(dispatcher.serve)
        toml = tmp_path / "node.toml"
        toml.write_text(
            NODE_TOML.format(
                node_id=NODE_ID,
                port=server.address.port,
                fake=fake.base_url,
                claude=CLAUDE,
                claude_served=CLAUDE_SERVED,
                gpt=GPT,
                gpt_served=GPT_SERVED,
            )
        )
        env = {
            **os.environ,
            "NATIVE_TEST_ANTHROPIC_KEY": ANTHROPIC_KEY,
            "NATIVE_TEST_OPENAI_KEY": OPENAI_KEY,
        }
        command = [sys.executable, "-m", "dispatcher", "node", "--config", str(toml)]
        node = await nursery.start(
            functools.partial(trio.run_process, command, check=False, env=env)
        )
        try:
            with trio.fail_after(30):
                while NODE_ID not in dispatcher.registry.sessions:
                    await dispatcher.registry.wait_changed()
            yield NativeEnv(dispatcher, server, fake, usages)
        finally:
            # The node drains and leaves on SIGTERM; the edge and the fake stop once it is gone.
            node.send_signal(signal.SIGTERM)
            with trio.move_on_after(20):
                await node.wait()
            nursery.cancel_scope.cancel()


def sse_events(raw: bytes) -> list[bytes]:
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event]


def renamed(raw: bytes, served: str, asked: str) -> bytes:
    """The provider's bytes as the client must get them: the served name in a ``"model"``
    member replaced by the asked one (the fake writes compact JSON)."""
    return raw.replace(b'"model":' + orjson.dumps(served), b'"model":' + orjson.dumps(asked))


def raw_post(path: str, body: dict[str, Any], request_id: str) -> bytes:
    """An HTTP/1.1 POST of ``body`` as JSON, with the client's key (Anthropic's way)."""
    data = orjson.dumps(body)
    return (
        f"POST {path} HTTP/1.1\r\nhost: edge\r\nx-api-key: {CLIENT_KEY}\r\n"
        f"anthropic-version: 2023-06-01\r\nx-request-id: {request_id}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    ).encode() + data


def messages_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": CLAUDE,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "say hello"}],
        **extra,
    }


# --------------------------------------------------------------------------- /v1/messages


async def test_messages_stream_is_the_providers_events_but_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_native(tmp_path, monkeypatch) as env:
        env.fake.chunk_count = 6
        async with (
            env.raw() as client,
            client.stream(
                "POST",
                "/v1/messages",
                json=messages_body(stream=True),
                headers={
                    "x-request-id": "m-stream",
                    "anthropic-version": "2023-06-01",
                    "anthropic-beta": "prompt-caching-2024-07-31",
                },
            ) as response,
        ):
            assert response.status_code == 200
            received = b"".join([part async for part in response.aiter_raw()])
        sent = env.fake.sent_bytes()
        assert b'"model":"claude-served-4"' in sent
        assert received == renamed(sent, CLAUDE_SERVED, CLAUDE)
        assert sse_events(received)[-1].startswith(b"event: message_stop")
        (seen,) = env.fake.requests
        assert seen.json == {**messages_body(stream=True), "model": CLAUDE_SERVED}
        assert seen.header("anthropic-version") == "2023-06-01"
        assert seen.header("anthropic-beta") == "prompt-caching-2024-07-31"
        env.assert_keys_stayed_home()
        (row,) = await env.rows("m-stream", 1)
        assert (row.provider_id in ("anth-a", "anth-b"), row.path, row.route) == (
            True,
            "tunnel",
            "/v1/messages",
        )
        assert (row.outcome, row.usage_source) == ("completed", "reported")
        assert (row.prompt_tokens, row.completion_tokens) == (
            INPUT_TOKENS + CACHE_READ + CACHE_WRITE,
            6,
        )
        # the ledger keeps the parts too (cached_tokens, cache_write_tokens columns)
        assert (row.cached_tokens, row.cache_write_tokens, row.reasoning_tokens) == (
            CACHE_READ,
            CACHE_WRITE,
            0,
        )
        assert env.usages == [
            wire.Usage(
                prompt_tokens=INPUT_TOKENS + CACHE_READ + CACHE_WRITE,
                completion_tokens=6,
                cached_tokens=CACHE_READ,
                cache_write_tokens=CACHE_WRITE,
            )
        ]
        await env.idle()


async def test_the_anthropic_sdk_streams_and_creates_through_a_native_tunnel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_native(tmp_path, monkeypatch) as env:
        env.fake.chunk_count = 5
        async with env.anthropic() as client:
            message = await client.messages.create(
                model=CLAUDE,
                max_tokens=64,
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-request-id": "m-whole"},
            )
            assert message.model == CLAUDE
            assert message.content[0].type == "text"
            assert message.content[0].text == env.fake.expected_text
            assert message.usage.cache_read_input_tokens == CACHE_READ
            whole = env.fake.sent_bytes()
            async with client.messages.stream(
                model=CLAUDE,
                max_tokens=64,
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-request-id": "m-sdk-stream"},
            ) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_message()
        assert final.model == CLAUDE
        assert final.content[0].type == "text"
        assert final.content[0].text == env.fake.expected_text
        assert final.usage.output_tokens == 5
        assert kinds[0] == "message_start"
        assert kinds[-1] == "message_stop"
        # the SDK sent its own anthropic-version; the node added none beside it
        for seen in env.fake.requests:
            assert [k for k, _ in seen.headers].count("anthropic-version") == 1
        env.assert_keys_stayed_home()
        (row,) = await env.rows("m-whole", 1)
        assert (row.outcome, row.usage_source, row.prompt_tokens, row.completion_tokens) == (
            "completed",
            "reported",
            INPUT_TOKENS + CACHE_READ + CACHE_WRITE,
            5,
        )
        assert env.usages[0].cached_tokens == CACHE_READ
        assert env.usages[0].cache_write_tokens == CACHE_WRITE
        assert (row.cached_tokens, row.cache_write_tokens) == (CACHE_READ, CACHE_WRITE)
        assert orjson.loads(whole)["model"] == CLAUDE_SERVED
        await env.rows("m-sdk-stream", 1)


async def test_the_node_adds_anthropic_version_when_the_client_sent_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_native(tmp_path, monkeypatch) as env:
        async with env.raw() as client:
            response = await client.post("/v1/messages", json=messages_body())
        assert response.status_code == 200, response.text
        assert response.json()["model"] == CLAUDE
        # the body as the provider sent it, but for the model's name
        assert response.content == renamed(env.fake.sent_bytes(), CLAUDE_SERVED, CLAUDE)
        assert response.headers["content-type"] == "application/json"
        (seen,) = env.fake.requests
        assert seen.header("anthropic-version") == "2023-06-01"
        env.assert_keys_stayed_home()


@pytest.mark.parametrize("with_event", [False, True], ids=["status-529", "error-event"])
async def test_messages_recover_before_the_first_content_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_event: bool
) -> None:
    async with open_native(tmp_path, monkeypatch) as env:
        env.fake.fail_next = 1
        env.fake.fail_with_event = with_event
        async with (
            env.anthropic() as client,
            client.messages.stream(
                model=CLAUDE,
                max_tokens=64,
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-request-id": "m-recover"},
            ) as stream,
        ):
            text = "".join([piece async for piece in stream.text_stream])
        assert text == env.fake.expected_text
        first, second = await env.rows("m-recover", 2)
        assert {first.provider_id, second.provider_id} == {"anth-a", "anth-b"}
        assert (first.attempt, first.outcome) == (1, "aborted")
        assert (second.attempt, second.outcome) == (2, "completed")
        assert second.completion_tokens == len(env.fake.tokens)
        assert len(env.fake.requests) == 2
        env.assert_keys_stayed_home()
        await env.idle()


async def test_messages_after_the_commit_end_with_an_error_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_native(tmp_path, monkeypatch) as env:
        env.fake.chunk_count = 6
        env.fake.break_after = 5  # message_start, block start, ping, two deltas
        async with (
            env.raw() as client,
            client.stream(
                "POST",
                "/v1/messages",
                json=messages_body(stream=True),
                headers={"x-request-id": "m-broken", "anthropic-version": "2023-06-01"},
            ) as response,
        ):
            assert response.status_code == 200
            received = b"".join([part async for part in response.aiter_raw()])
        events = sse_events(received)
        sent = env.fake.sent_bytes()
        assert b"".join(events[:-1]) == renamed(sent, CLAUDE_SERVED, CLAUDE)
        assert events[-1].startswith(b"event: error\ndata: ")
        error = orjson.loads(events[-1].split(b"data: ", 1)[1])
        assert error["type"] == "error"
        assert error["error"]["type"] == "api_error"
        assert "failed mid-body" in error["error"]["message"]
        # the SDK sees it as an error, not a clean end
        env.fake.break_after = 5
        async with env.anthropic() as sdk:

            async def consume() -> None:
                async with sdk.messages.stream(
                    model=CLAUDE, max_tokens=64, messages=[{"role": "user", "content": "hi"}]
                ) as stream:
                    async for _ in stream:
                        pass

            with pytest.raises(anthropic.APIStatusError) as raised:
                await consume()
        assert "api_error" in str(raised.value.body)
        (row,) = await env.rows("m-broken", 1)
        assert row.outcome == "failed"
        assert len(env.fake.requests) == 2  # no retry after the commit
        await env.idle()


async def test_a_client_leaving_a_messages_stream_reaches_the_provider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_native(tmp_path, monkeypatch) as env:
        env.fake.chunk_count = 100_000
        env.fake.chunk_delay = 0.005
        request = raw_post("/v1/messages", messages_body(stream=True), "m-leaver")
        await env.leave_after(request, b"content_block_delta", 3)
        (seen,) = env.fake.requests
        with trio.fail_after(10):
            await seen.disconnected.wait()
        assert seen.chunks_sent < 100_000
        (row,) = await env.rows("m-leaver", 1)
        assert row.outcome == "cancelled"
        await env.idle()
        assert env.dispatcher.tunnels.statistics().ended.get("cancelled") == 1


async def test_a_provider_not_declaring_the_route_is_never_chosen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_native(tmp_path, monkeypatch) as env:
        async with env.raw() as client:
            for index in range(6):
                response = await client.post(
                    "/v1/messages",
                    json=messages_body(),
                    headers={"x-request-id": f"m-choice-{index}"},
                )
                assert response.status_code == 200, response.text
                response = await client.post(
                    "/v1/responses",
                    json={"model": GPT, "input": "hi"},
                    headers={"x-request-id": f"r-choice-{index}"},
                )
                assert response.status_code == 200, response.text
        rows = (await env.dispatcher.ledger.query()).rows
        assert len(rows) == 12
        assert {r.provider_id for r in rows if r.route == "/v1/messages"} <= {"anth-a", "anth-b"}
        assert {r.provider_id for r in rows if r.route == "/v1/responses"} <= {"resp-a", "resp-b"}
        assert all(r.attempt == 1 for r in rows)
        env.assert_keys_stayed_home()


# --------------------------------------------------------------------------- /v1/responses


async def test_responses_stream_is_the_providers_events_but_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_native(tmp_path, monkeypatch) as env:
        env.fake.chunk_count = 4
        body = {"model": GPT, "input": "say hello", "stream": True, "store": False}
        async with (
            env.raw() as client,
            client.stream(
                "POST", "/v1/responses", json=body, headers={"x-request-id": "r-stream"}
            ) as response,
        ):
            assert response.status_code == 200
            received = b"".join([part async for part in response.aiter_raw()])
        sent = env.fake.sent_bytes()
        assert sent.count(b'"model":"gpt-served-5"') == 3  # created, in_progress, completed
        assert received == renamed(sent, GPT_SERVED, GPT)
        (seen,) = env.fake.requests
        assert seen.json == {**body, "model": GPT_SERVED}
        env.assert_keys_stayed_home()
        (row,) = await env.rows("r-stream", 1)
        assert (row.path, row.route, row.outcome, row.usage_source) == (
            "tunnel",
            "/v1/responses",
            "completed",
            "reported",
        )
        assert (row.prompt_tokens, row.completion_tokens) == (INPUT_TOKENS, 4)
        assert (row.cached_tokens, row.reasoning_tokens) == (CACHED_TOKENS, REASONING_TOKENS)
        assert env.usages == [
            wire.Usage(
                prompt_tokens=INPUT_TOKENS,
                completion_tokens=4,
                cached_tokens=CACHED_TOKENS,
                reasoning_tokens=REASONING_TOKENS,
            )
        ]
        await env.idle()


async def test_the_openai_sdk_creates_responses_through_a_native_tunnel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_native(tmp_path, monkeypatch) as env:
        env.fake.chunk_count = 3
        async with env.openai() as client:
            response = await client.responses.create(
                model=GPT, input="hi", extra_headers={"x-request-id": "r-whole"}
            )
            assert response.model == GPT
            assert response.output_text == env.fake.expected_text
            assert response.usage is not None
            assert response.usage.input_tokens_details.cached_tokens == CACHED_TOKENS
            stream = await client.responses.create(
                model=GPT, input="hi", stream=True, extra_headers={"x-request-id": "r-sdk"}
            )
            events = [event async for event in stream]
        assert events[0].type == "response.created"
        assert events[0].response.model == GPT
        assert events[-1].type == "response.completed"
        assert events[-1].response.model == GPT
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert "".join(deltas) == env.fake.expected_text
        (row,) = await env.rows("r-whole", 1)
        assert (row.usage_source, row.prompt_tokens, row.completion_tokens) == (
            "reported",
            INPUT_TOKENS,
            3,
        )
        await env.rows("r-sdk", 1)
        assert [u.reasoning_tokens for u in env.usages] == [REASONING_TOKENS] * 2
        env.assert_keys_stayed_home()
        # the edge does not store a native answer: the upstream holds it
        async with env.raw() as raw:
            stored = await raw.get(f"/v1/responses/{response.id}")
        assert stored.status_code == 404


@pytest.mark.parametrize("with_event", [False, True], ids=["status-500", "response-failed"])
async def test_responses_recover_before_the_first_content_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_event: bool
) -> None:
    async with open_native(tmp_path, monkeypatch) as env:
        env.fake.fail_next = 1
        env.fake.fail_status = 500
        env.fake.fail_with_event = with_event
        async with env.openai() as client:
            stream = await client.responses.create(
                model=GPT, input="hi", stream=True, extra_headers={"x-request-id": "r-recover"}
            )
            events = [event async for event in stream]
        assert events[-1].type == "response.completed"
        first, second = await env.rows("r-recover", 2)
        assert {first.provider_id, second.provider_id} == {"resp-a", "resp-b"}
        assert (first.outcome, second.outcome) == ("aborted", "completed")
        await env.idle()


async def test_responses_after_the_commit_end_with_response_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_native(tmp_path, monkeypatch) as env:
        env.fake.chunk_count = 6
        env.fake.break_after = 6  # created, in_progress, item, part, two deltas
        async with env.openai() as client:
            stream = await client.responses.create(
                model=GPT, input="hi", stream=True, extra_headers={"x-request-id": "r-broken"}
            )
            events = [event async for event in stream]
        assert [e.type for e in events[-3:]] == [
            "response.output_text.delta",
            "response.output_text.delta",
            "response.failed",
        ]
        failed = events[-1]
        assert failed.type == "response.failed"
        assert failed.sequence_number == events[-2].sequence_number + 1
        assert failed.response.status == "failed"
        assert failed.response.model == GPT
        assert failed.response.id == "resp_fake_native"
        assert failed.response.error is not None
        assert failed.response.error.code == "server_error"
        (row,) = await env.rows("r-broken", 1)
        assert row.outcome == "failed"
        assert len(env.fake.requests) == 1
        await env.idle()


async def test_a_client_leaving_a_responses_stream_reaches_the_provider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_native(tmp_path, monkeypatch) as env:
        env.fake.chunk_count = 100_000
        env.fake.chunk_delay = 0.005
        body = {"model": GPT, "input": "hi", "stream": True}
        await env.leave_after(raw_post("/v1/responses", body, "r-leaver"), b"text.delta", 3)
        (seen,) = env.fake.requests
        with trio.fail_after(10):
            await seen.disconnected.wait()
        assert seen.chunks_sent < 100_000
        (row,) = await env.rows("r-leaver", 1)
        assert row.outcome == "cancelled"
        await env.idle()


async def test_a_previous_response_id_is_served_translated_not_by_a_native_tunnel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_native(tmp_path, monkeypatch) as env:
        async with env.raw() as client:
            first = await client.post(
                "/v1/responses",
                json={"model": GPT, "input": "hi"},
                headers={"x-request-id": "r-first"},
            )
            assert first.status_code == 200, first.text
            assert first.content == renamed(env.fake.sent_bytes(), GPT_SERVED, GPT)
            (row,) = await env.rows("r-first", 1)
            # the edge did not store the native answer: chaining on it is an unknown id
            unknown = await client.post(
                "/v1/responses",
                json={"model": GPT, "input": "more", "previous_response_id": first.json()["id"]},
            )
            assert unknown.status_code == 400, unknown.text
            assert unknown.json()["error"]["code"] == "previous_response_not_found"
            # one the edge stored holds a conversation only the edge has: no tunnel takes it
            stored = {"id": "resp_edge_stored", "object": "response", "model": GPT}
            conversation = [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                }
            ]
            assert await env.dispatcher.response_store.put(stored, conversation, row.attribution)
            chained = await client.post(
                "/v1/responses",
                json={"model": GPT, "input": "more", "previous_response_id": "resp_edge_stored"},
            )
        assert chained.status_code == 400, chained.text
        error = chained.json()["error"]
        assert error["code"] == "no_capable_candidate"
        assert "previous_response_id names a response stored by this edge" in error["message"]
        assert len(env.fake.requests) == 1


# --------------------------------------------------------------------------- the pieces


def _feed_in_pieces(sse: SSEFilter, raw: bytes, size: int) -> bytes:
    out = b"".join(sse.feed(raw[i : i + size]) for i in range(0, len(raw), size))
    return out + sse.finish()


def _anthropic_stream(*middle: bytes, usage: dict[str, Any] | None = None) -> bytes:
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "served",
            "content": [],
            "usage": usage or {"input_tokens": 10, "output_tokens": 1},
        },
    }
    return b"".join(
        [
            anthropic_event("message_start", start),
            anthropic_event("ping", {"type": "ping"}),
            *middle,
            anthropic_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "tool_use"},
                    "usage": {"output_tokens": 7},
                },
            ),
            anthropic_event("message_stop", {"type": "message_stop"}),
        ]
    )


def test_the_anthropic_dialect_commits_at_a_tool_use_block_and_merges_usage() -> None:
    tool = anthropic_event(
        "content_block_start",
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {}},
        },
    )
    usage = {
        "input_tokens": 10,
        "cache_read_input_tokens": 100,
        "cache_creation_input_tokens": 20,
        "output_tokens": 1,
    }
    raw = _anthropic_stream(tool, usage=usage)
    for size in (1, 7, 64, len(raw)):
        sse = SSEFilter(
            strip_usage_chunk=True,  # never in a native dialect
            find_content=True,
            rewrite=ModelRewrite("served", "asked"),
            dialect="anthropic",
        )
        assert _feed_in_pieces(sse, raw, size) == raw.replace(b'"served"', b'"asked"')
        assert sse.content_seen
        assert sse.done
        assert sse.failure is None
        assert sse.usage == wire.Usage(
            prompt_tokens=130, completion_tokens=7, cached_tokens=100, cache_write_tokens=20
        )
    # the preamble alone (message_start, ping, an empty text block) is not content
    preamble = _anthropic_stream(
        anthropic_event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        )
    )
    sse = SSEFilter(strip_usage_chunk=False, find_content=True, dialect="anthropic")
    sse.feed(preamble)
    assert not sse.content_seen


def test_an_error_event_before_content_is_a_failure_and_after_it_is_relayed() -> None:
    error = anthropic_event(
        "error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    )
    sse = SSEFilter(strip_usage_chunk=False, find_content=True, dialect="anthropic")
    sse.feed(_anthropic_stream(error))
    assert sse.failure == "overloaded_error: Overloaded"
    delta = anthropic_event(
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "a"}},
    )
    after = SSEFilter(strip_usage_chunk=False, find_content=True, dialect="anthropic")
    after.feed(_anthropic_stream(delta, error))
    assert after.content_seen
    assert after.failure is None


def test_the_responses_dialect_commits_at_function_call_arguments_and_reads_usage() -> None:
    base = {"id": "resp_1", "object": "response", "model": "served", "status": "in_progress"}
    call = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": ""}
    done_usage = {
        "input_tokens": 50,
        "input_tokens_details": {"cached_tokens": 40},
        "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 4},
        "total_tokens": 59,
    }
    events = [
        {"type": "response.created", "sequence_number": 0, "response": {**base, "usage": None}},
        {"type": "response.in_progress", "sequence_number": 1, "response": {**base, "usage": None}},
        {
            "type": "response.output_item.added",
            "sequence_number": 2,
            "output_index": 0,
            "item": call,
        },
        {
            "type": "response.function_call_arguments.delta",
            "sequence_number": 3,
            "item_id": "fc_1",
            "output_index": 0,
            "delta": '{"a":',
        },
        {
            "type": "response.completed",
            "sequence_number": 4,
            "response": {**base, "status": "completed", "usage": done_usage},
        },
    ]
    raw = b"".join(responses_event(dict(event)) for event in events)
    # the function call item itself is the first content
    head = SSEFilter(strip_usage_chunk=False, find_content=True, dialect="responses")
    seen = []
    for event in events[:3]:
        head.feed(responses_event(dict(event)))
        seen.append(head.content_seen)
    assert seen == [False, False, True]
    for size in (1, 13, len(raw)):
        sse = SSEFilter(
            strip_usage_chunk=False,
            find_content=True,
            rewrite=ModelRewrite("served", "asked"),
            dialect="responses",
        )
        assert _feed_in_pieces(sse, raw, size) == raw.replace(b'"served"', b'"asked"')
        assert sse.done
        assert sse.sequence == 4
        assert sse.usage == wire.Usage(
            prompt_tokens=50, completion_tokens=9, cached_tokens=40, reasoning_tokens=4
        )


def test_each_dialect_has_its_own_error_event() -> None:
    openai_sse = SSEFilter(strip_usage_chunk=False)
    assert orjson.loads(openai_sse.error_event("gone", "tunnel_failed")[6:]) == {
        "error": {"message": "gone", "type": "server_error", "param": None, "code": "tunnel_failed"}
    }
    anthropic_sse = SSEFilter(strip_usage_chunk=False, dialect="anthropic")
    raw = anthropic_sse.error_event("the dispatcher is shutting down", "shutting_down")
    assert raw.startswith(b"event: error\ndata: ")
    assert orjson.loads(raw.split(b"data: ", 1)[1]) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the dispatcher is shutting down"},
    }
    responses_sse = SSEFilter(
        strip_usage_chunk=False,
        dialect="responses",
        rewrite=ModelRewrite("served", "asked"),
    )
    created = {
        "type": "response.created",
        "sequence_number": 0,
        "response": {"id": "resp_9", "object": "response", "model": "served", "usage": None},
    }
    responses_sse.feed(responses_event(created))
    raw = responses_sse.error_event("broke off", "tunnel_failed")
    assert raw.startswith(b"event: response.failed\ndata: ")
    event = orjson.loads(raw.split(b"data: ", 1)[1])
    assert event["type"] == "response.failed"
    assert event["sequence_number"] == 1
    assert event["response"]["id"] == "resp_9"
    assert event["response"]["model"] == "asked"
    assert event["response"]["status"] == "failed"
    assert event["response"]["error"] == {"code": "server_error", "message": "broke off"}


def test_the_dialects_read_usage_from_whole_bodies() -> None:
    message = {"type": "message", "model": "m", "usage": anthropic_usage_object(4)}
    assert body_usage(orjson.dumps(message), dialect_usage("anthropic")) == wire.Usage(
        prompt_tokens=INPUT_TOKENS + CACHE_READ + CACHE_WRITE,
        completion_tokens=4,
        cached_tokens=CACHE_READ,
        cache_write_tokens=CACHE_WRITE,
    )
    response = {"object": "response", "output": [], "usage": responses_usage_object(4)}
    expected = wire.Usage(
        prompt_tokens=INPUT_TOKENS,
        completion_tokens=4,
        cached_tokens=CACHED_TOKENS,
        reasoning_tokens=REASONING_TOKENS,
    )
    assert body_usage(orjson.dumps(response), dialect_usage("responses")) == expected
    assert tail_usage(orjson.dumps(response)[-200:], dialect_usage("responses")) == expected
    assert body_usage(orjson.dumps(response)) is None  # not OpenAI chat usage
    assert dialect_of("/v1/messages") == "anthropic"
    assert dialect_of("/v1/responses") == "responses"
    assert dialect_of("/v1/chat/completions") == "openai"


def test_the_node_sends_an_anthropic_key_as_x_api_key() -> None:
    client = [
        ("x-api-key", CLIENT_KEY),
        ("authorization", f"Bearer {CLIENT_KEY}"),
        ("anthropic-beta", "prompt-caching-2024-07-31"),
        ("content-type", "application/json"),
    ]
    headers = request_headers(client, ANTHROPIC_KEY, "x-api-key")
    assert headers == [
        ("anthropic-beta", "prompt-caching-2024-07-31"),
        ("content-type", "application/json"),
        ("accept-encoding", "identity"),
        ("anthropic-version", "2023-06-01"),
        ("x-api-key", ANTHROPIC_KEY),
    ]
    versioned = request_headers([("Anthropic-Version", "2024-01-01")], ANTHROPIC_KEY, "x-api-key")
    assert [k.lower() for k, _ in versioned].count("anthropic-version") == 1
    assert request_headers(client, OPENAI_KEY)[-1] == ("authorization", f"Bearer {OPENAI_KEY}")
    assert all(CLIENT_KEY not in value for _, value in request_headers(client, OPENAI_KEY))
    assert ("x-api-key", CLIENT_KEY) not in upstream_headers(
        [(b"x-api-key", CLIENT_KEY.encode()), (b"anthropic-version", b"2023-06-01")]
    )
