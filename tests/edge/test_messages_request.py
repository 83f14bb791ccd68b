"""The Messages front end's pure parts: the translation to the OpenAI chat body, the input
estimate, the stream's block bookkeeping, stop reasons, and the error renderer's status and
type per error class."""

from __future__ import annotations

from typing import Any

import attrs
import orjson
import pytest

from dispatcher import wire
from dispatcher.admission import (
    Candidate,
    NoCapableCandidate,
    QueueFull,
    QueueTimeout,
    UnknownModel,
)
from dispatcher.api.anthropic import MESSAGES_PREDICATE, anthropic_error
from dispatcher.api.anthropic._answer import EventWriter, message_body, stop_reason
from dispatcher.api.anthropic._request import (
    count_input_tokens,
    parse_count_tokens_request,
    parse_messages_request,
    to_chat_body,
)
from dispatcher.errors import (
    AllAttemptsFailed,
    BadRequest,
    DispatcherError,
    NodeUnavailable,
    PayloadTooLarge,
    ShuttingDown,
    Unauthorized,
    UpstreamRejected,
)
from dispatcher.shared.tokens import estimate_tokens


def parse(**body: Any) -> dict[str, Any]:
    return parse_messages_request(orjson.dumps(body)).body


def user_text(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_the_whole_translation() -> None:
    body = parse(
        model="m",
        max_tokens=64,
        system=[{"type": "text", "text": "be brief"}, {"type": "text", "text": "be kind"}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": "P"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "w", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "18"}],
                    },
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": "down",
                        "is_error": True,
                    },
                ],
            },
        ],
        tools=[{"name": "w", "description": "weather", "input_schema": {"type": "object"}}],
        tool_choice={"type": "tool", "name": "w", "disable_parallel_tool_use": True},
        stop_sequences=["\n\nHuman:"],
        temperature=0.5,
        top_p=0.9,
        stream=True,
        metadata={"user_id": "u-1"},
    )
    assert to_chat_body(body) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief\n\nbe kind"},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "w", "arguments": '{"c":"P"}'},
                    },
                    {
                        "id": "toolu_2",
                        "type": "function",
                        "function": {"name": "w", "arguments": "{}"},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "[tool error] down"},
        ],
        "max_tokens": 64,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ["\n\nHuman:"],
        "stream": True,
        "user": "u-1",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "w",
                    "parameters": {"type": "object"},
                    "description": "weather",
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "w"}},
        "parallel_tool_calls": False,
    }


