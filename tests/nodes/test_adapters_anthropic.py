"""The ``anthropic`` adapter: its translation (pure), its reading of the answer (sans-IO), and
the adapter against the fake Messages API (``tests/fake_anthropic.py``), driven by the real
runner."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher import wire
from nodes import load_node_config
from nodes.adapters import ADAPTERS, Adapter, build_adapters, validate_options
from nodes.adapters.anthropic import (
    AnthropicAdapter,
    AnthropicOptions,
    MessagesStream,
    event_failure,
    messages_body,
    messages_url,
)
from nodes.adapters.base import AdapterError
from nodes.config import ModelConfig, NodeConfigError, OptionsError, ProviderConfig
from nodes.runner import open_runner
from tests.fake_anthropic import FakeAnthropic, Refused, serve_fake_anthropic
from tests.nodes._helpers import Recorder, assert_no_address, assert_well_formed

KEY = "sk-ant-test-123"
WEATHER = {
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
NO_CACHE = AnthropicOptions(prompt_cache=False)


def body(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    chosen = list(messages) or [{"role": "user", "content": "say hello"}]
    return {"model": "claude", "messages": chosen, **fields}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def call(call_id: str, name: str = "get_weather", arguments: str = '{"city": "Paris"}') -> Any:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def text(value: str, **extra: Any) -> dict[str, Any]:
    return {"type": "text", "text": value, **extra}


# --------------------------------------------------------------------------- the request


def test_a_plain_conversation() -> None:
    got = messages_body(
        body(
            {"role": "system", "content": "be brief"},
            user("hi"),
            {"role": "assistant", "content": [text("hello"), {"type": "refusal", "refusal": "no"}]},
            {"role": "developer", "content": [text("no jokes")]},
            user("again"),
            max_completion_tokens=50,
            max_tokens=99,
            stop="END",
            temperature=1.5,
            top_p=0.9,
            user="u-1",
        ),
        "claude-served",
        NO_CACHE,
    )
    assert got == {
        "model": "claude-served",
        "max_tokens": 50,
        "system": [text("be brief"), text("no jokes")],
        "messages": [
            {"role": "user", "content": [text("hi")]},
            {"role": "assistant", "content": [text("hello")]},
            {"role": "user", "content": [text("again")]},
        ],
        "stop_sequences": ["END"],
        "temperature": 1.0,  # Anthropic's range ends at 1
        "top_p": 0.9,
        "metadata": {"user_id": "u-1"},
        "stream": True,
    }


def test_max_tokens_from_the_request_else_the_option() -> None:
    assert messages_body(body(max_tokens=7), "m")["max_tokens"] == 7
    assert messages_body(body(), "m")["max_tokens"] == 4096
    assert messages_body(body(), "m", AnthropicOptions(max_tokens=12))["max_tokens"] == 12
    with pytest.raises(AdapterError) as info:
        messages_body(body(max_tokens=0), "m")
    assert (info.value.code, info.value.status, info.value.retryable) == (
        "invalid_request",
        400,
        False,
    )


def test_tool_calls_and_results_become_tool_use_and_merged_tool_results() -> None:
    got = messages_body(
        body(
            user("weather in Paris and Rome?"),
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call("toolu_1"), call("toolu_2", arguments='{"city": "Rome"}')],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": [text("rainy")]},
            user("thanks"),
            tools=[WEATHER],
            tool_choice="auto",
        ),
        "m",
        NO_CACHE,
    )
    assert got["tools"] == [
        {
            "name": "get_weather",
            "description": "The weather in a city.",
            "input_schema": WEATHER["function"]["parameters"],  # type: ignore[index]
        }
    ]
    assert got["tool_choice"] == {"type": "auto"}
    assert got["messages"] == [
        {"role": "user", "content": [text("weather in Paris and Rome?")]},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {
                    "type": "tool_use",
                    "id": "toolu_2",
                    "name": "get_weather",
                    "input": {"city": "Rome"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": [text("rainy")]},
                text("thanks"),
            ],
        },
    ]
    FakeAnthropic()._check(got)  # what Anthropic would take


@pytest.mark.parametrize(
    ("choice", "parallel", "expected"),
    [
        ("auto", None, {"type": "auto"}),
        ("none", None, {"type": "none"}),
        ("required", None, {"type": "any"}),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            None,
            {"type": "tool", "name": "get_weather"},
        ),
        (None, None, None),
        (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("required", False, {"type": "any", "disable_parallel_tool_use": True}),
        ("none", False, {"type": "none"}),
    ],
)
def test_tool_choice(choice: Any, parallel: Any, expected: Any) -> None:
    fields: dict[str, Any] = {"tools": [WEATHER]}
    if choice is not None:
        fields["tool_choice"] = choice
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    assert messages_body(body(**fields), "m").get("tool_choice") == expected


def test_images_and_what_cannot_be_translated() -> None:
    got = messages_body(
        body(
            {
                "role": "user",
                "content": [
                    text("what is this?"),
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
                ],
            }
        ),
        "m",
        NO_CACHE,
    )
    assert got["messages"][0]["content"][1:] == [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
    ]
    wrong = [
        body({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}),
        body({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x"}}]}),
        body(user("x"), {"role": "assistant", "tool_calls": [call("c1", arguments="[1]")]}),
        body({"role": "tool", "content": "no id"}),
        body({"role": "function", "name": "f", "content": "legacy"}),
        body(tools=[{"type": "web_search"}]),
        body(messages=[]),
    ]
    for request in wrong:
        with pytest.raises(AdapterError) as info:
            messages_body(request, "m")
        assert (info.value.code, info.value.status) == ("invalid_request", 400), request


def test_reasoning_effort_becomes_thinking_only_where_anthropic_takes_it() -> None:
    got = messages_body(body(reasoning_effort="low", max_tokens=100, temperature=0.2), "m")
    assert got["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert got["max_tokens"] == 2148  # the budget on top of the answer's own
    assert "temperature" not in got
    FakeAnthropic()._check(got)
    forced = body(reasoning_effort="high", tools=[WEATHER], tool_choice="required")
    assert "thinking" not in messages_body(forced, "m")
    mid_loop = body(
        user("weather?"),
        {"role": "assistant", "tool_calls": [call("toolu_1")]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        reasoning_effort="medium",
        tools=[WEATHER],
    )
    assert "thinking" not in messages_body(mid_loop, "m")
    assert "thinking" not in messages_body(body(reasoning_effort="none"), "m")


def test_prompt_cache_breakpoints() -> None:
    conversation = body({"role": "system", "content": "sys"}, user("a"), user("b"))
    got = messages_body(conversation, "m")
    assert got["system"] == [text("sys", cache_control={"type": "ephemeral"})]
    assert got["messages"] == [
        {"role": "user", "content": [text("a"), text("b", cache_control={"type": "ephemeral"})]}
    ]
    assert "cache_control" not in orjson.dumps(messages_body(conversation, "m", NO_CACHE)).decode()
    own = body(
        {"role": "user", "content": [text("a", cache_control={"type": "ephemeral", "ttl": "1h"})]},
        user("b"),
    )
    got = messages_body(own, "m")
    assert got["messages"][0]["content"] == [
        text("a", cache_control={"type": "ephemeral", "ttl": "1h"}),
        text("b"),
    ]


def test_json_schema_response_format_becomes_output_config() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fields = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }
    got = messages_body(body(**fields), "m")
    assert got["output_config"] == {"format": {"type": "json_schema", "schema": schema}}
    assert "output_config" not in messages_body(body(response_format={"type": "json_object"}), "m")


def test_messages_url() -> None:
    assert messages_url("https://api.anthropic.com") == "https://api.anthropic.com/v1/messages"
    assert messages_url("https://api.anthropic.com/v1/") == "https://api.anthropic.com/v1/messages"
    assert messages_url("http://h/proxy/v1") == "http://h/proxy/v1/messages"


# Conversations a chat client may send: user turns, assistant turns with text and/or tool
# calls, each call answered by a tool message, in any arrangement around them.
WORDS = st.text(alphabet="abcdefgh ", min_size=1, max_size=12).filter(str.strip)


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(WORDS)})
    calls = 0
    for _ in range(draw(st.integers(1, 5))):
        messages.append(user(draw(WORDS)))
        if draw(st.booleans()):
            messages.append(user(draw(WORDS)))  # two user messages in a row
        if draw(st.booleans()):
            said = draw(st.one_of(st.none(), WORDS))
            ids = [f"toolu_{calls + i}" for i in range(draw(st.integers(0, 3)))]
            calls += len(ids)
            assistant: dict[str, Any] = {"role": "assistant", "content": said}
            if ids:
                assistant["tool_calls"] = [call(i) for i in ids]
            messages.append(assistant)
            for call_id in ids:
                messages.append({"role": "tool", "tool_call_id": call_id, "content": draw(WORDS)})
            more: bool = draw(st.booleans())
            if ids and more:
                messages.append(user(draw(WORDS)))
        if draw(st.booleans()):
            messages.append({"role": "developer", "content": draw(WORDS)})
    if messages[-1]["role"] == "assistant":
        messages.append(user(draw(WORDS)))
    return messages


def _texts(messages: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in messages if isinstance(m.get("content"), str)]


@given(conversations(), st.booleans())
@settings(max_examples=200, deadline=None)
def test_any_well_formed_chat_conversation_is_one_anthropic_takes(
    messages: list[dict[str, Any]], cache: bool
) -> None:
    """Roles alternate, every tool call is answered in the next user turn with its results
    first (the fake checks as Anthropic does), and no text is lost or reordered."""
    got = messages_body(body(*messages, tools=[WEATHER]), "m", AnthropicOptions(prompt_cache=cache))
    FakeAnthropic()._check(got)
    roles = [turn["role"] for turn in got["messages"]]
    assert all(a != b for a, b in itertools.pairwise(roles))
    system = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    assert [block["text"] for block in got.get("system", [])] == system
    said: list[str] = []
    for turn in got["messages"]:
        for block in turn["content"]:
            if block["type"] == "text":
                said.append(block["text"])
    others = [m for m in messages if m["role"] in ("user", "assistant")]
    # tool results go before a turn's text, so compare per kind
    assert sorted(said) == sorted(_texts(others))
    results = [
        b["content"] for t in got["messages"] for b in t["content"] if b["type"] == "tool_result"
    ]
    assert results == [m["content"] for m in messages if m["role"] == "tool"]


def test_the_fake_refuses_what_anthropic_refuses() -> None:
    """The property above means something: the fake does refuse a broken conversation."""
    broken = messages_body(
        body(user("x"), {"role": "assistant", "tool_calls": [call("toolu_1")]}, user("y")),
        "m",
    )
    with pytest.raises(Refused):
        FakeAnthropic()._check(broken)


# --------------------------------------------------------------------------- the answer


def sse_events(blocks: list[dict[str, Any]], stop_reason: str = "end_turn") -> list[Any]:
    """A stream's events for ``blocks`` (text, tool_use with its input, thinking)."""
    events: list[Any] = [
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "content": [],
                "usage": {
                    "input_tokens": 5,
                    "output_tokens": 1,
                    "cache_read_input_tokens": 100,
                    "cache_creation_input_tokens": 20,
                },
            },
        },
        {"type": "ping"},
    ]
    for index, block in enumerate(blocks):
        if block["type"] == "text":
            events.append(
                {"type": "content_block_start", "index": index, "content_block": text("")}
            )
            for piece in block["pieces"]:
                delta = {"type": "text_delta", "text": piece}
                events.append({"type": "content_block_delta", "index": index, "delta": delta})
        elif block["type"] == "tool_use":
            head = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            events.append({"type": "content_block_start", "index": index, "content_block": head})
            for piece in block["pieces"]:
                delta = {"type": "input_json_delta", "partial_json": piece}
                events.append({"type": "content_block_delta", "index": index, "delta": delta})
        else:
            head = {"type": "thinking", "thinking": "", "signature": ""}
            events.append({"type": "content_block_start", "index": index, "content_block": head})
            delta = {"type": "thinking_delta", "thinking": "hmm"}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})
    events.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": {"output_tokens": 42},
        }
    )
    events.append({"type": "message_stop"})
    return events


