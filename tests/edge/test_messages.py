"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` (issue #13) against a real edge on
127.0.0.1 port 0, with in-process echo nodes (and scripted ones where the test must decide
when a node fails), driven by the official ``anthropic`` SDK, unchanged.

The SDK runs in a worker thread (its sync client): the edge and the nodes stay on Trio. Its
``_strict_response_validation`` is on, so an answer that is not the Messages API's shape
fails the test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any, TypeVar

import anthropic
import httpx
import orjson
import pytest
import trio

from dispatcher import wire
from dispatcher.api.anthropic import FRONT_END as MESSAGES
from dispatcher.api.app import FRONT_ENDS
from dispatcher.config import EdgeConfig
from dispatcher.shared.tokens import estimate_tokens
from nodes.config import ModelConfig, NodeConfig, ProviderConfig

from .fakes import ServedEdge, connect, hello, serve_edge, wait_until

T = TypeVar("T")


class Edge(ServedEdge):
    @contextmanager
    def client(self, **options: Any) -> Iterator[anthropic.Anthropic]:
        options.setdefault("api_key", "unused")
        with anthropic.Anthropic(
            base_url=self.url, max_retries=0, _strict_response_validation=True, **options
        ) as client:
            yield client

    async def sdk(self, call: Callable[[anthropic.Anthropic], T], **options: Any) -> T:
        """``call(client)`` in a worker thread."""

        def run() -> T:
            with self.client(**options) as client:
                return call(client)

        return await trio.to_thread.run_sync(run)


def provider(model: str, slots: int = 4, capabilities: tuple[str, ...] = (), **options: Any) -> Any:
    return ProviderConfig(
        id=model,
        type="echo",
        options=options,
        models=(ModelConfig(name=model, slots=slots, capabilities=capabilities),),
    )


WEATHER_CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
LOCAL = NodeConfig(
    node_id="local",
    providers=(
        provider("echo"),
        provider("echo-tools", capabilities=("tools",), tool_call=WEATHER_CALL),
        provider("echo-faulty", fail_after_tokens=2),
        provider("echo-down", fail_before_first_token=True),
        provider("echo-slow", token_delay=0.02),
        provider("echo-held", slots=1, stall_after_tokens=0),
    ),
)


SERVED = FRONT_ENDS if MESSAGES in FRONT_ENDS else (*FRONT_ENDS, MESSAGES)
"""The edge's front ends with the Messages one (registered in ``api/app.py``'s FRONT_ENDS
once that line is applied: then as it is)."""


def open_edge(node: NodeConfig | None = LOCAL, **config: Any) -> AbstractAsyncContextManager[Edge]:
    return serve_edge(
        EdgeConfig(port=0, **config),
        Edge,
        local_node=False if node is None else node,
        front_ends=SERVED,
    )


