"""An ``anthropic`` provider end to end: a real edge on 127.0.0.1 (in this process), a real
``dispatcher node`` process whose providers are ``type = "anthropic"``, pointed at the fake
Messages API (``tests/fake_anthropic.py``, in this process), and the official SDKs:

* ``openai`` on ``/v1/chat/completions``, streamed and not, a tool round trip (the model
  calls a tool, the client sends its result, the model answers);
* ``anthropic`` on ``/v1/messages`` -- translated to a chat body by the edge, back to a
  Messages body by the node's adapter --, streamed and not, the same round trip;
* the run's usage (``dispatcher.open_run``) carries the provider's cached tokens;
* an upstream 529 before any content: recovered on the model's second candidate, or -- a
  model with one -- answered as a retryable error;
* a client that leaves: the cancellation reaches the provider (the fake sees it disconnect);
* ``/v1/responses`` too (the edge translates it to a chat body, the adapter to a Messages one).

The SDKs run in worker threads (their sync clients): the edge, the fake and the node's pipes
stay on Trio. Bounds are generous (a slow machine waits longer, never fails)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import attrs
import httpx
import openai
import orjson
import pytest
import trio

from dispatcher import RunSpec, wire
from dispatcher.config import EdgeConfig
from tests.fake_anthropic import FakeAnthropic, serve_fake_anthropic

from .fakes import ServedEdge, serve_edge
from .test_drain_process import BOUND, dispatcher_process, wait_for

T = TypeVar("T")
KEY = "sk-ant-e2e-key"
KEY_ENV = "E2E_FAKE_ANTHROPIC_KEY"

NODE_TOML = """\
[node]
id = "anth-node"
edge_url = "ws://127.0.0.1:{edge_port}/v1/nodes/connect"
reconnect_min_backoff = 0.2
reconnect_max_backoff = 1

[[providers]]
id = "claude-a"
type = "anthropic"
base_url = "{fake}"
api_key_env = "{key_env}"

  [[providers.models]]
  name = "claude"
  served_name = "claude-served"
  slots = 2
  capabilities = ["tools"]

[[providers]]
id = "claude-b"
type = "anthropic"
base_url = "{fake}/v1"
api_key_env = "{key_env}"
options = {{ stream = false }}

  [[providers.models]]
  name = "claude"
  served_name = "claude-served"
  slots = 2
  capabilities = ["tools"]

[[providers]]
id = "claude-solo"
type = "anthropic"
base_url = "{solo}"
api_key_env = "{key_env}"

  [[providers.models]]
  name = "claude-solo"
  served_name = "claude-served"
  slots = 1
