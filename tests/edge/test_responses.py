"""``/v1/responses`` (issue #13) against a real edge on 127.0.0.1 port 0 with echo nodes (the
in-process one, or real ones over a websocket): the official ``openai`` SDK unchanged, stored
responses, recovery before the commit point, ``response.failed`` after it, a client leaving,
and one usage row per attempt on the route ``/v1/responses``.

The SDK's async client streams with async generators Trio reports unclosed, so streams are
read with the sync client in a worker thread (as ``test_http_api.py`` does).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import openai
import orjson
import pytest
import trio
from openai.types.responses import FunctionTool

from dispatcher import wire
from dispatcher.api.app import FRONT_ENDS
from dispatcher.api.front import FrontEnd
from dispatcher.api.responses import (
    RESPONSES_PATH,
    chat_body,
    error_code,
    make_front_end,
    parse_responses_request,
)
from dispatcher.config import (
    EdgeConfig,
    HTTPSettings,
    NodeSettings,
    ResponsesSettings,
)
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server
from dispatcher.store.responses import open_response_store
from dispatcher.store.seam import ResponseStore
from dispatcher.store.usage import UsageRow
from nodes.agent import serve_node
from nodes.config import ModelConfig, NodeConfig, ProviderConfig

from .fakes import connect, hello, wait_until

WEATHER_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TOOL_KNOB = {"tool_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def others() -> tuple[FrontEnd, ...]:
    """The app's front ends but its own responses one (each test has its own store)."""
    return tuple(front for front in FRONT_ENDS if front.name != "responses")