def assembled(pieces: list[Any]) -> tuple[str, list[dict[str, str]]]:
    """The text and the tool calls (id, name, arguments) the pieces make, as a client
    assembles OpenAI deltas."""
    said, calls = "", dict[int, dict[str, str]]()
    for piece in pieces:
        if isinstance(piece, str):
            said += piece
            continue
        for delta in piece:
            entry = calls.setdefault(delta["index"], {"id": "", "name": "", "arguments": ""})
            entry["id"] = delta.get("id", entry["id"])
            entry["name"] = delta.get("function", {}).get("name", entry["name"])
            entry["arguments"] += delta.get("function", {}).get("arguments", "")
    return said, [calls[i] for i in sorted(calls)]


def test_a_stream_with_text_tool_use_and_thinking() -> None:
    events = sse_events(
        [
            {"type": "thinking"},
            {"type": "text", "pieces": ["Let me ", "check."]},
            {
                "type": "tool_use",
                "id": "toolu_a",
                "name": "get_weather",
                "pieces": ["", '{"ci', 'ty": "Paris"}'],
            },
            {"type": "tool_use", "id": "toolu_b", "name": "now", "pieces": [""]},
        ],
        stop_reason="tool_use",
    )
    stream = MessagesStream()
    pieces = [piece for event in events for piece in stream.take(event)]
    assert assembled(pieces) == (
        "Let me check.",
        [
            {"id": "toolu_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"id": "toolu_b", "name": "now", "arguments": "{}"},
        ],
    )
    assert pieces[2] == [
        {
            "index": 0,
            "id": "toolu_a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        }
    ]
    assert stream.ended
    assert stream.finish_reason == "tool_calls"
    usage = stream.usage
    assert (usage.prompt_tokens, usage.output_tokens) == (125, 42)
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (100, 20)


@pytest.mark.parametrize(
    ("reason", "finish"),
    [
        ("end_turn", "stop"),
        ("max_tokens", "length"),
        ("tool_use", "tool_calls"),
        ("stop_sequence", "stop"),
        ("refusal", "content_filter"),
        ("something_new", "stop"),
    ],
)
def test_stop_reasons(reason: str, finish: str) -> None:
    stream = MessagesStream()
    stream.take({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": "X"}})
    assert stream.finish_reason == finish
    assert stream.matched_sequence == ("X" if reason == "stop_sequence" else None)


BLOCKS = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "type": st.just("text"),
                "pieces": st.lists(st.text(min_size=1, max_size=5), max_size=4),
            }
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("tool_use"),
                "id": st.from_regex(r"toolu_[a-z0-9]{1,6}", fullmatch=True),
                "name": st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
                "input": st.dictionaries(st.text(max_size=4), st.integers(-1000, 1000), max_size=3),
            }
        ),
        st.fixed_dictionaries({"type": st.just("thinking")}),
    ),
    max_size=5,
)