"""

WEATHER_OPENAI: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
WEATHER_ANTHROPIC: Any = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": WEATHER_OPENAI["function"]["parameters"],
}
ASK = "What is the weather in Paris? Use get_weather."


@attrs.frozen
class Stack:
    edge: ServedEdge
    fake: FakeAnthropic
    """Serves ``claude`` (two providers: one streamed, one not)."""
    solo: FakeAnthropic
    """Serves ``claude-solo`` (one provider)."""

    async def in_thread(self, call: Callable[[], T]) -> T:
        return await trio.to_thread.run_sync(call)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.edge.url}/v1", api_key="unused", max_retries=0)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.edge.url,
            api_key="unused",
            max_retries=0,
            _strict_response_validation=True,
        )


@asynccontextmanager
async def open_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Stack]:
    monkeypatch.setenv(KEY_ENV, KEY)
    config = EdgeConfig(port=0, local_node=False, expose_node_ids=True)
    async with (
        serve_edge(config, ServedEdge) as edge,
        trio.open_nursery() as nursery,
    ):
        fake = await nursery.start(serve_fake_anthropic, FakeAnthropic(api_key=KEY))
        solo = await nursery.start(serve_fake_anthropic, FakeAnthropic(api_key=KEY))
        path = tmp_path / "node.toml"
        path.write_text(
            NODE_TOML.format(
                edge_port=edge.server.address.port,
                fake=fake.base_url,
                solo=solo.base_url,
                key_env=KEY_ENV,
            )
        )
        async with dispatcher_process(tmp_path, "node", "node", "--config", str(path)) as node:

            async def serving() -> bool:
                await trio.lowlevel.checkpoint()
                return {"claude", "claude-solo"} <= set(edge.dispatcher.registry.models())

            try:
                await wait_for(serving)
            except trio.TooSlowError:
                raise AssertionError(f"the node did not join:\n{node.stderr}") from None
            yield Stack(edge, fake, solo)
            assert "Traceback" not in node.stderr, node.stderr
        nursery.cancel_scope.cancel()


@pytest.fixture
async def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Stack]:
    async with open_stack(tmp_path, monkeypatch) as opened:
        yield opened


# --------------------------------------------------------------------------- openai SDK


def _openai_round_trip(client: openai.OpenAI, stream: bool) -> tuple[Any, str, str]:
    """Ask, get the tool call, send its result, get the answer: (the call, the finish
    reasons of both turns joined, the final text)."""
    messages: list[Any] = [{"role": "user", "content": ASK}]
    if stream:
        calls: dict[int, dict[str, str]] = {}
        finish = ""
        with client.chat.completions.create(
            model="claude", messages=messages, tools=[WEATHER_OPENAI], stream=True
        ) as chunks:
            for chunk in chunks:
                for choice in chunk.choices:
                    for delta in choice.delta.tool_calls or []:
                        entry = calls.setdefault(
                            delta.index, {"id": "", "name": "", "arguments": ""}
                        )
                        entry["id"] = delta.id or entry["id"]
                        if delta.function is not None:
                            entry["name"] = delta.function.name or entry["name"]
                            entry["arguments"] += delta.function.arguments or ""
                    finish = choice.finish_reason or finish
        [call] = calls.values()
        made = {
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]},
        }
    else:
        first = client.chat.completions.create(
            model="claude", messages=messages, tools=[WEATHER_OPENAI]
        )
        finish = first.choices[0].finish_reason
        [tool_call] = first.choices[0].message.tool_calls or []
        made = tool_call.model_dump()
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [made]},
        {"role": "tool", "tool_call_id": made["id"], "content": "sunny, 21 C"},
    ]
    if stream:
        text, last = "", ""
        with client.chat.completions.create(
            model="claude", messages=messages, tools=[WEATHER_OPENAI], stream=True
        ) as chunks:
            for chunk in chunks:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    last = choice.finish_reason or last
    else:
        second = client.chat.completions.create(
            model="claude", messages=messages, tools=[WEATHER_OPENAI]
        )
        text, last = second.choices[0].message.content or "", second.choices[0].finish_reason
    return made, f"{finish},{last}", text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_openai_sdk_makes_a_tool_round_trip(stack: Stack, stream: bool) -> None:
    def run() -> tuple[Any, str, str]:
        with stack.openai() as client:
            return _openai_round_trip(client, stream)

    made, finishes, text = await stack.in_thread(run)
    assert made["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert made["id"].startswith("toolu_fake_")
    assert finishes == "tool_calls,stop"
    assert text == "The tool said: sunny, 21 C."
    first, second = stack.fake.requests
    assert first.header("x-api-key") == KEY
    assert first.json["tools"][0]["name"] == "get_weather"
    tool_result = second.json["messages"][-1]["content"][0]
    assert tool_result == {
        "type": "tool_result",
        "tool_use_id": made["id"],
        "content": "sunny, 21 C",
        "cache_control": {"type": "ephemeral"},
    }


# --------------------------------------------------------------------------- anthropic SDK


def _anthropic_round_trip(client: anthropic.Anthropic, stream: bool) -> tuple[Any, Any]:
    messages: list[Any] = [{"role": "user", "content": ASK}]

    def create(**request: Any) -> Any:
        if not stream:
            return client.messages.create(**request)
        with client.messages.stream(**request) as events:
            return events.get_final_message()

    first = create(model="claude", max_tokens=200, messages=messages, tools=[WEATHER_ANTHROPIC])
    [tool_use] = [block for block in first.content if block.type == "tool_use"]
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": tool_use.id, "content": "sunny, 21 C"}
            ],
        },
    ]
    second = create(model="claude", max_tokens=200, messages=messages, tools=[WEATHER_ANTHROPIC])
    return first, second


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_anthropic_sdk_makes_a_tool_round_trip_through_the_adapter(
    stack: Stack, stream: bool
) -> None:
    def run() -> tuple[Any, Any]:
        with stack.anthropic() as client:
            return _anthropic_round_trip(client, stream)

    first, second = await stack.in_thread(run)
    assert first.stop_reason == "tool_use"
    text, tool_use = first.content
    assert (text.type, text.text) == ("text", "Calling get_weather.")
    assert (tool_use.name, tool_use.input) == ("get_weather", {"city": "Paris"})
    assert tool_use.id.startswith("toolu_fake_")
    assert second.stop_reason == "end_turn"
    assert [block.text for block in second.content] == ["The tool said: sunny, 21 C."]
    # the provider's own counts, through the node and the edge
    answered = stack.fake.answers[-1]["usage"]
    assert second.usage.output_tokens == answered["output_tokens"]
    # Anthropic's convention both ways: input_tokens is what was neither read from nor
    # written to the cache, so the edge's three counts are the provider's
    assert second.usage.input_tokens == answered["input_tokens"]
    assert second.usage.cache_read_input_tokens == answered.get("cache_read_input_tokens", 0)
    assert second.usage.cache_creation_input_tokens == answered.get(
        "cache_creation_input_tokens", 0
    )
    assert (
        second.usage.input_tokens
        + second.usage.cache_read_input_tokens
        + second.usage.cache_creation_input_tokens
        > 0
    )


async def test_a_stop_sequence_through_the_adapter_reaches_the_messages_client(
    stack: Stack,
) -> None:
    stack.fake.reply = "one two STOP three"

    def run() -> Any:
        with stack.anthropic() as client:
            return client.messages.create(
                model="claude",
                max_tokens=50,
                messages=[{"role": "user", "content": "count"}],
                stop_sequences=["STOP"],
            )

    message = await stack.in_thread(run)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "STOP")
    assert message.content[0].text == "one two "


# --------------------------------------------------------------------------- usage, faults


async def test_the_runs_usage_carries_the_providers_cached_tokens(stack: Stack) -> None:
    system = {"role": "system", "content": "You answer about the weather, briefly. " * 30}

    async def usage_of(*messages: dict[str, Any]) -> wire.Usage:
        body = {"messages": [system, *messages]}
        async with stack.edge.dispatcher.open_run(RunSpec(model="claude", body=body)) as run:
            events = [event async for event in run]
        assert isinstance(events[-1], wire.RunCompleted), events[-1]
        assert run.usage is not None
        return run.usage

    first = await usage_of({"role": "user", "content": "Paris?"})
    second = await usage_of(
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And Rome?"},
    )
    assert (first.cached_tokens, first.estimated) == (0, False)
    assert first.cache_write_tokens == first.prompt_tokens > 0
    assert second.cached_tokens == first.prompt_tokens  # the first turn, read from the cache
    assert second.prompt_tokens == second.cached_tokens + second.cache_write_tokens
    [_, answered] = stack.fake.answers
    assert answered["usage"]["cache_read_input_tokens"] == second.cached_tokens


async def test_an_overloaded_provider_is_recovered_on_the_second_candidate(stack: Stack) -> None:
    stack.fake.fail_statuses = [529]
    async with httpx.AsyncClient(base_url=stack.edge.url, timeout=BOUND) as client:
        answer = await client.post(
            "/v1/chat/completions",
            json={"model": "claude", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == stack.fake.expected_text
    assert answer.headers["x-dispatcher-attempts"] == "2"
    assert len(stack.fake.requests) == 2
    assert stack.fake.fail_statuses == []
    rows = sorted(stack.edge.rows, key=lambda row: row.attempt)
    assert [(row.attempt, row.outcome) for row in rows] == [(1, "aborted"), (2, "completed")]
    assert rows[0].provider_id != rows[1].provider_id


async def test_an_overloaded_only_candidate_is_a_retryable_error(stack: Stack) -> None:
    stack.solo.status = 529
    async with httpx.AsyncClient(base_url=stack.edge.url, timeout=BOUND) as client:
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "claude-solo", "messages": [{"role": "user", "content": "hi"}]},
        )
        messages = await client.post(
            "/v1/messages",
            json={
                "model": "claude-solo",
                "max_tokens": 10,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
    assert chat.status_code == 502, chat.text
    error = chat.json()["error"]
    assert error["code"] == "upstream_5xx"
    assert "HTTP 529" in error["message"]
    assert "Overloaded" in error["message"]
    assert stack.solo.base_url not in error["message"]
    # Anthropic's own shape for a provider that is overloaded: 529, which its SDK retries
    assert messages.status_code == 529, messages.text
    assert messages.json()["error"]["type"] == "overloaded_error"


async def test_a_client_that_leaves_cancels_the_providers_stream(stack: Stack) -> None:
    stack.fake.chunk_count, stack.fake.chunk_delay = 10_000, 0.01
    body = {
        "model": "claude",
        "max_tokens": 20_000,
        "stream": True,
        "messages": [{"role": "user", "content": "talk"}],
    }
    payload = orjson.dumps(body)
    stream = await trio.open_tcp_stream("127.0.0.1", stack.edge.server.address.port)
    await stream.send_all(
        b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    received = b""
    with trio.fail_after(BOUND):
        while received.count(b"event: content_block_delta") < 3:
            chunk = await stream.receive_some()
            assert chunk, "the edge closed the stream early"
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 ")
    await stream.aclose()
    with trio.fail_after(BOUND):
        (request,) = stack.fake.requests
        await request.disconnected.wait()
    assert request.chunks_sent < 10_000
    await wait_for(functools.partial(_row_written, stack))
    [row] = stack.edge.rows
    assert row.outcome == "cancelled"


async def _row_written(stack: Stack) -> bool:
    await trio.lowlevel.checkpoint()
    return len(stack.edge.rows) == 1


async def test_the_responses_api_is_served_through_the_adapter_too(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.edge.url, timeout=BOUND) as client:
        answer = await client.post(
            "/v1/responses", json={"model": "claude", "input": "hi", "instructions": "be brief"}
        )
    assert answer.status_code == 200, answer.text
    said = [
        part["text"]
        for item in answer.json()["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    ]
    assert said == [stack.fake.expected_text]
    (seen,) = stack.fake.requests
    assert seen.json["system"][0]["text"] == "be brief"
    assert seen.json["messages"][0]["content"][0]["text"] == "hi"