@attrs.frozen
class Edge:
    dispatcher: Dispatcher
    server: Server
    nursery: trio.Nursery
    store: ResponseStore

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.address.port}"

    def sdk(self, **options: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", **options)

    def sync_sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    async def add_node(self, node_id: str, *, tools: bool = False, **echo: Any) -> None:
        """A real node over a real websocket, serving ``echo`` with these options."""
        config = NodeConfig(
            node_id=node_id,
            edge_url=f"ws://127.0.0.1:{self.server.address.port}/v1/nodes/connect",
            providers=(
                ProviderConfig(
                    id="echo",
                    type="echo",
                    options=echo,
                    models=(
                        ModelConfig(name="echo", slots=4, capabilities=("tools",) if tools else ()),
                    ),
                ),
            ),
        )
        await self.nursery.start(functools.partial(serve_node, config))

    async def rows(self, request_id: str, count: int) -> list[UsageRow]:
        """The rows of the request the client sent with ``x-request-id: request_id``, once
        there are ``count`` (a row is written when its attempt's block ends, which may be
        just after the client has its answer); then checks no more arrive."""
        rows: list[UsageRow] = []
        with trio.fail_after(5):
            while len(rows) < count:
                await trio.sleep(0.01)
                report = await self.dispatcher.ledger.query()
                rows = [r for r in report.rows if r.client_request_id == request_id]
        await trio.sleep(0.05)
        report = await self.dispatcher.ledger.query()
        rows = [r for r in report.rows if r.client_request_id == request_id]
        assert len(rows) == count, rows
        return sorted(rows, key=lambda r: r.attempt)

    async def nothing_left(self) -> None:
        admission = self.dispatcher.admission
        await wait_until(
            lambda: (admission.statistics().in_use, admission.statistics().draining) == (0, 0)
        )


@asynccontextmanager
async def open_edge(
    *,
    local: bool = True,
    tools: bool = False,
    store: ResponseStore | None = None,
    api_keys: tuple[str, ...] = (),
    responses: ResponsesSettings | None = None,
) -> AsyncIterator[Edge]:
    """An edge serving the app's front ends and the responses one; with ``local``, the
    in-process echo node (announcing ``tools`` if asked)."""
    config = EdgeConfig(
        port=0,
        local_node=False,
        expose_node_ids=True,
        api_keys=api_keys,
        http=HTTPSettings(shutdown_grace=2),
        nodes=NodeSettings(heartbeat_interval=1, heartbeat_timeout=5),
        responses=responses or ResponsesSettings(),
    )
    front_ends = (*others(), make_front_end(store))
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        if local:
            capabilities = ("tools",) if tools else ()
            node = NodeConfig(
                node_id="local",
                providers=(
                    ProviderConfig(
                        id="echo",
                        type="echo",
                        models=(ModelConfig(name="echo", slots=4, capabilities=capabilities),),
                    ),
                ),
            )
            await dispatcher.attach_local_node(node)
        server: Server = await nursery.start(
            functools.partial(dispatcher.serve, host="127.0.0.1", port=0, front_ends=front_ends)
        )
        yield Edge(
            dispatcher, server, nursery, store if store is not None else dispatcher.response_store
        )
        server.shutdown()
        nursery.cancel_scope.cancel()


def sse(raw: str) -> list[dict[str, Any]]:
    """The events of a Responses stream, checking each ``event:`` line names its data."""
    events = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        event = orjson.loads(lines["data"])
        assert lines["event"] == event["type"]
        events.append(event)
    return events


# --------------------------------------------------------------------------- the SDK


async def test_sdk_create_non_streamed_with_instructions_and_one_usage_row() -> None:
    async with open_edge() as edge, edge.sdk() as client:
        raw = await client.responses.with_raw_response.create(
            model="echo",
            input="the quick brown fox",
            instructions="answer briefly",
            metadata={"ticket": "13"},
            max_output_tokens=50,
            temperature=0.5,
            extra_headers={"x-request-id": "plain"},
        )
        response = raw.parse()
        assert response.id.startswith("resp_")
        assert response.object == "response"
        assert response.status == "completed"
        assert response.model == "echo"
        assert response.output_text == "the quick brown fox"
        assert response.metadata == {"ticket": "13"}
        (message,) = response.output
        assert message.type == "message"
        assert message.role == "assistant"
        assert [part.type for part in message.content] == ["output_text"]
        assert response.usage is not None
        # echo counts the words of every message: the instructions reached it as one.
        assert (response.usage.input_tokens, response.usage.output_tokens) == (6, 4)
        assert response.usage.total_tokens == 10
        assert raw.headers["x-dispatcher-attempts"] == "1"
        (row,) = await edge.rows("plain", 1)
        assert (row.route, row.model_group, row.outcome) == (RESPONSES_PATH, "echo", "completed")
        assert row.completion_tokens == 4


async def test_sdk_create_streamed_event_sequence() -> None:
    text = "one two three four five"
    async with open_edge() as edge:

        def consume() -> list[Any]:
            with edge.sync_sdk() as client:
                stream = client.responses.create(model="echo", input=text, stream=True)
                with stream:
                    return list(stream)

        events = await trio.to_thread.run_sync(consume)
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert "".join(event.delta for event in deltas) == text
    assert types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert types[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    created, completed = events[0].response, events[-1].response
    assert created.id == completed.id
    assert (created.status, completed.status) == ("in_progress", "completed")
    assert events[-4].text == events[-3].part.text == text
    assert completed.output_text == text
    assert completed.usage is not None
    assert completed.usage.output_tokens == 5


async def test_sdk_function_tool_round_trip_non_streamed() -> None:
    async with open_edge(tools=True) as edge, edge.sdk() as client:
        first = await client.responses.create(
            model="echo",
            input="weather in Paris?",
            tools=[WEATHER_TOOL],
            tool_choice="auto",
            store=False,
            extra_body={"echo": TOOL_KNOB},
        )
        (call,) = first.output
        assert call.type == "function_call"
        assert (call.name, call.arguments, call.call_id) == (
            "get_weather",
            '{"city": "Paris"}',
            "call_echo_0",
        )
        assert first.status == "completed"
        (tool,) = first.tools
        assert isinstance(tool, FunctionTool)
        assert (tool.name, tool.parameters) == ("get_weather", WEATHER_TOOL["parameters"])
        # The second turn sends the whole conversation back, as store=false clients do.
        conversation: list[Any] = [
            {"role": "user", "content": "weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny 21C"},
            {"role": "user", "content": [{"type": "input_text", "text": "so, a coat?"}]},
        ]
        second = await client.responses.create(
            model="echo",
            input=conversation,
            tools=[WEATHER_TOOL],
            store=False,
        )
        assert second.output_text == "so, a coat?"
        assert second.usage is not None
        # echo's prompt: the two user messages and the tool's output (the call has no text).
        assert second.usage.input_tokens == 3 + 3 + 2
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)  # store=false kept nothing
    assert edge.store.statistics().entries == 0


async def test_sdk_function_tool_call_streamed() -> None:
    async with open_edge(tools=True) as edge:

        def consume() -> list[Any]:
            with edge.sync_sdk() as client:
                stream = client.responses.create(
                    model="echo",
                    input="weather?",
                    tools=[WEATHER_TOOL],
                    stream=True,
                    extra_body={"echo": TOOL_KNOB},
                )
                with stream:
                    return list(stream)

        events = await trio.to_thread.run_sync(consume)
    types = [event.type for event in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call"
    assert events[2].item.name == "get_weather"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == '{"city": "Paris"}'
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-3].arguments == '{"city": "Paris"}'
    (item,) = events[-1].response.output
    assert (item.type, item.call_id, item.status) == ("function_call", "call_echo_0", "completed")
    assert "response.output_text.delta" not in types


async def test_previous_response_id_get_and_delete() -> None:
    async with open_edge() as edge, edge.sdk(max_retries=0) as client:
        first = await client.responses.create(model="echo", input="alpha beta")
        second = await client.responses.create(
            model="echo", input="gamma", previous_response_id=first.id
        )
        assert second.output_text == "gamma"
        assert second.previous_response_id == first.id
        assert second.usage is not None
        # The stored conversation was prepended: alpha beta, its answer, gamma.
        assert second.usage.input_tokens == 2 + 2 + 1
        third = await client.responses.create(
            model="echo", input="delta", previous_response_id=second.id
        )
        assert third.usage is not None
        assert third.usage.input_tokens == 5 + 1 + 1

        fetched = await client.responses.retrieve(second.id)
        assert fetched.id == second.id
        assert fetched.output_text == "gamma"
        assert fetched.usage == second.usage

        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.retrieve(first.id)
        assert missing.value.code == "response_not_found"
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(first.id)
        with pytest.raises(openai.BadRequestError) as chained:
            await client.responses.create(model="echo", input="x", previous_response_id=first.id)
        assert chained.value.param == "previous_response_id"
        assert chained.value.code == "previous_response_not_found"
        # The later responses keep their own copy of the conversation.
        fourth = await client.responses.create(
            model="echo", input="epsilon", previous_response_id=second.id
        )
        assert fourth.usage is not None
        assert fourth.usage.input_tokens == 5 + 1 + 1
        unstored = await client.responses.create(model="echo", input="gone", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
    assert edge.store.statistics().entries == 3  # second, third, fourth


async def test_the_store_bounds_answer_404_and_400_past_them() -> None:
    now = [0.0]
    async with (
        open_response_store(max_entries=2, max_age=60, clock=lambda: now[0]) as store,
        open_edge(store=store) as edge,
        edge.sdk(max_retries=0) as client,
    ):
        ids = [(await client.responses.create(model="echo", input=f"n{i}")).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(ids[0])  # the oldest made room
        assert (await client.responses.retrieve(ids[2])).id == ids[2]
        now[0] = 61.0
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(ids[2])  # too old
        with pytest.raises(openai.BadRequestError) as chained:
            await client.responses.create(model="echo", input="x", previous_response_id=ids[1])
        assert chained.value.param == "previous_response_id"
        # The age bound is counted at the next write: the expired one goes then.
        await client.responses.create(model="echo", input="late")
    assert store.statistics().evicted == 3


# --------------------------------------------------------------------------- the gate


async def test_response_failed_after_commit_through_the_sdk() -> None:
    async with open_edge() as edge:

        def consume() -> list[Any]:
            with edge.sync_sdk() as client:
                stream = client.responses.create(
                    model="echo",
                    input="one two three four five",
                    stream=True,
                    extra_body={"echo": {"fail_after_tokens": 2}},
                    extra_headers={"x-request-id": "after-commit"},
                )
                with stream:
                    return list(stream)

        events = await trio.to_thread.run_sync(consume)
        types = [event.type for event in events]
        assert types[-1] == "response.failed"
        assert "response.completed" not in types
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
            "one two "
        )
        failed = events[-1].response
        assert failed.status == "failed"
        assert failed.error is not None
        assert failed.error.code == "server_error"
        assert "echo_fault" in failed.error.message
        assert failed.output[0].status == "incomplete"
        (row,) = await edge.rows("after-commit", 1)
        assert (row.route, row.outcome, row.billable_to) == (RESPONSES_PATH, "failed", "client")
        assert await edge.store.get(failed.id) is None


@pytest.mark.parametrize("stream", [False, True])
async def test_failure_before_commit_is_recovered_on_another_node(stream: bool) -> None:
    async with open_edge(local=False) as edge:
        await edge.add_node("node-a", fail_before_first_token=True)
        await edge.add_node("node-b")
        await wait_until(lambda: len(edge.dispatcher.registry.sessions) == 2)
        body = {"model": "echo", "input": "one two three", "stream": stream}
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            # Ties between idle nodes go round-robin: one of two requests lands on node-a.
            for i in range(2):
                response = await client.post(
                    RESPONSES_PATH, json=body, headers={"x-request-id": f"r{i}"}
                )
                assert response.status_code == 200, response.text
                if response.headers["x-dispatcher-attempts"] == "2":
                    request_id = f"r{i}"
                    break
            else:
                pytest.fail("no request was placed on the failing node first")
        assert response.headers["x-dispatcher-node"] == "node-b"
        if stream:
            events = sse(response.text)
            assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
            assert events[-1]["type"] == "response.completed"
            assert not [e for e in events if e["type"] == "response.failed"]
            assert events[-1]["response"]["output"][0]["content"][0]["text"] == "one two three"
        else:
            assert response.json()["output"][0]["content"][0]["text"] == "one two three"
        rows = await edge.rows(request_id, 2)
        assert [(r.attempt, r.node_id, r.outcome, r.billable_to, r.route) for r in rows] == [
            (1, "node-a", "aborted", "operator", RESPONSES_PATH),
            (2, "node-b", "completed", "client", RESPONSES_PATH),
        ]
        await edge.nothing_left()


async def test_every_attempt_failing_is_an_openai_error_body() -> None:
    async with open_edge() as edge, edge.sdk(max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await client.responses.create(
                model="echo",
                input="x y",
                extra_body={"echo": {"fail_before_first_token": True}},
                extra_headers={"x-request-id": "all-fail"},
            )
        assert info.value.status_code == 502
        assert info.value.code == "echo_fault"
        # One candidate: once it failed, no other is left to recover on.
        (row,) = await edge.rows("all-fail", 1)
        assert (row.route, row.outcome, row.billable_to) == (RESPONSES_PATH, "aborted", "operator")


async def test_client_disconnect_cancels_the_node_run() -> None:
    async with open_edge() as edge:
        words = " ".join(f"w{i}" for i in range(200))
        payload = orjson.dumps(
            {"model": "echo", "input": words, "stream": True, "echo": {"token_delay": 0.02}}
        )
        stream = await trio.open_tcp_stream("127.0.0.1", edge.server.address.port)
        await stream.send_all(
            b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"x-request-id: leaver\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        received = b""
        with trio.fail_after(10):
            while b"response.output_text.delta" not in received:
                chunk = await stream.receive_some()
                assert chunk, "the edge closed the stream early"
                received += chunk
        assert received.startswith(b"HTTP/1.1 200 ")
        assert edge.dispatcher.admission.statistics().in_use == 1
        await stream.aclose()
        await wait_until(lambda: edge.dispatcher.runs.stats.cancels_sent == 1)
        await edge.nothing_left()
        assert edge.dispatcher.runs.stats.ended.get("cancelled") == 1
        (row,) = await edge.rows("leaver", 1)
        assert (row.route, row.outcome) == (RESPONSES_PATH, "cancelled")
        assert edge.store.statistics().entries == 0  # an answer the client left is not stored


async def test_tunnel_candidates_not_declaring_responses_are_excluded_at_admission() -> None:
    async with open_edge(local=False) as edge:
        greeting = hello("tunnel-node", model="echo", slots=2)
        provider = attrs.evolve(greeting.providers[0], path="tunnel")
        node = await connect(edge.dispatcher, attrs.evolve(greeting, providers=(provider,)))
        async with httpx.AsyncClient(base_url=edge.url) as client:
            response = await client.post(RESPONSES_PATH, json={"model": "echo", "input": "hi"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "no_capable_candidate"
        assert (
            "its tunnel provider declares the routes chat, completions, embeddings, not "
            "'responses'" in error["message"]
        )
        assert not [m for m in node.seen if isinstance(m, wire.TunnelRequest)]
        assert not (await edge.dispatcher.ledger.query()).rows


# --------------------------------------------------------------------------- what is a 400


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": "x"}, "model", "missing_required_parameter"),
        ({"model": "echo"}, "input", "missing_required_parameter"),
        ({"model": "echo", "input": []}, "input", "invalid_value"),
        ({"model": "echo", "input": 3}, "input", "invalid_type"),
        ({"model": "echo", "input": "x", "conversation": "c"}, "conversation", None),
        ({"model": "echo", "input": "x", "prompt": {"id": "p"}}, "prompt", "unsupported_parameter"),
        (
            {"model": "echo", "input": "x", "reasoning": {"effort": "huge"}},
            "reasoning.effort",
            "invalid_value",
        ),
        (
            {"model": "echo", "input": "x", "reasoning": {"budget": 3}},
            "reasoning.budget",
            "unsupported_parameter",
        ),
        ({"model": "echo", "input": "x", "include": ["everything"]}, "include[0]", "invalid_value"),
        ({"model": "echo", "input": "x", "background": True}, "background", "unsupported_value"),
        (  # reasoning items are dropped: nothing is left
            {"model": "echo", "input": [{"type": "reasoning", "summary": []}]},
            "input",
            "invalid_value",
        ),
        (
            {"model": "echo", "input": [{"type": "item_reference", "id": "x"}]},
            "input[0].type",
            "unsupported_value",
        ),
        (
            {"model": "echo", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
            "invalid_value",
        ),
        (
            {"model": "echo", "input": [{"role": "tool", "content": "x"}]},
            "input[0].role",
            "invalid_value",
        ),
        (
            {"model": "echo", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
            "missing_required_parameter",
        ),
        (
            {"model": "echo", "input": [{"role": "user", "content": "x", "extra": 1}]},
            "input[0].extra",
            "unsupported_parameter",
        ),
        (  # an unknown type (a built-in tool is dropped, not refused)
            {"model": "echo", "input": "x", "tools": [{"type": "web_searching"}]},
            "tools[0].type",
            "invalid_value",
        ),
        (
            {
                "model": "echo",
                "input": "x",
                "tools": [
                    {"type": "function", "name": "a__b"},
                    {
                        "type": "namespace",
                        "name": "a",
                        "description": "",
                        "tools": [
                            {"type": "function", "name": "b"},
                        ],
                    },
                ],
            },
            "tools[1].tools[0].name",
            "invalid_value",
        ),
        (
            {"model": "echo", "input": "x", "tool_choice": {"type": "file_search"}},
            "tool_choice.type",
            "invalid_value",
        ),
        ({"model": "echo", "input": "x", "temperature": 3}, "temperature", "invalid_value"),
        ({"model": "echo", "input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
        ({"model": "echo", "input": "x", "metadata": {"k": 1}}, "metadata.k", "invalid_type"),
        ({"model": "echo", "input": "x", "truncation": "auto"}, "truncation", "invalid_value"),
    ],
)
async def test_bad_requests_are_400_naming_the_param(
    body: dict[str, Any], param: str, code: str | None
) -> None:
    async with open_edge() as edge, httpx.AsyncClient(base_url=edge.url) as client:
        response = await client.post(RESPONSES_PATH, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
        if code is not None:
            assert error["code"] == code
        assert not (await edge.dispatcher.ledger.query()).rows


async def test_the_sdk_sees_a_bad_request_and_an_unknown_model() -> None:
    async with open_edge() as edge, edge.sdk(max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            await client.responses.create(model="echo", input="x", top_p=2)
        assert bad.value.param == "top_p"
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.responses.create(model="nope", input="x")
        assert unknown.value.code == "model_not_found"


async def test_stored_response_routes_refuse_other_methods() -> None:
    async with open_edge() as edge, httpx.AsyncClient(base_url=edge.url) as client:
        created = (await client.post(RESPONSES_PATH, json={"model": "echo", "input": "x"})).json()
        put = await client.put(f"{RESPONSES_PATH}/{created['id']}")
        assert put.status_code == 405
        assert put.headers["allow"] == "GET, DELETE, OPTIONS"
        wrong = await client.get(f"{RESPONSES_PATH}/{created['id']}", params={"stream": "true"})
        assert wrong.status_code == 400
        deleted = await client.delete(f"{RESPONSES_PATH}/{created['id']}")
        assert deleted.json() == {
            "id": created["id"],
            "object": "response.deleted",
            "deleted": True,
        }


async def test_the_app_routes_the_id_pattern_itself(nursery: trio.Nursery) -> None:
    responses = make_front_end()
    async with open_dispatcher(EdgeConfig(port=0)) as dispatcher:
        await dispatcher.attach_local_node()
        serve = functools.partial(dispatcher.serve, front_ends=(*others(), responses))
        server = await nursery.start(serve)
        url = f"http://127.0.0.1:{server.address.port}"
        async with httpx.AsyncClient(base_url=url) as client:
            created = await client.post(RESPONSES_PATH, json={"model": "echo", "input": "x"})
            fetched = await client.get(f"{RESPONSES_PATH}/{created.json()['id']}")
        server.shutdown()
    assert fetched.status_code == 200, fetched.text


async def test_a_reply_cut_by_max_output_tokens_is_incomplete() -> None:
    async with open_edge() as edge:
        async with edge.sdk() as client:
            cut = await client.responses.create(
                model="echo", input="one two three four", max_output_tokens=2
            )
        assert cut.status == "incomplete"
        assert cut.incomplete_details is not None
        assert cut.incomplete_details.reason == "max_output_tokens"
        assert cut.output_text == "one two "
        assert cut.max_output_tokens == 2

        def consume() -> list[Any]:
            with edge.sync_sdk() as client:
                stream = client.responses.create(
                    model="echo", input="one two three four", max_output_tokens=2, stream=True
                )
                with stream:
                    return list(stream)

        events = await trio.to_thread.run_sync(consume)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "incomplete"
    assert events[-2].item.status == "incomplete"


@pytest.mark.parametrize(
    ("code", "status", "expected"),
    [
        ("upstream_rate_limited", 429, "rate_limit_exceeded"),
        ("upstream_error", 429, "rate_limit_exceeded"),
        ("context_length_exceeded", None, "context_length_exceeded"),
        ("echo_fault", None, "server_error"),
        ("stall_timeout", None, "server_error"),
    ],
)
def test_failures_after_commit_get_the_responses_api_error_codes(
    code: str, status: int | None, expected: str
) -> None:
    failed = wire.RunFailed(run_id="r", seq=1, code=code, message="m", status=status)
    assert error_code(failed) == expected


def test_items_translate_to_chat_messages() -> None:
    request = parse_responses_request(
        orjson.dumps(
            {
                "model": "m",
                "instructions": "be kind",
                "input": [
                    {"type": "message", "role": "developer", "content": "rules"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "a"},
                            {"type": "input_text", "text": "b"},
                        ],
                    },
                    {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "[]"},
                    {"type": "function_call_output", "call_id": "c1", "output": "one"},
                    {
                        "type": "function_call_output",
                        "call_id": "c2",
                        "output": [{"type": "input_text", "text": "two"}],
                    },
                ],
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "name": "get_weather"},
                "max_output_tokens": 7,
                "top_p": 0.5,
                "text": {"format": {"type": "json_object"}},
            }
        )
    )
    body = chat_body(request, [])
    assert body["messages"] == [
        {"role": "system", "content": "be kind"},
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": "c",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "[]"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER_TOOL["description"],
                "parameters": WEATHER_TOOL["parameters"],
            },
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (body["max_tokens"], body["top_p"]) == (7, 0.5)
    assert body["response_format"] == {"type": "json_object"}
    assert "stream" not in body


async def test_a_stored_response_is_only_its_own_keys() -> None:
    async with open_edge(api_keys=("sk-a", "sk-b")) as edge:
        a = openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key="sk-a", max_retries=0)
        b = openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key="sk-b", max_retries=0)
        async with a, b:
            mine = await a.responses.create(model="echo", input="secret words")
            with pytest.raises(openai.NotFoundError):
                await b.responses.retrieve(mine.id)
            with pytest.raises(openai.NotFoundError):
                await b.responses.delete(mine.id)
            with pytest.raises(openai.BadRequestError):
                await b.responses.create(model="echo", input="x", previous_response_id=mine.id)
            assert (await a.responses.retrieve(mine.id)).output_text == "secret words"