@pytest.fixture
async def edge() -> AsyncIterator[Edge]:
    async with open_edge() as opened:
        yield opened


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event of a Messages stream."""
    events = []
    for chunk in raw.decode().split("\n\n"):
        if not chunk.strip():
            continue
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        events.append((lines["event"], orjson.loads(lines["data"])))
    return events


# --------------------------------------------------------------------------- answers


async def test_create_answers_a_message_and_the_ledger_has_its_row(edge: Edge) -> None:
    message = await edge.sdk(
        lambda client: client.messages.with_raw_response.create(
            model="echo",
            max_tokens=100,
            system="you echo",
            messages=user("the quick brown fox"),
            metadata={"user_id": "someone"},
            extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"},
        )
    )
    parsed = message.parse()
    assert parsed.type == "message"
    assert parsed.role == "assistant"
    assert parsed.id.startswith("msg_")
    assert parsed.model == "echo"
    assert [(block.type, getattr(block, "text", None)) for block in parsed.content] == [
        ("text", "the quick brown fox")
    ]
    assert parsed.stop_reason == "end_turn"
    assert parsed.stop_sequence is None
    # echo counts the words of every message, the system one included.
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens) == (6, 4)
    request_id = message.headers["x-dispatcher-request-id"]
    assert message.headers["request-id"] == request_id
    assert [
        (r.request_id, r.route, r.model_group, r.outcome, r.billable_to) for r in edge.rows
    ] == [(request_id, "/v1/messages", "echo", "completed", "client")]
    assert (edge.rows[0].prompt_tokens, edge.rows[0].completion_tokens) == (6, 4)


async def test_max_tokens_cuts_the_answer_and_says_so(edge: Edge) -> None:
    message = await edge.sdk(
        lambda client: client.messages.create(
            model="echo", max_tokens=2, messages=user("one two three four")
        )
    )
    assert message.content[0].type == "text"
    assert message.content[0].text == "one two "
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 2


async def test_stream_text_and_final_message(edge: Edge) -> None:
    def consume(client: anthropic.Anthropic) -> tuple[list[str], Any]:
        with client.messages.stream(
            model="echo", max_tokens=100, messages=user("streamed back word by word")
        ) as stream:
            pieces = list(stream.text_stream)
            return pieces, stream.get_final_message()

    pieces, final = await edge.sdk(consume)
    assert "".join(pieces) == "streamed back word by word"
    assert len(pieces) >= 1
    assert final.model == "echo"
    assert final.id.startswith("msg_")
    assert [block.type for block in final.content] == ["text"]
    assert final.content[0].text == "streamed back word by word"
    assert final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (5, 5)
    await wait_until(lambda: len(edge.rows) == 1)
    assert (edge.rows[0].route, edge.rows[0].outcome) == ("/v1/messages", "completed")


async def test_the_stream_is_the_documented_event_sequence(edge: Edge) -> None:
    body = {"model": "echo", "max_tokens": 50, "stream": True, "messages": user("a b c")}
    async with httpx.AsyncClient(base_url=edge.url) as client:
        response = await client.post("/v1/messages", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.content)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == [
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert (start["model"], start["content"], start["stop_reason"]) == ("echo", [], None)
    assert start["usage"] == {
        "input_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }
    assert events[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert text == "a b c"
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {
            "input_tokens": 3,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 3,
        },
    }


async def test_message_start_carries_the_runs_own_count_when_it_came_first(edge: Edge) -> None:
    """Echo counts its prompt before its first token (one long word: 1 token to echo, 26 to
    the edge's estimate of 104 characters); the node sends that count ahead of the text, so
    ``message_start`` says 1, as ``message_delta`` does -- not the estimate."""
    word = "abcdefghijklmnopqrstuvwxyz" * 4
    body = {"model": "echo", "max_tokens": 50, "stream": True, "messages": user(word)}
    async with httpx.AsyncClient(base_url=edge.url) as client:
        response = await client.post("/v1/messages", json=body)
    events = sse_events(response.content)
    assert events[0][1]["message"]["usage"] == {
        "input_tokens": 1,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }
    assert events[-2][1]["usage"] == {
        "input_tokens": 1,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 1,
    }


# --------------------------------------------------------------------------- tools

WEATHER_TOOL: anthropic.types.ToolParam = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


async def test_tool_use_non_streamed(edge: Edge) -> None:
    message = await edge.sdk(
        lambda client: client.messages.create(
            model="echo-tools",
            max_tokens=100,
            messages=user("weather in Paris?"),
            tools=[WEATHER_TOOL],
            tool_choice={"type": "any"},
        )
    )
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use"
    assert (block.id, block.name, block.input) == (
        "toolu_call_echo_0",
        "get_weather",
        {"city": "Paris"},
    )


async def test_tool_use_streamed_as_input_json_deltas(edge: Edge) -> None:
    def consume(client: anthropic.Anthropic) -> tuple[list[Any], Any]:
        with client.messages.stream(
            model="echo-tools",
            max_tokens=100,
            messages=user("weather in Paris?"),
            tools=[WEATHER_TOOL],
        ) as stream:
            events = list(stream)
            return events, stream.get_final_message()

    events, final = await edge.sdk(consume)
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == '{"city": "Paris"}'
    assert len(deltas) == 2  # echo sends the arguments in two pieces
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [(b.type, b.id, b.name) for b in starts] == [
        ("tool_use", "toolu_call_echo_0", "get_weather")
    ]
    assert final.stop_reason == "tool_use"
    (block,) = final.content
    assert (block.type, block.input) == ("tool_use", {"city": "Paris"})


async def test_a_tool_round_trip() -> None:
    """The echo model asks for the tool; the client answers with its ``tool_result``; the node
    that takes the second turn (scripted, so the test sees what it was sent) gets the OpenAI
    conversation: the assistant's tool call and the tool message, by the same id."""
    async with open_edge() as edge:
        node = await connect(
            edge.dispatcher, hello("scripted", model="weather", capabilities=("tools",))
        )
        first = await edge.sdk(
            lambda client: client.messages.create(
                model="echo-tools",
                max_tokens=100,
                messages=user("weather in Paris?"),
                tools=[WEATHER_TOOL],
            )
        )
        (call,) = first.content
        assert call.type == "tool_use"
        conversation: list[Any] = [
            *user("weather in Paris?"),
            {"role": "assistant", "content": [call.model_dump()]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees"},
                    {"type": "text", "text": "and tomorrow?"},
                ],
            },
        ]
        async with trio.open_nursery() as nursery:
            sent: list[wire.RunRequest] = []

            async def answer() -> None:
                request = await node.receive_run()
                sent.append(request)
                await node.emit(
                    request.run_id,
                    ("run.delta", {"text": "It is 18 degrees."}),
                    ("run.usage", {"usage": wire.Usage(prompt_tokens=20, completion_tokens=4)}),
                    ("run.completed", {"finish_reason": "stop"}),
                )

            nursery.start_soon(answer)
            second = await edge.sdk(
                lambda client: client.messages.create(
                    model="weather", max_tokens=100, messages=conversation, tools=[WEATHER_TOOL]
                )
            )
        assert second.content[0].type == "text"
        assert second.content[0].text == "It is 18 degrees."
        assert second.stop_reason == "end_turn"
        assert (second.usage.input_tokens, second.usage.output_tokens) == (20, 4)
        (request,) = sent
        assert request.body["messages"] == [
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "toolu_call_echo_0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_call_echo_0", "content": "18 degrees"},
            {"role": "user", "content": "and tomorrow?"},
        ]
        assert request.body["tools"] == [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": WEATHER_TOOL["input_schema"],
                    "description": "The weather in a city",
                },
            }
        ]
        assert [r.route for r in edge.rows] == ["/v1/messages", "/v1/messages"]


# --------------------------------------------------------------------------- count_tokens


async def test_count_tokens_estimates_system_messages_and_tools(edge: Edge) -> None:
    def count(client: anthropic.Anthropic) -> tuple[int, int]:
        bare = client.messages.count_tokens(
            model="echo", system="be brief", messages=user("the quick brown fox")
        )
        with_tools = client.messages.count_tokens(
            model="echo",
            system="be brief",
            messages=user("the quick brown fox"),
            tools=[WEATHER_TOOL],
        )
        return bare.input_tokens, with_tools.input_tokens

    bare, with_tools = await edge.sdk(count)
    assert bare == estimate_tokens("be brief") + estimate_tokens("the quick brown fox")
    schema = orjson.dumps(WEATHER_TOOL["input_schema"]).decode()
    tool = estimate_tokens(f"get_weather The weather in a city {schema}")
    assert with_tools == bare + tool
    assert edge.rows == []  # no model ran


async def test_count_tokens_of_an_unknown_model_is_not_found(edge: Edge) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        await edge.sdk(
            lambda client: client.messages.count_tokens(model="nope", messages=user("x"))
        )
    assert info.value.type == "not_found_error"
