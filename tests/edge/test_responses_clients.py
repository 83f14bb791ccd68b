"""``/v1/responses`` as the real clients use it (issue #21): tools inside a ``namespace``,
``custom`` tools, the API's built-in tools (dropped, or refused when the edge says so), and a
reasoning effort passed only to models that reason -- against a real edge on 127.0.0.1."""

from __future__ import annotations

import functools
import logging
from typing import Any

import httpx
import orjson
import pytest
import trio

from dispatcher.api.responses import RESPONSES_PATH, parse_responses_request
from dispatcher.api.responses._request import chat_body
from dispatcher.config import ResponsesSettings
from dispatcher.observe.logs import FIELDS

from .fakes import connect, hello
from .test_responses import open_edge, sse

NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "description": "Close an agent.",
            "strict": False,
            "parameters": {"type": "object", "properties": {"target": {"type": "string"}}},
        }
    ],
}
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
}


def knob(name: str, arguments: str) -> dict[str, Any]:
    return {"tool_call": {"name": name, "arguments": arguments}}


def test_namespace_and_custom_tools_become_chat_functions() -> None:
    request = parse_responses_request(
        orjson.dumps({"model": "m", "input": "x", "tools": [NAMESPACE, PATCH]})
    )
    functions = [tool["function"] for tool in chat_body(request, [])["tools"]]
    assert [f["name"] for f in functions] == ["multi_agent_v1__close_agent", "apply_patch"]
    assert functions[0]["parameters"] == NAMESPACE["tools"][0]["parameters"]  # type: ignore[index]
    assert "Tools for sub-agents." in functions[0]["description"]
    assert functions[1]["parameters"]["required"] == ["input"]
    assert "start: /.+/" in functions[1]["description"]  # the grammar, for the model


def test_a_long_flattened_name_stays_within_64_characters_and_apart() -> None:
    space = {**NAMESPACE, "name": "n" * 60}
    tools = [space, {**space, "tools": [{"type": "function", "name": "close_agent2"}]}]
    tools[1]["name"] = "n" * 59 + "m"
    request = parse_responses_request(orjson.dumps({"model": "m", "input": "x", "tools": tools}))
    names = [tool["function"]["name"] for tool in chat_body(request, [])["tools"]]
    assert all(len(name) <= 64 for name in names)
    assert len(set(names)) == 2


async def test_a_call_of_a_namespace_tool_is_answered_with_its_own_name_and_namespace() -> None:
    async with open_edge(tools=True) as edge, httpx.AsyncClient(base_url=edge.url) as client:
        body = {
            "model": "echo",
            "input": "close it",
            "tools": [NAMESPACE],
            "echo": knob("multi_agent_v1__close_agent", '{"target": "a1"}'),
        }
        answer = (await client.post(RESPONSES_PATH, json=body)).json()
        (call,) = answer["output"]
        assert (call["type"], call["name"], call["namespace"]) == (
            "function_call",
            "close_agent",
            "multi_agent_v1",
        )
        assert orjson.loads(call["arguments"]) == {"target": "a1"}
        # the next turn sends the call back with its namespace: the same chat function
        follow_up = {
            "model": "echo",
            "tools": [NAMESPACE],
            "input": [
                {"role": "user", "content": "close it"},
                {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")},
                {"type": "function_call_output", "call_id": call["call_id"], "output": "closed"},
                {"role": "user", "content": "thanks"},
            ],
            "echo": {"tool_call": None},
        }
        parsed = parse_responses_request(orjson.dumps(follow_up))
        (assistant,) = [m for m in chat_body(parsed, [])["messages"] if m["role"] == "assistant"]
        assert assistant["tool_calls"][0]["function"]["name"] == "multi_agent_v1__close_agent"
        response = await client.post(RESPONSES_PATH, json=follow_up)
        assert response.status_code == 200, response.text
        assert response.json()["output"][0]["content"][0]["text"] == "thanks"


async def test_a_custom_tool_call_streams_as_custom_tool_call_events() -> None:
    async with open_edge(tools=True) as edge, httpx.AsyncClient(base_url=edge.url) as client:
        body = {
            "model": "echo",
            "input": "patch it",
            "stream": True,
            "tools": [PATCH],
            "echo": knob("apply_patch", orjson.dumps({"input": "*** Begin Patch"}).decode()),
        }
        response = await client.post(RESPONSES_PATH, json=body)
        events = sse(response.text)
        kinds = [event["type"] for event in events]
        assert kinds == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.custom_tool_call_input.delta",
            "response.custom_tool_call_input.done",
            "response.output_item.done",
            "response.completed",
        ]
        added = events[2]["item"]
        assert (added["type"], added["name"], added["input"]) == (
            "custom_tool_call",
            "apply_patch",
            "",
        )
        assert events[3]["delta"] == events[4]["input"] == "*** Begin Patch"
        (item,) = events[-1]["response"]["output"]
        assert (item["type"], item["input"], item["status"]) == (
            "custom_tool_call",
            "*** Begin Patch",
            "completed",
        )
        # and the custom call and its output go back as the next turn's input
        follow_up = {
            "model": "echo",
            "input": [
                {"role": "user", "content": "patch it"},
                {k: item[k] for k in ("type", "call_id", "name", "input")},
                {"type": "custom_tool_call_output", "call_id": item["call_id"], "output": "ok"},
                {"role": "user", "content": "done?"},
            ],
            "tools": [PATCH],
            "echo": {"tool_call": None},
        }
        parsed = parse_responses_request(orjson.dumps(follow_up))
        messages = chat_body(parsed, [])["messages"]
        assert messages[1]["tool_calls"][0]["function"] == {
            "name": "apply_patch",
            "arguments": '{"input":"*** Begin Patch"}',
        }
        assert messages[2] == {"role": "tool", "tool_call_id": item["call_id"], "content": "ok"}
        assert (await client.post(RESPONSES_PATH, json=follow_up)).status_code == 200


