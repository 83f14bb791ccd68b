"""``/v1/messages`` on the gate (issue #13, acceptance 2 and 3): the SDK's error classes for
401, 404, 429 and 529, recovery before the commit, an explicit ``error`` event after it, a
client that leaves cancelling the node's run, exactly one usage row per attempt, and tunnel
candidates never tried. Real edge on 127.0.0.1 port 0; in-process echo nodes, scripted ones
where the test decides when a node fails."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import orjson
import pytest
import trio

from dispatcher import wire
from dispatcher.config import QueuePolicySettings
from dispatcher.paths.runs import RunSpec

from .fakes import connect, hello, wait_until
from .test_messages import Edge, open_edge, sse_events, user


@pytest.fixture
async def edge() -> AsyncIterator[Edge]:
    async with open_edge() as opened:
        yield opened


# --------------------------------------------------------------------------- errors


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = orjson.loads(response.content)
    assert body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    error: dict[str, Any] = body["error"]
    return error


def create(model: str = "echo", **extra: Any) -> Any:
    return lambda client: client.messages.create(
        model=model, max_tokens=50, messages=user("hi"), **extra
    )


async def test_a_wrong_key_is_an_authentication_error_and_the_right_one_works() -> None:
    async with open_edge(api_keys=("sk-good",)) as edge:
        with pytest.raises(anthropic.AuthenticationError) as info:
            await edge.sdk(create(), api_key="sk-bad")
        assert info.value.status_code == 401
        assert info.value.type == "authentication_error"
        # This SDK (2.x) sends its api_key as 'Authorization: Bearer', which the edge reads.
        message = await edge.sdk(create(), api_key="sk-good")
        assert message.content[0].type == "text"
        message = await edge.sdk(create(), api_key=None, auth_token="sk-good")
        assert message.content[0].type == "text"


async def test_an_x_api_key_header_is_accepted() -> None:
    """What Claude Code, older SDKs and Anthropic's curl examples send."""
    async with open_edge(api_keys=("sk-good",)) as edge:
        body = {"model": "echo", "max_tokens": 5, "messages": user("hi")}
        async with httpx.AsyncClient(base_url=edge.url) as client:
            good = await client.post("/v1/messages", json=body, headers={"x-api-key": "sk-good"})
            bad = await client.post("/v1/messages", json=body, headers={"x-api-key": "sk-bad"})
            counted = await client.post(
                "/v1/messages/count_tokens",
                json={"model": "echo", "messages": user("hi")},
                headers={"x-api-key": "sk-good"},
            )
        assert bad.status_code == 401
        assert error_of(bad)["type"] == "authentication_error"
        assert good.status_code == 200, good.text
        assert counted.status_code == 200, counted.text
        assert edge.rows[0].attribution is not None


async def test_an_unknown_model_is_not_found(edge: Edge) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        await edge.sdk(create("no-such-model"))
    assert info.value.type == "not_found_error"
    assert "no-such-model" in str(info.value.api_message)
    assert edge.rows == []


async def hold_the_only_slot(edge: Edge, nursery: trio.Nursery) -> None:
    """Take echo-held's only slot (its echo never answers) until the nursery is cancelled."""

    async def hold() -> None:
        body = {"model": "echo-held", "messages": user("hold")}
        async with edge.dispatcher.open_run(RunSpec(model="echo-held", body=body)):
            await trio.sleep_forever()

    nursery.start_soon(hold)
    await wait_until(lambda: edge.dispatcher.admission.statistics().in_use == 1)


async def test_a_full_queue_is_a_rate_limit_error() -> None:
    async with (
        open_edge(models={"echo-held": QueuePolicySettings(max_queue=0)}) as edge,
        trio.open_nursery() as nursery,
    ):
        await hold_the_only_slot(edge, nursery)
        with pytest.raises(anthropic.RateLimitError) as info:
            await edge.sdk(create("echo-held"))
        assert info.value.status_code == 429
        assert info.value.type == "rate_limit_error"
        assert info.value.response.headers["retry-after"] == "1"
        nursery.cancel_scope.cancel()