@given(BLOCKS, st.data())
@settings(max_examples=200, deadline=None)
def test_streamed_and_whole_answers_say_the_same(
    blocks: list[dict[str, Any]], data: st.DataObject
) -> None:
    """However the stream cuts a tool call's input into pieces, the assembled answer is the
    whole message's: the same text and the same calls."""
    for block in blocks:
        if block["type"] == "tool_use":
            raw = orjson.dumps(block["input"]).decode()
            cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=3)))
            bounds = [0, *cuts, len(raw)]
            block["pieces"] = [raw[a:b] for a, b in itertools.pairwise(bounds)]
    streamed = MessagesStream()
    pieces = [piece for event in sse_events(blocks) for piece in streamed.take(event)]
    content = []
    for block in blocks:
        if block["type"] == "text":
            content.append(text("".join(block["pieces"])))
        elif block["type"] == "tool_use":
            content.append({k: block[k] for k in ("type", "id", "name", "input")})
        else:
            content.append({"type": "thinking", "thinking": "hmm", "signature": "s"})
    whole = MessagesStream()
    message = {
        "type": "message",
        "content": content,
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }
    said, calls = assembled(pieces)
    whole_said, whole_calls = assembled(whole.take_message(message))
    assert said == whole_said
    assert [c["id"] for c in calls] == [c["id"] for c in whole_calls]
    assert [orjson.loads(c["arguments"]) for c in calls] == [
        orjson.loads(c["arguments"]) for c in whole_calls
    ]