async def test_built_in_tools_are_dropped_and_the_answer_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dispatcher.access")
    async with open_edge(tools=True) as edge, httpx.AsyncClient(base_url=edge.url) as client:
        body = {
            "model": "echo",
            "input": "search",
            "tools": [
                {"type": "web_search", "external_web_access": False},
                {"type": "function", "name": "f", "parameters": {"type": "object"}},
                {"type": "file_search", "vector_store_ids": ["vs"]},
                {"type": "web_search"},
            ],
            "tool_choice": "required",
        }
        response = await client.post(RESPONSES_PATH, json=body)
        assert response.status_code == 200, response.text
        assert response.headers["x-dispatcher-dropped-tools"] == "web_search,file_search"
        answer = response.json()
        assert [tool["type"] for tool in answer["tools"]] == ["function"]
        (call,) = answer["output"]  # "required" with the one function tool left: echo calls it
        assert call["name"] == "f"
        # without built-in tools there is no header
        plain = await client.post(RESPONSES_PATH, json={"model": "echo", "input": "x"})
        assert "x-dispatcher-dropped-tools" not in plain.headers
    lines = [getattr(r, FIELDS) for r in caplog.records if r.name == "dispatcher.access"]
    assert [line["dropped_tools"] for line in lines] == ["web_search,file_search", None]


async def test_an_edge_set_to_refuse_built_in_tools_answers_400() -> None:
    refuse = ResponsesSettings(built_in_tools="refuse")
    async with open_edge(responses=refuse) as edge, httpx.AsyncClient(base_url=edge.url) as client:
        body = {
            "model": "echo",
            "input": "x",
            "tools": [{"type": "function", "name": "f"}, {"type": "web_search"}],
        }
        response = await client.post(RESPONSES_PATH, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("tools[1].type", "unsupported_value")
        assert "web_search" in error["message"]
        assert not (await edge.dispatcher.ledger.query()).rows


async def test_a_reasoning_effort_reaches_only_models_that_reason() -> None:
    async with open_edge(local=False) as edge:
        plain = await connect(edge.dispatcher, hello("plain", model="m", slots=1))
        greeting = hello("thinker", model="m", slots=1, capabilities=("reasoning",))
        thinker = await connect(edge.dispatcher, greeting)
        body = {"model": "m", "input": "x", "reasoning": {"effort": "high", "summary": "auto"}}
        seen: dict[str, Any] = {}
        both = trio.Event()

        async def answer(name: str, node: Any) -> None:
            run = await node.receive_run()
            seen[name] = run.body.get("reasoning_effort", "left out")
            if len(seen) == 2:
                both.set()
            await both.wait()  # each holds its one slot until both have a request
            await node.emit(
                run.run_id,
                ("run.started", {}),
                ("run.delta", {"text": "ok"}),
                ("run.completed", {"finish_reason": "stop"}),
            )

        async with httpx.AsyncClient(base_url=edge.url) as client, trio.open_nursery() as nursery:
            nursery.start_soon(answer, "plain", plain)
            nursery.start_soon(answer, "thinker", thinker)
            for _ in range(2):
                nursery.start_soon(functools.partial(client.post, RESPONSES_PATH, json=body))
        assert seen == {"plain": "left out", "thinker": "high"}
