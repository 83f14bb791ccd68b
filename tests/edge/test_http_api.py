"""The edge's HTTP API against a real server on 127.0.0.1 port 0, with the in-process echo
node: the official openai client, bad input, disconnects and shutdown."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx
import openai
import orjson
import pytest
import trio

from dispatcher.config import EdgeConfig, HTTPSettings, NodeSettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server
from nodes.config import ModelConfig, NodeConfig, ProviderConfig

from .fakes import wait_until


@attrs.frozen
class Edge:
    dispatcher: Dispatcher
    server: Server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.address.port}"


@pytest.fixture
async def edge(nursery: trio.Nursery) -> AsyncIterator[Edge]:
    config = EdgeConfig(
        port=0,
        http=HTTPSettings(max_body_size=64 * 1024, shutdown_grace=5),
        nodes=NodeSettings(heartbeat_interval=1, heartbeat_timeout=5),
    )
    async with open_dispatcher(config) as dispatcher:
        await dispatcher.attach_local_node()
        server = await nursery.start(dispatcher.serve)
        yield Edge(dispatcher, server)
        server.shutdown()


def chat(content: str = "hello there", **extra: object) -> dict[str, object]:
    return {"model": "echo", "messages": [{"role": "user", "content": content}], **extra}


async def test_openai_client_non_streaming(edge: Edge) -> None:
    async with openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key="unused") as client:
        completion = await client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "the quick brown fox"}]
        )
    assert completion.choices[0].message.content == "the quick brown fox"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 4
    assert completion.model == "echo"


async def test_openai_client_streaming(edge: Edge) -> None:
    # The async client's SSE decoder leaves its async generators unclosed, which Trio's
    # finalizer reports (and warnings are errors here), so the sync client streams in a
    # worker thread: the edge sees the same HTTP either way.
    text = "one two three four five six seven"

    def consume() -> tuple[list[str], list[str | None], openai.types.CompletionUsage | None]:
        parts: list[str] = []
        finish: list[str | None] = []
        usage = None
        with openai.OpenAI(base_url=f"{edge.url}/v1", api_key="unused") as client:
            stream = client.chat.completions.create(
                model="echo",
                messages=[{"role": "user", "content": text}],
                stream=True,
                stream_options={"include_usage": True},
            )
            with stream:
                for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    for choice in chunk.choices:
                        parts.append(choice.delta.content or "")
                        finish.append(choice.finish_reason)
        return parts, finish, usage

    parts, finish, usage = await trio.to_thread.run_sync(consume)
    assert "".join(parts) == text
    assert finish[-1] == "stop"
    assert usage is not None
    assert usage.completion_tokens == 7


async def test_openai_client_unknown_model(edge: Edge) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{edge.url}/v1", api_key="unused", max_retries=0
    ) as client:
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
    assert info.value.code == "model_not_found"


async def test_models_and_health(edge: Edge) -> None:
    async with httpx.AsyncClient(base_url=edge.url) as client:
        models = (await client.get("/v1/models")).json()
        health = await client.get("/healthz")
    assert [m["id"] for m in models["data"]] == ["echo"]
    assert health.json() == {"status": "ok", "nodes": 1}


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), 400, "'model'"),
        (orjson.dumps({"model": 5, "messages": []}), 400, "'model'"),
        (orjson.dumps({"model": "echo", "messages": "hi"}), 400, "'messages'"),
        (orjson.dumps({"model": "echo", "messages": [{"content": "x"}]}), 400, "role"),
        (orjson.dumps(chat(stream="yes")), 400, "'stream'"),
        (orjson.dumps(chat(max_tokens=-1)), 400, "'max_tokens'"),
        (orjson.dumps(chat(temperature="hot")), 400, "'temperature'"),
        (orjson.dumps(chat(n=3)), 400, "'n'"),
        (orjson.dumps({**chat(), "messages": [{"role": "user", "content": 7}]}), 400, "content"),
        (orjson.dumps({**chat(), "model": "gpt-nope"}), 404, "does not exist"),
        (orjson.dumps(chat("x" * 70_000)), 413, "size limit"),
    ],
)
async def test_bad_requests(edge: Edge, body: bytes, status: int, needle: str) -> None:
    async with httpx.AsyncClient(base_url=edge.url) as client:
        response = await client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        # The edge keeps serving.
        after = await client.post("/v1/chat/completions", json=chat("still here"))
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"]
    assert error["type"] in {"invalid_request_error", "server_error"}
    assert response.headers["x-request-id"]
    assert after.json()["choices"][0]["message"]["content"] == "still here"
    assert edge.dispatcher.admission.statistics().in_use == 0


async def test_unknown_route_and_method(edge: Edge) -> None:
    async with httpx.AsyncClient(base_url=edge.url) as client:
        missing = await client.get("/v1/nothing")
        wrong = await client.get("/v1/chat/completions")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "unknown_url"
    assert wrong.status_code == 405


async def test_api_keys(nursery: trio.Nursery) -> None:
    config = EdgeConfig(port=0, api_keys=("sk-good",))
    async with open_dispatcher(config) as dispatcher:
        await dispatcher.attach_local_node()
        server = await nursery.start(dispatcher.serve)
        url = f"http://127.0.0.1:{server.address.port}"
        async with httpx.AsyncClient(base_url=url) as client:
            none = await client.post("/v1/chat/completions", json=chat())
            wrong = await client.post(
                "/v1/chat/completions", json=chat(), headers={"authorization": "Bearer sk-bad"}
            )
            good = await client.post(
                "/v1/chat/completions", json=chat(), headers={"authorization": "Bearer sk-good"}
            )
        server.shutdown()
    assert none.status_code == 401
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"
    assert good.status_code == 200


async def open_raw_stream(port: int, body: dict[str, object]) -> trio.SocketStream:
    """POST ``body`` on a raw socket (so the test controls exactly when the client leaves)
    and read until the first content chunk has arrived."""
    payload = orjson.dumps(body)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    received = b""
    with trio.fail_after(10):
        while b'"content":"w' not in received:
            chunk = await stream.receive_some()
            assert chunk, "the edge closed the stream early"
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 ")
    return stream


async def test_client_disconnect_mid_stream_cancels_node_run(edge: Edge) -> None:
    body = chat(" ".join(f"w{i}" for i in range(200)), stream=True, echo={"token_delay": 0.02})
    stream = await open_raw_stream(edge.server.address.port, body)
    assert edge.dispatcher.admission.statistics().in_use == 1
    await stream.aclose()
    # The client is gone: the node is told, confirms, and the slot is free.
    await wait_until(lambda: edge.dispatcher.runs.stats.cancels_sent == 1)
    await wait_until(
        lambda: (
            (
                edge.dispatcher.admission.statistics().in_use,
                edge.dispatcher.admission.statistics().draining,
            )
            == (0, 0)
        )
    )
    assert edge.dispatcher.admission.statistics().drains_expired == 0  # the node confirmed
    assert edge.dispatcher.runs.stats.ended.get("cancelled") == 1


async def test_graceful_shutdown_ends_streams_with_an_error_event(nursery: trio.Nursery) -> None:
    # A stream longer than the grace (10 s of tokens, 0.5 s of grace): it goes on while the
    # edge drains, and is ended with the shutting_down event when the grace is over.
    config = EdgeConfig(port=0, http=HTTPSettings(shutdown_grace=0.5))
    async with open_dispatcher(config) as dispatcher:
        await dispatcher.attach_local_node()
        server: Server = await nursery.start(dispatcher.serve)
        url = f"http://127.0.0.1:{server.address.port}"
        body = chat(" ".join(f"w{i}" for i in range(500)), stream=True, echo={"token_delay": 0.02})
        lines: list[str] = []
        at_shutdown = 0
        async with (
            httpx.AsyncClient(base_url=url) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            async for line in response.aiter_lines():
                lines.append(line)
                if len(lines) == 4:
                    server.shutdown()
                    at_shutdown = len(lines)
        await wait_until(lambda: dispatcher.runs.stats.cancels_sent == 1)
    data = [line for line in lines if line.startswith("data: ")]
    assert "shutting_down" in data[-1]
    assert "data: [DONE]" not in data
    assert len(lines) > at_shutdown + 10  # the stream went on during the grace


async def test_usage_is_attributed_to_the_key_id_and_admin_only(nursery: trio.Nursery) -> None:
    from dispatcher.api.app import key_id

    config = EdgeConfig(port=0, api_keys=("sk-client",), admin_keys=("sk-admin",))
    async with open_dispatcher(config) as dispatcher:
        await dispatcher.attach_local_node()
        server = await nursery.start(dispatcher.serve)
        url = f"http://127.0.0.1:{server.address.port}"
        async with httpx.AsyncClient(base_url=url) as client:
            client_auth = {"authorization": "Bearer sk-client"}
            done = await client.post("/v1/chat/completions", json=chat(), headers=client_auth)
            assert done.status_code == 200
            as_client = await client.get("/v1/usage", headers=client_auth)
            as_admin = await client.get("/v1/usage", headers={"authorization": "Bearer sk-admin"})
        server.shutdown()
    assert as_client.status_code == 401
    assert as_admin.status_code == 200
    (row,) = as_admin.json()["rows"]
    assert row["attribution"] == key_id(b"sk-client")
    assert "sk-client" not in as_admin.text


WEATHER_TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture
async def tool_edge(nursery: trio.Nursery) -> AsyncIterator[Edge]:
    """The edge with an in-process echo node that answers every request with a tool call and
    announces the ``tools`` capability."""
    node = NodeConfig(
        node_id="local",
        providers=(
            ProviderConfig(
                id="echo",
                type="echo",
                options={"tool_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                models=(ModelConfig(name="echo", slots=4, capabilities=("tools",)),),
            ),
        ),
    )
    async with open_dispatcher(EdgeConfig(port=0)) as dispatcher:
        await dispatcher.attach_local_node(node)
        server = await nursery.start(dispatcher.serve)
        yield Edge(dispatcher, server)
        server.shutdown()


async def test_openai_client_tool_calls_non_streaming(tool_edge: Edge) -> None:
    async with openai.AsyncOpenAI(base_url=f"{tool_edge.url}/v1", api_key="unused") as client:
        completion = await client.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "weather in Paris?"}],
            tools=WEATHER_TOOLS,
        )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.id == "call_echo_0"
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris"}'


async def test_openai_client_tool_calls_streaming(tool_edge: Edge) -> None:
    def consume() -> tuple[dict[int, dict[str, str]], list[str | None], str]:
        calls: dict[int, dict[str, str]] = {}
        finish: list[str | None] = []
        text = ""
        with openai.OpenAI(base_url=f"{tool_edge.url}/v1", api_key="unused") as client:
            stream = client.chat.completions.create(
                model="echo",
                messages=[{"role": "user", "content": "weather in Paris?"}],
                tools=WEATHER_TOOLS,
                stream=True,
            )
            with stream:
                for chunk in stream:
                    for choice in chunk.choices:
                        text += choice.delta.content or ""
                        finish.append(choice.finish_reason)
                        for delta in choice.delta.tool_calls or ():
                            call = calls.setdefault(
                                delta.index, {"id": "", "name": "", "arguments": ""}
                            )
                            call["id"] = call["id"] or delta.id or ""
                            if delta.function is not None:
                                call["name"] += delta.function.name or ""
                                call["arguments"] += delta.function.arguments or ""
        return calls, finish, text

    calls, finish, text = await trio.to_thread.run_sync(consume)
    assert calls == {
        0: {"id": "call_echo_0", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    }
    assert finish[-1] == "tool_calls"
    assert text == ""


async def test_openai_client_stream_accumulates_tool_calls(tool_edge: Edge) -> None:
    """The client's own stream helper (which checks the chunk shape strictly) assembles the
    same call."""

    def consume() -> Any:
        with (
            openai.OpenAI(base_url=f"{tool_edge.url}/v1", api_key="unused") as client,
            client.beta.chat.completions.stream(
                model="echo",
                messages=[{"role": "user", "content": "weather in Paris?"}],
                tools=WEATHER_TOOLS,
            ) as stream,
        ):
            for _ in stream:
                pass
            return stream.get_final_completion()

    completion = await trio.to_thread.run_sync(consume)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.id, call.function.name) == ("call_echo_0", "get_weather")
    assert call.function.arguments == '{"city": "Paris"}'