@pytest.mark.parametrize(
    ("kind", "code", "retryable", "status"),
    [
        ("invalid_request_error", "invalid_request", False, 400),
        ("request_too_large", "request_too_large", False, 413),
        ("rate_limit_error", "upstream_rate_limited", True, None),
        ("overloaded_error", "upstream_5xx", True, None),
        ("api_error", "upstream_5xx", True, None),
        ("billing_error", "upstream_error", True, None),
    ],
)
def test_error_events(kind: str, code: str, retryable: bool, status: int | None) -> None:
    failure = event_failure({"type": "error", "error": {"type": kind, "message": "boom"}})
    assert (failure.code, failure.retryable, failure.status) == (code, retryable, status)
    assert "boom" in failure.message
    with pytest.raises(AdapterError):
        MessagesStream().take({"type": "error", "error": {"type": kind, "message": "boom"}})


# --------------------------------------------------------------------------- against the fake


def adapter_for(base_url: str, *, api_key: str | None = KEY, **options: Any) -> AnthropicAdapter:
    provider = ProviderConfig(
        id="an",
        type="anthropic",
        base_url=base_url,
        api_key_env="FAKE_ANTHROPIC_KEY" if api_key is not None else None,
        options=options,
        models=(ModelConfig(name="claude", served_name="claude-served"),),
    )
    environ = {"FAKE_ANTHROPIC_KEY": api_key} if api_key is not None else {}
    return AnthropicAdapter.from_provider(provider, environ=environ)


