"""The quick-start edge (the in-process echo node, as `dispatcher serve` runs it) serves what
clients that bind tools or ask for structured output send -- LangChain's ``bind_tools`` and
``with_structured_output`` send exactly these -- through the official openai SDK, instead of
answering 400 "lacks capability"."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest
import trio
from openai.types.chat import ChatCompletionFunctionToolParam

from dispatcher.config import EdgeConfig
from dispatcher.edge import open_dispatcher

WEATHER: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}


@pytest.fixture
async def base_url(nursery: trio.Nursery) -> AsyncIterator[str]:
    async with open_dispatcher(EdgeConfig(port=0)) as dispatcher:
        await dispatcher.attach_local_node()
        server = await nursery.start(dispatcher.serve)
        yield f"http://127.0.0.1:{server.address.port}/v1"
        server.shutdown()


async def test_a_forced_tool_call_is_answered_with_one(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused") as client:
        completion = await client.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "Paris"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 0}


async def test_offered_tools_are_answered_with_text(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused") as client:
        completion = await client.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "hello there"}],
            tools=[WEATHER],
        )
    assert completion.choices[0].message.content == "hello there"


async def test_structured_output_is_json_of_the_schema(base_url: str) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "confident": {"type": "boolean"}},
        "required": ["answer", "confident"],
        "additionalProperties": False,
    }
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused") as client:
        completion = await client.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "yes"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "verdict", "schema": schema, "strict": True},
            },
        )
        content = completion.choices[0].message.content
        assert content is not None
        assert json.loads(content) == {"answer": "yes", "confident": False}
        completion = await client.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "yes"}],
            response_format={"type": "json_object"},
        )
    content = completion.choices[0].message.content
    assert content is not None
    assert json.loads(content) == {"echo": "yes"}