async def test_a_queue_timeout_is_overloaded() -> None:
    policy = QueuePolicySettings(max_queue=1, queue_timeout_s=0.2)
    async with (
        open_edge(models={"echo-held": policy}) as edge,
        trio.open_nursery() as nursery,
    ):
        await hold_the_only_slot(edge, nursery)
        with pytest.raises(anthropic.OverloadedError) as info:
            await edge.sdk(create("echo-held", stream=True))
        assert info.value.status_code == 529
        assert info.value.type == "overloaded_error"
        assert isinstance(info.value, anthropic.InternalServerError)
        nursery.cancel_scope.cancel()


async def test_every_attempt_failing_is_overloaded_and_each_dispatched_one_has_a_row(
    edge: Edge,
) -> None:
    with pytest.raises(anthropic.OverloadedError) as info:
        await edge.sdk(create("echo-down"))
    assert info.value.type == "overloaded_error"
    assert "injected failure before the first token" in str(info.value.api_message)
    assert [(r.route, r.attempt, r.outcome, r.billable_to) for r in edge.rows] == [
        ("/v1/messages", 1, "aborted", "operator")
    ]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"model": "echo", "messages": user("x")}, "'max_tokens': a positive integer is required"),
        ({"model": "echo", "max_tokens": 0, "messages": user("x")}, "'max_tokens': must be"),
        ({"max_tokens": 5, "messages": user("x")}, "'model'"),
        ({"model": "echo", "max_tokens": 5, "messages": []}, "'messages': must be a non-empty"),
        (
            {"model": "echo", "max_tokens": 5, "messages": user("x"), "frequency_penalty": 1},
            "'frequency_penalty': extra inputs are not permitted",
        ),
        (
            {"model": "echo", "max_tokens": 5, "messages": user("x"), "top_k": 5},
            "'top_k': not supported",
        ),
        (
            {
                "model": "echo",
                "max_tokens": 5,
                "messages": user("x"),
                "thinking": {"type": "enabled"},
            },
            "'thinking.budget_tokens': a positive integer is required",
        ),
        (
            {
                "model": "echo",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image", "source": {"type": "url", "url": "http://x/y"}},
                        ],
                    }
                ],
            },
            "'messages[0].content[1].type': content blocks of type 'image' are not supported in "
            "a user message (supported: 'text', 'tool_result')",
        ),
        (
            {
                "model": "echo",
                "max_tokens": 5,
                "messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}],
            },
            "content blocks of type 'tool_result' are not supported in an assistant message",
        ),
        (
            {
                "model": "echo",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}],
                    }
                ],
            },
            "'messages[0].content[0].tool_use_id': tool_use_id 'toolu_x' answers no tool_use",
        ),
        (
            {
                "model": "echo",
                "max_tokens": 5,
                "messages": user("x"),
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "'tools[0].type': tools of type 'web_search_20250305'",
        ),
        (
            {
                "model": "echo",
                "max_tokens": 5,
                "messages": user("x"),
                "tools": [{"name": "f", "input_schema": {"type": "string"}}],
            },
            "'tools[0].input_schema': must be a JSON schema of type 'object'",
        ),
        (
            {
                "model": "echo",
                "max_tokens": 5,
                "messages": user("x"),
                "tool_choice": {"type": "tool", "name": "f"},
            },
            "'tool_choice': type 'tool' needs 'tools'",
        ),
        (
            {"model": "echo", "max_tokens": 5, "messages": user("x"), "temperature": 1.5},
            "'temperature': must be a number from 0 to 1",
        ),
        (
            {"model": "echo", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]},
            "'messages[0].role': must be one of 'system', 'user', 'assistant'",
        ),
        (
            {"model": "echo", "max_tokens": 5, "messages": [*user("x"), {"role": "system"}]},
            "'messages[1].content': a system message needs content or output_config",
        ),
        (
            {"model": "echo", "max_tokens": 5, "messages": user("x"), "container": "c"},
            "'container': not supported: code execution containers",
        ),
    ],
)
async def test_invalid_requests_are_answered_400_naming_what_is_wrong(
    edge: Edge, body: dict[str, Any], needle: str
) -> None:
    async with httpx.AsyncClient(base_url=edge.url) as client:
        response = await client.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert needle in error["message"]
    assert edge.rows == []