def req(run_id: str = "r1", *messages: dict[str, Any], **fields: Any) -> wire.RunRequest:
    return wire.RunRequest(
        run_id=run_id,
        provider_id="an",
        model="claude",
        served_model="claude-served",
        body=body(*messages, **fields),
    )


async def run(adapter: Adapter, *requests: wire.RunRequest) -> Recorder:
    rec = Recorder()
    requests = requests or (req(),)
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"an": adapter}) as runner:
            for request in requests:
                runner.start(request)
                await rec.wait_terminal(request.run_id)
    for request in requests:
        assert_well_formed(rec.events(request.run_id))
    return rec


def usage_of(rec: Recorder, run_id: str = "r1") -> wire.Usage:
    usages = [e.usage for e in rec.events(run_id) if isinstance(e, wire.RunUsage)]
    assert len(usages) == 1
    usage: wire.Usage = usages[0]
    return usage


def calls_of(rec: Recorder, run_id: str = "r1") -> list[dict[str, str]]:
    pieces = [
        list(e.tool_calls)
        for e in rec.events(run_id)
        if isinstance(e, wire.RunDelta) and e.tool_calls
    ]
    return assembled(pieces)[1]


@pytest.fixture
async def fake(nursery: trio.Nursery) -> FakeAnthropic:
    started: FakeAnthropic = await nursery.start(serve_fake_anthropic, FakeAnthropic(api_key=KEY))
    return started


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_text_usage_and_finish(fake: FakeAnthropic, stream: bool) -> None:
    rec = await run(adapter_for(fake.base_url, stream=stream))
    assert rec.text("r1") == fake.expected_text == "Hello from the fake provider!"
    terminal = rec.terminal("r1")
    assert isinstance(terminal, wire.RunCompleted)
    assert (terminal.finish_reason, terminal.stop_sequence) == ("stop", None)
    (seen,) = fake.requests
    assert (seen.method, seen.path) == ("POST", "/v1/messages")
    assert seen.header("x-api-key") == KEY
    assert seen.header("anthropic-version") == "2023-06-01"
    assert seen.authorization is None
    assert seen.json["model"] == "claude-served"
    assert seen.json.get("stream", False) is stream
    answered = fake.answers[0]["usage"]
    usage = usage_of(rec)
    assert usage == wire.Usage(
        prompt_tokens=answered["input_tokens"] + answered["cache_creation_input_tokens"],
        completion_tokens=answered["output_tokens"],
        cache_write_tokens=answered["cache_creation_input_tokens"],
    )
    assert usage.cache_write_tokens > 0  # the default breakpoints wrote the prompt
    first = next(e for e in rec.events("r1") if isinstance(e, wire.RunDelta))
    assert first.usage is not None
    assert first.usage.prompt_tokens == usage.prompt_tokens


