from __future__ import annotations

from typing import Any

import attrs
import orjson
import pytest
import trio
import trio.testing

from dispatcher import wire
from nodes.adapters import DropConnection, EchoAdapter, EchoOptions
from nodes.adapters.echo import split_tokens
from nodes.config import ModelConfig, OptionsError, ProviderConfig
from nodes.runner import open_runner
from tests.nodes._helpers import Recorder, assert_well_formed, request


async def run_echo(
    req: wire.RunRequest, options: EchoOptions | None = None, rec: Recorder | None = None
) -> Recorder:
    rec = rec or Recorder()
    adapter = EchoAdapter(options or EchoOptions())
    async with open_runner(rec.send, adapters={"echo": adapter}) as runner:
        runner.start(req)
        await rec.wait_terminal(req.run_id)
    assert_well_formed(rec.events(req.run_id))
    return rec


def usage_of(rec: Recorder, run_id: str = "r1") -> wire.Usage:
    """The run's usage: its one ``run.usage``. Echo counts its prompt before its first
    token, so its first delta (if any) carries that count, with no output tokens yet."""
    events = rec.events(run_id)
    (event,) = [e for e in events if isinstance(e, wire.RunUsage)]
    usage: wire.Usage = event.usage
    deltas = [e for e in events if isinstance(e, wire.RunDelta)]
    if deltas:
        assert deltas[0].usage == attrs.evolve(usage, completion_tokens=0)
        assert all(delta.usage is None for delta in deltas[1:])
    return usage


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "  leading and trailing spaces  ",
        "tabs\tand\nnew  lines\n\n",
        "one",
        "   ",
        "",
        "ünïcödé  😀 text",
    ],
)
def test_split_tokens_keeps_every_character(text: str) -> None:
    assert "".join(split_tokens(text)) == text
    if text.strip():
        assert len(split_tokens(text)) == len(text.split())


async def test_echo_streams_the_last_user_message_exactly() -> None:
    message = "  The quick\tbrown fox\n jumps  "
    req = request(
        messages=[
            {"role": "system", "content": "be brief please"},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": message},
        ]
    )
    rec = await run_echo(req)
    assert rec.text("r1") == message
    assert rec.terminal("r1").finish_reason == "stop"
    # prompt: 3 + 2 + 2 + 5 words; completion: 5 words
    assert usage_of(rec) == wire.Usage(prompt_tokens=12, completion_tokens=5)


async def test_echo_with_token_delay_sends_one_word_per_delta(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = await run_echo(request(text="a b c d"), EchoOptions(token_delay=0.5))
    deltas = [e.text for e in rec.events("r1") if isinstance(e, wire.RunDelta)]
    assert deltas == ["a ", "b ", "c ", "d"]
    assert trio.current_time() == pytest.approx(2.0)


async def test_echo_list_content_uses_the_text_parts() -> None:
    content: list[dict[str, Any]] = [
        {"type": "text", "text": "look at"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "this picture"},
    ]
    rec = await run_echo(request(messages=[{"role": "user", "content": content}]))
    assert rec.text("r1") == "look at\nthis picture"
    assert usage_of(rec) == wire.Usage(prompt_tokens=4, completion_tokens=4)


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
async def test_echo_max_tokens_cuts_with_finish_length(key: str) -> None:
    limit: dict[str, Any] = {key: 3}
    rec = await run_echo(request(text="one two three four five", **limit))
    assert rec.text("r1") == "one two three "
    assert rec.terminal("r1").finish_reason == "length"
    assert usage_of(rec) == wire.Usage(prompt_tokens=5, completion_tokens=3)


async def test_echo_max_tokens_not_reached_is_stop() -> None:
    rec = await run_echo(request(text="one two", max_tokens=2))
    assert rec.text("r1") == "one two"
    assert rec.terminal("r1").finish_reason == "stop"


async def test_echo_reply_option_and_per_request_override() -> None:
    rec = await run_echo(request(text="ignored"), EchoOptions(reply="fixed reply"))
    assert rec.text("r1") == "fixed reply"
    rec = await run_echo(
        request(text="ignored", echo={"reply": "from the request"}), EchoOptions(reply="fixed")
    )
    assert rec.text("r1") == "from the request"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"echo": {"token_delay": "fast"}}, "echo.token_delay: expected a number >= 0"),
        ({"echo": {"nope": 1}}, "echo.nope: unknown echo option"),
        ({"echo": [1]}, "echo: expected an object"),
        ({"max_tokens": 0}, "max_tokens: expected a positive integer"),
        ({"messages": [{"role": "system", "content": "x"}]}, "needs a user message"),
        ({"messages": "hi"}, "messages: expected an array"),
    ],
)
async def test_echo_invalid_request(body: dict[str, Any], message: str) -> None:
    req = request()
    req = wire.RunRequest(
        run_id="r1",
        provider_id="echo",
        model="echo",
        served_model="echo",
        body={**req.body, **body},
    )
    rec = await run_echo(req)
    failed = rec.terminal("r1")
    assert isinstance(failed, wire.RunFailed)
    assert (failed.code, failed.retryable) == ("invalid_request", False)
    assert message in failed.message