async def test_the_sdk_gets_a_bad_request_for_an_image(edge: Edge) -> None:
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    blocks: list[Any] = [{"role": "user", "content": [image]}]
    with pytest.raises(anthropic.BadRequestError) as info:
        await edge.sdk(
            lambda client: client.messages.create(
                model="echo",
                max_tokens=5,
                messages=blocks,
            )
        )
    assert info.value.type == "invalid_request_error"
    assert "'image'" in str(info.value.api_message)


async def test_other_errors_keep_anthropics_shape(edge: Edge) -> None:
    async with httpx.AsyncClient(base_url=edge.url) as client:
        not_json = await client.post("/v1/messages", content=b"{nope")
        wrong_method = await client.get("/v1/messages")
    assert not_json.status_code == 400
    assert error_of(not_json)["type"] == "invalid_request_error"
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST, OPTIONS"
    assert error_of(wrong_method)["type"] == "invalid_request_error"


# --------------------------------------------------------------------------- the gate


async def test_recovery_before_the_commit_is_invisible_to_the_client() -> None:
    """The first candidate fails before its first token; the second (attached meanwhile)
    answers. The client sees one clean stream; each attempt has exactly one row."""
    async with open_edge(node=None) as edge:
        bad = await connect(edge.dispatcher, hello("bad", model="echo"))
        async with trio.open_nursery() as nursery:
            got: list[Any] = []

            def consume(client: anthropic.Anthropic) -> None:
                with client.messages.with_streaming_response.create(
                    model="echo", max_tokens=50, messages=user("recovered words"), stream=True
                ) as raw:
                    got.append(raw.headers)
                    got.append(raw.read())

            async def call() -> None:
                await edge.sdk(consume)

            nursery.start_soon(call)
            request = await bad.receive_run()
            await edge.dispatcher.attach_local_node()  # the built-in echo: the second candidate
            await bad.emit(
                request.run_id,
                ("run.started", {}),
                ("run.failed", {"code": "upstream_5xx", "message": "boom", "retryable": True}),
            )
        headers, raw = got
    assert headers["x-dispatcher-attempts"] == "2"
    events = sse_events(raw)
    assert [name for name, _ in events][:2] == ["message_start", "ping"]
    assert events[-1][0] == "message_stop"
    assert "error" not in [name for name, _ in events]
    text = "".join(d["delta"]["text"] for name, d in events if name == "content_block_delta")
    assert text == "recovered words"
    await wait_until(lambda: len(edge.rows) == 2)
    rows = sorted(edge.rows, key=lambda r: r.attempt)
    assert [(r.route, r.attempt, r.node_id, r.outcome, r.billable_to) for r in rows] == [
        ("/v1/messages", 1, "bad", "aborted", "operator"),
        ("/v1/messages", 2, "local", "completed", "client"),
    ]
    assert rows[0].request_id == rows[1].request_id


async def test_a_failure_after_the_commit_is_an_error_event_never_a_clean_end(
    edge: Edge,
) -> None:
    pieces: list[str] = []

    def consume(client: anthropic.Anthropic) -> None:
        with client.messages.stream(
            model="echo-faulty", max_tokens=50, messages=user("one two three four five")
        ) as stream:
            for piece in stream.text_stream:
                pieces.append(piece)

    with pytest.raises(anthropic.APIStatusError) as info:
        await edge.sdk(consume)
    assert info.value.type == "api_error"
    assert "injected failure after 2 tokens" in str(info.value.api_message)
    assert "".join(pieces) == "one two "
    # The same on the wire: an error event last, no message_delta / message_stop.
    body = {"model": "echo-faulty", "max_tokens": 50, "stream": True, "messages": user("a b c")}
    async with httpx.AsyncClient(base_url=edge.url) as client:
        response = await client.post("/v1/messages", json=body)
    assert response.status_code == 200
    events = sse_events(response.content)
    names = [name for name, _ in events]
    assert names[-1] == "error"
    assert "message_stop" not in names
    assert "message_delta" not in names
    assert events[-1][1]["error"]["type"] == "api_error"
    await wait_until(lambda: len(edge.rows) == 2)
    assert [(r.route, r.attempt, r.outcome, r.billable_to) for r in edge.rows] == [
        ("/v1/messages", 1, "failed", "client"),
        ("/v1/messages", 1, "failed", "client"),
    ]


