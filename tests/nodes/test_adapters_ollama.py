"""The ``ollama`` adapter against a fake Ollama server, driven by the real runner."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from dispatcher import wire
from nodes.adapters import Adapter, build_adapters, validate_options
from nodes.adapters.base import AdapterError
from nodes.adapters.ollama import OllamaAdapter, OllamaOptions
from nodes.config import ModelConfig, OptionsError, ProviderConfig
from nodes.runner import open_runner
from tests.nodes._helpers import Recorder, assert_no_address, assert_well_formed
from tests.nodes.fake_providers import FakeOllama, refused_base_url, serve_fake_ollama

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "say hello"},
]


def req(run_id: str = "r1", messages: list[Any] | None = None, **body: Any) -> wire.RunRequest:
    return wire.RunRequest(
        run_id=run_id,
        provider_id="ol",
        model="llama",
        served_model="llama3:8b",
        body={"model": "llama3:8b", "messages": MESSAGES if messages is None else messages, **body},
    )


def adapter_for(base_url: str, **options: Any) -> OllamaAdapter:
    provider = ProviderConfig(
        id="ol",
        type="ollama",
        base_url=base_url,
        options=options,
        models=(ModelConfig(name="llama", served_name="llama3:8b"),),
    )
    return OllamaAdapter.from_provider(provider)


async def run(adapter: Adapter, request: wire.RunRequest | None = None) -> Recorder:
    request = request or req()
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"ol": adapter}) as runner:
            runner.start(request)
            await rec.wait_terminal(request.run_id)
    assert_well_formed(rec.events(request.run_id))
    return rec


def usage_of(rec: Recorder, run_id: str = "r1") -> wire.Usage:
    usages = [e.usage for e in rec.events(run_id) if isinstance(e, wire.RunUsage)]
    assert len(usages) == 1
    usage: wire.Usage = usages[0]
    return usage


@pytest.fixture
async def fake(nursery: trio.Nursery) -> FakeOllama:
    started: FakeOllama = await nursery.start(serve_fake_ollama)
    return started


async def test_streams_text_usage_and_finish(fake: FakeOllama) -> None:
    fake.prompt_tokens = 26
    rec = await run(adapter_for(fake.base_url))
    assert rec.text("r1") == fake.expected_text == "Hello from the fake provider!"
    assert usage_of(rec) == wire.Usage(prompt_tokens=26, completion_tokens=5)
    terminal = rec.terminal("r1")
    assert isinstance(terminal, wire.RunCompleted)
    assert terminal.finish_reason == "stop"
    (seen,) = fake.requests
    assert (seen.method, seen.path) == ("POST", "/api/chat")
    assert seen.json == {"model": "llama3:8b", "messages": MESSAGES, "stream": True}
    assert seen.authorization is None


@pytest.mark.parametrize(
    ("done_reason", "finish"),
    [("stop", "stop"), ("length", "length"), ("load", "stop"), ("unload", "stop"), ("odd", "stop")],
)
async def test_done_reason_mapping(fake: FakeOllama, done_reason: str, finish: str) -> None:
    fake.done_reason = done_reason
    rec = await run(adapter_for(fake.base_url + "/"))
    assert rec.terminal("r1").finish_reason == finish


async def test_options_and_messages_mapping(fake: FakeOllama) -> None:
    adapter = adapter_for(
        fake.base_url,
        keep_alive="10m",
        model_options={"num_ctx": 8192, "temperature": 0.9},
    )
    messages = [
        {"role": "developer", "content": "answer in French"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "text", "text": "in this picture?"},
            ],
        },
    ]
    await run(
        adapter,
        req(
            messages=messages,
            temperature=0.2,
            top_p=0.5,
            seed=42,
            max_tokens=64,
            stop="\n\n",
            response_format={"type": "json_object"},
        ),
    )
    assert fake.requests[0].json == {
        "model": "llama3:8b",
        "messages": [
            {"role": "system", "content": "answer in French"},
            {"role": "user", "content": "what is\nin this picture?", "images": ["iVBORw0KGgo="]},
        ],
        "stream": True,
        "options": {
            "num_ctx": 8192,
            "temperature": 0.2,
            "top_p": 0.5,
            "seed": 42,
            "num_predict": 64,
            "stop": ["\n\n"],
        },
        "format": "json",
        "keep_alive": "10m",
    }


def test_payload_details() -> None:
    adapter = adapter_for("http://127.0.0.1:1")
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    payload = adapter.payload(
        req(
            max_completion_tokens=5,
            max_tokens=99,
            stop=["a", "b"],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    )
    assert payload["options"] == {"num_predict": 5, "stop": ["a", "b"]}
    assert payload["format"] == schema


async def test_remote_image_urls_are_refused(fake: FakeOllama) -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    rec = await run(
        adapter_for(fake.base_url), req(messages=[{"role": "user", "content": [image]}])
    )
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable) == ("invalid_request", False)
    assert fake.requests == []


async def test_missing_counts_are_estimated(fake: FakeOllama) -> None:
    fake.include_counts = False
    rec = await run(adapter_for(fake.base_url))
    # "be brief" -> 2, "say hello" -> 3; the reply: 29 characters -> 8
    assert usage_of(rec) == wire.Usage(prompt_tokens=5, completion_tokens=8, estimated=True)


async def test_cancel_closes_the_upstream_connection(fake: FakeOllama) -> None:
    fake.chunk_count = 10_000
    fake.chunk_delay = 0.01
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"ol": adapter_for(fake.base_url)}) as runner:
            runner.start(req())
            await rec.wait_for(lambda: len(rec.text("r1")) > 10)
            runner.cancel("r1", "client gone")
            terminal = await rec.wait_terminal("r1")
            (seen,) = fake.requests
            await seen.disconnected.wait()
            await fake.wait_idle()
    assert isinstance(terminal, wire.RunCancelled)
    assert_well_formed(rec.events("r1"))
    assert seen.chunks_sent < 10_000
    assert terminal.usage is not None
    assert terminal.usage.completion_tokens > 0


async def test_error_line_mid_stream(fake: FakeOllama) -> None:
    fake.fail_after_chunks = 2
    fake.fail_mode = "error"
    fake.error_message = "model runner has unexpectedly stopped"
    rec = await run(adapter_for(fake.base_url))
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable, failed.status) == ("upstream_error", True, None)
    assert "model runner has unexpectedly stopped" in failed.message
    assert_no_address(failed.message, fake.base_url)
    assert rec.text("r1") == "".join(fake.tokens[:2])


async def test_stream_cut_before_done(fake: FakeOllama) -> None:
    fake.fail_after_chunks = 3
    rec = await run(adapter_for(fake.base_url))
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable) == ("upstream_disconnected", True)
    assert_no_address(failed.message, fake.base_url)


@pytest.mark.parametrize(
    ("status", "code", "retryable"),
    [
        (500, "upstream_5xx", True),
        (502, "upstream_5xx", True),
        (429, "upstream_rate_limited", True),
        # a model this Ollama does not have: the node's problem, another node may have it
        (404, "upstream_not_found", True),
    ],
)
async def test_http_errors(fake: FakeOllama, status: int, code: str, retryable: bool) -> None:
    fake.status = status
    fake.error_message = 'model "llama3:8b" not found, try pulling it first'
    rec = await run(adapter_for(fake.base_url))
    failed = rec.terminal("r1")
    assert isinstance(failed, wire.RunFailed)
    assert (failed.code, failed.retryable, failed.status) == (code, retryable, None)
    assert f'HTTP {status}: model "llama3:8b" not found, try pulling it first' in failed.message
    assert rec.types("r1") == ["run.started", "run.failed"]
    assert_no_address(failed.message, fake.base_url)


@pytest.mark.parametrize("status", [400, 413, 415, 422])
async def test_client_errors_carry_the_upstream_status_and_message(
    fake: FakeOllama, status: int
) -> None:
    fake.status = status
    fake.error_message = "invalid options: num_predict must be an integer"
    rec = await run(adapter_for(fake.base_url))
    failed = rec.terminal("r1")
    assert failed == wire.RunFailed(
        run_id="r1",
        seq=1,
        code="invalid_request",
        message="invalid options: num_predict must be an integer",
        retryable=False,
        status=status,
    )
    assert len(fake.requests) == 1


@pytest.mark.parametrize("status", [400, 500])
async def test_an_upstream_that_quotes_its_address_is_redacted(
    fake: FakeOllama, status: int
) -> None:
    fake.status = status
    fake.error_message = f"cannot load model from {fake.base_url}/api/chat"
    failed = (await run(adapter_for(fake.base_url))).terminal("r1")
    assert_no_address(failed.message, fake.base_url)
    assert "cannot load model from <provider>" in failed.message


async def test_connection_refused() -> None:
    base_url = refused_base_url()
    rec = await run(adapter_for(base_url))
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable, failed.status) == ("upstream_unreachable", True, None)
    assert_no_address(failed.message, base_url)


async def test_read_timeout_is_unreachable(fake: FakeOllama) -> None:
    fake.stall_after_chunks = 0
    rec = await run(adapter_for(fake.base_url, read_timeout=0.2))
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable) == ("upstream_unreachable", True)
    assert_no_address(failed.message, fake.base_url)


def test_default_base_url_and_registry() -> None:
    provider = ProviderConfig(id="ol", type="ollama", models=(ModelConfig(name="m"),))
    adapter = build_adapters([provider])["ol"]
    assert isinstance(adapter, OllamaAdapter)
    assert adapter.url == "http://127.0.0.1:11434/api/chat"


def test_options_validation() -> None:
    options = OllamaOptions.from_mapping({"keep_alive": 300, "read_timeout": 5})
    assert (options.keep_alive, options.timeouts.read) == (300, 5.0)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"keep_alive": [1]}, "keep_alive"),
        ({"model_options": 3}, "model_options"),
        ({"connect_timeout": "1"}, "connect_timeout"),
        ({"num_ctx": 2048}, "num_ctx"),
    ]
    for bad, key in cases:
        with pytest.raises(OptionsError) as info:
            validate_options("ollama", bad)
        assert info.value.key == key


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


async def test_tool_calls_become_openai_deltas(fake: FakeOllama) -> None:
    fake.reply = "Checking."
    fake.tool_calls = [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"function": {"name": "get_time", "arguments": {}}},
    ]
    rec = await run(adapter_for(fake.base_url), req(tools=TOOLS, tool_choice="auto"))
    terminal = rec.terminal("r1")
    assert isinstance(terminal, wire.RunCompleted)
    assert terminal.finish_reason == "tool_calls"
    deltas = [e for e in rec.events("r1") if isinstance(e, wire.RunDelta)]
    assert rec.text("r1") == "Checking."
    (call_delta,) = [d for d in deltas if d.tool_calls]
    assert deltas[-1] is call_delta  # after the text
    first, second = call_delta.tool_calls
    assert first["id"].startswith("call_")
    assert second["id"].startswith("call_")
    assert first["id"] != second["id"]
    assert {k: v for k, v in first.items() if k != "id"} == {
        "index": 0,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
    }
    assert (second["index"], second["function"]) == (1, {"name": "get_time", "arguments": "{}"})
    (seen,) = fake.requests
    assert seen.json["tools"] == TOOLS
    assert "tool_choice" not in seen.json


async def test_tool_calls_with_length_keep_length(fake: FakeOllama) -> None:
    fake.done_reason = "length"
    fake.tool_calls = [{"function": {"name": "f", "arguments": {}}}]
    rec = await run(adapter_for(fake.base_url))
    assert rec.terminal("r1").finish_reason == "length"


def test_tool_messages_are_mapped() -> None:
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21C"},
        {"role": "tool", "tool_call_id": "unknown", "content": "?"},
    ]
    payload = adapter_for("http://x").payload(req(messages=messages, tools=TOOLS))
    assert payload["messages"][1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny, 21C", "tool_name": "get_weather"},
        {"role": "tool", "content": "?"},
    ]
    assert payload["tools"] == TOOLS
    bad = [
        {
            "role": "assistant",
            "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}],
        }
    ]
    with pytest.raises(AdapterError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments"):
        adapter_for("http://x").payload(req(messages=bad))