async def test_a_repeated_prompt_reads_from_the_cache(fake: FakeAnthropic) -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    rec = await run(
        adapter_for(fake.base_url),
        req("r1", system, user("first question")),
        req(
            "r2",
            system,
            user("first question"),
            {"role": "assistant", "content": "ok"},
            user("more"),
        ),
    )
    first, second = usage_of(rec, "r1"), usage_of(rec, "r2")
    assert first.cached_tokens == 0
    assert first.cache_write_tokens > 0
    assert second.cached_tokens == first.cache_write_tokens  # the whole first prompt
    assert second.cache_write_tokens > 0  # and its own new turns
    # the breakpoint ends the conversation: every input token is read from or written to it
    assert second.prompt_tokens == second.cached_tokens + second.cache_write_tokens
    assert first.prompt_tokens == first.cache_write_tokens
    assert first.prompt_tokens < second.prompt_tokens


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_tool_round_trip(fake: FakeAnthropic, stream: bool) -> None:
    adapter = adapter_for(fake.base_url, stream=stream)
    asked = [user("what is the weather in Paris? use get_weather")]
    rec = await run(adapter, req("r1", *asked, tools=[WEATHER]))
    assert rec.terminal("r1").finish_reason == "tool_calls"
    assert rec.text("r1") == "Calling get_weather."
    [made] = calls_of(rec)
    assert made == {"id": "toolu_fake_1", "name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert fake.requests[0].json["tools"][0]["name"] == "get_weather"

    follow_up = [
        *asked,
        {
            "role": "assistant",
            "content": rec.text("r1"),
            "tool_calls": [call(made["id"], made["name"], made["arguments"])],
        },
        {"role": "tool", "tool_call_id": made["id"], "content": "sunny, 21 C"},
    ]
    rec = await run(adapter, req("r2", *follow_up, tools=[WEATHER]))
    assert rec.text("r2") == "The tool said: sunny, 21 C."
    assert rec.terminal("r2").finish_reason == "stop"
    assert calls_of(rec, "r2") == []


async def test_a_stop_sequence_is_carried_to_run_completed(fake: FakeAnthropic) -> None:
    fake.reply = "one two STOP three"
    rec = await run(adapter_for(fake.base_url), req(stop=["STOP", "never"]))
    assert rec.text("r1") == "one two "
    terminal = rec.terminal("r1")
    assert (terminal.finish_reason, terminal.stop_sequence) == ("stop", "STOP")
    assert fake.requests[0].json["stop_sequences"] == ["STOP", "never"]


async def test_max_tokens_is_length(fake: FakeAnthropic) -> None:
    fake.chunk_count = 10
    rec = await run(adapter_for(fake.base_url), req(max_tokens=3))
    assert rec.text("r1") == "tok0 tok1 tok2 "
    assert rec.terminal("r1").finish_reason == "length"


async def test_thinking_is_asked_and_not_relayed(fake: FakeAnthropic) -> None:
    rec = await run(adapter_for(fake.base_url), req(reasoning_effort="low", max_tokens=20))
    assert fake.requests[0].json["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert fake.answers[0]["content"][0]["type"] == "thinking"
    assert rec.text("r1") == fake.expected_text
    usage = usage_of(rec)
    assert usage.reasoning_tokens == 2  # the thinking's tokens, among the output's
    assert usage.completion_tokens == 2 + len(fake.tokens)


@pytest.mark.parametrize(
    ("status", "code", "retryable", "relayed"),
    [
        (400, "invalid_request", False, 400),
        (413, "invalid_request", False, 413),
        (401, "upstream_unauthorized", True, None),
        (429, "upstream_rate_limited", True, None),
        (500, "upstream_5xx", True, None),
        (529, "upstream_5xx", True, None),
    ],
)
async def test_http_errors(
    fake: FakeAnthropic, status: int, code: str, retryable: bool, relayed: int | None
) -> None:
    fake.fail_statuses = [status]
    fake.error_message = "the fake says no"
    rec = await run(adapter_for(fake.base_url))
    failed = rec.terminal("r1")
    assert isinstance(failed, wire.RunFailed)
    assert (failed.code, failed.retryable, failed.status) == (code, retryable, relayed)
    assert ("Overloaded" if status == 529 else "the fake says no") in failed.message
    assert_no_address(failed.message, fake.base_url)
    assert fake.fail_statuses == []


async def test_a_wrong_key_and_a_request_the_fake_refuses(fake: FakeAnthropic) -> None:
    rec = await run(adapter_for(fake.base_url, api_key="sk-wrong"))
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable) == ("upstream_unauthorized", True)
    assert "sk-wrong" not in failed.message
    rec = await run(adapter_for(fake.base_url), req(temperature=-1))
    failed = rec.terminal("r1")
    assert (failed.code, failed.status, failed.retryable) == ("invalid_request", 400, False)
    assert "temperature" in failed.message


async def test_an_error_event_mid_stream_fails_the_run(fake: FakeAnthropic) -> None:
    fake.chunk_count, fake.fail_after_chunks, fake.fail_mode = 5, 2, "error"
    rec = await run(adapter_for(fake.base_url))
    assert rec.text("r1") == "tok0 tok1 "
    failed = rec.terminal("r1")
    assert isinstance(failed, wire.RunFailed)
    assert (failed.code, failed.retryable) == ("upstream_5xx", True)
    assert "overloaded_error" in failed.message


async def test_a_stream_cut_before_message_stop_is_a_disconnection(fake: FakeAnthropic) -> None:
    fake.chunk_count, fake.fail_after_chunks = 5, 2
    rec = await run(adapter_for(fake.base_url))
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable) == ("upstream_disconnected", True)