async def test_a_client_that_leaves_cancels_the_node_run(edge: Edge) -> None:
    words = " ".join(f"w{i}" for i in range(300))
    payload = orjson.dumps(
        {"model": "echo-slow", "max_tokens": 1000, "stream": True, "messages": user(words)}
    )
    stream = await trio.open_tcp_stream("127.0.0.1", edge.server.address.port)
    await stream.send_all(
        b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"anthropic-version: 2023-06-01\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    received = b""
    with trio.fail_after(10):
        while b"event: content_block_delta" not in received:
            chunk = await stream.receive_some()
            assert chunk, "the edge closed the stream early"
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 ")
    assert edge.dispatcher.admission.statistics().in_use == 1
    await stream.aclose()
    await wait_until(lambda: edge.dispatcher.runs.stats.cancels_sent == 1)
    await wait_until(lambda: edge.dispatcher.admission.statistics().in_use == 0)
    await wait_until(lambda: len(edge.rows) == 1)
    assert edge.dispatcher.runs.stats.ended.get("cancelled") == 1
    (row,) = edge.rows
    assert (row.route, row.outcome, row.billable_to) == ("/v1/messages", "cancelled", "client")
    assert row.completion_tokens < 300


def tunnel_hello(node_id: str) -> wire.Hello:
    return wire.Hello(
        protocol=wire.PROTOCOL_VERSION,
        node_id=node_id,
        providers=(
            wire.ProviderInfo(
                id="t1",
                type="openai",
                adapter="tunnel",
                path="tunnel",
                models=(wire.ModelInfo(name="m", served_name="m-served", slots=4),),
            ),
        ),
    )


async def test_tunnel_candidates_not_declaring_messages_are_excluded_at_admission() -> None:
    async with open_edge(node=None) as edge:
        tunnel = await connect(edge.dispatcher, tunnel_hello("tunnel-node"))
        async with httpx.AsyncClient(base_url=edge.url) as client:
            only_tunnel = await client.post(
                "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": user("x")}
            )
        assert only_tunnel.status_code == 400
        error = error_of(only_tunnel)
        assert error["type"] == "invalid_request_error"
        assert (
            "its tunnel provider declares the routes chat, completions, embeddings, not "
            "'messages'" in error["message"]
        )
        # With a normalized candidate beside it, the request goes there, never to the tunnel.
        normal = await connect(edge.dispatcher, hello("normal", model="m", slots=4))
        async with trio.open_nursery() as nursery:

            async def answer() -> None:
                request = await normal.receive_run()
                await normal.emit(
                    request.run_id, ("run.delta", {"text": "ok"}), ("run.completed", {})
                )

            nursery.start_soon(answer)
            message = await edge.sdk(create("m"))
        assert message.content[0].text == "ok"
        assert not [m for m in tunnel.seen if not isinstance(m, wire.Welcome)]
        assert [(r.node_id, r.path, r.route) for r in edge.rows] == [
            ("normal", "normalized", "/v1/messages")
        ]


async def test_a_draining_edge_is_overloaded_and_ends_open_streams_with_an_error_event(
    edge: Edge,
) -> None:
    words = " ".join(f"w{i}" for i in range(300))
    body = {"model": "echo-slow", "max_tokens": 1000, "stream": True, "messages": user(words)}
    received = b""
    async with (
        httpx.AsyncClient(base_url=edge.url, timeout=30) as client,
        client.stream("POST", "/v1/messages", json=body) as response,
    ):
        assert response.status_code == 200
        async for chunk in response.aiter_bytes():
            received += chunk
            if b"event: content_block_delta" in received and not edge.dispatcher.draining:
                await edge.dispatcher.begin_shutdown()
    events = sse_events(received)
    assert events[-1][0] == "error"
    assert events[-1][1]["error"] == {
        "type": "overloaded_error",
        "message": "the dispatcher is shutting down",
    }
    assert "message_stop" not in [name for name, _ in events]
    with pytest.raises(anthropic.OverloadedError) as info:
        await edge.sdk(create())
    assert info.value.response.headers["retry-after"] == "1"