@pytest.mark.parametrize(
    ("choice", "expected"),
    [({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none")],
)
def test_tool_choice(choice: dict[str, Any], expected: str) -> None:
    tools = [{"name": "w", "input_schema": {"type": "object"}}]
    chat = to_chat_body(
        parse(
            model="m",
            max_tokens=5,
            messages=[{"role": "user", "content": "x"}],
            tools=tools,
            tool_choice=choice,
        )
    )
    assert chat["tool_choice"] == expected
    assert "parallel_tool_calls" not in chat


def test_a_minimal_request_adds_nothing() -> None:
    chat = to_chat_body(parse(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]))
    assert chat == {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}


def test_disabled_thinking_and_cache_control_are_accepted_and_not_forwarded() -> None:
    chat = to_chat_body(
        parse(
            model="m",
            max_tokens=5,
            thinking={"type": "disabled"},
            system=[{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "x"}],
        )
    )
    assert chat["messages"][0] == {"role": "system", "content": "s"}
    assert "thinking" not in chat


def test_a_system_message_in_the_conversation_stays_in_place() -> None:
    """Claude Code's mid-conversation system messages (beta mid-conversation-system): kept
    where they are; one right after an assistant's tool calls follows their results (chat
    wants the tool messages right after the calls); ``clear_at: next_user_message`` drops
    one once a user message follows it."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "file text"}
    chat = to_chat_body(
        parse(
            model="m",
            max_tokens=8,
            system="top",
            messages=[
                {"role": "user", "content": "read it"},
                {"role": "system", "content": "agents: Explore"},
                {"role": "assistant", "content": [call]},
                {"role": "system", "content": [{"type": "text", "text": "after the call"}]},
                {"role": "user", "content": [result, {"type": "text", "text": "and?"}]},
                {"role": "system", "content": "gone", "clear_at": "next_user_message"},
                {"role": "user", "content": "last"},
                {"role": "system", "content": "shown", "clear_at": "next_user_message"},
            ],
        )
    )
    roles = [(m["role"], m.get("content")) for m in chat["messages"]]
    assert roles == [
        ("system", "top"),
        ("user", "read it"),
        ("system", "agents: Explore"),
        ("assistant", None),
        ("tool", "file text"),
        ("system", "after the call"),
        ("user", "and?"),
        ("user", "last"),
        ("system", "shown"),
    ]


@pytest.mark.parametrize(
    ("extra", "effort"),
    [
        ({}, None),
        ({"thinking": {"type": "disabled"}, "output_config": {"effort": "high"}}, None),
        ({"thinking": {"type": "adaptive"}}, "medium"),
        ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}}, "high"),
        ({"output_config": {"effort": "low"}}, "low"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "low"),
        ({"thinking": {"type": "enabled", "budget_tokens": 8000}}, "medium"),
        ({"thinking": {"type": "enabled", "budget_tokens": 32000}}, "high"),
    ],
)
def test_thinking_and_effort_become_a_reasoning_effort(
    extra: dict[str, Any], effort: str | None
) -> None:
    chat = to_chat_body(parse(model="m", max_tokens=8, messages=[user_text("x")], **extra))
    assert chat.get("reasoning_effort") == effort
    assert "thinking" not in chat
    assert "output_config" not in chat


def test_a_system_messages_effort_is_the_turns() -> None:
    messages = [
        user_text("x"),
        {"role": "system", "output_config": {"effort": "max"}},
    ]
    chat = to_chat_body(
        parse(model="m", max_tokens=8, messages=messages, output_config={"effort": "low"})
    )
    assert chat["reasoning_effort"] == "max"
    assert [m["role"] for m in chat["messages"]] == ["user"]  # no content: nothing shown


def test_an_output_format_is_a_json_schema_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    chat = to_chat_body(
        parse(
            model="m",
            max_tokens=8,
            messages=[user_text("x")],
            output_config={"format": {"type": "json_schema", "schema": schema}},
            context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        )
    )
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }
    assert "context_management" not in chat


def test_count_tokens_takes_what_messages_takes_and_refuses_extra_inputs() -> None:
    """Claude Code sends ``count_tokens`` the body it sends ``messages`` (``max_tokens``,
    ``stream``, ``thinking`` ...): accepted, only the input counted; an extra input is still
    refused."""
    body = parse_count_tokens_request(
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "a b"}]})
    )
    assert count_input_tokens(body) == estimate_tokens("a b")
    full = parse_count_tokens_request(
        orjson.dumps(
            {
                "model": "m",
                "max_tokens": 5,
                "stream": True,
                "thinking": {"type": "adaptive"},
                "messages": [{"role": "user", "content": "a b"}],
            }
        )
    )
    assert count_input_tokens(full) == estimate_tokens("a b")
    with pytest.raises(BadRequest, match="'frequency_penalty': extra inputs are not permitted"):
        parse_count_tokens_request(
            orjson.dumps(
                {
                    "model": "m",
                    "frequency_penalty": 1,
                    "messages": [{"role": "user", "content": "x"}],
                }
            )
        )


def test_the_estimate_counts_tool_uses_and_results() -> None:
    body = parse(
        model="m",
        max_tokens=5,
        messages=[
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "done now"}],
            },
        ],
    )
    assert count_input_tokens(body) == (
        estimate_tokens("go") + estimate_tokens('f {"a":1}') + estimate_tokens("done now")
    )


# --------------------------------------------------------------------------- answers


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for chunk in raw.decode().split("\n\n"):
        if chunk:
            name, data = chunk.split("\n")
            out.append((name.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return out


def delta(seq: int, text: str = "", *calls: dict[str, Any]) -> wire.RunDelta:
    return wire.RunDelta(run_id="r", seq=seq, text=text, tool_calls=calls)


def test_text_then_two_tool_calls_are_three_blocks() -> None:
    writer = EventWriter(message_id="msg_r", model="m", input_estimate=7)
    out: list[bytes] = [writer.start([])]
    stream: list[wire.RunEvent] = [
        delta(1, "Checking."),
        delta(2, "", {"index": 0, "id": "call_a", "function": {"name": "f", "arguments": '{"x"'}}),
        delta(3, "", {"index": 0, "function": {"arguments": ": 1}"}}),
        delta(4, "", {"index": 1, "id": "call_b", "function": {"name": "g", "arguments": ""}}),
        wire.RunCompleted(run_id="r", seq=5, finish_reason="tool_calls"),
    ]
    assert [writer.render(item, out) for item in stream] == [False, False, False, False, True]
    got = events(b"".join(out))
    assert got[0][1]["message"]["usage"] == {
        "input_tokens": 7,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }
    assert [(name, data.get("index")) for name, data in got[2:]] == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert got[5][1]["content_block"] == {
        "type": "tool_use",
        "id": "toolu_call_a",
        "name": "f",
        "input": {},
    }
    assert got[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"x"'}
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_tool_call_that_goes_on_after_its_block_closed_is_an_error_event() -> None:
    writer = EventWriter(message_id="msg_r", model="m", input_estimate=0)
    out: list[bytes] = []
    writer.render(delta(1, "", {"index": 0, "id": "a", "function": {"name": "f"}}), out)
    writer.render(delta(2, "", {"index": 1, "id": "b", "function": {"name": "g"}}), out)
    assert writer.render(delta(3, "", {"index": 0, "function": {"arguments": "{}"}}), out)
    assert events(b"".join(out))[-1][0] == "error"


def test_a_failure_after_the_commit_is_an_error_event_typed_by_its_code() -> None:
    for code, error_type in [
        ("upstream_rate_limited", "rate_limit_error"),
        ("upstream_5xx", "overloaded_error"),
        ("stall_timeout", "api_error"),
    ]:
        writer = EventWriter(message_id="msg_r", model="m", input_estimate=0)
        out: list[bytes] = []
        failed = wire.RunFailed(run_id="r", seq=1, code=code, message="x")
        assert writer.render(failed, out)
        ((name, data),) = events(b"".join(out))
        assert (name, data["type"], data["error"]["type"]) == ("error", "error", error_type)


def test_a_non_streamed_message_with_invalid_tool_arguments_keeps_them() -> None:
    head: list[wire.RunEvent] = [
        delta(0, "", {"index": 0, "id": "c", "function": {"name": "f", "arguments": "{not json"}}),
        wire.RunCompleted(run_id="r", seq=1, finish_reason="tool_calls"),
    ]
    body = message_body(message_id="msg_r", model="m", head=head, input_estimate=3)
    assert body["content"] == [
        {"type": "tool_use", "id": "toolu_c", "name": "f", "input": {"_raw_arguments": "{not json"}}
    ]
    assert body["usage"] == {
        "input_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }  # estimated: no run.usage


@pytest.mark.parametrize(
    ("finish", "tool_calls", "reason"),
    [
        ("stop", False, "end_turn"),
        ("length", False, "max_tokens"),
        ("tool_calls", True, "tool_use"),
        ("stop", True, "tool_use"),
        ("content_filter", False, "refusal"),
        ("something_else", False, "end_turn"),
    ],
)
def test_stop_reasons(finish: str, tool_calls: bool, reason: str) -> None:
    assert stop_reason(finish, tool_calls=tool_calls) == reason


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("error", "status", "error_type"),
    [
        (BadRequest("x"), 400, "invalid_request_error"),
        (NoCapableCandidate("x"), 400, "invalid_request_error"),
        (Unauthorized("x"), 401, "authentication_error"),
        (DispatcherError("x", status=403), 403, "permission_error"),
        (UnknownModel("x"), 404, "not_found_error"),
        (PayloadTooLarge("x"), 413, "request_too_large"),
        (UpstreamRejected("x", status=422), 422, "invalid_request_error"),
        (QueueFull("x", retry_after=3), 429, "rate_limit_error"),
        (QueueTimeout("x", retry_after=1), 529, "overloaded_error"),
        (ShuttingDown("x"), 529, "overloaded_error"),
        (AllAttemptsFailed("x"), 529, "overloaded_error"),
        (NodeUnavailable("x"), 529, "overloaded_error"),
        (DispatcherError("x"), 500, "api_error"),
        (RuntimeError("secret detail"), 500, "api_error"),
    ],
)
def test_errors_by_class(error: BaseException, status: int, error_type: str) -> None:
    rendered = anthropic_error(error)
    assert rendered.status == status
    body = orjson.loads(rendered.body)
    assert body == {
        "type": "error",
        "error": {"type": error_type, "message": body["error"]["message"]},
    }
    assert "secret" not in body["error"]["message"]
    if isinstance(error, QueueFull):
        assert rendered.retry_after == 3


def candidate(path: str) -> Candidate:
    return Candidate(
        node_id="n",
        generation=1,
        provider_id="p",
        provider_type="openai",
        adapter="openai",
        model="m",
        served_model="m",
        path=path,  # type: ignore[arg-type]
    )


def test_the_predicate_refuses_tunnels_not_declaring_messages_only() -> None:
    assert MESSAGES_PREDICATE(candidate("normalized")) is None
    reason = MESSAGES_PREDICATE(candidate("tunnel"))
    assert reason is not None
    assert "not 'messages'" in reason
    assert MESSAGES_PREDICATE(attrs.evolve(candidate("tunnel"), routes=("messages",))) is None


def test_the_echo_models_knobs_are_forwarded() -> None:
    chat = to_chat_body(
        parse(
            model="m",
            max_tokens=5,
            messages=[{"role": "user", "content": "x"}],
            echo={"fail_after_tokens": 1},
        )
    )
    assert chat["echo"] == {"fail_after_tokens": 1}


def test_an_image_in_system_is_refused_naming_where() -> None:
    with pytest.raises(BadRequest, match=r"'system\[0\].type': content blocks of type 'image'"):
        parse(
            model="m",
            max_tokens=5,
            system=[{"type": "image", "source": {}}],
            messages=[{"role": "user", "content": "x"}],
        )