async def test_cancel_reaches_the_provider(fake: FakeAnthropic) -> None:
    fake.chunk_count, fake.chunk_delay = 10_000, 0.01
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"an": adapter_for(fake.base_url)}) as runner:
            runner.start(req())
            await rec.wait_for(lambda: len(rec.text("r1")) > 10)
            runner.cancel("r1", "client gone")
            terminal = await rec.wait_terminal("r1")
            (seen,) = fake.requests
            await seen.disconnected.wait()
    assert isinstance(terminal, wire.RunCancelled)
    assert fake.disconnects == [seen]
    assert seen.chunks_sent < 10_000


async def test_through_the_registry(fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ANTHROPIC_KEY", KEY)
    provider = ProviderConfig(
        id="an",
        type="anthropic",
        base_url=fake.base_url + "/v1",
        api_key_env="FAKE_ANTHROPIC_KEY",
        options={"max_tokens": 64, "read_timeout": 30},
        models=(ModelConfig(name="claude", served_name="claude-served"),),
    )
    adapters = build_adapters([provider])
    assert isinstance(adapters["an"], AnthropicAdapter)
    assert ADAPTERS["anthropic"].tunnel
    rec = await run(adapters["an"])
    assert rec.text("r1") == fake.expected_text
    assert fake.requests[0].json["max_tokens"] == 64


def test_a_node_config_with_anthropic_providers_loads(tmp_path: Path) -> None:
    """Normalized, and as a tunnel (the client's Messages request relayed as it is)."""
    path = tmp_path / "node.toml"
    path.write_text(
        """
[node]
id = "n"

[[providers]]
id = "claude"
type = "anthropic"
api_key_env = "ANTHROPIC_API_KEY"
options = { max_tokens = 1024, prompt_cache = false }
models = [{ name = "claude", served_name = "claude-sonnet-4-5" }]

[[providers]]
id = "claude-raw"
type = "anthropic"
path = "tunnel"
base_url = "https://api.anthropic.com"
routes = ["messages"]
models = [{ name = "claude-raw", served_name = "claude-sonnet-4-5" }]
"""
    )
    config = load_node_config(path, environ={})
    normalized, tunnel = config.providers
    assert (normalized.type, normalized.path, tunnel.path) == ("anthropic", "normalized", "tunnel")
    assert tunnel.routes == ("messages",)
    path.write_text(path.read_text().replace("prompt_cache", "prompt_caching"))
    with pytest.raises(NodeConfigError, match="unknown anthropic option"):
        load_node_config(path, environ={})


def test_options() -> None:
    options = AnthropicOptions.from_mapping(
        {"max_tokens": 100, "prompt_cache": False, "stream": False, "anthropic_beta": ["b1", "b2"]}
    )
    assert (options.max_tokens, options.prompt_cache, options.stream) == (100, False, False)
    adapter = AnthropicAdapter(url="http://x/v1/messages", options=options, api_key="sk-secret")
    assert adapter.headers()["anthropic-beta"] == "b1,b2"
    assert "sk-secret" not in repr(adapter)
    assert adapter.headers()["x-api-key"] == "sk-secret"
    for bad in ({"max_tokens": 0}, {"stream": "yes"}, {"model": "x"}, {"anthropic_beta": "b"}):
        with pytest.raises(OptionsError):
            validate_options("anthropic", bad)
    provider = ProviderConfig(id="an", type="anthropic", api_key_env="UNSET_ANTHROPIC_KEY")
    with pytest.raises(NodeConfigError):
        AnthropicAdapter.from_provider(provider, environ={})