async def test_fail_before_first_token() -> None:
    rec = await run_echo(request(echo={"fail_before_first_token": True}))
    assert rec.types("r1") == ["run.started", "run.failed"]
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable) == ("echo_fault", True)


async def test_fail_after_tokens() -> None:
    rec = await run_echo(request(text="a b c d e"), EchoOptions(fail_after_tokens=2))
    assert rec.text("r1") == "a b "
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable) == ("echo_fault", True)
    assert usage_of(rec) == wire.Usage(prompt_tokens=5, completion_tokens=2)


async def test_stall_after_tokens_until_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    adapter = EchoAdapter(EchoOptions(stall_after_tokens=3))
    async with open_runner(rec.send, adapters={"echo": adapter}) as runner:
        runner.start(request(text="a b c d e"))
        await rec.wait_text("r1", "a b c ")
        await trio.sleep(3600)
        assert rec.terminal("r1") is None
        assert rec.text("r1") == "a b c "
        runner.cancel("r1", "client gone")
        cancelled = await rec.wait_terminal("r1")
    assert_well_formed(rec.events("r1"))
    assert cancelled == wire.RunCancelled(
        run_id="r1",
        seq=cancelled.seq,
        usage=wire.Usage(prompt_tokens=5, completion_tokens=3),
    )


async def test_drop_connection_after_tokens() -> None:
    rec = Recorder()
    adapter = EchoAdapter(EchoOptions(drop_connection_after_tokens=2))
    with pytest.RaisesGroup(DropConnection, flatten_subgroups=True):
        async with open_runner(rec.send, adapters={"echo": adapter}) as runner:
            runner.start(request(text="a b c d"))
            await trio.sleep_forever()
    assert rec.terminal("r1") is None
    assert "c" not in rec.text("r1")


async def test_ignore_cancel_completes_normally(autojump_clock: trio.testing.MockClock) -> None:
    rec = Recorder()
    adapter = EchoAdapter(EchoOptions(token_delay=1.0, ignore_cancel=True))
    async with open_runner(rec.send, adapters={"echo": adapter}) as runner:
        runner.start(request(text="a b c d"))
        await rec.wait_text("r1", "a ")
        runner.cancel("r1", "please stop")
        completed = await rec.wait_terminal("r1")
    assert isinstance(completed, wire.RunCompleted)
    assert rec.text("r1") == "a b c d"
    assert "run.cancelled" not in rec.types("r1")
    assert trio.current_time() == pytest.approx(4.0)


async def test_token_delay_zero_streams_a_long_reply_fast(
    autojump_clock: trio.testing.MockClock,
) -> None:
    words = " ".join(f"w{i}" for i in range(5000))
    rec = await run_echo(request(text=words), rec=Recorder(delay=0.01))
    assert rec.text("r1") == words
    deltas = [e for e in rec.events("r1") if isinstance(e, wire.RunDelta)]
    assert len(deltas) < 100  # coalesced: the connection is slower than echo


def test_echo_options_from_provider_config() -> None:
    provider = ProviderConfig(
        id="echo",
        type="echo",
        options={"token_delay": 0.25, "stall_after_tokens": 4, "reply": "x"},
        models=(ModelConfig(name="echo"),),
    )
    assert EchoAdapter.from_provider(provider).options == EchoOptions(
        token_delay=0.25, stall_after_tokens=4, reply="x"
    )
    with pytest.raises(OptionsError, match="fail_after_tokens: expected an integer >= 0"):
        EchoOptions.from_mapping({"fail_after_tokens": -1})
    with pytest.raises(OptionsError, match="ignore_cancel: expected true or false"):
        EchoOptions.from_mapping({"ignore_cancel": 1})


async def test_echo_tool_call_option_and_per_request_override() -> None:
    options = EchoOptions.from_mapping(
        {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    )
    rec = await run_echo(request("r1", "weather?"), options)
    deltas = [e for e in rec.events("r1") if isinstance(e, wire.RunDelta)]
    assert [d.text for d in deltas] == ["", "", ""]
    pieces = [call for d in deltas for call in d.tool_calls]
    assert pieces[0] == {
        "index": 0,
        "id": "call_echo_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"city":"Paris"}'
    assert all(p["function"]["arguments"] for p in pieces[1:])
    assert rec.terminal("r1").finish_reason == "tool_calls"

    # per request: another call, or none at all
    override = {"tool_call": {"name": "f", "arguments": "{}"}}
    rec = await run_echo(request("r2", "x", echo=override), options)
    assert rec.events("r2")[1].tool_calls[0]["function"]["name"] == "f"
    rec = await run_echo(request("r3", "plain text", echo={"tool_call": None}), options)
    assert rec.text("r3") == "plain text"
    assert rec.terminal("r3").finish_reason == "stop"


async def test_echo_tool_call_once_answers_the_tool_result_with_its_text() -> None:
    """``tool_call_once``: a tool call while the conversation holds no tool result, then the
    last result's text -- an agent's round trip (the agents session's node uses it)."""
    options = EchoOptions.from_mapping(
        {"tool_call": {"name": "Read", "arguments": {"file_path": "/m"}}, "tool_call_once": True}
    )
    rec = await run_echo(request("r1", "read it"), options)
    assert rec.terminal("r1").finish_reason == "tool_calls"
    call = {
        "id": "call_echo_0",
        "type": "function",
        "function": {"name": "Read", "arguments": "{}"},
    }
    conversation: list[dict[str, Any]] = [
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_echo_0", "content": "first result"},
        {"role": "user", "content": "a reminder after the result"},
    ]
    rec = await run_echo(request("r2", messages=conversation), options)
    assert rec.text("r2") == "first result"
    assert rec.terminal("r2").finish_reason == "stop"
    # without the knob, the call is made again (the option as it was)
    rec = await run_echo(
        request("r3", messages=conversation), attrs.evolve(options, tool_call_once=False)
    )
    assert rec.terminal("r3").finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ("get_weather", "tool_call"),
        ({"name": "f", "extra": 1}, "tool_call"),
        ({"name": ""}, "tool_call.name"),
        ({"name": "f", "arguments": 5}, "tool_call.arguments"),
    ],
)
def test_echo_tool_call_option_validation(value: Any, key: str) -> None:
    with pytest.raises(OptionsError) as info:
        EchoOptions.from_mapping({"tool_call": value})
    assert info.value.key == key


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "note": {"type": "string"},
            },
            "required": ["city", "days", "unit"],
        },
    },
}


def _arguments(rec: Recorder) -> tuple[str, Any]:
    pieces = [c for e in rec.events("r1") if isinstance(e, wire.RunDelta) for c in e.tool_calls]
    name = pieces[0]["function"]["name"]
    return name, orjson.loads("".join(p["function"]["arguments"] for p in pieces))


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_echo_answers_a_forced_tool_call_from_the_schema(choice: Any) -> None:
    other = {"type": "function", "function": {"name": "other", "parameters": {}}}
    tools = [WEATHER, other] if choice == "required" else [other, WEATHER]
    rec = await run_echo(request("r1", "Paris", tools=tools, tool_choice=choice))
    assert _arguments(rec) == ("get_weather", {"city": "Paris", "days": 0, "unit": "celsius"})
    assert rec.terminal("r1").finish_reason == "tool_calls"


async def test_echo_answers_offered_tools_with_text() -> None:
    rec = await run_echo(request("r1", "hello world", tools=[WEATHER], tool_choice="auto"))
    assert "".join(e.text for e in rec.events("r1") if isinstance(e, wire.RunDelta)) == (
        "hello world"
    )
    assert rec.terminal("r1").finish_reason == "stop"


async def test_echo_json_mode_and_json_schema() -> None:
    rec = await run_echo(request("r1", "hi there", response_format={"type": "json_object"}))
    text = "".join(e.text for e in rec.events("r1") if isinstance(e, wire.RunDelta))
    assert orjson.loads(text) == {"echo": "hi there"}
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "score": {"type": "number"}},
        "required": ["answer", "score"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    rec = await run_echo(request("r1", "hi there", response_format=fmt))
    text = "".join(e.text for e in rec.events("r1") if isinstance(e, wire.RunDelta))
    assert orjson.loads(text) == {"answer": "hi there", "score": 0}
